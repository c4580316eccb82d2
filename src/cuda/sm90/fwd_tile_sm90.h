// Tile sizes and shared-memory layouts of the Hopper (sm_90a, wgmma) forward kernel.
// Two consumer warpgroups of 64 query rows each (kBlockM = 128) share the K and V tiles.
// Q, K and V use wgmma's 128-byte-swizzled K-major layout; V is read transposed (MN-major B
// operand of O += P V) through a composed view, without a copy.
// kStagesKV: K and V buffers each. The plain kernel (no mask / bias) double buffers them so that
// the next block's loads land during this block's products; the mask / bias kernel keeps one of
// each (its mask and bias tiles need the shared memory: at D = 128, Q / K / V 96 KB + three mask
// tiles 54 KB + two bf16 bias tiles 68 KB = 218 KB of the 227 KB a CTA may have; a full fp32
// bias tile is 68 KB alone, so that bias keeps one buffer, launch_fwd_kernel). Gathered keys add one positions tile
// per K buffer after the mask / bias tiles (launch_fwd_kernel's kPosTiles).
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

namespace dmattn::cuda::sm90 {

template <typename Element_, int kHeadDim_, int kStagesKV_>
struct FwdTileSm90 {
  static constexpr int kStagesKV = kStagesKV_;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kCtasPerSm = 1;
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 128);

  using WarpgroupsM = cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>;
  // S = Q K^T: both operands from shared memory, K-major.
  using TiledMmaS = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<Element, Element, float,
                                       cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      WarpgroupsM{}));
  // O += P V: P from registers (K-major A), V^T from shared memory (MN-major B).
  using TiledMmaO = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::rs_op_selector<Element, Element, float,
                                       cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      WarpgroupsM{}));

  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V (keys, D) viewed as (D, keys).
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));

  // Elements of 2 or 4 bytes per bias row: padded against bank conflicts in the mask / bias
  // kernel; unpadded and swizzled in the plain kernel's bias fast path (bias_tile_sm90.h), where
  // two 32 KB tiles must fit beside double-buffered K and V.
  static constexpr int kBiasPitch = kStagesKV == 2 ? kBlockN : kBlockN + 8;
  static constexpr int kMaskPitch = kBlockN + 16;  // bytes

  static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKVBytes = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kOffK = kQBytes, kOffV = kOffK + kStagesKV * kKVBytes;
  static constexpr int kOffBias = kOffV + kStagesKV * kKVBytes;  // end of Q / K / V
};

}  // namespace dmattn::cuda::sm90
