// Tile sizes and shared-memory layouts of the backward kernels, one traits struct per
// (element type, instantiated head dim). FlashAttention-2-like: kBlockM = 64 query rows,
// kBlockN = 128 keys, 8 warps; P and dS are staged through shared memory for the transposed
// products (dV = P^T dO, dK = dS^T Q) and for dQ = dS K.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>

#include <type_traits>

namespace dmattn::cuda {

// Head dims with a backward instantiation; D <= 128, D % 8 == 0 runs on the next one (zero-filled
// columns). Larger head dims (the forward may support them) raise a clear error.
inline constexpr int bwd_instantiated_head_dim(int d) {
  return d <= 0 ? 0 : d <= 64 ? 64 : d <= 128 ? 128 : d <= 256 ? 256 : 0;
}

// Shared memory of the key-block-major backward kernels (the sm80-class one and the Hopper one):
// Q and dO (kQBuffers each), K, V, P, dS, the column-sum rows of a query-broadcast dbias
// (kColSumRows x kBlockN floats), then only the bias and mask tiles present (bias tile sized by
// its dtype): the rest of the SM's unified L1 / shared memory stays cache.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kQBuffers_, int kColSumRows>
struct BwdSmemPlan {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kQBuffers = kQBuffers_;
  static constexpr int kBiasPitch = kBlockN + 8;   // elements (2 or 4 bytes)
  static constexpr int kMaskPitch = kBlockN + 16;  // bytes

  static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKVBytes = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kPBytes = kBlockM * kBlockN * int(sizeof(Element));
  static constexpr int kMaskBytes = kBlockM * kMaskPitch;
  static constexpr int kOffQ = 0;
  static constexpr int kOffdO = kOffQ + kQBuffers * kQBytes;
  static constexpr int kOffK = kOffdO + kQBuffers * kQBytes;
  static constexpr int kOffV = kOffK + kKVBytes;
  static constexpr int kOffP = kOffV + kKVBytes;
  static constexpr int kOffdS = kOffP + kPBytes;
  static constexpr int kOffColSum = kOffdS + kPBytes;
  static constexpr int kColSumBytes = kColSumRows * kBlockN * 4;
  static constexpr int kOffBias = kOffColSum + kColSumBytes;
  static constexpr int mask_offset(bool bias, bool bias_fp32) {
    return kOffBias + (bias ? kBlockM * kBiasPitch * (bias_fp32 ? 4 : 2) : 0);
  }
  static constexpr int smem_bytes(bool mask, bool bias, bool bias_fp32) {
    return mask_offset(bias, bias_fp32) + (mask ? kMaskBytes : 0);
  }
  // dK / dV staging at the end of the sm80-class kernel reuses the Q and dO buffers.
  static_assert(kQBuffers * kQBytes >= kKVBytes);
};

// kBlockM = 64 query rows; hd256: 64 keys per block (the dK / dV accumulators stay at 128
// registers) and one Q / dO buffer (shared memory), else 128 keys, Q / dO double buffered; the
// column sums have one row per warp sharing score columns (kAtomMSdP), and the area holds the
// gate's row sums too (one kBlockM row per warp along the columns: 4 x 64 floats; bwd_parts.h).
template <typename Element, int kHeadDim>
using BwdTilePlan = BwdSmemPlan<Element, kHeadDim, 64, kHeadDim <= 128 ? 128 : 64, kHeadDim <= 128 ? 2 : 1,
                                kHeadDim <= 128 ? 2 : 4>;

template <typename Element_, int kHeadDim_>
struct BwdTile : BwdTilePlan<Element_, kHeadDim_> {
  using Plan = BwdTilePlan<Element_, kHeadDim_>;
  using typename Plan::Element;
  using Plan::kHeadDim;
  using Plan::kBlockM;
  using Plan::kBlockN;
  using Plan::kQBuffers;
  static constexpr int kHalfN = 64;  // S and dP are computed 64 columns at a time (registers)
  static constexpr int kHalves = kBlockN / kHalfN;
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 64 == 0);

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     cute::MMA_Atom<cute::SM80_16x8x16_F32F16F16F32_TN>,
                                     cute::MMA_Atom<cute::SM80_16x8x16_F32BF16BF16F32_TN>>;
  // S = Q K^T and dP = dO V^T: (kBlockM, kHalfN) at a time, warps 2 (M) x 4 (N).
  static constexpr int kAtomMSdP = 2;  // (the warps sharing score columns: the plan's column-sum rows)
  using TiledMmaSdP = cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::Int<kAtomMSdP>, cute::Int<kNWarps / kAtomMSdP>, cute::_1>>,
                                     cute::Tile<cute::Int<16 * kAtomMSdP>, cute::Int<16 * kNWarps / kAtomMSdP>, cute::_16>>;
  // dK = dS^T Q and dV = P^T dO: (kBlockN, D), warps 4 (N) x 2 (D).
  static constexpr int kAtomNdKV = 4;
  using TiledMmadKV = cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::Int<kAtomNdKV>, cute::Int<kNWarps / kAtomNdKV>, cute::_1>>,
                                     cute::Tile<cute::Int<16 * kAtomNdKV>, cute::Int<16 * kNWarps / kAtomNdKV>, cute::_16>>;
  // dQ = dS K: (kBlockM, D), warps 2 (M) x 4 (D).
  static constexpr int kAtomMdQ = 2;
  using TiledMmadQ = cute::TiledMMA<MmaAtom, cute::Layout<cute::Shape<cute::Int<kAtomMdQ>, cute::Int<kNWarps / kAtomMdQ>, cute::_1>>,
                                    cute::Tile<cute::Int<16 * kAtomMdQ>, cute::Int<16 * kNWarps / kAtomMdQ>, cute::_16>>;

  // Swizzled (rows, 64-column) atoms: ldmatrix (plain and transposed) conflict free.
  using SmemAtom = decltype(cute::composition(
      cute::Swizzle<3, 3, 3>{}, cute::Layout<cute::Shape<cute::_8, cute::_64>, cute::Stride<cute::_64, cute::_1>>{}));
  using SmemLayoutQdO = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutPdS = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  // Transposed views (B operands / A operand of the transposed products).
  using SmemLayoutQdOt = decltype(cute::composition(
      SmemLayoutQdO{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using SmemLayoutQdOtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutQdOt{}));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using SmemLayoutKtNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutKt{}));
  using SmemLayoutPdSt = decltype(cute::composition(
      SmemLayoutPdS{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using SmemLayoutPdStNoSwizzle = decltype(cute::get_nonswizzle_portion(SmemLayoutPdSt{}));

  using LdsmCopy = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using LdsmCopyT = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using StoreCopyC = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  static_assert(kAtomMSdP == 2);  // the plan's column-sum rows
};

}  // namespace dmattn::cuda
