// stream_capturing(): cudaStreamIsCapturing, which queues nothing and is allowed while a capture
// runs (unlike most of the runtime's calls). clear_bytes(): cudaMemsetAsync.
#include "cuda/common/stream_ops.h"

#include <cuda_runtime.h>

#include "cuda/common/check.h"

namespace dmattn::cuda {

bool stream_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) != cudaSuccess) {
    // (the legacy stream while another thread captures in the global mode: an error that is not
    // sticky, cleared for the caller's next check; counted as capturing)
    cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

void clear_bytes(void* ptr, int64_t bytes, void* stream) {
  check_cuda(cudaMemsetAsync(ptr, 0, static_cast<size_t>(bytes), static_cast<cudaStream_t>(stream)),
             "cudaMemsetAsync");
}

}  // namespace dmattn::cuda
