#!/usr/bin/env bash
# Device-side cycle for the gather-path work tree staged at <main>/.wt/positions: build into
# its own folder (/tmp/positions-build, so that other staged trees on a warm machine keep
# theirs), then the steps in $STEPS: test (GPU tests of the gather path), time
# (benchmarks/topk_gather_timing.py --profile), bench (dmattn.bench with $BENCH_ARGS),
# gputest (the rest of the GPU test group). Logs go to $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CARRY_ROOT=$(realpath "${CARRY_ROOT:-../..}")
OUT=${OUT:-/tmp/positions-out}; mkdir -p "$OUT"
STEPS=${STEPS:-test time}
export PYTHONUNBUFFERED=1
SITE=/tmp/dmattn-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY_ROOT"/.whl/*.whl || exit 1
export PYTHONPATH="$PWD/python:$SITE"
CUT=/tmp/dmattn-cutlass; mkdir -p $CUT; [ -d $CUT/cute ] || tar xzf "$CARRY_ROOT"/.devcarry/cutlass_include.tgz -C $CUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$(date +%s)
cmake -S . -B /tmp/positions-build -G Ninja -DDMATTN_CUDA_ARCHS="${ARCHS:-90a}" -DCUTLASS_INCLUDE_DIR=$CUT \
  -DPython_EXECUTABLE="$(command -v python3)" > "$OUT/build.log" 2>&1 &&
  cmake --build /tmp/positions-build -j "$(nproc)" >> "$OUT/build.log" 2>&1
rc=$?; echo "build rc=$rc in $(( $(date +%s) - start )) s"
grep -E "error|spill" "$OUT/build.log" | sed 's/.*function //' | sort | uniq | head -30
[ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
cp /tmp/positions-build/libdmattn_ffi.so python/dmattn/
status=0
if [[ " $STEPS " == *" test "* ]]; then
  echo "=== gather tests ($(date +%T))"
  python3 -m pytest tests/python/test_gather_path.py -m gpu -q -p no:cacheprovider -rf 2>&1 | tee "$OUT/pytest_gather.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ " $STEPS " == *" time "* ]]; then
  echo "=== timing ($(date +%T))"
  python3 benchmarks/topk_gather_timing.py --profile 2>&1 | tee "$OUT/timing.txt"
fi
if [[ " $STEPS " == *" bench "* ]]; then
  echo "=== bench ($(date +%T))"
  # shellcheck disable=SC2086
  python3 -m dmattn.bench --device cuda --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>"$OUT/bench.err" | tee "$OUT/bench.txt"
  tail -3 "$OUT/bench.err"
fi
if [[ " $STEPS " == *" gputest "* ]]; then
  echo "=== other GPU tests ($(date +%T))"
  timeout "${GPUTEST_TIMEOUT:-240}" python3 -m pytest tests/python -m gpu -q -p no:cacheprovider -rf \
    --ignore=tests/python/test_gather_path.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "status=$status ($(date +%T))"
exit $status
