// Tile sizes and shared-memory layouts of the Hopper (sm_90a, wgmma) backward kernel. Same
// blocking as the sm80-class kernel (bwd_tile.h: 64 query rows x 128 keys, Q / dO double
// buffered, P and dS staged in shared memory) and the same shared-memory plan (BwdSmemPlan), so
// that run_bwd sizes either; two warpgroups instead of 8 independent warps:
//   S = Q K^T, dP = dO V^T   (64 queries, 128 keys): warpgroup w takes keys [64 w, 64 w + 64)
//   dV += P^T dO, dK += dS^T Q  (128 keys, D):      warpgroup w takes keys [64 w, 64 w + 64)
//   dQ = dS K                 (64 queries, D):      warpgroup w takes columns [w D/2, (w+1) D/2)
// Every operand comes from shared memory. Q, dO, K, V, P and dS use wgmma's 128-byte-swizzled
// K-major layout; the transposed operands (P^T, dS^T, Q^T, dO^T, K^T) are composed views of the
// same bytes, which wgmma reads as MN-major.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/sm80/bwd_tile.h"
#include "cuda/sm90/bwd_mmas_sm90.h"

namespace dmattn::cuda::sm90 {

// Head dim 128 only: each warpgroup's slice of the MN-major K^T operand of dQ = dS K must be a
// whole 64-element swizzle row (D / 2 = 32 at head dim 64 is not; that size stays on the
// sm80-class kernel). Column sums: one row per warp sharing score columns (kWarpsPerCol: the 4
// warps of a warpgroup split its 64 query rows).
template <typename Element_, int kHeadDim_>
struct BwdTileSm90 : BwdSmemPlan<Element_, kHeadDim_, 64, 128, 2, 4> {
  using Plan = BwdSmemPlan<Element_, kHeadDim_, 64, 128, 2, 4>;
  using typename Plan::Element;
  using Plan::kHeadDim;
  using Plan::kBlockM;
  using Plan::kBlockN;
  static constexpr int kWarpsPerCol = 4;
  static_assert(kHeadDim == 128);
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;

  using Mmas = BwdMmas<Element, kHeadDim, kBlockM, kBlockN>;  // (bwd_mmas_sm90.h)
  template <int M, int N, int K, cute::GMMA::Major kMajorA, cute::GMMA::Major kMajorB, class WarpgroupLayout>
  using SsMma = typename Mmas::template SsMma<M, N, K, kMajorA, kMajorB, WarpgroupLayout>;
  using AlongM = typename Mmas::AlongM;
  using TiledMmaSdP = typename Mmas::TiledMmaSdP;
  using TiledMmadKV = typename Mmas::TiledMmadKV;
  using TiledMmadQ = typename Mmas::TiledMmadQ;

  // The query-broadcast dbias of the bias fast path (kBiasPathColSum): its column sums as one
  // more product (bwd_mmas_sm90.h).
  using TiledMmaColSum = typename Mmas::TiledMmaColSum;

  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQdO = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutPdS = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using SmemLayoutOnes = typename Mmas::SmemLayoutOnes;
  using SmemLayoutQdOt = decltype(cute::composition(
      SmemLayoutQdO{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutPdSt = decltype(cute::composition(
      SmemLayoutPdS{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));

  // The common offsets (Q, dO, K, V, P, dS, column sums, kOffBias) come from the plan. Mask / bias
  // tiles: one set (bias tile, then mask tile) or two (double buffered: the set of query block
  // t + 1 loads during the whole of iteration t) when both fit, see mb_sets.
  using Plan::kMaskBytes;
  // Row statistics (m, log2 l, Delta) of the query block, one set per Q / dO buffer
  // (bwd_row_stats_async), between the column sums and the mask / bias sets.
  static constexpr int kStatsFloats = 3 * kBlockM;
  static constexpr int kOffStats = Plan::kOffBias;
  static constexpr int kOffBias = kOffStats + Plan::kQBuffers * kStatsFloats * 4;
  static constexpr int mask_offset(bool bias, bool bias_fp32) { return kOffBias + bias_tile_bytes(bias, bias_fp32); }
  static constexpr int bias_tile_bytes(bool bias, bool bias_fp32) {
    return bias ? kBlockM * Plan::kBiasPitch * (bias_fp32 ? 4 : 2) : 0;
  }
  static constexpr int mb_set_bytes(bool mask, bool bias, bool bias_fp32) {
    return bias_tile_bytes(bias, bias_fp32) + (mask ? kMaskBytes : 0);
  }
  // Opt-in shared memory per block on sm_90 (227 KB), less the gathered keys' positions tile
  // (kBlockN int32) that run_bwd appends after smem_bytes: the choice below never depends on
  // whether keys are gathered, so host and kernel make it from (mask, bias, bias_fp32) alone.
  static constexpr int kSmemMax = 227 * 1024;
  static constexpr int kSmemReserve = kBlockN * 4;
  // 2 with a 16-bit bias and / or a mask (at most 2 x (17 + 9) KB); 1 with an fp32 bias (2 x 35
  // KB does not fit), whose tiles load after the middle barrier as before.
  static constexpr int mb_sets(bool mask, bool bias, bool bias_fp32) {
    return kOffBias + 2 * mb_set_bytes(mask, bias, bias_fp32) + kSmemReserve <= kSmemMax ? 2 : 1;
  }
  // Profiling experiment (DMATTN_BWD_EXP bit, BwdArgs::exp_flags): one set even where two fit,
  // shared memory sized for it, to time the double buffering (and the L1 it takes) in one build.
  static constexpr int kExpOneMbSet = 16;
  static constexpr int mb_sets_used(bool mask, bool bias, bool bias_fp32, int exp_flags) {
    return (exp_flags & kExpOneMbSet) ? 1 : mb_sets(mask, bias, bias_fp32);
  }
  // Shadows the plan's smem_bytes: the Hopper kernel may hold two mask / bias sets.
  static constexpr int smem_bytes(bool mask, bool bias, bool bias_fp32, int exp_flags = 0) {
    return kOffBias + mb_sets_used(mask, bias, bias_fp32, exp_flags) * mb_set_bytes(mask, bias, bias_fp32);
  }
  // The bias fast path (bwd_kernel_sm90's kBias16): one unpadded, row-swizzled 16-bit bias tile
  // per Q / dO buffer (bias_tile_sm90.h), after the row statistics.
  static constexpr int kBias16TileBytes = kBlockM * kBlockN * 2;
  static constexpr int bias16_smem_bytes() { return kOffBias + Plan::kQBuffers * kBias16TileBytes; }
  static_assert(bias16_smem_bytes() + kSmemReserve <= kSmemMax);
  // The ones tile of TiledMmaColSum sits in the second KB of the column-sum rows: that variant
  // uses only their first row (kBlockN floats).
  static constexpr int kOffOnes = Plan::kOffColSum + 1024;
  static_assert(kOffOnes % 1024 == 0 && Plan::kColSumBytes >= 1024 + 8 * kBlockM * 2);
  // 1024-byte aligned tiles (the swizzle atom's period) for the products' operands.
  static_assert(Plan::kOffdS % 1024 == 0 && Plan::kOffP % 1024 == 0 && Plan::kOffdO % 1024 == 0);
  static_assert(mb_sets(true, true, false) == 2 && mb_sets(true, true, true) == 1);
  static_assert(mb_set_bytes(true, true, false) % 16 == 0);  // the second set stays 16-byte aligned
  static_assert(kOffBias % 16 == 0);
};

}  // namespace dmattn::cuda::sm90
