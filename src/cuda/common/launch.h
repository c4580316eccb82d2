// One kernel launch with dynamic shared memory: the opt-in for its size (device_info.h, once per
// kernel and device), the launch, the launch's error check. Every launcher of a kernel that takes
// more than the default 48 KB goes through it, so that none forgets the opt-in or the check.
// (CUDA translation units only: the launch syntax needs nvcc.)
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/check.h"
#include "cuda/common/device_info.h"

namespace dmattn::cuda {

// kernel<<<grid, threads, smem, stream>>>(args); `what` names the launch in an error.
template <typename Kernel, typename Args>
void launch_kernel(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream, const Args& args,
                   const char* what) {
  allow_dynamic_shared_memory(kernel, smem, what);
  kernel<<<grid, threads, smem, stream>>>(args);
  check_cuda(cudaGetLastError(), what);
}

}  // namespace dmattn::cuda
