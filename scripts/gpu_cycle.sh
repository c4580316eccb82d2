#!/usr/bin/env bash
# The whole GPU cycle in one command, for a GPU machine without a package registry (a CI or
# cloud H100/H200 host): build the native library for the local GPU, run the GPU test group,
# run the benchmark, optionally compute-sanitizer; logs, the benchmark's table, JSON and plots
# go to $OUT.
#
# Carried from the development machine (see scripts/prepare_gpu_carry.sh):
#   .whl/        apache-tvm-ffi wheel for the GPU machine's Python
#   .devcarry/   cutlass_include.tgz (CuTe/CUTLASS headers from the nvidia-cutlass wheel)
#
# Usage on the GPU machine (repo root):  bash scripts/gpu_cycle.sh [steps...]
#   steps: build test bench sm90 bwd multigpu sanitize (default: build test bench; sm90: the GPU
#          tests with the Hopper kernels off, DMATTN_FWD_SM90=0 DMATTN_BWD_SM90=0 -- on a Hopper
#          GPU the only run of the sm80-class kernels at head dims up to 128 -- and forward
#          timings of both; bwd: the warp-specialized Hopper backward's own tests, then fwd+bwd
#          timings with it and with the general Hopper kernel, DMATTN_BWD_SM90_WS=0; multigpu:
#          context parallelism on every visible GPU, the NCCL tests of dmattn.distributed and
#          the scaling table of benchmarks/profiling/ring_scaling.py)
#   (the PTX path that GPUs newer than the build's archs take: scripts/ptx_jit_check.sh)
#   env:   OUT (default /tmp/dmattn-out), ARCHS (default 90a), PTX (default OFF: DMATTN_CUDA_PTX),
#          CMAKE_ARGS (more CMake options for the build, e.g. -DDMATTN_GATE_TERM_WARPS=ON),
#          PYTEST_ARGS, BENCH_ARGS, SANITIZE_CASES (a regex: the sanitizer cases to run, all
#          unless set; scripts/sanitizer_cases.py),
#          CARRY_ROOT (folder holding .whl/ and .devcarry/, default the repo root; lets a copy of
#          a work tree staged inside the checkout reuse the checkout's carried folders)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CARRY_ROOT=$(realpath "${CARRY_ROOT:-.}")
OUT=${OUT:-/tmp/dmattn-out}
mkdir -p "$OUT"
STEPS=${*:-build test bench}
ARCHS=${ARCHS:-90a}
export PYTHONUNBUFFERED=1
status=0

step() { echo; echo "=== $* ($(date +%T))"; }

step "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

step "dependencies"
SITE=/tmp/dmattn-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$CARRY_ROOT"/.whl/*.whl || exit 1
export PYTHONPATH="$PWD/python:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# Without the build step the library is the one in python/dmattn/ (built on the development
# machine with -DDMATTN_CUDA_ARCHS=90a, and -DDMATTN_USE_BLAS=OFF unless the GPU machine has
# OpenBLAS, and copied over: saves the GPU machine's build minutes),
# or, when present, .devlib/libdmattn_ffi.so.gz (scripts/prepare_gpu_carry.sh lib: the stripped
# library is ~60 MiB; gzipped ~17 MB).
if [[ " $STEPS " != *" build "* && -f "$CARRY_ROOT/.devlib/libdmattn_ffi.so.gz" ]]; then
  gunzip -c "$CARRY_ROOT/.devlib/libdmattn_ffi.so.gz" > python/dmattn/libdmattn_ffi.so || exit 1
fi
if [[ " $STEPS " == *" build "* ]]; then
  CUTLASS_DIR=/tmp/dmattn-cutlass
  mkdir -p "$CUTLASS_DIR" && tar xzf "$CARRY_ROOT"/.devcarry/cutlass_include.tgz -C "$CUTLASS_DIR" || exit 1
  step "build (archs $ARCHS)"
  start=$(date +%s)
  # (no compute_80 PTX unless PTX=ON: beside sm_90a alone it is a second device compilation of
  # every translation unit, which the release build's sm_80 pass makes for free)
  # (ptxas -v: every kernel's registers, stack frame and spills, in $OUT/spills.md)
  cmake -S . -B /tmp/dmattn-build -G Ninja -DDMATTN_CUDA_ARCHS="$ARCHS" -DDMATTN_CUDA_PTX="${PTX:-OFF}" \
    -DCUTLASS_INCLUDE_DIR="$CUTLASS_DIR" -DPython_EXECUTABLE="$(command -v python3)" \
    "-DCMAKE_CUDA_FLAGS=-Xptxas=-v" ${CMAKE_ARGS:-} > "$OUT/build.log" 2>&1 &&
  cmake --build /tmp/dmattn-build -j "$(nproc)" >> "$OUT/build.log" 2>&1
  rc=$?
  grep -E "(^|[ :])(fatal )?error" "$OUT/build.log" | sort | uniq | head -20
  python3 scripts/spill_report.py "$OUT/build.log" > "$OUT/spills.md"
  python3 scripts/spill_report.py "$OUT/build.log" --families
  echo "build rc=$rc in $(( $(date +%s) - start )) s"
  [ $rc -eq 0 ] || { tail -60 "$OUT/build.log"; exit 1; }
  cp /tmp/dmattn-build/libdmattn_ffi.so python/dmattn/
