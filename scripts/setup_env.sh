#!/usr/bin/env bash
# Creates (or reuses) .venv with PyTorch and builds + installs dmattn into it.
# Sourced by scripts/run.sh and scripts/test.sh; safe to run repeatedly (the CMake build
# directory build/ is reused, so a second install only recompiles what changed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch first and pinned: this machine's local CPU build. A plain `torch` requirement would
# make the resolver pull a multi-GB CUDA build. Any torch >= 2.4 works at run time.
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${DMATTN_TORCH_VERSION:-2.13.0}"
fi
# Build requirements installed into the venv and used without isolation, so the CMake
# build directory stays valid between runs (plain `pip install .` works too, just slower).
python -m pip install -q "scikit-build-core>=0.10" "apache-tvm-ffi>=0.1.15,<0.2" \
  "nvidia-cutlass==4.2.0.0" numpy pytest
python -m pip install -q --no-build-isolation ".[test]"
python -c "import dmattn; print('dmattn', dmattn.__version__, '| CUDA backend built:', dmattn.cuda_available())"
