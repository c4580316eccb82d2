#!/usr/bin/env bash
# The PTX path on a GPU that has machine code in the build (a Hopper or Ampere host), taken the way
# a GPU without any (compute capability 10.x, 12.x) takes it: the CUDA driver JIT-compiles the
# compute_80 PTX of the sm80-class kernels at first use and caches the result. Logs go to $OUT.
#
# Carried like scripts/gpu_cycle.sh's (scripts/prepare_gpu_carry.sh): .whl/ (apache-tvm-ffi) and,
# for the build step, .devcarry/cutlass_include.tgz.
#
# Usage (repo root):  bash scripts/ptx_jit_check.sh [steps...]   (default: build list jit warm test)
#   build  the library with DMATTN_CUDA_PTX=ON for ARCHS into python/dmattn/ (skipped with WHEEL)
#   list   cuobjdump: the library's PTX and machine code (compute_80 PTX must be there)
#   jit    a fresh driver cache, then two processes of scripts/ptx_jit_probe.py: the first
#          JIT-compiles what its calls need, the second finds it cached (times in jit_times.jsonl)
#   warm   one process per (dtype, head dim) at once: the rest of the kernels compiled in parallel
#   test   the GPU test group (pytest -m gpu) on the PTX path
# Environment:
#   OUT      log folder (default /tmp/dmattn-out)
#   ARCHS    machine code beside the PTX (default empty: a PTX-only library, whose kernels the
#            driver must JIT-compile on any GPU, as on a GPU newer than every arch of the build;
#            its PTX is the release build's: the same compute_80 pass of the same sources).
#            With machine code that runs on this GPU ("80;90a" on a Hopper one, or such a
#            WHEEL), the steps set CUDA_FORCE_PTX_JIT=1, which makes the driver ignore torch's
#            machine code too: this script first checks that torch still runs so.
#   WHEEL    a built dmattn wheel to test instead of a build (installed with --no-deps into a
#            folder of its own; the tests import it from there)
#   CACHE    the driver's JIT cache for these steps (default /tmp/dmattn-ptx-jit-cache; the jit
#            step empties it)
# Every step runs with the Hopper kernels off (DMATTN_FWD_SM90=0 DMATTN_BWD_SM90=0; the library
# also turns them off by itself on the PTX, whose Hopper kernels are empty).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CARRY_ROOT=$(realpath "${CARRY_ROOT:-.}")
OUT=${OUT:-/tmp/dmattn-out}
mkdir -p "$OUT"
STEPS=${*:-build list jit warm test}
ARCHS=${ARCHS-}
WHEEL=${WHEEL:-}
export CUDA_CACHE_PATH=${CACHE:-/tmp/dmattn-ptx-jit-cache}
export CUDA_CACHE_MAXSIZE=4294967296
export DMATTN_FWD_SM90=0 DMATTN_BWD_SM90=0 PYTHONUNBUFFERED=1
status=0
step() { echo; echo "=== $* ($(date +%T))"; }
fail() { echo "ptx_jit_check: $*" | tee -a "$OUT/ptx_check_status.txt"; status=1; }

step "environment"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-(unset: lazy)} CUDA_CACHE_PATH=$CUDA_CACHE_PATH"
SITE=/tmp/dmattn-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$CARRY_ROOT"/.whl/*.whl || exit 1
if [ -n "$WHEEL" ]; then
  WSITE=/tmp/dmattn-wheel-site
  rm -rf "$WSITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$WSITE" "$WHEEL" || exit 1
  export PYTHONPATH="$WSITE:$SITE"
  LIB=$WSITE/dmattn/libdmattn_ffi.so
else
  export PYTHONPATH="$PWD/python:$SITE"
  LIB=$PWD/python/dmattn/libdmattn_ffi.so
fi
CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)

if [[ " $STEPS " == *" build "* && -z "$WHEEL" ]]; then
  step "build: DMATTN_CUDA_ARCHS=\"$ARCHS\" DMATTN_CUDA_PTX=ON"
  CUTLASS_DIR=/tmp/dmattn-cutlass
  mkdir -p "$CUTLASS_DIR" && tar xzf "$CARRY_ROOT"/.devcarry/cutlass_include.tgz -C "$CUTLASS_DIR" || exit 1
  start=$(date +%s)
  cmake -S . -B /tmp/dmattn-ptx-build -G Ninja -DDMATTN_CUDA_ARCHS="$ARCHS" -DDMATTN_CUDA_PTX=ON \
    -DCUTLASS_INCLUDE_DIR="$CUTLASS_DIR" -DPython_EXECUTABLE="$(command -v python3)" \
    > "$OUT/ptx_build.log" 2>&1 &&
  cmake --build /tmp/dmattn-ptx-build -j "$(nproc)" >> "$OUT/ptx_build.log" 2>&1
  rc=$?
  echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee "$OUT/ptx_build_time.txt"
  [ $rc -eq 0 ] || { tail -40 "$OUT/ptx_build.log"; exit 1; }
  cp /tmp/dmattn-ptx-build/libdmattn_ffi.so python/dmattn/
