"""Smoke test of `python -m kvcourse.bench allocator --json`: the last line's structure, at tiny sizes (no timing asserts)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = (200, 400)  # tiny pools through the private `_sizes` parameter: structure only


def _run(switch: str, flags: list[str]) -> subprocess.CompletedProcess:
    """The study in a fresh process, so KVCOURSE_SOLUTIONS decides which allocator it imports."""
    code = f"import sys; from kvcourse.bench.allocator import main; sys.exit(main({flags!r}, _sizes={SIZES!r}))"
    env = {**os.environ, "KVCOURSE_SOLUTIONS": switch}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_json_last_line_has_every_figure():
    done = _run("1", ["--quick", "--json"])
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    per_block = ("per_block_us", "stack_per_block_us", "naive_per_block_us", "hit_linked_us", "hit_stack_us")
    ratios = ("ratio", "stack_ratio", "naive_ratio", "hit_linked_ratio", "hit_stack_ratio")
    assert {"device", *per_block, *ratios} <= set(result)
    assert isinstance(result["device"], str) and result["device"]
    for key in per_block:
        assert list(result[key]) == [str(n) for n in SIZES]
        assert all(math.isfinite(v) and v > 0 for v in result[key].values())
    for key in ratios:
        assert math.isfinite(result[key]) and result[key] > 0
    assert "the reference" in result["allocator"]
    assert any("ratio largest/smallest" in line for line in lines[:-1]), "the table should print the ratio"


def test_without_json_no_json_line():
    done = _run("1", ["--quick"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert not done.stdout.strip().splitlines()[-1].startswith("{")
