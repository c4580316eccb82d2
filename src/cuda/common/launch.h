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
// merge): where the device runs the kernel's sm_90 code, it is launched as a programmatic
// dependent of that kernel, so that its CTAs are placed while the previous grid finishes and
// wait in griddepcontrol.wait (wait_for_prerequisite_grid, pdl.h) instead of the stream's
// launch gap. Elsewhere the ordinary stream order: older GPUs, and newer ones that run the
// compute_80 PTX, whose code has no wait (cudaFuncGetAttributes' ptxVersion tells which code a
// device loaded).
template <typename Kernel, typename Args>
void launch_dependent_kernel(Kernel kernel, dim3 grid, int threads, cudaStream_t stream, const Args& args,
                             const char* what) {
  constexpr int kDevices = 64;
  static int has_wait[kDevices] = {};  // per device: 0 unknown, 1 yes, -1 no (benign races: one answer)
  const int device = current_device();
  int& known = has_wait[device < kDevices ? device : 0];
  if (known == 0 || device >= kDevices) {
    cudaFuncAttributes attributes{};
    check_cuda(cudaFuncGetAttributes(&attributes, kernel), what);
    known = attributes.ptxVersion >= 90 && compute_capability_major(device) >= 9 ? 1 : -1;
  }
  if (known < 0) {
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
