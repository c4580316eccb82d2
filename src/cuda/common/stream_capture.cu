// stream_capturing(): cudaStreamIsCapturing, which queues nothing and is allowed while a capture
// runs (unlike most of the runtime's calls).
#include "cuda/common/stream_capture.h"

#include <cuda_runtime.h>

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

}  // namespace dmattn::cuda
