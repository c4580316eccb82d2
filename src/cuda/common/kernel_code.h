// Which device code of this build a CUDA device runs. Where the build has machine code for the
// device (sm_80 on 8.x, sm_90a on 9.0) the driver loads it; on any other device of compute
// capability >= 8.0 (10.x, 12.x, ...), and on every device under CUDA_FORCE_PTX_JIT=1, it
// JIT-compiles the compute_80 PTX instead, in which the Hopper kernels have empty bodies: what
// the launchers ask before choosing them (sm90/enabled.h).
#pragma once

namespace dmattn::cuda {

// binary_arch: the architecture of the machine code loaded (e.g. 90); ptx_arch: the virtual
// architecture it was compiled from (80 for the JIT-compiled PTX, 90 for the sm_90a code). Both
// 0 when no code of this build runs on the device.
struct KernelCode {
  int binary_arch = 0;
  int ptx_arch = 0;
};

// Of `device`, asked of the driver once (a probe kernel compiled like every other kernel).
KernelCode kernel_code(int device);

}  // namespace dmattn::cuda
