// The per-key rows of the warp-specialized Hopper kernels (forward and backward): a key
// block's positions, query bounds and bias, loaded by one producer warp into a pipeline stage
// (load_key_rows), and the bias added to the scores on the accumulator's row/col view
// (add_key_bias).
#pragma once

#include <climits>
#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/utils.h"

namespace dmattn::cuda::sm90 {

// s = s * scale + bias[col] on the accumulator row/col view, the key bias from a kBlockN fp32 row
// in shared memory (read as column pairs: broadcast within a quad's columns).
template <class S, class C>
__device__ __forceinline__ void add_key_bias(S& s, C const& coord, const float* s_bias, float scale) {
  using namespace cute;
  const int col0 = get<1>(coord(0, 0));
  CUTE_UNROLL
  for (int c = 0; c < size<1>(s); c += 2) {
    const int cc = get<1>(coord(0, c)) - col0;  // compile-time after folding, even
    const float2 bv = *reinterpret_cast<const float2*>(s_bias + col0 + cc);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      s(r, c) = fmaf(s(r, c), scale, bv.x);
      s(r, c + 1) = fmaf(s(r, c + 1), scale, bv.y);
    }
  }
}

// The per-key rows of key block n (Tile::kKeyRows) into `st`, by the 32 lanes of one warp:
// position (gathered keys' own, else the index), query bound (key ends, else INT_MAX; 0 where
// a query-broadcast mask is false: no query sees the key) and bias (fp32 or q's dtype, else 0);
// past the `count` keys -1, 0 and 0 (a padding row: masked).
template <typename Element, class Stage, int kBlockN>
__device__ __forceinline__ void load_key_rows(Stage& st, int n, int count, const int32_t* pos_row,
                                              const int32_t* end_row, const char* bias_row, int64_t bias_step,
                                              bool bias_fp32, const uint8_t* mask_row, int64_t mask_step) {
  const int lane = threadIdx.x & 31;
  CUTE_UNROLL
  for (int c = lane; c < kBlockN; c += 32) {
    const int j = n * kBlockN + c;
    const bool in = j < count;
    st.pos[c] = !in ? -1 : pos_row != nullptr ? __ldg(pos_row + j) : j;
    int end = !in ? 0 : end_row != nullptr ? __ldg(end_row + j) : INT_MAX;
    if (in && mask_row != nullptr && __ldg(mask_row + int64_t(j) * mask_step) == 0) end = 0;
    st.end[c] = end;
    float bv = 0.f;
    if (in && bias_row != nullptr) {
      const char* e = bias_row + int64_t(j) * bias_step;
      bv = bias_fp32 ? __ldg(reinterpret_cast<const float*>(e)) : ElemInfo<Element>::to_float(e);
    }
    st.bias[c] = bv;
  }
}

}  // namespace dmattn::cuda::sm90
