// Programmatic dependent launch (sm_90 and newer; no-ops elsewhere): a kernel whose results a
// dependent kernel consumes lets it be launched early (launch_dependents), and the dependent
// waits for the whole previous grid, its memory operations visible, before it reads them
// (wait_for_prerequisite_grid). Launched without the attribute (launch_dependent_kernel,
// launch.h, on a device that runs other code), the wait returns at once: the stream's order
// already holds.
#pragma once

namespace dmattn::cuda {

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace dmattn::cuda