fi
[ -f "$LIB" ] || { echo "no library at $LIB: run the build step (or set WHEEL)"; exit 1; }

if [[ " $STEPS " == *" list "* ]]; then
  step "cuobjdump: PTX and machine code of $(basename "$LIB")"
  { "$CUOBJDUMP" --list-ptx "$LIB"; "$CUOBJDUMP" --list-elf "$LIB"; } > "$OUT/cuobjdump.txt" 2>&1
  # (one line per image, e.g. "PTX file 1: libdmattn_ffi.1.sm_80.ptx", "ELF file 2: ....sm_90a.cubin")
  for kind in 'PTX:ptx' 'machine code:cubin'; do
    printf '%s files by architecture: ' "${kind%%:*}"
    grep -oE "sm_[0-9]+[af]?\.${kind##*:}" "$OUT/cuobjdump.txt" | sed 's/\..*//' | sort | uniq -c | tr -s ' \n' ' '
    echo
  done | tee "$OUT/cuobjdump_summary.txt"
  grep -qE "sm_80\.ptx" "$OUT/cuobjdump.txt" || fail "no compute_80 PTX in $LIB"
fi

# The driver's switch only where the library holds machine code this GPU would otherwise run.
python3 -c "import dmattn._lib as l; raise SystemExit(0 if l.device_kernel_path(0).startswith('native') else 1)" &&
  export CUDA_FORCE_PTX_JIT=1
if [ "${CUDA_FORCE_PTX_JIT:-0}" = 1 ]; then
  step "torch under CUDA_FORCE_PTX_JIT=1"
  if ! python3 -c "import torch; x = torch.randn(256, 256, device='cuda'); print(float((x @ x).sum()))" \
      > "$OUT/torch_forced_jit.log" 2>&1; then
    tail -3 "$OUT/torch_forced_jit.log"
    fail "torch itself fails under CUDA_FORCE_PTX_JIT=1 (its kernels carry no PTX for this GPU);" \
         "run this script without ARCHS / WHEEL: a PTX-only build takes the same path without it"
    exit 1
  fi
fi
python3 -m dmattn.info | tee "$OUT/ptx_info.txt"
grep -q "PTX JIT (compute_80)" "$OUT/ptx_info.txt" || fail "dmattn.info does not report the PTX path"

if [[ " $STEPS " == *" jit "* ]]; then
  step "first process with an empty JIT cache ($CUDA_CACHE_PATH), then a second one"
  rm -rf "$CUDA_CACHE_PATH"
  : > "$OUT/jit_times.jsonl"
  for tag in first_process second_process; do
    start=$(date +%s%N)
    python3 scripts/ptx_jit_probe.py --tag "$tag" 2>&1 | tee "$OUT/jit_$tag.log" | grep -v '^{'
    rc=${PIPESTATUS[0]}
    wall=$(awk -v ns="$(( $(date +%s%N) - start ))" 'BEGIN { printf "%.2f", ns / 1e9 }')
    grep '^{' "$OUT/jit_$tag.log" | sed "s/}\$/, \"process_wall_s\": $wall}/" | tee -a "$OUT/jit_times.jsonl"
    [ "$rc" -eq 0 ] || fail "ptx_jit_probe.py ($tag) rc=$rc"
  done
  du -sh "$CUDA_CACHE_PATH" | tee "$OUT/jit_cache_size.txt"
fi

if [[ " $STEPS " == *" warm "* ]]; then
  step "the rest of the kernels JIT-compiled in parallel (one process per dtype and head dim)"
  start=$(date +%s)
  pids=()
  for dt in bf16 fp16; do
    for d in 64 128 256; do
      python3 scripts/ptx_jit_probe.py --dtype "$dt" --head-dim "$d" --tag "warm_${dt}_$d" \
        > "$OUT/jit_warm_${dt}_$d.log" 2>&1 &
      pids+=($!)
    done
  done
  for pid in "${pids[@]}"; do wait "$pid" || fail "a warm-up process failed (jit_warm_*.log)"; done
  grep -h '^{' "$OUT"/jit_warm_*.log | tee -a "$OUT/jit_times.jsonl"
  echo "warm-up: $(( $(date +%s) - start )) s; cache $(du -sh "$CUDA_CACHE_PATH" | cut -f1)" |
    tee -a "$OUT/jit_cache_size.txt"
fi

if [[ " $STEPS " == *" test "* ]]; then
  step "GPU tests on the PTX path"
  start=$(date +%s)
  # shellcheck disable=SC2086
  python3 -m pytest tests/python -m gpu -q --maxfail=40 -p no:cacheprovider -rf ${PYTEST_ARGS:-} \
    2>&1 | tee "$OUT/pytest_gpu_ptx.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "GPU tests failed on the PTX path (pytest_gpu_ptx.log)"
  echo "tests: $(( $(date +%s) - start )) s" | tee -a "$OUT/jit_cache_size.txt"
fi

echo; echo "ptx_jit_check status=$status"
exit $status