fi
python3 -c "import dmattn; print('dmattn CUDA backend:', dmattn.cuda_available())"

if [[ " $STEPS " == *" test "* ]]; then
  step "GPU tests"
  # shellcheck disable=SC2086
  python3 -m pytest tests/python -m gpu -q --maxfail=40 -p no:cacheprovider -rf ${PYTEST_ARGS:-} \
    2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $STEPS " == *" bench "* ]]; then
  step "benchmark"
  # shellcheck disable=SC2086
  python3 -m dmattn.bench --device cuda --out "$OUT/bench" --json "$OUT/bench.json" ${BENCH_ARGS:-} \
    2>"$OUT/bench.err" | tee "$OUT/bench.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $STEPS " == *" sm90 "* ]]; then
  # The Hopper kernels (src/cuda/sm90/) are the default on compute capability 9.0: the GPU suite
  # with the sm80-class forward and backward kernels instead (the test step covers the default),
  # then forward timings of both.
  step "GPU tests with DMATTN_FWD_SM90=0 DMATTN_BWD_SM90=0"
  # shellcheck disable=SC2086
  DMATTN_FWD_SM90=0 DMATTN_BWD_SM90=0 python3 -m pytest tests/python -m gpu -q --maxfail=40 -p no:cacheprovider -rf ${PYTEST_ARGS:-} \
    2>&1 | tee "$OUT/pytest_gpu_sm80.log" | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  step "forward timings, default (sm90) vs DMATTN_FWD_SM90=0 (sm80-class kernels)"
  python3 benchmarks/profiling/fwd_timing.py 2>&1 | grep -A40 TABLE | tee "$OUT/fwd_timing_sm90.txt"
  DMATTN_FWD_SM90=0 python3 benchmarks/profiling/fwd_timing.py 2>&1 | grep -A40 TABLE | tee "$OUT/fwd_timing_sm80.txt"
fi

if [[ " $STEPS " == *" bwd "* ]]; then
  step "warp-specialized backward: tests"
  timeout 200 python3 -m pytest tests/python/test_gpu_backward_ws.py -q -x -p no:cacheprovider -rf \
    2>&1 | tee "$OUT/pytest_bwd_ws.log" | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  step "fwd+bwd timings: warp-specialized backward, then the general Hopper kernel (DMATTN_BWD_SM90_WS=0)"
  timeout 150 python3 benchmarks/profiling/bwd_timing.py 2>&1 | tee "$OUT/bwd_timing_ws.txt" | grep -A40 -E "TABLE|rel err"
  DMATTN_BWD_SM90_WS=0 timeout 150 python3 benchmarks/profiling/bwd_timing.py 2>&1 | tee "$OUT/bwd_timing_general.txt" |
    grep -A40 TABLE
fi

if [[ " $STEPS " == *" multigpu "* ]]; then
  # Time limits grow with the GPU count: the tests spawn a group per world size (2, 4, 8) and the
  # scaling script one per world size (1, 2, 4, 8) whose work per rank grows with it. On 2 GPUs
  # the step ends within about 5 minutes; the script ends its running group at its deadline and
  # still prints the rows of the world sizes that finished.
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
  step "context parallelism: tests over NCCL, $ngpu GPUs"
  NCCL_NVLS_ENABLE=0 timeout $((90 + 30 * ngpu)) python3 -m pytest tests/python/test_ring_attention.py -m gpu -q \
    -p no:cacheprovider -rfs 2>&1 | tee "$OUT/pytest_multigpu.log" | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  step "context parallelism: ring_attention scaling over 1..$ngpu GPUs"
  limit=$((60 + 40 * ngpu))
  timeout $((limit + 20)) python3 benchmarks/profiling/ring_scaling.py --deadline-s "$limit" \
    --json "$OUT/ring_scaling.json" 2>&1 | tee "$OUT/ring_scaling.txt" | tail -20
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $STEPS " == *" sanitize "* ]]; then
  step "compute-sanitizer (memcheck, racecheck, synccheck) on a small configuration set"
  for tool in memcheck racecheck synccheck; do
    # shellcheck disable=SC2086
    compute-sanitizer --tool "$tool" --error-exitcode 9 python3 scripts/sanitizer_cases.py ${SANITIZE_CASES:-} \
      > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?
    echo "$tool rc=$rc"; tail -5 "$OUT/sanitize_$tool.log"
    [ $rc -eq 0 ] || status=1
  done
fi

echo; echo "gpu_cycle status=$status"
exit $status
