// Forward epilogue: O (fp32 accumulator, already normalized) -> Element with saturation,
// staged through shared memory for 16-byte coalesced stores; LSE per row. Rows >= Sq and
// columns >= D are never written.
#pragma once

#include "cuda/common/utils.h"

namespace dmattn::cuda {

template <class Tile, class AccO, class SmemO, class ThrMma, int kRows>
__device__ __forceinline__ void fwd_epilogue(AccO const& acc_o, SmemO& sO, ThrMma const& thr_mma,
                                             const float (&lse)[kRows], const int (&rows)[kRows],
                                             typename Tile::Element* gO, int64_t o_row_stride,
                                             float* g_lse, int rows_valid, int head_dim, int tid) {
  using namespace cute;
  using Element = typename Tile::Element;
  constexpr int kBlockM = Tile::kBlockM, kHeadDim = Tile::kHeadDim, kThreads = Tile::kNThreads;

  Tensor rO = make_tensor<Element>(acc_o.layout());
  convert_fragment<Element, /*kSaturate=*/true>(acc_o, rO);
  Tensor tOsO = thr_mma.partition_C(sO);
  copy(rO, tOsO);

  // One thread of each quad holds the row's LSE.
  if ((tid & 3) == 0) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r)
      if (rows[r] < rows_valid) g_lse[rows[r]] = lse[r];
  }
  __syncthreads();

  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kChunks = kBlockM * kChunksPerRow;
  static_assert(kChunks % kThreads == 0);
  CUTE_UNROLL
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const int idx = it * kThreads + tid;
    const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
    if (r < rows_valid && c < head_dim)
      *reinterpret_cast<uint4*>(gO + r * o_row_stride + c) = *reinterpret_cast<const uint4*>(&sO(r, c));
  }
}

}  // namespace dmattn::cuda
