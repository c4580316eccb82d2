// A zeroed device scratch buffer in stream order: allocated and cleared on the stream, given back
// on it once the kernels queued before the destructor have run (cudaMallocAsync / cudaFreeAsync:
// no host synchronization, capturable in a CUDA graph).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/check.h"

namespace dmattn::cuda {

class ZeroedStreamBuffer {
 public:
  ZeroedStreamBuffer(size_t bytes, cudaStream_t stream, const char* what) : stream_(stream) {
    check_cuda(cudaMallocAsync(&ptr_, bytes, stream), what);
    const cudaError_t err = cudaMemsetAsync(ptr_, 0, bytes, stream);
    if (err != cudaSuccess) {
      cudaFreeAsync(ptr_, stream);
      check_cuda(err, what);
    }
  }
  ~ZeroedStreamBuffer() { cudaFreeAsync(ptr_, stream_); }
  ZeroedStreamBuffer(const ZeroedStreamBuffer&) = delete;
  ZeroedStreamBuffer& operator=(const ZeroedStreamBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
};

}  // namespace dmattn::cuda
