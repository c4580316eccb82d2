// The decode calls' float32 scratch (the splits' partial rows, an lse the caller does not want),
// reused by the eager calls of one stream (decode_scratch.cpp says when).
#pragma once

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>

#include <cstdint>

namespace dmattn::binding {

// A float32 tensor of at least `elements` (> 0) on `device` for kernels queued on `stream` (the
// call's cudaStream_t), allocated through tvm-ffi's environment allocator. Its contents are
// undefined: the kernels write every element they read.
tvm::ffi::Tensor decode_scratch(int64_t elements, DLDevice device, void* stream);

}  // namespace dmattn::binding
