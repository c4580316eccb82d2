#!/usr/bin/env bash
# Creates (or reuses) .venv with PyTorch and builds + installs dmattn into it.
# Sourced by scripts/run.sh and scripts/test.sh; safe to run repeatedly (the CMake build
# directory build/ is reused, so a second install only recompiles what changed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/system_packages.sh
. scripts/system_packages.sh

say() { echo "[setup] $*"; }

# The CPU backend's matrix products use the system BLAS (CMake's FindBLAS; without one it
# falls back to plain loops, several times slower).
if ! compgen -G "/usr/include/cblas.h" >/dev/null && ! compgen -G "/usr/include/*/cblas.h" >/dev/null; then
  install_system_package libopenblas-dev "OpenBLAS (the CPU backend's matrix products)"
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch first and pinned: this machine's local CPU build. A plain `torch` requirement would
# make the resolver pull a multi-GB CUDA build. Any torch >= 2.4 works at run time.
if ! python -c "import torch" 2>/dev/null; then
  say "installing torch ${DMATTN_TORCH_VERSION:-2.13.0} (about a minute)"
  python -m pip install -q "torch==${DMATTN_TORCH_VERSION:-2.13.0}"
fi
# Build requirements installed into the venv and used without isolation, so the CMake build
# directory stays valid between runs (plain `pip install .` works too, just slower);
# matplotlib draws the benchmark's plots.
say "installing the build requirements and matplotlib"
python -m pip install -q "scikit-build-core>=0.10" "apache-tvm-ffi>=0.1.15,<0.2" \
  "nvidia-cutlass==4.2.0.0" numpy pytest matplotlib ninja "cmake>=3.24"

# What the build will compile, and roughly how long it takes. The CUDA kernels by default only
# where they can run: nvcc present and a GPU visible. Without a GPU they would take well over an
# hour on 2 cores for code nothing here runs (scripts/test.sh compiles one unit per kernel family
# there instead); DMATTN_BUILD_CUDA=ON builds them all anyway, OFF never.
# (nvidia-smi's list, or the driver's own entries where a container has the driver without the tool)
gpu_visible() {
  { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; } ||
    compgen -G "/proc/driver/nvidia/gpus/*" >/dev/null || [ -e /dev/nvidia0 ] || [ -e /dev/dxg ]
}
if [ -z "${DMATTN_BUILD_CUDA:-}" ]; then
  if command -v nvcc >/dev/null 2>&1 && ! gpu_visible; then
    say "nvcc found but no GPU visible: the CUDA kernels are left out (DMATTN_BUILD_CUDA=ON builds them)"
    DMATTN_BUILD_CUDA=OFF
  else
    DMATTN_BUILD_CUDA=ON
  fi
fi
export DMATTN_BUILD_CUDA
if [ "$DMATTN_BUILD_CUDA" != OFF ] && command -v nvcc >/dev/null 2>&1; then
  if [ -z "${DMATTN_CUDA_ARCHS:-}" ] && gpu_visible; then
    # Only the visible GPUs' architectures: 9.0 gets the Hopper kernels (90a), any 8.x the
    # sm80-class kernels (80), others their own number.
    archs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
      awk -F. '/^[0-9]+\.[0-9]+/ { if ($1 == 9 && $2 == 0) print "90a"; else if ($1 == 8) print "80";
                                   else print $1 $2 }' | sort -u | paste -sd';' -) || archs=""
    if [ -n "$archs" ]; then export DMATTN_CUDA_ARCHS="$archs"; fi
  fi
  archs=${DMATTN_CUDA_ARCHS:-80;90a}
  n_archs=$(awk -F';' '{ print NF }' <<<"$archs")
  # Measured: over 90 minutes for two architectures on 2 cores (a fresh clone), 5-6 for both on
  # 16 (the largest translation units set a floor whatever the core count).
  minutes=$(( 100 * n_archs / $(nproc) )); [ "$minutes" -ge 5 ] || minutes=5
  say "building dmattn: C++ core, CPU backend and CUDA kernels for sm_${archs//;/, sm_}"
  say "this is the long step: roughly $minutes-$(( minutes * 3 / 2 + 1 )) minutes on $(nproc) cores (ninja's [done/total] lines below; DMATTN_CUDA_ARCHS picks the architectures)"
else
  say "building dmattn: C++ core and CPU backend (no nvcc, or DMATTN_BUILD_CUDA=OFF): about a minute"
fi

# pip -v passes the build's output through; only ninja's progress lines ("[n/N] ..."), dmattn's
# own CMake messages ("dmattn: ..." at the line's start or after CMake's "-- ", never the
# "dmattn::" of a compiler's template notes), errors (compiler, CMake, ninja, pip) and the final
# install line reach the terminal; the whole log goes to build/setup-build.log.
mkdir -p build
start=$(date +%s)
set +e
python -m pip install -v --no-build-isolation ".[test]" 2>&1 | tee build/setup-build.log |
  awk '/^ *\[[0-9]+\/[0-9]+\] / || /^ *(-- )?dmattn: / ||
       /(^|[ :])(fatal )?error( #[0-9]+-D)?:|^ *CMake Error|^ *FAILED:|^ *ERROR/ ||
       /^Successfully installed .*dmattn-/ { print "  " $0; fflush() }'
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
  echo "[setup] the build failed (exit $rc); the last lines of build/setup-build.log:" >&2
  tail -40 build/setup-build.log >&2
  exit "$rc"
fi
say "built and installed in $(( $(date +%s) - start )) s"
python -c "import dmattn; print('[setup] dmattn', dmattn.__version__, '| CUDA backend built:', dmattn.cuda_available())"
