// Global-memory views that the Hopper kernels hand to make_tma_copy: a sequence tensor (q, k,
// v, dO, the bias and its gradient, dQ's fp32 accumulator) as (rows, cols, heads, batch) with
// contiguous cols.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/common/fwd_args.h"

namespace dmattn::cuda::sm90 {

// TMA needs every stride of a dimension with more than one index to be a non-zero multiple of
// 16 bytes (the sequence tensors' strides are multiples of 8 elements: check_seq_tensor).
inline bool tma_strides_ok(int64_t bs, int64_t hs, int batch, int heads) {
  return (batch == 1 || bs != 0) && (heads == 1 || hs != 0);
}

// The head and batch extents a TMA view of a sequence operand takes: 1 along a dimension the
// operand broadcasts (stride 0, which no TMA descriptor takes), whose coordinate is then 0 for
// every head / batch (at), else the dimension's own.
struct TmaExtents {
  int heads = 1, batch = 1;
  static TmaExtents of(int64_t hs, int heads, int64_t bs, int batch) {
    return {hs == 0 ? 1 : heads, bs == 0 ? 1 : batch};
  }
  __host__ __device__ int head_at(int h) const { return heads == 1 ? 0 : h; }
  __host__ __device__ int batch_at(int b) const { return batch == 1 ? 0 : b; }
};

// A stride TMA accepts for a dimension of one index (its value is never used).
inline int64_t tma_stride(int64_t stride, int extent, int64_t fallback) { return extent == 1 ? fallback : stride; }

// (rows, cols, heads, batch) over `ptr` with row / head / batch strides rs, hs, bs (elements),
// the strides of dims of one index replaced by valid ones.
template <typename T>
auto tma_gmem_view(T* ptr, int rows, int cols, int heads, int batch, int64_t rs, int64_t hs, int64_t bs) {
  using namespace cute;
  const int64_t hs_ok = tma_stride(hs, heads, rs * rows == 0 ? 8 : rs * rows);
  const int64_t bs_ok = tma_stride(bs, batch, hs_ok * heads == 0 ? 8 : hs_ok * heads);
  return make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(rows, cols, heads, batch), make_stride(rs, _1{}, hs_ok, bs_ok)));
}

// A bias whose (rows, keys) tiles TMA loads: q's dtype (16-bit; fp32 too where the kernel takes
// fp32 tiles), one row per query, contiguous keys, 16-byte multiples as strides and base.
inline bool tma_bias_tiles_ok(const OperandArgs& b, bool fp32_ok = false) {
  if (b.esize != 2 && !(fp32_ok && b.esize == 4)) return false;
  const int64_t per16 = 16 / b.esize;  // elements in 16 bytes
  return !b.row_bcast && b.stride_k == 1 && b.stride_q % per16 == 0 && b.stride_h % per16 == 0 &&
         b.stride_b % per16 == 0 && reinterpret_cast<uintptr_t>(b.ptr) % 16 == 0;
}

}  // namespace dmattn::cuda::sm90
