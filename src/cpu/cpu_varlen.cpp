// Packed variable-length batches on the CPU.
//
// Each sequence is an ordinary dense problem of batch 1 over a slice of the packed tensors:
// q/out/dout/dq rows [cu_seqlens_q[b], cu_seqlens_q[b+1]), k/v/dk/dv rows
// [cu_seqlens_k[b], cu_seqlens_k[b+1]), lse columns like q's rows, and the key-side mask, bias
// and dbias restricted to the sequence's keys (a (1, Hb, 1, len_k) operand broadcast over the
// queries), the gate's alpha / delta (and their gradients) to the sequence's query / key rows. So varlen reuses the dense forward and backward unchanged, including the per-
// sequence bottom-right alignment of causal/window (the dense rule with the sequence's lengths).
//
// The sequences own disjoint parts of every output -- including dbias, whose key range is the
// sequence's own -- and together they cover all of them (cu_seqlens run from 0 to the totals),
// so running them one after another writes every element exactly once, needs no reduction
// across sequences, and keeps the backward deterministic. Each dense call parallelizes over
// its heads and blocks.
#include <type_traits>

#include "cpu/cpu_backend.h"

namespace dmattn::cpu {
namespace {

// `elements` elements of `dtype` past `ptr`.
template <typename Pointer>
Pointer advance(Pointer ptr, int64_t elements, DType dtype) {
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>, const char, char>;
  return static_cast<Pointer>(static_cast<Byte*>(ptr) + elements * dtype_size(dtype));
}

// The keys [first, first + count) of a key-side operand (size_k = total_k).
BroadcastOperand key_slice(const BroadcastOperand& op, int64_t first, int64_t count) {
  BroadcastOperand slice = op;
  if (!op.present()) return slice;
  slice.ptr = advance(op.ptr, first * op.stride_k, op.dtype);
  slice.size_k = count;
  return slice;
}

struct SequenceRows {
  int64_t first_q, len_q, first_k, len_k;
};

SequenceRows sequence_rows(const ForwardParams& p, int64_t b) {
  const int64_t first_q = p.cu_seqlens_q[b], first_k = p.cu_seqlens_k[b];
  return {first_q, p.cu_seqlens_q[b + 1] - first_q, first_k, p.cu_seqlens_k[b + 1] - first_k};
}

ForwardParams sequence_params(const ForwardParams& p, const SequenceRows& s, int64_t b) {
  ForwardParams seq = p;
  seq.cu_seqlens_q = seq.cu_seqlens_k = nullptr;  // dense, batch 1
  seq.total_q = seq.total_k = 0;
  seq.batch = 1;
  seq.seqlen_q = s.len_q;
  seq.seqlen_k = s.len_k;
  seq.q = advance(p.q, s.first_q * p.q_strides.row_stride, p.dtype);
  seq.k = advance(p.k, s.first_k * p.k_strides.row_stride, p.dtype);
  seq.v = advance(p.v, s.first_k * p.v_strides.row_stride, p.dtype);
  seq.out = advance(p.out, s.first_q * p.out_strides.row_stride, p.dtype);
  // lse is (H, total_q): the sequence's columns, keeping the head stride total_q.
  const DType lse_dtype = p.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  seq.lse = advance(p.lse, s.first_q, lse_dtype);
  seq.mask = key_slice(p.mask, s.first_k, s.len_k);
  seq.bias = key_slice(p.bias, s.first_k, s.len_k);
  if (p.gate.present()) {  // alpha (total_q, H) and delta (total_k, Hkv): the sequence's rows
    seq.gate.alpha = advance(p.gate.alpha, s.first_q * p.gate.alpha_strides.row_stride, p.gate.alpha_dtype);
    seq.gate.delta = advance(p.gate.delta, s.first_k * p.gate.delta_strides.row_stride, p.gate.delta_dtype);
    if (p.gate.keep != nullptr) seq.gate.keep = p.gate.keep + b * p.gate.keep_bs;  // (cells per sequence)
  }
  return seq;
}

}  // namespace

void forward_varlen(const ForwardParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) forward(sequence_params(p, sequence_rows(p, b), b));
}

void backward_varlen(const BackwardParams& p) {
  const ForwardParams& f = p.fwd;
  for (int64_t b = 0; b < f.batch; ++b) {
    const SequenceRows s = sequence_rows(f, b);
    BackwardParams seq = p;
    seq.fwd = sequence_params(f, s, b);
    seq.dout = advance(p.dout, s.first_q * p.dout_strides.row_stride, f.dtype);
    seq.dq = advance(p.dq, s.first_q * p.dq_strides.row_stride, f.dtype);
    seq.dk = advance(p.dk, s.first_k * p.dk_strides.row_stride, f.dtype);
    seq.dv = advance(p.dv, s.first_k * p.dv_strides.row_stride, f.dtype);
    if (p.dbias != nullptr) seq.dbias = advance(p.dbias, s.first_k * p.dbias_stride_k, f.bias.dtype);
    if (p.dalpha != nullptr) seq.dalpha = advance(p.dalpha, s.first_q * p.dalpha_strides.row_stride, f.gate.alpha_dtype);
    if (p.ddelta != nullptr) seq.ddelta = advance(p.ddelta, s.first_k * p.ddelta_strides.row_stride, f.gate.delta_dtype);
    // CUDA scratch, laid out for the whole packed batch; the CPU backend keeps its own.
    seq.softmax_delta = seq.dq_accum = seq.dbias_accum = nullptr;
    backward(seq);
  }
}

}  // namespace dmattn::cpu
