// Whether the Hopper kernels (sm90/) may run: the build holds sm_90a code (DMATTN_HAS_SM90A,
// set by CMakeLists.txt when DMATTN_CUDA_ARCHS has 90a; without it the kernels have only their
// empty bodies), the current device has compute capability 9.0 and the driver loaded that code
// (not the compute_80 PTX, JIT-compiled under CUDA_FORCE_PTX_JIT=1, whose Hopper kernels are
// empty too: kernel_code.h). Each pass also has an environment switch (DMATTN_FWD_SM90=0,
// DMATTN_BWD_SM90=0) that falls back to the sm80-class kernels, for comparisons.
#pragma once

#include <cstdlib>

#include <cuda_runtime.h>

#include "cuda/common/check.h"
#include "cuda/common/device_info.h"
#include "cuda/common/kernel_code.h"

#ifndef DMATTN_HAS_SM90A
#define DMATTN_HAS_SM90A 0
#endif

namespace dmattn::cuda::sm90 {

inline bool env_switched_off(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && env[0] == '0';
}

inline bool device_runs_sm90_kernels(int device) {
  if (!DMATTN_HAS_SM90A) return false;
  return compute_capability_major(device) == 9 && kernel_code(device).ptx_arch >= 90;
}
inline bool device_runs_sm90_kernels() { return device_runs_sm90_kernels(current_device()); }

}  // namespace dmattn::cuda::sm90
