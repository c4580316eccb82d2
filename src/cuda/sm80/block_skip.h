// Key-block skipping driven by a bool mask, for the forward and the backward kernels.
// Tiles that no query of the tile may attend are skipped without loading their K, V, mask
// (beyond the tile itself) or bias, and without any MMA. Causal / window ranges are handled
// before this by WindowMask::key_block_range (mask.h); a mask adds skipping of the blocks in
// that range whose (query block x key block) mask tile is all false.
//
//  * Forward (fixed query block, key blocks walked downwards): the mask tile of the next key
//    block is issued one block ahead (it must be loaded anyway, and it is small: kBlockN bytes
//    for a query-broadcast mask, kBlockM rows of kBlockN bytes for a full one), so deciding
//    costs one OR over the bytes each thread copied plus a __syncthreads_or that replaces a
//    barrier the loop has anyway. next_live_key_block() walks further down, one more tile per
//    empty block, until it finds a tile with a true element. A full-mask pre-pass (a bitmap per
//    (b, h, m block, n block)) would read the whole mask once more (B*H*Sq*Sk bytes) before the
//    forward starts; this reads each tile once, and only the tiles the kernel reaches.
//  * Backward (fixed key block, query blocks walked): mask_tile_any_gmem() reads a tile's mask
//    straight from global memory (16-byte loads on the vec path) before Q / dO / bias of that
//    query block are loaded; the caller combines the per-thread results with __syncthreads_or.
#pragma once

#include "cuda/common/fwd_args.h"
#include "cuda/common/operand_tile.h"
#include "cuda/common/utils.h"

namespace dmattn::cuda {

// Forward: the mask tile of key block n (n >= n_min) has been issued by every thread into
// `buf` (OperandTile::load + cp_async_commit). Waits for it (cp_async_wait<0>: every group in
// flight), and while the tile has no true element loads the next lower block's tile into the
// same buffer. Returns the highest block in [n_min, n] with a true element, or n_min - 1 when
// there is none. On return that block's tile is in `buf` and visible to all threads; the call
// executes at least one block-wide barrier (it can stand in for a __syncthreads()). Every
// thread of the block must call it with the same arguments.
template <int kBlockM, int kBlockN, int kThreads>
__device__ __forceinline__ int next_live_key_block(const OperandTile<kBlockM, kBlockN, kThreads>& mask_tile,
                                                   char* buf, int smem_pitch, int n, int n_min,
                                                   int seqlen_k, int tid) {
  cp_async_wait<0>();
  while (true) {
    if (__syncthreads_or(mask_tile.own_any(buf, smem_pitch, tid))) return n;
    if (n <= n_min) return n_min - 1;
    --n;
    // Each thread rewrites only the bytes it read itself just above: no barrier needed.
    mask_tile.load(buf, smem_pitch, n * kBlockN, seqlen_k, tid);
    cp_async_commit();
    cp_async_wait<0>();
  }
}

// Backward (or any kernel that decides before loading): does this thread's share of the mask
// tile (queries [m0, m0 + block_m) x keys [n0, n0 + block_n)) hold a true element inside
// (Sq, Sk)? The block-wide answer is __syncthreads_or(result). Reads global memory directly
// (16-byte loads when mask.vec and block_n % 16 == 0), each element once across the block.
// A query-broadcast mask (stride_q == 0) reads one row.
__device__ __forceinline__ bool mask_tile_any_gmem(const OperandArgs& mask, int b, int h, int m0,
                                                   int block_m, int seqlen_q, int n0, int block_n,
                                                   int seqlen_k, int tid, int nthreads) {
  const char* base = mask.ptr + int64_t(b) * mask.stride_b + int64_t(h / mask.head_div) * mask.stride_h +
                     int64_t(m0) * mask.stride_q;
  const int rows = mask.row_bcast ? 1 : min(block_m, seqlen_q - m0);
  const int cols = min(block_n, seqlen_k - n0);
  bool any = false;
  if (rows <= 0 || cols <= 0) return false;
  if (mask.vec && block_n % 16 == 0) {
    const int chunks_per_row = block_n / 16;
    for (int idx = tid; idx < rows * chunks_per_row; idx += nthreads) {
      const int r = idx / chunks_per_row, c = (idx % chunks_per_row) * 16;
      if (c >= cols) continue;
      const char* p = base + int64_t(r) * mask.stride_q + n0 + c;
      if (cols - c >= 16) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
        any |= (v.x | v.y | v.z | v.w) != 0u;
      } else {
        for (int j = 0; j < cols - c; ++j) any |= p[j] != 0;
      }
    }
  } else {
    for (int idx = tid; idx < rows * block_n; idx += nthreads) {
      const int r = idx / block_n, c = idx % block_n;
      if (c < cols) any |= base[int64_t(r) * mask.stride_q + int64_t(n0 + c) * mask.stride_k] != 0;
    }
  }
  return any;
}

}  // namespace dmattn::cuda
