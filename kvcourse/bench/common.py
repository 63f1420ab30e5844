"""What every benchmark shares: arguments, the device's name, a progress bar, the JSON last line."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def parse_args(study: str, description: str, argv: list[str] | None) -> argparse.Namespace:
    """The flags every study takes: --quick (CPU-sized, under a minute) and --json."""
    parser = argparse.ArgumentParser(prog=f"python -m kvcourse.bench {study}", description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes: finishes in under a minute on a CPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every figure as the last line")
    return parser.parse_args(argv)


def device_name() -> str:
    """The device the figures come from, e.g. 'NVIDIA H200' or 'cpu (x86_64, 2 threads)'."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """A progress bar on stderr, so stdout stays clean for tables and JSON."""
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False)


def emit(result: dict, as_json: bool) -> None:
    """Print the JSON last line when asked (the tables are printed by the study itself)."""
    if as_json:
        print(json.dumps(result, sort_keys=True))
