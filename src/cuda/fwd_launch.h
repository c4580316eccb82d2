// Launcher of the forward kernel for one (element type, instantiated head dim); explicitly
// instantiated once per pair in src/cuda/inst/fwd_<dtype>_hd<D>.cu.
#pragma once

#include <cuda_runtime.h>

#include "cuda/check.h"
#include "cuda/fwd_args.h"

namespace dmattn::cuda {

template <typename Element, int kHeadDim>
void run_fwd(const FwdArgs& a, cudaStream_t stream);

}  // namespace dmattn::cuda

#ifdef DMATTN_FWD_LAUNCH_IMPL
#include "cuda/fwd_kernel.h"

namespace dmattn::cuda {

template <typename Element, int kHeadDim>
void run_fwd(const FwdArgs& a, cudaStream_t stream) {
  using Tile = FwdTile<Element, kHeadDim>;
  const bool mask_or_bias = a.mask.ptr != nullptr || a.bias.ptr != nullptr;
  const int smem = Tile::smem_bytes(mask_or_bias);
  const dim3 grid((a.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM, a.num_heads, a.batch);
  auto launch = [&](auto kernel) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "cudaFuncSetAttribute(forward smem)");
    kernel<<<grid, Tile::kNThreads, smem, stream>>>(a);
    check_cuda(cudaGetLastError(), "forward kernel launch");
  };
  if (mask_or_bias) launch(fwd_kernel<Tile, true>);
  else launch(fwd_kernel<Tile, false>);
}

}  // namespace dmattn::cuda

#define DMATTN_INSTANTIATE_FWD(Element, HD) \
  template void dmattn::cuda::run_fwd<Element, HD>(const dmattn::cuda::FwdArgs&, cudaStream_t);
#endif
