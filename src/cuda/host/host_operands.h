// Host-side rules both CUDA backends (cuda_backend.cu, decode_backend.cu) apply to their
// operands: the 16-byte alignment the kernels' vector loads need, and a broadcast operand's
// strides as the kernels read them (0 along every dimension of size 1).
#pragma once

#include <cstdint>

#include "cuda/common/fwd_args.h"
#include "dmattn/error.h"
#include "dmattn/params.h"

namespace dmattn::cuda {

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// q, k, v, out: a 16-byte aligned pointer and strides of whole 8-element (16-byte) vectors.
inline void check_seq_tensor(const char* name, const void* ptr, const SeqTensor& t) {
  check(aligned16(ptr) && t.batch_stride % 8 == 0 && t.row_stride % 8 == 0 && t.head_stride % 8 == 0,
        ErrorKind::kValue, name, ": the CUDA backend needs a 16-byte aligned data pointer and strides ",
        "that are multiples of 8 elements, got strides (", t.batch_stride, ", ", t.row_stride, ", ",
        t.head_stride, ")");
}

// A mask / bias as the kernels read it (absent: ptr null); esize bytes per element.
inline OperandArgs make_operand(const BroadcastOperand& op, int esize) {
  OperandArgs o;
  if (!op.present()) return o;
  o.ptr = static_cast<const char*>(op.ptr);
  o.stride_b = op.size_b == 1 ? 0 : op.stride_b;
  o.stride_h = op.size_h == 1 ? 0 : op.stride_h;
  o.stride_q = op.size_q == 1 ? 0 : op.stride_q;
  o.stride_k = op.size_k == 1 ? 0 : op.stride_k;
  o.head_div = static_cast<int>(op.head_div);
  o.esize = esize;
  o.row_bcast = o.stride_q == 0;
  const auto al = [&](int64_t s) { return (s * esize) % 16 == 0; };
  o.vec = o.stride_k == 1 && aligned16(op.ptr) && al(o.stride_b) && al(o.stride_h) && al(o.stride_q);
  return o;
}

}  // namespace dmattn::cuda
