#!/usr/bin/env bash
# Compiles one translation unit of each CUDA kernel family for sm_80 and sm_90a (with the
# compute_80 PTX), as the full build does, without linking or running anything: on a machine
# with nvcc and no GPU (scripts/test.sh runs it there) it shows in ~20 minutes on 2 cores that
# the kernels still compile, where the full build of every unit takes well over an hour.
# Head dim 64, bf16: each unit instantiates every score policy of its family (masks, biases,
# gathered keys, the gate's sm80-class path, windows with sinks); the gate's Hopper variants and
# the general Hopper backward (head dim 128) have units of their own, so a broken policy or a
# broken shared header fails here; a tile configuration of another head dim or dtype only in a
# full build. Then the gate's term-warp variants (DMATTN_GATE_TERM_WARPS=ON), sm_90a only.
#
# Usage (repo root, with .venv set up by scripts/setup_env.sh):  bash scripts/cuda_compile_check.sh
# Environment: JOBS (parallel compilations, default: the core count).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -x .venv/bin/python ]; then export PATH="$PWD/.venv/bin:$PATH"; fi  # its cmake and ninja
PYTHON=$(command -v python)
JOBS=${JOBS:-$(nproc)}
UNITS=(
  common/kernel_code.cu host/cuda_backend.cu host/decode_backend.cu host/aligned_operand.cu
  indexed/key_glue.cu indexed/per_query_glue.cu
  inst/decode_bf16.cu
  inst/fwd_bf16_hd64.cu inst/bwd_bf16_hd64.cu inst/bwd_dq_bf16_hd64.cu inst/bwd_sm90_bf16.cu
  inst/fwd_ws_bf16_hd64.cu inst/bwd_ws_bf16_hd64.cu
  inst/fwd_ws_gate_bf16.cu inst/bwd_ws_gate_bf16.cu inst/bwd_ws_plain_gate_bf16.cu
)
# compile_units LABEL DIR CMAKE_OPTIONS UNIT...: configures DIR with the options, compiles the
# units' objects (no link) and reports the time; ninja's progress lines and, for a failing unit,
# the compiler's output are shown, ptxas's spill reports (--warn-on-spills, for kernel work)
# counted here and listed in DIR.log.
compile_units() {
  local label=$1 dir=$2 options=$3
  shift 3
  local start rc spills unit targets=()
  start=$(date +%s)
  # shellcheck disable=SC2086
  cmake -S . -B "$dir" -G Ninja -DDMATTN_BUILD_CUDA=ON $options -DPython_EXECUTABLE="$PYTHON" \
    >"$dir.configure.log" 2>&1 || {
    echo "[cuda-check] CMake configure ($label) failed; $dir.configure.log:" >&2
    tail -30 "$dir.configure.log" >&2
    exit 1
  }
  for unit in "$@"; do
    [ -f "src/cuda/$unit" ] || { echo "[cuda-check] no such unit: src/cuda/$unit" >&2; exit 1; }
    targets+=("CMakeFiles/dmattn_core.dir/src/cuda/$unit.o")
  done
  set +e
  cmake --build "$dir" -j "$JOBS" --target "${targets[@]}" 2>&1 | tee "$dir.log" |
    grep --line-buffered -v '^ptxas warning : Registers are spilled'
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" -eq 0 ] || { echo "[cuda-check] compilation ($label) failed (exit $rc); the whole output: $dir.log" >&2; exit "$rc"; }
  spills=$(grep -c '^ptxas warning : Registers are spilled' "$dir.log" || true)
  echo "[cuda-check] $label: $# units compiled in $(( $(date +%s) - start )) s;" \
    "ptxas reports spills in $spills kernel images (listed in $dir.log)"
}

echo "[cuda-check] compiling ${#UNITS[@]} CUDA translation units (one per family) for sm_80 and" \
  "sm_90a: about 20 minutes on 2 cores"
compile_units "one unit per family" build/cuda-compile-check "-DDMATTN_CUDA_ARCHS=80;90a -DDMATTN_CUDA_PTX=ON" \
  "${UNITS[@]}"
# The gate's term warps and their forward's turns (CMake options DMATTN_GATE_TERM_WARPS and
# DMATTN_GATE_TERM_TURNS, off by default): their forward and backward variants, sm_90a only (the
# kernels' bodies are sm_90a's).
compile_units "the gate's term warps" build/cuda-compile-check-gate-terms \
  "-DDMATTN_CUDA_ARCHS=90a -DDMATTN_CUDA_PTX=OFF -DDMATTN_GATE_TERM_WARPS=ON -DDMATTN_GATE_TERM_TURNS=ON" \
  inst/fwd_ws_gate_bf16.cu inst/bwd_ws_gate_bf16.cu inst/bwd_ws_plain_gate_bf16.cu
