// The products of the Hopper backward kernels (the general one, bwd_kernel_sm90.h, and the
// warp-specialized one, bwd_ws_kernel_sm90.h) on two warpgroups, every operand from shared
// memory:
//   S = Q K^T, dP = dO V^T   (kBlockM queries, kBlockN keys): warpgroup w takes keys [64 w, 64 w + 64)
//   dV += P^T dO, dK += dS^T Q  (kBlockN keys, D):            warpgroup w takes keys [64 w, 64 w + 64)
//                                                             (kBlockN = 64: columns [w D/2, (w+1) D/2)
//                                                             of all 64 keys, kSplitDkvD)
//   dQ = dS K                   (kBlockM queries, D):         warpgroup w takes columns [w D/2, (w+1) D/2)
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace dmattn::cuda::sm90 {

template <typename Element, int kHeadDim, int kBlockM, int kBlockN>
struct BwdMmas {
  template <int M, int N, int K, cute::GMMA::Major kMajorA, cute::GMMA::Major kMajorB, class WarpgroupLayout>
  using SsMma = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::Int<M>, cute::Int<N>, cute::Int<K>>,
                                       kMajorA, kMajorB>(),
      WarpgroupLayout{}));
  using AlongM = cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>;
  using AlongN = cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>;
  using OneWarpgroup = cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>;
  using TiledMmaSdP = SsMma<64, kBlockN / 2, kHeadDim, cute::GMMA::Major::K, cute::GMMA::Major::K, AlongN>;
  // A key block of 64 (head dim 256: dK and dV of 128 keys would take 256 registers a thread)
  // holds one wgmma row of keys: the warpgroups split dK and dV along the head dim instead.
  static constexpr bool kSplitDkvD = kBlockN == 64;
  using TiledMmadKV = std::conditional_t<
      kSplitDkvD, SsMma<64, kHeadDim / 2, kBlockM, cute::GMMA::Major::MN, cute::GMMA::Major::MN, AlongN>,
      SsMma<64, kHeadDim, kBlockM, cute::GMMA::Major::MN, cute::GMMA::Major::MN, AlongM>>;
  using TiledMmadQ = SsMma<kBlockM, kHeadDim / 2, kBlockN, cute::GMMA::Major::K, cute::GMMA::Major::MN, AlongN>;
  // A query-broadcast dbias's column sums as one more product (the general kernel's bias fast
  // path, the warp-specialized kernel's kColSum variant): dS^T (keys x queries, the dK product's
  // A operand) times a tile of ones (8 x kBlockM, K-major: SmemLayoutOnes). Each column of a
  // warpgroup's 64 x 8 fp32 accumulator holds the sums of its 64 keys over the query block,
  // which the kernels add to one shared row (colsum_acc_add_smem).
  using TiledMmaColSum = SsMma<64, 8, kBlockM, cute::GMMA::Major::MN, cute::GMMA::Major::K, AlongM>;
  using SmemLayoutOnes = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                      cute::Shape<cute::_8, cute::Int<kBlockM>>{}));
};

}  // namespace dmattn::cuda::sm90
