"""scripts/gpu_check.sh: without CUDA it stops at once, loudly, and writes no figures."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: run scripts/gpu_check.sh itself")
def test_gpu_check_fails_loudly_without_cuda(tmp_path):
    data = ROOT / "notebooks" / "data"
    before = sorted(data.glob("gpu_*.json")) if data.exists() else []
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1
    assert "gpu_check: FAILED" in done.stderr and "sees no CUDA device" in done.stderr
    assert (sorted(data.glob("gpu_*.json")) if data.exists() else []) == before
