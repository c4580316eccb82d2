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
dir=build/cuda-compile-check
echo "[cuda-check] compiling ${#UNITS[@]} CUDA translation units (one per family) for sm_80 and" \
  "sm_90a: about 20 minutes on 2 cores"
start=$(date +%s)
cmake -S . -B "$dir" -G Ninja -DDMATTN_BUILD_CUDA=ON -DDMATTN_CUDA_ARCHS="80;90a" \
  -DDMATTN_CUDA_PTX=ON -DPython_EXECUTABLE="$PYTHON" >"$dir.configure.log" 2>&1 || {
  echo "[cuda-check] CMake configure failed; $dir.configure.log:" >&2
  tail -30 "$dir.configure.log" >&2
  exit 1
}
targets=()
for unit in "${UNITS[@]}"; do
  [ -f "src/cuda/$unit" ] || { echo "[cuda-check] no such unit: src/cuda/$unit" >&2; exit 1; }
  targets+=("CMakeFiles/dmattn_core.dir/src/cuda/$unit.o")
done
# ninja's progress lines and, for a failing unit, the compiler's output; ptxas's spill reports
# (--warn-on-spills, for kernel work) are counted here and listed in the log.
set +e
cmake --build "$dir" -j "$JOBS" --target "${targets[@]}" 2>&1 | tee "$dir.log" |
  grep --line-buffered -v '^ptxas warning : Registers are spilled'
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 0 ] || { echo "[cuda-check] compilation failed (exit $rc); the whole output: $dir.log" >&2; exit "$rc"; }
spills=$(grep -c '^ptxas warning : Registers are spilled' "$dir.log" || true)
echo "[cuda-check] ${#UNITS[@]} units compiled in $(( $(date +%s) - start )) s;" \
  "ptxas reports spills in $spills kernel images (listed in $dir.log)"

# The gate's term warps (CMake option DMATTN_GATE_TERM_WARPS, off by default): their
# forward variants and the backward of the gate alone, sm_90a only (the kernels' bodies are
# sm_90a's).
tdir=build/cuda-compile-check-gate-terms
tstart=$(date +%s)
cmake -S . -B "$tdir" -G Ninja -DDMATTN_BUILD_CUDA=ON -DDMATTN_CUDA_ARCHS="90a" -DDMATTN_CUDA_PTX=OFF \
  -DDMATTN_GATE_TERM_WARPS=ON -DPython_EXECUTABLE="$PYTHON" >"$tdir.configure.log" 2>&1 || {
  echo "[cuda-check] CMake configure (gate term warps) failed; $tdir.configure.log:" >&2
  tail -30 "$tdir.configure.log" >&2
  exit 1
}
set +e
cmake --build "$tdir" -j "$JOBS" --target CMakeFiles/dmattn_core.dir/src/cuda/inst/fwd_ws_gate_bf16.cu.o \
  CMakeFiles/dmattn_core.dir/src/cuda/inst/bwd_ws_plain_gate_bf16.cu.o 2>&1 |
  tee "$tdir.log" | grep --line-buffered -v '^ptxas warning : Registers are spilled'
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 0 ] || { echo "[cuda-check] the gate term warps' units failed (exit $rc): $tdir.log" >&2; exit "$rc"; }
tspills=$(grep -c '^ptxas warning : Registers are spilled' "$tdir.log" || true)
echo "[cuda-check] the gate term warps' units compiled in $(( $(date +%s) - tstart )) s;" \
  "ptxas reports spills in $tspills kernel images"
