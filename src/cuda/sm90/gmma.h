// Warpgroup MMA (wgmma, sm_90a) helpers for the Hopper kernels: issuing a GEMM over all k
// blocks of its fragments, and the register layouts of the wgmma accumulator seen as
// (rows, cols) and re-read as the A operand of a register-sourced wgmma.
//
// wgmma is asynchronous: gemm_issue() only issues (and commits one batch); the caller waits
// with gemm_wait<N>() before it reads the accumulator or overwrites a register-sourced A.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

namespace dmattn::cuda::sm90 {

// acc (+)= A * B^T over every k block. kZeroInit: the first k block overwrites acc (no
// separate clear). kRegA: A lives in registers (fenced so that the compiler keeps them
// until the wgmma has read them).
template <bool kZeroInit, bool kRegA, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void gemm_issue(TiledMma& mma, TA& a, TB const& b, TC& acc) {
  using namespace cute;
  if constexpr (kRegA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
  if constexpr (kRegA) warpgroup_fence_operand(a);
}

// Waits until at most N committed wgmma batches are in flight; acc is then readable.
template <int N, class TC>
__device__ __forceinline__ void gemm_wait(TC& acc) {
  cute::warpgroup_wait<N>();
  cute::warpgroup_fence_operand(acc);
}

// wgmma accumulator ((2 cols, 2 rows, N/8 col groups), MMA_M, MMA_N) as
// (rows (2, MMA_M), cols (2, N/8, MMA_N)): the same per-quad row ownership as mma.sync's
// m16n8 accumulator, so the score transform and the online softmax work on it unchanged.
template <class Layout>
__host__ __device__ constexpr auto acc_rowcol(Layout const& acc) {
  using namespace cute;
  static_assert(decltype(rank<0>(acc))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// The accumulator of S = Q K^T (16-bit elements after conversion) as the register A operand
// of O += P V: one k16 slice of A is two adjacent n8 column groups of the accumulator, in the
// same register order ((2, 2, 2), MMA_M, N/16).
template <class Layout>
__host__ __device__ constexpr auto acc_to_a(Layout const& acc) {
  using namespace cute;
  static_assert(decltype(rank<0>(acc))::value == 3);
  auto split = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(split), get<1>(split), get<2, 0>(split)), get<1>(acc),
                     make_layout(get<2, 1>(split), get<2>(acc)));
}

// Shared memory written by threads (cp.async, st.shared) is read by wgmma through the async
// proxy: each writer fences its own writes before the barrier that publishes them.
__device__ __forceinline__ void fence_smem_for_wgmma() { cutlass::arch::fence_view_async_shared(); }

}  // namespace dmattn::cuda::sm90
