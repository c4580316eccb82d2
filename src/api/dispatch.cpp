// Routes validated params to the backend of their device.
#include "dmattn/api.h"
#include "cpu/cpu_backend.h"
#ifdef DMATTN_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace dmattn {

bool cuda_available() {
#ifdef DMATTN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

namespace {
[[noreturn]] void no_cuda() {
  fail(ErrorKind::kRuntime,
       "q: got a CUDA tensor, but this build of dmattn has no CUDA backend (it was built without "
       "nvcc or with DMATTN_BUILD_CUDA=OFF); rebuild with CUDA or move the tensors to the CPU");
}
}  // namespace

void run_forward(const ForwardParams& params) {
  if (params.device == DeviceKind::kCPU) return cpu::forward(params);
#ifdef DMATTN_WITH_CUDA
  return cuda::forward(params);
#else
  no_cuda();
#endif
}

void run_backward(const BackwardParams& params) {
  if (params.fwd.device == DeviceKind::kCPU) return cpu::backward(params);
#ifdef DMATTN_WITH_CUDA
  return cuda::backward(params);
#else
  no_cuda();
#endif
}

}  // namespace dmattn
