// Properties of the current CUDA device that the launches read on every call, queried once per
// device.
#pragma once

#include <atomic>

#include <cuda_runtime.h>

#include "cuda/check.h"

namespace dmattn::cuda {

// The multiprocessor count of `device` (0 past the 64 devices it keeps: the caller's default).
inline int multiprocessor_count(int device) {
  static std::atomic<int> counts[64] = {};
  if (device < 0 || device >= 64) return 0;
  int n = counts[device].load(std::memory_order_relaxed);
  if (n == 0) {
    check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
               "cudaDeviceGetAttribute(multiprocessor count)");
    counts[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

inline int current_multiprocessor_count() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return multiprocessor_count(device);
}

}  // namespace dmattn::cuda
