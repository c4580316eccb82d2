// The decode calls' float32 scratch (the splits' partial rows, an lse the caller does not want) and
// merge counters, reused by the eager calls of one stream (decode_scratch.cpp says when).
#pragma once

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>

#include <cstdint>

namespace dmattn::binding {

// A float32 tensor of at least `elements` (> 0) on `device` for kernels queued on `stream` (the
// call's cudaStream_t), allocated through tvm-ffi's environment allocator. Its contents are
// undefined: the kernels write every element they read.
tvm::ffi::Tensor decode_scratch(int64_t elements, DLDevice device, void* stream);

// At least `count` int32 counters, all zero, for the decode kernel's own merge of an eager call
// on `stream` (ForwardParams::decode_merge_counters: the kernel leaves them zero), kept for the
// stream's next calls as its scratch is; null where the scratch is not reused (a graph capture,
// DMATTN_DECODE_SCRATCH=0, not CUDA) or with DMATTN_DECODE_OWN_MERGE=0, so that a second kernel
// merges.
int32_t* decode_merge_counters(int64_t count, DLDevice device, void* stream);

}  // namespace dmattn::binding
