"""`python -m kvcourse.course.demo` prints a readable trace and the lesson's four prompts with their outputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # the demo in a fresh process (imports torch, runs GPT-2): `./course test -m slow` (CI runs it)
def test_demo_prints_trace_and_outputs():
    env = {**os.environ, "KVCOURSE_SOLUTIONS": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcourse.course.demo",
            "--model",
            "tiny",
            "--num-blocks",
            "8",
            "--block-size",
            "8",
            "--token-budget",
            "24",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "Scheduler trace" in out and "it   1 |" in out
    assert "prefill" in out and "decode" in out
    assert out.count("    -> ") == 4, "one decoded output per lesson prompt"
    assert "The capital of France" in out
    assert "Identical to Hugging Face's model.generate(do_sample=False), one prompt at a time: True" in out
