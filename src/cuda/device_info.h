// Properties of the current CUDA device that the launches read on every call, queried once per
// device.
#pragma once

#include <atomic>

#include <cuda_runtime.h>

#include "cuda/check.h"

namespace dmattn::cuda {

namespace device_info_detail {
// Attribute `Attr` of `device`, queried on first use (0 past the 64 devices it keeps).
template <cudaDeviceAttr Attr>
inline int cached_attribute(int device, const char* what) {
  static std::atomic<int> values[64] = {};
  if (device < 0 || device >= 64) return 0;
  int n = values[device].load(std::memory_order_relaxed);
  if (n == 0) {
    check_cuda(cudaDeviceGetAttribute(&n, Attr, device), what);
    values[device].store(n, std::memory_order_relaxed);
  }
  return n;
}
}  // namespace device_info_detail

// The multiprocessor count of `device` (0 past the 64 devices it keeps: the caller's default).
inline int multiprocessor_count(int device) {
  return device_info_detail::cached_attribute<cudaDevAttrMultiProcessorCount>(
      device, "cudaDeviceGetAttribute(multiprocessor count)");
}

// The most dynamic shared memory a block of `device` may opt in to (0 as above).
inline int max_shared_memory_optin(int device) {
  return device_info_detail::cached_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(
      device, "cudaDeviceGetAttribute(max shared memory per block, opt-in)");
}

inline int current_multiprocessor_count() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return multiprocessor_count(device);
}

}  // namespace dmattn::cuda
