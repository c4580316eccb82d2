// CUDA error -> dmattn::Error(kRuntime) with the CUDA error string.
#pragma once

#include <cuda_runtime.h>

#include "dmattn/error.h"

namespace dmattn::cuda {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    fail(ErrorKind::kRuntime, "CUDA backend: ", what, " failed: ", cudaGetErrorString(err));
}

}  // namespace dmattn::cuda
