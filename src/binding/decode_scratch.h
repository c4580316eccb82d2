// The decode calls' float32 scratch (the splits' partial rows, an lse the caller does not want),
// reused by the eager calls of one stream (decode_scratch.cpp says when).
#pragma once

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>

#include <cstdint>
#include <mutex>

namespace dmattn::binding {

// A float32 tensor of at least `elements` (> 0) on `device` for kernels queued on `stream` (the
// call's cudaStream_t), allocated through tvm-ffi's environment allocator. Its contents are
// undefined: the kernels write every element they read. Where it is the stream's reused buffer,
// `hold` is locked: the caller keeps it until its last launch that uses the tensor is queued, so
// that no other thread's call on the stream queues kernels between them.
struct DecodeScratch {
  tvm::ffi::Tensor tensor;
  std::unique_lock<std::mutex> hold;
};
DecodeScratch decode_scratch(int64_t elements, DLDevice device, void* stream);

}  // namespace dmattn::binding
