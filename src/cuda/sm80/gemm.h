// Warp-level GEMMs on mma.sync with ldmatrix fragment loads, one k16 slice of fragments at a time (the
// scheduler overlaps ldmatrix and mma; explicit double buffering only cost registers).
#pragma once

#include "cuda/common/utils.h"

#ifndef DMATTN_GEMM_PREFETCH
#define DMATTN_GEMM_PREFETCH 1
#endif

namespace dmattn::cuda {

// acc += A * B^T, both operands read from shared memory (tCsA / tCsB are the ldmatrix source
// partitions, tCrA / tCrB the MMA fragments). kPrefetch: the next k16 slice's fragments are
// loaded before this slice's MMAs (without it, a slice's loads and MMAs in turn: fewer live
// registers, for a kernel at the register limit).
template <bool kPrefetch = DMATTN_GEMM_PREFETCH, class Acc, class RA, class RB, class SA, class SB, class TiledMma,
          class CopyA, class CopyB>
__device__ __forceinline__ void gemm_ss(Acc& acc, RA& tCrA, RB& tCrB, SA const& tCsA, SB const& tCsB,
                                        TiledMma const& mma, CopyA const& copy_a, CopyB const& copy_b,
                                        int tid) {
  using namespace cute;
  auto thr_a = copy_a.get_thread_slice(tid);
  auto thr_b = copy_b.get_thread_slice(tid);
  Tensor va = thr_a.retile_D(tCrA);
  Tensor vb = thr_b.retile_D(tCrB);
  if constexpr (kPrefetch) {
    copy(copy_a, tCsA(_, _, 0), va(_, _, 0));
    copy(copy_b, tCsB(_, _, 0), vb(_, _, 0));
  }
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if constexpr (kPrefetch) {
      if (k + 1 < size<2>(tCrA)) {
        copy(copy_a, tCsA(_, _, k + 1), va(_, _, k + 1));
        copy(copy_b, tCsB(_, _, k + 1), vb(_, _, k + 1));
      }
    } else {
      copy(copy_a, tCsA(_, _, k), va(_, _, k));
      copy(copy_b, tCsB(_, _, k), vb(_, _, k));
    }
    cute::gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// acc += A * B^T with A already in registers (the probabilities P).
template <bool kPrefetch = DMATTN_GEMM_PREFETCH, class Acc, class RA, class RB, class SB, class TiledMma, class CopyB>
__device__ __forceinline__ void gemm_rs(Acc& acc, RA const& tCrA, RB& tCrB, SB const& tCsB,
                                        TiledMma const& mma, CopyB const& copy_b, int tid) {
  using namespace cute;
  auto thr_b = copy_b.get_thread_slice(tid);
  Tensor vb = thr_b.retile_D(tCrB);
  if constexpr (kPrefetch) copy(copy_b, tCsB(_, _, 0), vb(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if constexpr (kPrefetch) {
      if (k + 1 < size<2>(tCrA)) copy(copy_b, tCsB(_, _, k + 1), vb(_, _, k + 1));
    } else {
      copy(copy_b, tCsB(_, _, k), vb(_, _, k));
    }
    cute::gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

}  // namespace dmattn::cuda
