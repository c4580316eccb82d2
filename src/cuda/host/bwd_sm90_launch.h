// The general Hopper backward (sm90/bwd_kernel_sm90.h, head dim 128) for one element type: the
// backward on compute capability 9.0 where the warp-specialized kernel does not take the problem,
// and its bias fast path. Compiled in translation units of its own
// (src/cuda/inst/bwd_sm90_<dtype>.cu, DMATTN_INSTANTIATE_BWD_SM90), beside the rest of the
// backward (bwd_launch.h): see bwd_dq_launch.h.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/bwd_args.h"
#include "cutlass/bfloat16.h"
#include "cutlass/half.h"

namespace dmattn::cuda {

// bias16: the bias fast path (run_bwd decides it: a 16-bit bias alone, no softcap), its dbias
// reduced over the CTA's queries where a.dbias_mode is kDbColSum; otherwise the general kernel's
// variant for mask_or_bias and softcap. grid: bwd_cta_grid's order; smem: its dynamic shared
// memory.
template <typename Element>
void launch_bwd_sm90(const BwdArgs& a, dim3 grid, int smem, bool bias16, bool mask_or_bias, bool softcap,
                     cudaStream_t stream);

}  // namespace dmattn::cuda

#define DMATTN_BWD_SM90_LAUNCH(Element) \
  void dmattn::cuda::launch_bwd_sm90<Element>(const dmattn::cuda::BwdArgs&, dim3, int, bool, bool, bool, cudaStream_t)
extern template DMATTN_BWD_SM90_LAUNCH(cutlass::half_t);
extern template DMATTN_BWD_SM90_LAUNCH(cutlass::bfloat16_t);

#ifdef DMATTN_BWD_SM90_LAUNCH_IMPL
#include "cuda/common/launch.h"
#include "cuda/sm90/bwd_kernel_sm90.h"

namespace dmattn::cuda {

template <typename Element>
void launch_bwd_sm90(const BwdArgs& a, dim3 grid, int smem, bool bias16, bool mask_or_bias, bool softcap,
                     cudaStream_t stream) {
  using Tile = sm90::BwdTileSm90<Element, 128>;
  auto launch = [&](auto kernel, const char* what) {
    launch_kernel(kernel, grid, Tile::kNThreads, smem, stream, a, what);
  };
  if (bias16) {  // (a bias without a mask or softcap: always mask_or_bias and no softcap)
    if (mask_or_bias && !softcap) {
      if (a.dbias_mode == kDbColSum)
        launch(sm90::bwd_kernel_sm90<Tile, false, false, sm90::kBiasPathColSum>,
               "backward kernel (sm90, bias fast path, column sums)");
      else
        launch(sm90::bwd_kernel_sm90<Tile, false, false, sm90::kBiasPathDirect>, "backward kernel (sm90, bias fast path)");
    }
    return;
  }
  if (mask_or_bias) {
    if (softcap) launch(sm90::bwd_kernel_sm90<Tile, true, true>, "backward kernel (sm90)");
    else launch(sm90::bwd_kernel_sm90<Tile, true, false>, "backward kernel (sm90)");
  } else {
    if (softcap) launch(sm90::bwd_kernel_sm90<Tile, false, true>, "backward kernel (sm90)");
    else launch(sm90::bwd_kernel_sm90<Tile, false, false>, "backward kernel (sm90)");
  }
}

}  // namespace dmattn::cuda

#define DMATTN_INSTANTIATE_BWD_SM90(Element) template DMATTN_BWD_SM90_LAUNCH(Element);
#endif
