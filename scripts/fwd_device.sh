#!/usr/bin/env bash
# Forward-kernel cycle on the lent GPU in one command: builds the library (gpu_cycle.sh build),
# the standalone forward check (tests/cuda/standalone_check.cu) for the default tile
# configuration and for a few tile variants (compile-time knobs of src/cuda/fwd_tile.h; only the
# translation unit a knob touches is rebuilt), then runs: the standalone check + timings, the
# forward timings against SDPA flash / FlexAttention (benchmarks/fwd_timing.py), the variants'
# timings, and the forward-only GPU tests. Logs go to $OUT. Env: CARRY_ROOT as gpu_cycle.sh,
# VARIANTS (default below: "name|file|defines" entries separated by ';'), STEPS.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s]"; }
OUT=${OUT:-/tmp/dmattn-out}; mkdir -p "$OUT"
CARRY_ROOT=$(realpath "${CARRY_ROOT:-.}")
STEPS=${STEPS:-"check timing variants pytest"}
# "name|translation unit|defines|timed names filter" entries separated by ';'
# (a name starting with "chk" also runs the variant's correctness checks)
VARIANTS=${VARIANTS:-"chk_init|fwd_bf16_hd128|-DDMATTN_FWD_INIT_KERNEL=1|bias|mask;chk_init4w|fwd_bf16_hd128|-DDMATTN_FWD_INIT_KERNEL=1 -DDMATTN_FWD_INIT_WARPS_HD128=4|bias|mask"}
END_S=${END_S:-280}   # the pytest step stops by this many seconds after the start
export PYTHONUNBUFFERED=1
SITE=/tmp/dmattn-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY_ROOT"/.whl/*.whl || exit 1
export PYTHONPATH="$PWD/python:$SITE${PYTHONPATH:+:$PYTHONPATH}"
CUT=/tmp/dmattn-cutlass; mkdir -p $CUT && tar xzf "$CARRY_ROOT"/.devcarry/cutlass_include.tgz -C $CUT || exit 1
NV="nvcc -std=c++17 --expt-relaxed-constexpr -O3 -gencode=arch=compute_90a,code=sm_90a -DDMATTN_HAS_SM90A=1 -Xptxas -v -I include -I src -I $CUT"
SC=/tmp/sc; mkdir -p $SC

echo "=== build $(el)"
( cmake -S . -B /tmp/dmattn-build -G Ninja -DDMATTN_CUDA_ARCHS=90a -DCUTLASS_INCLUDE_DIR=$CUT \
    -DPython_EXECUTABLE="$(command -v python3)" > $OUT/build.log 2>&1 &&
  cmake --build /tmp/dmattn-build -j 10 >> $OUT/build.log 2>&1; echo "lib rc=$?" >> $OUT/build.log ) &
LIBPID=$!
objs=""
for f in src/cuda/cuda_backend.cu src/cuda/inst/fwd_*.cu tests/cuda/standalone_check.cu; do
  o=$SC/$(basename $f).o; objs="$objs $o"
  ( $NV -c $f -o $o > $o.log 2>&1 || echo "FAILED $f" >> $SC/fail ) &
done
IFS=';' read -ra VS <<< "$VARIANTS"
for v in "${VS[@]}"; do
  IFS='|' read -r name file defs filt <<< "$v"
  ( $NV $defs -c src/cuda/inst/$file.cu -o $SC/var_$name.o > $SC/var_$name.log 2>&1 || echo "FAILED $name" >> $SC/fail ) &
done
wait
cat $SC/*.log | grep -E "error|Compiling entry|registers|spill" | sed -e 's/.*fwd_kernelINS0_7FwdTileIN7cutlass[0-9]*//' -e 's/ptxas info    : //' > $OUT/ptxas.txt
grep -h -E "error|rc=" $OUT/build.log | tail -5
[ -f $SC/fail ] && { cat $SC/fail; grep -h -B2 -A5 error $SC/*.log | head -60; }
# cuda_backend.cu also dispatches the backward: link the library build's backward objects.
BWD_OBJS=$(ls /tmp/dmattn-build/CMakeFiles/dmattn_core.dir/src/cuda/inst/bwd_*.o 2>/dev/null | tr '\n' ' ')
nvcc -gencode=arch=compute_90a,code=sm_90a $objs $BWD_OBJS -o $SC/check_default || echo "link default failed"
for v in "${VS[@]}"; do
  IFS='|' read -r name file defs filt <<< "$v"
  vobjs=$(echo $objs | tr ' ' '\n' | grep -v "/$file.cu.o" | tr '\n' ' ')
  nvcc -gencode=arch=compute_90a,code=sm_90a $vobjs $SC/var_$name.o $BWD_OBJS -o $SC/check_$name || echo "link $name failed"
done
cp /tmp/dmattn-build/libdmattn_ffi.so python/dmattn/ 2>/dev/null || echo "no lib"
echo "build done $(el)"

if [[ " $STEPS " == *" check "* ]]; then
  echo "=== standalone check + timings (default) $(el)"
  timeout 150 $SC/check_default 2>&1 | tee $OUT/check.log | grep -E "FAIL|failed|TIME|head_dim|THROW"
fi
if [[ " $STEPS " == *" timing "* ]]; then
  echo "=== fwd_timing.py $(el)"
  timeout 170 python3 benchmarks/fwd_timing.py ${FLEX:+--flex} 2>&1 | tee $OUT/timing.log | grep -v Warning | tail -14
fi
if [[ " $STEPS " == *" variants "* ]]; then
  echo "=== variants $(el)"
  for v in "${VS[@]}"; do
    IFS='|' read -r name file defs filt <<< "$v"
    echo "--- $name ($defs)"
    [[ $name == chk* ]] && timeout 60 $SC/check_$name --no-time 2>&1 | grep -E "FAIL|failed"
    timeout 60 $SC/check_$name --time-only "$filt" 2>&1 | grep TIME
  done 2>&1 | tee $OUT/variants.log
fi
if [[ " $STEPS " == *" pytest "* ]]; then
  left=$(( END_S - ($(date +%s) - T0) ))
  echo "=== pytest forward-only ($left s left) $(el)"
  [ $left -gt 20 ] && timeout $left python3 -m pytest tests/python/test_forward_gpu.py -q -p no:cacheprovider --maxfail=5 2>&1 | tee $OUT/pytest.log | tail -15
fi
echo "=== end $(el)"
