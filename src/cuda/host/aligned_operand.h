// A mask or bias with one row per query whose rows the kernels cannot load by 16-byte vectors or
// TMA (a row length that is not a multiple of 16 bytes: a bool mask with Sk % 16 != 0, a 16-bit
// bias with Sk % 8 != 0; a key stride other than 1; an unaligned pointer) is copied, for one
// call, into rows padded to a 16-byte multiple, and the arguments point at the copy. Its
// broadcast dimensions stay broadcast (one copy of each distinct row). Without the copy the
// kernels fall back to element-wise loads, each waiting on global memory (docs/design.md,
// "Operand tiles": 5x slower than with the copy). The copy is stream-ordered (the device's
// default pool) and freed after the kernels that read it; where the device has no memory for
// it, the element-wise path serves the call as before. Memory that pool gives back at a
// synchronization is mapped afresh by the next call, which costs more than the copy itself
// (H200: 2.9 against 1.0 ms for a 2.1 GB mask); a caller who keeps the pool's memory (its release
// threshold) or passes aligned rows avoids that.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/check.h"
#include "cuda/common/fwd_args.h"

namespace dmattn::cuda {

// dst[b, h, q, k] = src[b * sb + h * sh + q * sq + k * sk] (elements of esize bytes) for k < cols,
// 0 for cols <= k < pitch; dst contiguous (nb, nh, rows, pitch).
struct PaddedRowsArgs {
  const void* src = nullptr;
  int64_t sb = 0, sh = 0, sq = 0, sk = 0;
  int64_t nb = 1, nh = 1, rows = 0, cols = 0, pitch = 0;
  int esize = 1;
  void* dst = nullptr;
};
void copy_padded_rows(const PaddedRowsArgs& a, cudaStream_t stream);  // (aligned_operand.cu)

class AlignedOperandCopy {
 public:
  // Rewrites `op` (a mask or bias of (batch, heads, seqlen_q, seqlen_k)) to a padded copy where
  // it has a row per query and rows the kernels would read element by element.
  AlignedOperandCopy(OperandArgs& op, int batch, int heads, int seqlen_q, int seqlen_k, cudaStream_t stream)
      : stream_(stream) {
    if (op.ptr == nullptr || op.row_bcast || op.vec || seqlen_q == 0 || seqlen_k == 0) return;
    PaddedRowsArgs c;
    c.src = op.ptr;
    c.sb = op.stride_b, c.sh = op.stride_h, c.sq = op.stride_q, c.sk = op.stride_k;
    c.nb = op.stride_b == 0 ? 1 : batch;
    c.nh = op.stride_h == 0 ? 1 : heads / op.head_div;
    c.rows = seqlen_q, c.cols = seqlen_k;
    const int per16 = 16 / op.esize;
    c.pitch = (int64_t(seqlen_k) + per16 - 1) / per16 * per16;
    c.esize = op.esize;
    const size_t bytes = size_t(c.nb * c.nh * c.rows * c.pitch) * size_t(op.esize);
    if (cudaMallocAsync(&ptr_, bytes, stream) != cudaSuccess) {
      (void)cudaGetLastError();  // (no memory for it: the element-wise loads instead)
      ptr_ = nullptr;
      return;
    }
    c.dst = ptr_;
    copy_padded_rows(c, stream);
    op.ptr = static_cast<const char*>(ptr_);
    op.stride_k = 1;
    op.stride_q = c.pitch;
    op.stride_h = op.stride_h == 0 ? 0 : c.rows * c.pitch;
    op.stride_b = op.stride_b == 0 ? 0 : c.nh * c.rows * c.pitch;
    op.vec = true;
  }
  ~AlignedOperandCopy() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }
  AlignedOperandCopy(const AlignedOperandCopy&) = delete;
  AlignedOperandCopy& operator=(const AlignedOperandCopy&) = delete;

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
};

}  // namespace dmattn::cuda
