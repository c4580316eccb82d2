#!/usr/bin/env bash
# On the development machine: gathers what scripts/gpu_cycle.sh needs on a GPU machine without
# a package registry into git-ignored folders, to copy there with the work tree: .whl/ and
# .devcarry/.
#   bash scripts/prepare_gpu_carry.sh lib BUILD_DIR: instead, the library of BUILD_DIR (configured
#   with -DDMATTN_CUDA_ARCHS=90a) stripped and gzipped into .devlib/, to copy with .whl/;
#   gpu_cycle.sh without its build step unpacks it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "${1:-}" = lib ]; then
  mkdir -p .devlib
  # A library linked to the system BLAS needs it on the GPU machine too; configure BUILD_DIR
  # with -DDMATTN_USE_BLAS=OFF where that machine may lack it (the CPU backend then runs on
  # plain loops there, which the GPU tests do not time).
  if readelf -d "$2/libdmattn_ffi.so" | grep -qiE "NEEDED.*blas"; then
    echo "note: $2/libdmattn_ffi.so links $(readelf -d "$2/libdmattn_ffi.so" | grep -oiE 'lib[a-z]*blas[^]]*' | head -1);" \
      "the GPU machine needs it too (or configure with -DDMATTN_USE_BLAS=OFF)" >&2
  fi
  strip --strip-unneeded -o .devlib/libdmattn_ffi.so "$2/libdmattn_ffi.so"
  gzip -1 -f .devlib/libdmattn_ffi.so
  ls -la .devlib
  exit 0
fi
PY=${PYTHON:-python3}
DEVICE_PY=${DEVICE_PY:-3.12}  # the GPU machine's Python
mkdir -p .whl .devcarry
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PY" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "apache-tvm-ffi==$("$PY" -c 'import tvm_ffi; print(tvm_ffi.__version__)')"
inc=$("$PY" -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
tar czf .devcarry/cutlass_include.tgz -C "$inc" cute cutlass
ls -la .whl .devcarry
