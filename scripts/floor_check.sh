#!/usr/bin/env bash
# The floor job: the course at the oldest versions pyproject.toml states, as a bare CUDA image would run it.
#
#     scripts/floor_check.sh       # CI runs it (.ci/run); about 2 minutes on 2 cores with a warm pip cache
#
# 1. a second virtual environment, .venv-floor (ignored by git), with exactly requirements/floor.lock: the
#    floor set (transformers 5.17, triton 3.5, numpy 1.26, pytest 8.0, ...; torch 2.13.0, the oldest CPU
#    build the registry has: requirements/README.md says how torch's floor is checked);
# 2. the GPU kit (scripts/gpu_wheels.sh) installed into build/gpu-kit the way scripts/gpu_check.sh installs
#    it on a GPU machine (pip --no-index --no-deps --target), and nothing else: the course runs from the checkout;
# 3. against the reference: every graded test, the engine-equals-Hugging-Face tests (tiny GPT-2; the Triton
#    kernel through its interpreter), the fast and packed backends, the kernel compile checks.
set -euo pipefail
cd "$(dirname "$0")/.."

started=$SECONDS
VENV=.venv-floor
BASE="${PYTHON:-python3}"
stamp="$VENV/.floor-lock-sha256"
want=$(sha256sum requirements/floor.lock | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    rm -rf "$VENV"
    "$BASE" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements/floor.lock
    echo "$want" > "$stamp"
fi
"$VENV/bin/python" -m pip check --disable-pip-version-check
"$VENV/bin/python" - <<'EOF'
import sys
from importlib.metadata import version

floor = [line.split("==") for line in open("requirements/floor.lock") if "==" in line and not line.startswith("#")]
wrong = [f"{name} {version(name)} (floor.lock: {pin.strip()})" for name, pin in floor if version(name).split("+")[0] != pin.strip()]
if wrong:
    sys.exit("floor_check: FAILED: .venv-floor differs from requirements/floor.lock: " + ", ".join(wrong))
print(f"floor set: Python {sys.version.split()[0]}, " + ", ".join(f"{n} {version(n)}" for n in ("torch", "transformers", "triton", "numpy")))
EOF

[ -n "$(ls gpu_wheels/*.whl 2>/dev/null)" ] || scripts/gpu_wheels.sh
PYTHON="$VENV/bin/python" scripts/gpu_check.sh --kit "$PWD/build/gpu-kit"

# pyproject's addopts name nbval's options (a maintainers' tool): cleared, as on a GPU image.
KVCOURSE_SOLUTIONS=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD/build/gpu-kit:$PWD" "$VENV/bin/python" -m pytest \
    -o addopts="--strict-markers" -p no:cacheprovider -q \
    tests/exercises tests/test_engine.py tests/test_paged_attention.py tests/test_kernel_compile.py \
    tests/test_fast_attention.py tests/test_packed_weights.py tests/test_models.py
echo "floor_check: OK in $((SECONDS - started)) s"
