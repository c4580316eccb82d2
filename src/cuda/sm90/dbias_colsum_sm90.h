// Column sums of a query-broadcast dbias (kDbColSum) in the Hopper backward kernels: each query
// block's dS column sums added into shared rows (colsum_add_smem from registers, colsum_acc_add_smem
// from a column-sum product), flushed to dbias or its fp32 accumulator once per (batch, bias head)
// (colsum_flush_smem).
#pragma once

#include <cute/tensor.hpp>

#include "cuda/common/bwd_args.h"
#include "cuda/common/bwd_common.h"
#include "cuda/common/bwd_parts.h"
#include "cuda/common/seq_bounds.h"

namespace dmattn::cuda::sm90 {

// p ? x : y as one selp: written as a C++ select of two array elements, the compiler turns it
// into a load from a runtime index and moves the whole array to local memory.
__device__ __forceinline__ float select_f32(bool p, float x, float y) {
  float r;
  asm("{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n selp.f32 %0, %1, %2, q;\n}" : "=f"(r) : "f"(x), "f"(y), "r"(int(p)));
  return r;
}

// Column sums of a query-broadcast dbias (kDbColSum), accumulated in shared memory once per
// query block: 16 running sums per thread in registers across the loop spilled the mask / bias
// kernels. dp: dS on the accumulator's row/col view (kRows x kCols per thread); s_col: float
// [kWarpsPerCol][kBlockN], row (warp % kWarpsPerCol) owned by this warp. The 8 lanes of a warp
// that share columns (lane bits 2..4, same lane % 4) reduce-scatter their kCols row-summed
// values in log2(8) halving steps (kCols / 2 + kCols / 4 + kCols / 8 shuffles, 14 for 16), each
// lane ending with kCols / 8 of them, which it adds into its warp's row: every s_col element has
// one owner thread, the order of the adds is fixed (deterministic), no barrier is needed between
// query blocks. The pairs (c, c + 1) of the accumulator layout are adjacent columns.
// colsum_scatter_add takes the thread's values already summed over its rows (v[c]: column c of
// the row/col view; also the gate's terms, gate_sm90.h); colsum_add_smem sums dS's rows first.
template <int kBlockN, int kWarpsPerCol, int kCols, class C>
__device__ __forceinline__ void colsum_scatter_add(const float (&v)[kCols], C const& coord, float* s_col, int tid) {
  using namespace cute;
  static_assert(kCols % 16 == 0);  // 8 lanes share columns; each ends with an even count
  const int lane = tid & 31;
  // One halving step: the lane whose bit `mask` is set keeps the upper half of `in` and sends
  // the lower half to its partner, which keeps the lower half. (Three separate arrays with
  // static indices: one array updated in place by a loop over the steps went to local memory.)
  auto halve = [&](auto const& in, auto& out, int mask) {
    constexpr int kHalf = sizeof(out) / sizeof(float);
    const bool upper = lane & mask;
    CUTE_UNROLL
    for (int i = 0; i < kHalf; ++i) {
      const float keep = select_f32(upper, in[i + kHalf], in[i]);
      const float send = select_f32(upper, in[i], in[i + kHalf]);
      out[i] = keep + __shfl_xor_sync(0xffffffff, send, mask);
    }
  };
  float v2[kCols / 2], v4[kCols / 4], v8[kCols / 8];
  halve(v, v2, 4);
  halve(v2, v4, 8);
  halve(v4, v8, 16);
  // v8[i] is the sum of index c_first + i over the 8 lanes
  const int c_first = (lane & 4 ? kCols / 2 : 0) + (lane & 8 ? kCols / 4 : 0) + (lane & 16 ? kCols / 8 : 0);
  float* row = s_col + ((tid / 32) % kWarpsPerCol) * kBlockN;
  CUTE_UNROLL
  for (int i = 0; i < kCols / 8; i += 2) {
    // (column of index c_first + i, selected over the static indices: the layout is not assumed)
    int col = 0;
    CUTE_UNROLL
    for (int c = 0; c < kCols; c += 2)
      if (c == c_first + i) col = get<1>(coord(0, c));
    float2* p = reinterpret_cast<float2*>(row + col);
    float2 acc = *p;
    acc.x += v8[i];
    acc.y += v8[i + 1];
    *p = acc;
  }
}

template <int kBlockN, int kWarpsPerCol, class DP, class C>
__device__ __forceinline__ void colsum_add_smem(DP const& dp, C const& coord, float* s_col, int tid) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(dp))::value;
  constexpr int kCols = decltype(size<1>(dp))::value;
  float v[kCols];
  CUTE_UNROLL
  for (int c = 0; c < kCols; ++c) {
    float x = dp(0, c);
    CUTE_UNROLL
    for (int r = 1; r < kRows; ++r) x += dp(r, c);
    v[c] = x;
  }
  colsum_scatter_add<kBlockN, kWarpsPerCol>(v, coord, s_col, tid);
}

// Adds the column sums of one query block, from a column-sum product (dS^T times a tile of ones:
// the general kernel's bias fast path, the warp-specialized kernel's key rows), into row 0 of
// s_col (flushed by colsum_flush_smem): the lane holding column 0 of a key row adds its sum.
// Every key row has one such lane, always the same one: no barrier between query blocks, a fixed
// order of the adds. m64n8 fp32 accumulator of warpgroup w (keys [64 w, 64 w +
// 64)): value i of a thread is key row 64 w + 16 (warp % 4) + lane / 4 + 8 (i / 2), column
// 2 (lane % 4) + i % 2.
template <class Acc>
__device__ __forceinline__ void colsum_acc_add_smem(Acc const& acc, float* s_col, int tid) {
  static_assert(decltype(cute::size(acc))::value == 4);
  if ((tid & 3) == 0) {
    const int c = (tid / 128) * 64 + ((tid / 32) % 4) * 16 + (tid % 32) / 4;
    s_col[c] += acc(0);
    s_col[c + 8] += acc(2);
  }
}

// Flush of the shared-memory column sums of one (batch, bias head): the kWarpsPerCol rows of
// s_col summed in a fixed order, stored or added (as bwd_colsum_flush), and cleared for the next
// target. Barriers on both sides (`sync`: every thread that adds, tid in [0, kThreads)): the
// owners' last adds are visible, and nobody adds again before the clear is done.
template <typename Element, int kBlockN, int kWarpsPerCol, int kThreads, class Sync>
__device__ __forceinline__ void colsum_flush_smem(const BwdArgs& a, float* s_col, int b, int h, int n0, int cols,
                                                  int tid, Sync&& sync) {
  const FwdArgs& f = a.f;
  sync();
  const int bb = a.bsize_b == 1 ? 0 : b;
  const int hb = a.bsize_h == 1 ? 0 : h / a.bias_head_div;
  const int k0 = SeqBounds(f, b).k0();
  for (int c = tid; c < kBlockN; c += kThreads) {
    float v = s_col[c];
    s_col[c] = 0.f;
    CUTE_UNROLL
    for (int w = 1; w < kWarpsPerCol; ++w) {
      v += s_col[w * kBlockN + c];
      s_col[w * kBlockN + c] = 0.f;
    }
    if (c >= cols) continue;  // (columns past Sk: only zeros were added, cleared all the same)
    store_dbias_colsum<Element>(a, bb, hb, k0 + n0 + c, v);
  }
  sync();
}

}  // namespace dmattn::cuda::sm90
