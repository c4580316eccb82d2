// The gradients of gated attention's gate in the warp-specialized Hopper backward (gate_sm90.h
// adds the gate to the scores): G = scale * g'(alpha_i delta_j) dS (0 where dS is 0); its row
// sums times delta go into dalpha's fp32 accumulator, its column sums times alpha into shared
// memory (gate_grads_sm90), stored into ddelta once per CTA (store_ddelta_sums: the CTA walks
// every query head of its kv head and every query block that reaches its key block).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/common/bwd_args.h"
#include "cuda/common/score_terms.h"
#include "cuda/sm90/dbias_colsum_sm90.h"

namespace dmattn::cuda::sm90 {

// The gate's gradient terms of one query block (ds: dS on the row/col view, coord as above):
// row_sum[r] = sum over the thread's columns of G delta, reduced over its quad (lanes 1 and 2
// apart share rows); the column sums of G alpha added into s_col's row of this warp
// (colsum_scatter_add: one owner per element, deterministic). One code path for both gate
// functions (GateMath), as add_gate_scores. G's factor `scale` is applied to the sums, once per
// row and column. Where dS is 0 (a masked score) G is 0: g' is finite (in [0, 1] to rounding)
// for every product but NaN, and min(g', 1) turns a NaN (alpha or delta NaN or infinite beside
// a 0) into 1 -- a visible score with such a product is NaN itself, and so is its dS.
template <int kBlockN, int kWarpsPerCol, class DS, class C, int kRows>
__device__ __forceinline__ void gate_grads_impl(DS const& ds, C const& coord, const float* s_alpha,
                                                const float* s_delta, float scale, bool linear, float* s_col,
                                                int tid, float (&row_sum)[kRows]) {
  using namespace cute;
  constexpr int kCols = decltype(size<1>(ds))::value;
  const GateMath gm = GateMath::of(linear);
  float alpha_h[kRows];  // alpha / 2: g' from the half product; the column sums doubled at the end
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    alpha_h[r] = 0.5f * s_alpha[get<0>(coord(r, 0))];
    row_sum[r] = 0.f;
  }
  float col[kCols];
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += 2) {
    const float2 d = *reinterpret_cast<const float2*>(s_delta + get<1>(coord(0, c)));
    float c0 = 0.f, c1 = 0.f;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float g0 = ds(r, c) * fminf(gm.slope_half(alpha_h[r] * d.x), 1.f);
      const float g1 = ds(r, c + 1) * fminf(gm.slope_half(alpha_h[r] * d.y), 1.f);
      row_sum[r] = fmaf(g0, d.x, fmaf(g1, d.y, row_sum[r]));
      c0 = fmaf(g0, alpha_h[r], c0);
      c1 = fmaf(g1, alpha_h[r], c1);
    }
    col[c] = c0 * (2.f * scale);
    col[c + 1] = c1 * (2.f * scale);
  }
  colsum_scatter_add<kBlockN, kWarpsPerCol>(col, coord, s_col, tid);
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffff, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffff, row_sum[r], 2);
    row_sum[r] *= scale;
  }
}

// The gate's gradients of one query block of a consumer warpgroup that holds keys [key0, key0 +
// 64) of the key block: the column sums into s_col ([kWarpsPerCol][kBlockN] floats), the row
// sums into dalpha_accum (laid out like lse; rows of the block from `rows` at lse offset
// `stat`): stored into the consumer's own 64-key slice key0 / 64 in deterministic mode (each
// (slice, row) has one writer; the slices are zeroed before the kernel), else added atomically
// into the one slice.
template <int kBlockN, int kWarpsPerCol, class DS, class C>
__device__ __forceinline__ void gate_grads_sm90(const BwdArgs& a, DS const& ds, C const& coord, const float* s_alpha,
                                                const float* s_delta, float* s_col, int64_t stat, int rows_valid,
                                                int key0, int tid) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(ds))::value;
  const FwdArgs& f = a.f;
  float row_sum[kRows];
  gate_grads_impl<kBlockN, kWarpsPerCol>(ds, coord, s_alpha, s_delta, f.scale, f.gate.linear, s_col, tid, row_sum);
  if (a.dalpha == nullptr || (tid & 3) != 0) return;
  const int64_t slice = a.dalpha_slices > 1 ? key0 / 64 : 0;
  if (slice >= a.dalpha_slices) return;  // (keys past the longest sequence: nothing was summed)
  float* accum = a.dalpha_accum + slice * (int64_t(f.num_heads) * f.q_rows) + stat;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(coord(r, 0));
    if (row >= rows_valid) continue;
    if (a.dalpha_slices > 1) accum[row] = row_sum[r];
    else atomicAdd(accum + row, row_sum[r]);
  }
}

}  // namespace dmattn::cuda::sm90
