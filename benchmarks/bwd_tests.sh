#!/usr/bin/env bash
# Device: run the CUDA-relevant Python tests (gpu-marked + cuda-parametrized), logs to $OUT.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD/python:/tmp/dmattn-site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bwd-out}
timeout ${T1:-280} python3 -m pytest tests/python -m gpu -q -p no:cacheprovider -rf --tb=short ${PYTEST_ARGS:-} > $OUT/pytest_gpu.log 2>&1
echo "gpu-marked: $(tail -1 $OUT/pytest_gpu.log)"; grep -E "^FAILED|^ERROR" $OUT/pytest_gpu.log | head -30
if [ -z "${SKIP_CUDA_PARAM:-}" ]; then
timeout ${T2:-200} python3 -m pytest tests/python -k cuda -m "not gpu" -q -p no:cacheprovider -rf --tb=short > $OUT/pytest_cuda.log 2>&1
echo "cuda-param: $(tail -1 $OUT/pytest_cuda.log)"; grep -E "^FAILED|^ERROR" $OUT/pytest_cuda.log | head -30
fi
