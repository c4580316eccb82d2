#!/usr/bin/env bash
# Device-side cycle for the backward work tree staged at <main>/.wt/bwd: build into its own
# folder (/tmp/bwd-build), then run the steps given in $STEPS (test, gputest, time, custom).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CARRY_ROOT=$(realpath "${CARRY_ROOT:-../..}")
OUT=${OUT:-/tmp/bwd-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=/tmp/dmattn-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY_ROOT"/.whl/*.whl || exit 1
export PYTHONPATH="$PWD/python:$SITE"
CUT=/tmp/dmattn-cutlass; mkdir -p $CUT; [ -d $CUT/cute ] || tar xzf "$CARRY_ROOT"/.devcarry/cutlass_include.tgz -C $CUT
start=$(date +%s)
cmake -S . -B /tmp/bwd-build -G Ninja -DDMATTN_CUDA_ARCHS="${ARCHS:-90a}" -DCUTLASS_INCLUDE_DIR=$CUT -DPython_EXECUTABLE="$(command -v python3)" > "$OUT/build.log" 2>&1 &&
cmake --build /tmp/bwd-build -j "$(nproc)" >> "$OUT/build.log" 2>&1
rc=$?; echo "build rc=$rc in $(( $(date +%s) - start )) s"; grep -E "error" "$OUT/build.log" | head -20
[ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
cp /tmp/bwd-build/libdmattn_ffi.so python/dmattn/
nvidia-smi --query-gpu=name --format=csv,noheader
