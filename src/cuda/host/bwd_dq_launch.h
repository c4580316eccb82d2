// The query-major kernel of the sm80-class backward (sm80/bwd_dq_kernel.h) for one (element
// type, instantiated head dim): the exact path's row statistics and deterministic mode's dQ.
// Its twelve variants are compiled in translation units of their own
// (src/cuda/inst/bwd_dq_<dtype>_hd<D>.cu, DMATTN_INSTANTIATE_BWD_DQ), beside the rest of the
// backward (bwd_launch.h), rather than in one unit with it: the backward's were the longest units
// of the build, and a build on many cores waits for its longest unit.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/bwd_args.h"
#include "cutlass/bfloat16.h"
#include "cutlass/half.h"

namespace dmattn::cuda {

// stats: the statistics pass (m, log2 l and Delta per row), else dQ. mask_or_bias and softcap
// pick the score variant, terms the one that reads the gate and windows with sinks
// (score_terms.h). grid: the query blocks (x), heads, batches; smem: the dynamic shared memory
// of the pass's BwdTile launches.
template <typename Element, int kHeadDim>
void launch_bwd_dq(const BwdArgs& a, dim3 grid, int smem, bool stats, bool mask_or_bias, bool terms,
                   bool softcap, cudaStream_t stream);

}  // namespace dmattn::cuda

#define DMATTN_BWD_DQ_LAUNCH(Element, HD)                                                                        \
  void dmattn::cuda::launch_bwd_dq<Element, HD>(const dmattn::cuda::BwdArgs&, dim3, int, bool, bool, bool, bool, \
                                                cudaStream_t)
extern template DMATTN_BWD_DQ_LAUNCH(cutlass::half_t, 64);
extern template DMATTN_BWD_DQ_LAUNCH(cutlass::half_t, 128);
extern template DMATTN_BWD_DQ_LAUNCH(cutlass::half_t, 256);
extern template DMATTN_BWD_DQ_LAUNCH(cutlass::bfloat16_t, 64);
extern template DMATTN_BWD_DQ_LAUNCH(cutlass::bfloat16_t, 128);
extern template DMATTN_BWD_DQ_LAUNCH(cutlass::bfloat16_t, 256);

#ifdef DMATTN_BWD_DQ_LAUNCH_IMPL
#include <type_traits>

#include "cuda/common/launch.h"
#include "cuda/sm80/bwd_dq_kernel.h"

namespace dmattn::cuda {

template <typename Element, int kHeadDim>
void launch_bwd_dq(const BwdArgs& a, dim3 grid, int smem, bool stats, bool mask_or_bias, bool terms,
                   bool softcap, cudaStream_t stream) {
  using Tile = BwdTile<Element, kHeadDim>;
  auto launch = [&](auto kernel, const char* what) {
    launch_kernel(kernel, grid, Tile::kNThreads, smem, stream, a, what);
  };
  auto pass = [&](auto stats_pass) {
    constexpr bool kStats = decltype(stats_pass)::value;
    if (terms) {  // (the variant that reads the gate and windows with sinks; score_terms.h)
      const char* what = kStats ? "backward stats kernel (gate / windows)" : "backward dq kernel (gate / windows)";
      if (softcap) launch(bwd_dq_kernel<Tile, true, true, kStats, true>, what);
      else launch(bwd_dq_kernel<Tile, true, false, kStats, true>, what);
      return;
    }
    const char* what = kStats ? "backward stats kernel" : "backward dq kernel";
    if (mask_or_bias) {
      if (softcap) launch(bwd_dq_kernel<Tile, true, true, kStats>, what);
      else launch(bwd_dq_kernel<Tile, true, false, kStats>, what);
    } else {
      if (softcap) launch(bwd_dq_kernel<Tile, false, true, kStats>, what);
      else launch(bwd_dq_kernel<Tile, false, false, kStats>, what);
    }
  };
  if (stats) pass(std::true_type{});
  else pass(std::false_type{});
}

}  // namespace dmattn::cuda

#define DMATTN_INSTANTIATE_BWD_DQ(Element, HD) template DMATTN_BWD_DQ_LAUNCH(Element, HD);
#endif
