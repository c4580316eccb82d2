// kernel_code(): cudaFuncGetAttributes on an empty kernel, which every translation unit's
// -gencode list compiles alike, so the driver picks the same image kind for it as for the others.
#include "cuda/common/kernel_code.h"

#include <atomic>

#include <cuda_runtime.h>

#include "cuda/common/check.h"

namespace dmattn::cuda {

__global__ void kernel_code_probe() {}

namespace {

KernelCode query(int device) {
  int previous = 0;
  check_cuda(cudaGetDevice(&previous), "cudaGetDevice");
  if (previous != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, kernel_code_probe);
  if (previous != device) cudaSetDevice(previous);
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction ||
      err == cudaErrorUnsupportedPtxVersion || err == cudaErrorJitCompilationDisabled) {
    cudaGetLastError();  // (not sticky: clear it for the caller's next check)
    return {};
  }
  check_cuda(err, "cudaFuncGetAttributes(kernel code probe)");
  return {attr.binaryVersion, attr.ptxVersion};
}

}  // namespace

KernelCode kernel_code(int device) {
  // (binary_arch << 16 | ptx_arch) + 1 per device, 0 until asked; past 64 devices, asked each time.
  static std::atomic<int> known[64] = {};
  if (device < 0 || device >= 64) return query(device);
  int v = known[device].load(std::memory_order_relaxed);
  if (v == 0) {
    const KernelCode code = query(device);
    v = (code.binary_arch << 16 | code.ptx_arch) + 1;
    known[device].store(v, std::memory_order_relaxed);
  }
  --v;
  return {v >> 16, v & 0xffff};
}

}  // namespace dmattn::cuda
