"""What every benchmark shares: arguments, whose code runs, the device's name, a progress bar, the JSON last line.

Whose code a study measures is an explicit choice: the learner's `kvcourse/` modules by default, the
reference in `solutions/` with `--reference` / `run(..., reference=True)`. No study touches
`os.environ`: the reference runs in a child process whose environment alone has KVCOURSE_SOLUTIONS=1,
because the modules already imported in this process (a notebook's kernel) cannot be swapped safely.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]


def parse_args(
    study: str, description: str, argv: list[str] | None, models: list[str] | None = None
) -> argparse.Namespace:
    """The flags every study takes: --quick (CPU-sized, under a minute) and --json; --model where `models` is given."""
    parser = argparse.ArgumentParser(prog=f"python -m kvcourse.bench {study}", description=description)
    if models:
        parser.add_argument(
            "--model", choices=models, default=None, help="the model (default: the tiny GPT-2 with --quick, else gpt2)"
        )
    parser.add_argument("--quick", action="store_true", help="small sizes: finishes in under a minute on a CPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure as the last line")
    parser.add_argument(
        "--reference", action="store_true", help="measure the reference solutions/ instead of your kvcourse/"
    )
    return parser.parse_args(argv)


def whose_code(*modules: str) -> str:
    """Say whose exercise modules this process imports: 'yours (kvcourse/...)' or 'the reference (solutions/...)'."""
    owners = {}
    for name in modules:
        path = Path(getattr(importlib.import_module(f"kvcourse.{name}"), "__file__", "") or "")
        owners[name] = "solutions" if path.parent.name == "solutions" else "kvcourse"
    files = ", ".join(f"{owners[m]}/{m}.py" for m in modules)
    if set(owners.values()) == {"solutions"}:
        return f"the reference ({files})"
    if set(owners.values()) == {"kvcourse"}:
        return f"yours ({files})"
    return f"mixed ({files})"


def run_reference(study: str, arguments: dict) -> dict:
    """Run `kvcourse.bench.<study>.run(**arguments)` on the reference, in a child process, and return its dict."""
    arguments = {k: v for k, v in arguments.items() if k != "reference"}
    code = "from kvcourse.bench.common import _reference_child; _reference_child()"
    env = {**os.environ, "KVCOURSE_SOLUTIONS": "1"}  # the child's environment only
    done = subprocess.run(
        [sys.executable, "-c", code, study],
        input=json.dumps(arguments),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
        raise RuntimeError(
            f"the {study} study on the reference failed (exit code {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(lines[-1])


def _reference_child() -> None:
    """Inside the child of run_reference: read the arguments on stdin, print the study's dict as JSON."""
    study = importlib.import_module(f"kvcourse.bench.{sys.argv[1]}")
    arguments = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.stdin.read()).items()}
    print(json.dumps(study.run(**arguments), sort_keys=True))


def not_written(error: NotImplementedError, study: str) -> int:
    """The study stopped at one of the learner's unwritten exercises: say so, and how to measure the reference."""
    print(
        f"{error}\nFinish that exercise first, or measure the reference: python -m kvcourse.bench {study} --reference",
        file=sys.stderr,
    )
    return 1


def device_name() -> str:
    """The device the figures come from, e.g. 'NVIDIA H200' or 'cpu (x86_64, 2 threads)'."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """A progress bar on stderr, so stdout stays clean for tables and JSON."""
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False, disable=not progress_shown())


def progress_shown() -> bool:
    """Progress bars unless KVCOURSE_PROGRESS=0 (scripts/execute_notebooks.py: stored outputs carry none)."""
    return os.environ.get("KVCOURSE_PROGRESS", "1") != "0"


def emit(result: dict, as_json: bool) -> None:
    """Print the JSON last line when asked (the tables are printed by the study itself)."""
    if as_json:
        print(json.dumps(result, sort_keys=True))


@contextlib.contextmanager
def pinned_threads(threads: int | None, quick: bool, cuda: bool) -> Iterator[None]:
    """--quick on a CPU uses one thread (on a shared machine a second one mostly waits for a core); restored after."""
    import torch

    before = torch.get_num_threads()
    if threads or (quick and not cuda):
        torch.set_num_threads(threads or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
