#!/usr/bin/env bash
# The one GPU check for maintainers. On a Linux machine with an NVIDIA GPU, from a clone of the course:
#
#     scripts/gpu_check.sh            # about 5 minutes on a recent GPU (after ./course setup)
#
# 1. refuses to run (exit 1) unless torch sees a CUDA device;
# 2. runs every test marked `gpu` against the reference (Triton kernel vs dense attention in fp32, fp16
#    and bf16; mixed prefill/decode; the engine on CUDA equal to Hugging Face greedy) and fails if any
#    fails or skips;
# 3. runs the GPU benchmarks and writes their JSON where notebook 06 reads it:
#    notebooks/data/gpu_tests.json, gpu_throughput.json, gpu_kernel.json (each with device and date).
# Then re-execute notebook 06 (scripts/execute_notebooks.py) and commit notebooks/data/ with it.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
DATA=notebooks/data
unset TRITON_INTERPRET                    # the compiled kernel, not the CPU interpreter
export KVCOURSE_SOLUTIONS=1               # the reference solutions, as the notebooks' stored outputs
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== 1/3 device"
"$PY" - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(
        f"gpu_check: FAILED: torch {torch.__version__} sees no CUDA device (built for CUDA: {torch.version.cuda}). "
        "Run this on a machine with an NVIDIA GPU and a CUDA build of torch (README: GPU learners)."
    )
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

echo "== 2/3 tests marked gpu"
mkdir -p "$DATA"
"$PY" -m pytest tests -m gpu -q -rs -p no:cacheprovider --junitxml="$work/gpu.xml" || {
    echo "gpu_check: FAILED: a GPU test failed (above). No figures written." >&2
    exit 1
}
"$PY" - "$work/gpu.xml" "$DATA/gpu_tests.json" <<'EOF'
import datetime
import json
import sys
import xml.etree.ElementTree as ET

import torch
import triton

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
cases = suite.findall("testcase")
skipped = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("skipped") is not None]
if not cases or skipped:
    sys.exit(f"gpu_check: FAILED: {len(cases)} GPU tests ran and {len(skipped)} skipped on a GPU: {skipped[:5]}")
result = {
    "study": "gpu tests",
    "device": torch.cuda.get_device_name(0),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "triton": triton.__version__,
    "passed": len(cases),
    "tests": sorted(f"{c.get('classname')}::{c.get('name')}" for c in cases),
}
with open(sys.argv[2], "w") as out:
    json.dump(result, out, indent=1, sort_keys=True)
print(f"{len(cases)} GPU tests passed on {result['device']}")
EOF

echo "== 3/3 benchmarks"
for study in throughput kernel; do
    "$PY" -m kvcourse.bench "$study" --json | tee "$work/$study.log"
    tail -n 1 "$work/$study.log" > "$work/gpu_$study.json"
    "$PY" - "$work/gpu_$study.json" "$study" <<'EOF'
import json
import sys

import torch

result = json.loads(open(sys.argv[1]).read())
if result.get("study") != sys.argv[2] or result.get("device") != torch.cuda.get_device_name(0):
    sys.exit(f"gpu_check: FAILED: the {sys.argv[2]} study did not run on CUDA: {str(result)[:300]}")
EOF
    mv "$work/gpu_$study.json" "$DATA/gpu_$study.json"
done
echo "gpu_check: OK. Wrote $DATA/gpu_tests.json, gpu_throughput.json, gpu_kernel.json."
echo "Next: KVCOURSE_SOLUTIONS=1 $PY scripts/execute_notebooks.py notebooks/06_measuring_the_payoff.ipynb, then commit."
