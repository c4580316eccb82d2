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

// The same for a kernel that only consumes the previous kernel's results (the decode splits'
// merge), without dynamic shared memory. `programmatic`: the device runs code of the kernel that
// waits in griddepcontrol.wait (wait_for_prerequisite_grid, pdl.h: the sm_90a code,
// sm90::device_runs_sm90_kernels), so it is launched as a programmatic dependent of the previous
// kernel: its CTAs are placed while the previous grid finishes, instead of after the stream's
// launch gap. Otherwise (older GPUs, and newer ones that run the compute_80 PTX, whose code has
// no wait) the ordinary stream order.
template <typename Kernel, typename Args>
void launch_dependent_kernel(Kernel kernel, dim3 grid, int threads, cudaStream_t stream, const Args& args,
                             bool programmatic, const char* what) {
  if (!programmatic) {
    kernel<<<grid, threads, 0, stream>>>(args);
  } else {
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    check_cuda(cudaLaunchKernelEx(&config, kernel, args), what);
  }
  check_cuda(cudaGetLastError(), what);
}

}  // namespace dmattn::cuda
