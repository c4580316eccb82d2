// Routes validated params to the backend of their device.
#include "dmattn/api.h"
#include "cpu/cpu_backend.h"
#ifdef DMATTN_WITH_CUDA
#include "cuda/host/cuda_backend.h"
#include "cuda/host/decode_backend.h"
#include "cuda/common/kernel_code.h"
#include "cuda/common/stream_capture.h"
#endif

namespace dmattn {

bool cuda_available() {
#ifdef DMATTN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

CudaKernelCode cuda_kernel_code(int32_t device_id) {
#ifdef DMATTN_WITH_CUDA
  const cuda::KernelCode code = cuda::kernel_code(device_id);
  return {code.binary_arch, code.ptx_arch};
#else
  (void)device_id;
  return {};
#endif
}

bool stream_capturing(void* stream) {
#ifdef DMATTN_WITH_CUDA
  return cuda::stream_capturing(stream);
#else
  (void)stream;
  return false;
#endif
}

namespace {
thread_local bool persistent_kernels = true;  // (per thread: a setting of one caller's calls)
}  // namespace

bool set_persistent_kernels(bool allowed) {
  const bool previous = persistent_kernels;
  persistent_kernels = allowed;
  return previous;
}

bool persistent_kernels_allowed() { return persistent_kernels; }

namespace {
#ifndef DMATTN_WITH_CUDA
// (Only where the calls below have no CUDA backend to take: defined in a CUDA build it would be
// an unused function, which gcc warns about.)
[[noreturn]] void no_cuda() {
  fail(ErrorKind::kRuntime,
       "q: got a CUDA tensor, but this build of dmattn has no CUDA backend (it was built without "
       "nvcc or with DMATTN_BUILD_CUDA=OFF); rebuild with CUDA or move the tensors to the CPU");
}
#endif

// Gathered keys on a backend whose kernels do not read key_positions.
void reject_unsupported_key_positions(const ForwardParams& params) {
  check(!params.has_key_positions() || key_positions_supported(params.device),
        ErrorKind::kNotImplemented, "key_positions: gathered keys are not implemented on ",
        device_name(params.device), " yet; use the dense path (k, v with every key and a mask)");
}

}  // namespace

bool key_positions_supported(DeviceKind device) {
  return device == DeviceKind::kCPU || device == DeviceKind::kCUDA;
}

void run_forward(const ForwardParams& params) {
  check(params.decode_splits == 0 || params.device == DeviceKind::kCUDA, ErrorKind::kNotImplemented,
        "q: the decode kernel runs on CUDA tensors only");
  if (params.device == DeviceKind::kCPU) {
    return params.is_varlen() ? cpu::forward_varlen(params) : cpu::forward(params);
  }
  reject_unsupported_key_positions(params);
#ifdef DMATTN_WITH_CUDA
  if (params.decode_splits > 0) return cuda::decode_forward(params);  // docs/decode.md
  return cuda::forward(params);
#else
  no_cuda();
#endif
}

void run_backward(const BackwardParams& params) {
  if (params.fwd.device == DeviceKind::kCPU) {
    return params.fwd.is_varlen() ? cpu::backward_varlen(params) : cpu::backward(params);
  }
  reject_unsupported_key_positions(params.fwd);
#ifdef DMATTN_WITH_CUDA
  return cuda::backward(params);
#else
  no_cuda();
#endif
}

}  // namespace dmattn
