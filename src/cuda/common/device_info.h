// Properties of the current CUDA device that the launches read on every call, queried once per
// device.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include <cuda_runtime.h>

#include "cuda/common/check.h"

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

// The shared memory of one multiprocessor of `device` (0 as above).
inline int shared_memory_per_multiprocessor(int device) {
  return device_info_detail::cached_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(
      device, "cudaDeviceGetAttribute(max shared memory per multiprocessor)");
}

// The compute capability's major number of `device` (0 as above).
inline int compute_capability_major(int device) {
  return device_info_detail::cached_attribute<cudaDevAttrComputeCapabilityMajor>(
      device, "cudaDeviceGetAttribute(compute capability)");
}

inline int current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

// Lets `kernel` launch with `bytes` of dynamic shared memory on the current device: the driver
// call once per (kernel, device) and larger size, not per launch (its host time is a
// noticeable part of a short call's, which the GPU waits for when the call starts from idle).
template <typename Kernel>
void allow_dynamic_shared_memory(Kernel kernel, int bytes, const char* what) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> allowed;  // (kernel, device) -> bytes
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), current_device());
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = allowed.find(key);
    if (it != allowed.end() && it->second >= bytes) return;
  }
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what);
  std::lock_guard<std::mutex> lock(mutex);
  int& entry = allowed[key];
  if (entry < bytes) entry = bytes;
}

inline int current_multiprocessor_count() { return multiprocessor_count(current_device()); }

}  // namespace dmattn::cuda
