#!/usr/bin/env bash
# The test job: set up and build (the CUDA kernels are compiled whenever nvcc is present),
# build and run the C++ core's GoogleTest suite, then the Python suite. GPU tests run only
# where a CUDA device is visible; elsewhere they are reported as skipped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup_env.sh

if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
  echo "GoogleTest missing: installing Debian's libgtest-dev"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libgtest-dev >/dev/null
fi
cmake -S . -B build/cpp-tests -G Ninja -DDMATTN_BUILD_TESTS=ON -DDMATTN_BUILD_CUDA=OFF \
  -DPython_EXECUTABLE="$(command -v python)" >/dev/null
cmake --build build/cpp-tests --target dmattn_cpp_tests
(cd build/cpp-tests && ctest --output-on-failure)

python -m pytest -q "$@"
