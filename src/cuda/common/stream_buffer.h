// Device scratch buffers in stream order: allocated on the stream, given back on it once the
// kernels queued before the destructor have run (cudaMallocAsync / cudaFreeAsync: no host
// synchronization, capturable in a CUDA graph).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/common/check.h"

namespace dmattn::cuda {

class StreamBuffer {
 public:
  StreamBuffer(size_t bytes, cudaStream_t stream, const char* what) : stream_(stream) {
    check_cuda(cudaMallocAsync(&ptr_, bytes, stream), what);
  }
  ~StreamBuffer() { cudaFreeAsync(ptr_, stream_); }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
};

// The same, cleared on the stream (a failed clear gives the memory back: the base is built).
class ZeroedStreamBuffer : public StreamBuffer {
 public:
  ZeroedStreamBuffer(size_t bytes, cudaStream_t stream, const char* what) : StreamBuffer(bytes, stream, what) {
    check_cuda(cudaMemsetAsync(get(), 0, bytes, stream), what);
  }
};

}  // namespace dmattn::cuda
