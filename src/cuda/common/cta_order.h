// CTA order of the key-block-major backward kernel: which (key block, kv head, batch) a CTA takes.
// The hardware starts CTAs in launch order (blockIdx.x fastest). Launched as (key block, kv head,
// batch), a causal pass starts the heaviest key block of the last heads (key block 0 reaches
// every query block, the last one a single block) among the last CTAs, and the kernel ends on its
// long tail. With a group size G (run_bwd: bwd_cta_group_size) the grid is (G, key blocks,
// groups): the (kv head, batch) pairs G at a time and, inside a group, the key blocks slowest, so
// that every head's heaviest block starts first (longest job first) while only G heads' Q / dO
// are read at once (they stay in L2). G = 1 is the plain order. The key block is blockIdx.y in every order
// (ptxas rematerializes a block index; a key block computed or selected at run time was held
// across the loop and spilled).
#pragma once

#include "cuda/common/bwd_args.h"

namespace dmattn::cuda {

struct CtaCoords {
  int y, z;  // kv head and batch (or 0 where folded into the CTA)
};

// The group size for a requested G and `pairs` (kv head, batch) pairs: a divisor of pairs (no
// partial group: a CTA with nothing to do would need an early return, which made ptxas spill
// 60-90 B more in the bias kernels), large enough that the groups fit gridDim.z (65535).
inline int bwd_cta_group_size(int requested, int pairs) {
  int g = requested < 1 ? 1 : (requested < pairs ? requested : pairs);
  while (pairs % g != 0) --g;
  if (pairs / g > 65535) {
    g = (pairs + 65534) / 65535;
    while (pairs % g != 0) ++g;
  }
  return g;
}

// Grid of the main kernel: (G, key blocks, pairs / G), G from bwd_cta_group_size.
inline dim3 bwd_cta_grid(int group_size, int n_blocks, int pairs) {
  return dim3(unsigned(group_size), unsigned(n_blocks), unsigned(pairs / group_size));
}

__device__ __forceinline__ int bwd_cta_n_block() { return int(blockIdx.y); }

// ny: kv heads of the grid (1 when folded into the CTA).
__device__ __forceinline__ CtaCoords bwd_cta_coords(const BwdArgs& a) {
  const int ny = a.fold_heads ? 1 : a.num_heads_kv;
  const int yz = int(blockIdx.z * gridDim.x + blockIdx.x);
  return {yz % ny, yz / ny};
}

}  // namespace dmattn::cuda
