// The split-KV decode's second kernel (docs/decode.md): the partial rows of a call's key splits,
// or of the balanced form's shares (decode_balanced.h), merged into out and lse.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/pdl.h"
#include "cuda/common/utils.h"
#include "cuda/decode/decode_args.h"
#include "cuda/decode/decode_balanced.h"
#include "cuda/decode/decode_kernel.h"

namespace dmattn::cuda {

// Merges the splits' partial rows: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse)
// out_s; a row with one non-empty split takes that split's row as it is, the bits the kernel
// writes itself with one split (so that a packed sequence's rows do not depend on the splits of
// the others: DecodeArgs::split_table). One CTA of kDecodeCombineThreads per (b, h, i) row, grid
// B * H * Sq (packed: the longest sequence's Sq; balanced: the parts decode_balanced.h finds, in
// their slots): warp 0 turns the splits' lse into weights
// (shared memory), then the threads split the row's float4 columns and its splits between them
// (every load of a thread independent, the first ones issued before the weights: one memory round
// trip for the whole row), and sum their partial columns through shared memory. Empty splits (lse -inf,
// out 0) change no bit of the result.
inline constexpr int kDecodeCombineThreads = 128;
template <typename Element>
__global__ void __launch_bounds__(kDecodeCombineThreads) decode_combine_kernel(const DecodeArgs a) {
  using decode_detail::DecodeSeq;
  constexpr int kThreads = kDecodeCombineThreads;
  __shared__ float weight[kDecodeMaxSplits];
  __shared__ float row_lse;
  __shared__ __align__(16) float partial[kThreads * 4];
  // Launched as the decode kernel's dependent (launch_dependent_kernel): what the row's parts
  // are comes from the call's inputs, found while that grid still runs; its partial rows are read
  // after wait_for_prerequisite_grid.
  const int64_t row = blockIdx.x;
  const int i = static_cast<int>(row % a.seqlen_q);
  const int h = static_cast<int>((row / a.seqlen_q) % a.num_heads);
  const int b = static_cast<int>(row / (int64_t(a.seqlen_q) * a.num_heads));
  const DecodeSeq seq = decode_detail::decode_seq(a, b, kDecodeRows);
  if (seq.splits == 0 || i >= seq.len_q) return;  // (a packed batch: another launch's sequence, or a shorter one)
  Element* out = static_cast<Element*>(a.out) + seq.bm * a.o_st.batch_stride + (seq.q0 + i) * a.o_st.row_stride +
                 h * a.o_st.head_stride;
  float* lse_out = a.lse + seq.bm * a.lse_bs + h * a.lse_hs + seq.q0 + i;
  // Part s of the row: split s, or (balanced) slot first_split + s.
  int splits = a.num_splits, first_split = 0;
  if (a.balanced) {
    const decode_detail::BalancedParts parts = decode_detail::balanced_parts(a, b, h / a.group);
    if (parts.parts == 1) return;  // (its CTA wrote it)
    if (parts.parts == 0) {        // no key: 0 with lse -inf, as a split-KV row without one
      wait_for_prerequisite_grid();
      for (int d = threadIdx.x; d < a.head_dim; d += kThreads) out[d] = Element(0.f);
      if (threadIdx.x == 0) *lse_out = -INFINITY;
      return;
    }
    splits = parts.parts, first_split = parts.first_slot;
  }
  const auto part_row = [&](int s) {
    return a.balanced ? decode_detail::balanced_slot_row(a, first_split + s, h, i)
                      : decode_detail::partial_row(a, seq, s, h, i);
  };
  // Column c (4 elements) of the parts g, g + groups, ...: columns padded to a power of two. The
  // thread's first kPreloaded parts are loaded before the weights, which they do not depend on:
  // one round trip to L2 for the usual counts (up to 8 parts at head dims 65-128), not two.
  constexpr int kPreloaded = 2;
  const int cols = a.head_dim / 4;
  const int cols_pow2 = cols <= 16 ? 16 : cols <= 32 ? 32 : 64;
  const int groups = kThreads / cols_pow2, c = threadIdx.x % cols_pow2, g = threadIdx.x / cols_pow2;
  const auto part_columns = [&](int s) {
    return reinterpret_cast<const float4*>(a.part_out + part_row(s) * a.head_dim)[c];
  };
  wait_for_prerequisite_grid();
  float4 preloaded[kPreloaded];
#pragma unroll
  for (int u = 0; u < kPreloaded; ++u) {
    const int s = g + u * groups;
    if (c < cols && s < splits) preloaded[u] = part_columns(s);
  }
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float lse_s[kDecodeMaxSplits / 32];
    float mx = -INFINITY;
    int nonempty = 0;
#pragma unroll
    for (int u = 0; u < kDecodeMaxSplits / 32; ++u) {
      const int s = u * 32 + lane;
      lse_s[u] = s < splits ? a.part_lse[part_row(s)] : -INFINITY;
      mx = fmaxf(mx, lse_s[u]);
      nonempty += lse_s[u] != -INFINITY;
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      nonempty += __shfl_xor_sync(0xffffffffu, nonempty, o);
    }
    const float mu = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
#pragma unroll
    for (int u = 0; u < kDecodeMaxSplits / 32; ++u) sum += __expf(lse_s[u] - mu);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    // An empty row (no allowed key in any split) is 0 with lse -inf; a NaN stays NaN (a NaN
    // lse is not the maximum, so such a row never counts as having a single split).
    const bool empty = sum == 0.f;
    const bool single = nonempty == 1 && mx != -INFINITY;
    const float lse = empty ? -INFINITY : single ? mx : mu + __logf(sum);
#pragma unroll
    for (int u = 0; u < kDecodeMaxSplits / 32; ++u) {
      const int s = u * 32 + lane;
      if (s < splits) weight[s] = empty ? 0.f : single ? (lse_s[u] == mx ? 1.f : 0.f) : __expf(lse_s[u] - lse);
    }
    if (lane == 0) row_lse = lse;
  }
  __syncthreads();

  // (the parts in the same order as without the preloads: the same bits)
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const auto add = [&](float w, const float4& x) {
    acc.x = fmaf(w, x.x, acc.x), acc.y = fmaf(w, x.y, acc.y), acc.z = fmaf(w, x.z, acc.z), acc.w = fmaf(w, x.w, acc.w);
  };
  if (c < cols) {
#pragma unroll
    for (int u = 0; u < kPreloaded; ++u) {
      const int s = g + u * groups;
      if (s < splits) add(weight[s], preloaded[u]);
    }
#pragma unroll 4
    for (int s = g + kPreloaded * groups; s < splits; s += groups) add(weight[s], part_columns(s));
  }
  reinterpret_cast<float4*>(partial)[threadIdx.x] = acc;
  __syncthreads();
  for (int d = threadIdx.x; d < a.head_dim; d += kThreads) {
    float o = 0.f;
    for (int gg = 0; gg < groups; ++gg) o += partial[(gg * cols_pow2 + d / 4) * 4 + d % 4];
    out[d] = Element(saturate_keep_nan<Element>(o));
  }
  if (threadIdx.x == 0) *lse_out = row_lse;
}

}  // namespace dmattn::cuda
