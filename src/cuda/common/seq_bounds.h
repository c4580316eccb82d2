// Where one sequence of a batch lives, for every kernel: its lengths, its first rows, its window.
// Dense batches: every sequence has seqlen_q queries and seqlen_k keys and starts at row 0 of
// its batch slice (the batch strides select it). Packed variable-length batches (FwdArgs::
// cu_seqlens_q != null, batch strides 0): sequence b holds packed rows [cu_seqlens_q[b],
// cu_seqlens_q[b + 1]) of q / out / dout / dq and the lse columns of the same range, and key
// rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k / v / dk / dv and of the key-side mask,
// bias and dbias. Kernels take their loop bounds, window and tail predication from len_q() /
// len_k() (never from the grid's max lengths), so a tile never reaches a neighbouring sequence.
//
// Every accessor re-reads what it needs: the packed values from cu_seqlens through a volatile,
// predicated load (an L1 hit; volatile so that the compiler neither merges it with an earlier
// load nor hoists it out of a loop; predicated so that the dense path, where it is off and the
// value comes from the kernel parameters, gets no branch splitting the unrolled code). Nothing
// is then held in a register across the main loops, which are register-bound: holding the four
// values raised the plain bf16 hd128 forward's spills from 92 to 152 bytes, re-reading them
// leaves ~90. No template parameter: the dense path pays a few moves per use.
#pragma once

#include <cstdint>

#include "cuda/common/fwd_args.h"
#include "cuda/common/mask.h"

namespace dmattn::cuda {

// *p when `on`, else `otherwise`; p is not read when off.
__device__ __forceinline__ int load_fresh_or(const int* p, bool on, int otherwise) {
  int v;
  asm volatile(
      "{\n .reg .pred on;\n setp.ne.u32 on, %2, 0;\n mov.b32 %0, %3;\n @on ld.global.nc.b32 %0, [%1];\n}\n"
      : "=r"(v)
      : "l"(p), "r"(int(on)), "r"(otherwise));
  return v;
}

// kForm: kSeqFormAny, the batch's form (dense or packed) read at run time; kSeqFormDense or
// kSeqFormPacked, a kernel built for one form: its dense values are the kernel parameters
// themselves (no load, no test, nothing the compiler must hold in a register).
inline constexpr int kSeqFormAny = -1, kSeqFormDense = 0, kSeqFormPacked = 1;

template <int kForm = kSeqFormAny>
struct SeqBoundsOf {
  const FwdArgs& a;
  int b;

  __device__ __forceinline__ SeqBoundsOf(const FwdArgs& args, int batch) : a(args), b(batch) {}

  __device__ __forceinline__ bool packed() const {
    if constexpr (kForm == kSeqFormAny) return a.cu_seqlens_q != nullptr;
    else return kForm == kSeqFormPacked;
  }
  __device__ __forceinline__ int fresh_or(const int* p, int otherwise) const {
    if constexpr (kForm == kSeqFormDense) return otherwise;
    else return load_fresh_or(p, packed(), otherwise);
  }
  // First query / key row of the sequence inside its batch slice (dense: 0).
  __device__ __forceinline__ int q0() const { return fresh_or(a.cu_seqlens_q + b, 0); }
  __device__ __forceinline__ int k0() const { return fresh_or(a.cu_seqlens_k + b, 0); }
  __device__ __forceinline__ int len_q() const { return fresh_or(a.cu_seqlens_q + b + 1, a.seqlen_q) - q0(); }
  __device__ __forceinline__ int len_k() const { return fresh_or(a.cu_seqlens_k + b + 1, a.seqlen_k) - k0(); }
  // Query rows of the block starting at m0 that lie inside the sequence.
  __device__ __forceinline__ int rows_valid(int m0, int block_m) const { return min(block_m, len_q() - m0); }
  // Causal / window, bottom-right aligned with this sequence's own lengths.
  __device__ __forceinline__ WindowMask window() const {
    return WindowMask{len_q(), len_k(), a.window_left, a.window_right};
  }
  // Offset of (head h, row 0) of this sequence in an lse-shaped buffer (lse, Delta, the
  // backward's row statistics).
  __device__ __forceinline__ int64_t stat_offset(int h) const { return stat_offset(h, q0()); }
  // The same from the sequence's first row q0 already read (a loop that reads it once).
  __device__ __forceinline__ int64_t stat_offset(int h, int q0) const {
    return int64_t(b) * a.lse_bs + int64_t(h) * a.lse_hs + q0;
  }
  // Row 0 of this sequence among the query rows of the whole batch (the dq accumulator's rows:
  // B * seqlen_q dense, total_q packed).
  __device__ __forceinline__ int64_t batch_row() const {
    return int64_t(q0()) + (packed() ? 0 : int64_t(b) * a.seqlen_q);
  }
};
using SeqBounds = SeqBoundsOf<>;

}  // namespace dmattn::cuda
