// The per-key rows of the warp-specialized Hopper kernels (forward and backward): a key
// block's positions, query bounds and bias, loaded by one producer warp into a pipeline stage
// (load_key_rows), and the bias added to the scores on the accumulator's row/col view
// (add_key_bias).
#pragma once

#include <climits>
#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/common/fwd_args.h"
#include "cuda/common/key_positions.h"
#include "cuda/common/utils.h"

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

// Where the per-key rows of one (batch, query head) come from; null where absent.
struct KeyRowSources {
  const int32_t* pos = nullptr;  // gathered keys' positions
  const int32_t* end = nullptr;  // key ends
  const char* bias = nullptr;    // a query-broadcast bias's key row (fp32 or q's dtype)
  int64_t bias_step = 0;         // bytes between keys
  bool bias_fp32 = false;
  const uint8_t* mask = nullptr;  // a query-broadcast mask's key row
  int64_t mask_step = 0;
};

// The rows of (batch b, query head h), keys from the sequence's first key k0.
__device__ __forceinline__ KeyRowSources key_row_sources(const FwdArgs& a, int b, int h, int64_t k0) {
  KeyRowSources src;
  const OperandArgs& bias = a.bias;
  if (bias.ptr != nullptr && bias.row_bcast) {  // (a full bias comes by its tiles)
    src.bias = bias.ptr + (int64_t(b) * bias.stride_b + int64_t(h / bias.head_div) * bias.stride_h + k0 * bias.stride_k) *
                              bias.esize;
    src.bias_step = bias.stride_k * bias.esize;
    src.bias_fp32 = a.bias_fp32;
  }
  const OperandArgs& mask = a.mask;
  if (mask.ptr != nullptr) {
    src.mask = reinterpret_cast<const uint8_t*>(mask.ptr) + int64_t(b) * mask.stride_b +
               int64_t(h / mask.head_div) * mask.stride_h + k0 * mask.stride_k;
    src.mask_step = mask.stride_k;
  }
  if (a.kpos.ptr != nullptr) {
    src.pos = positions_row(a.kpos, b, h);
    src.end = ends_row(a.kpos, b, h);
  }
  return src;
}

// The per-key rows of key block n (keys [n kBlockN, (n + 1) kBlockN)) into `st`, by the 32
// lanes of one warp: position (gathered keys' own, else the index), query bound (key ends,
// else INT_MAX; 0 where a query-broadcast mask is false: no query sees the key) and bias (fp32
// or q's dtype, else 0); past the `count` keys -1, 0 and 0 (a padding row: masked); and the
// smallest bound into st.end_min. kUnrolled: every key of the lane's in flight at once (the
// forward's loader, once per key block); else one at a time (the backward's, whose key rows
// change with the head alone, in a producer of 40 registers that the unrolled loads spilled).
template <typename Element, class Stage, int kBlockN, bool kUnrolled = true>
__device__ __forceinline__ void load_key_rows(Stage& st, int n, int count, const KeyRowSources& src) {
  // (a stage beside bias tiles has no key bias: a placeholder of one entry)
  constexpr bool kStageBias = sizeof(st.bias) == kBlockN * sizeof(float);
  constexpr int kUnroll = kUnrolled ? kBlockN / 32 : 1;
  const int lane = threadIdx.x & 31;
#pragma unroll kUnroll
  for (int c = lane; c < kBlockN; c += 32) {
    const int j = n * kBlockN + c;
    const bool in = j < count;
    st.pos[c] = !in ? -1 : src.pos != nullptr ? __ldg(src.pos + j) : j;
    int end = !in ? 0 : src.end != nullptr ? __ldg(src.end + j) : INT_MAX;
    if (in && src.mask != nullptr && __ldg(src.mask + int64_t(j) * src.mask_step) == 0) end = 0;
    st.end[c] = end;
    if constexpr (kStageBias) {
      float bv = 0.f;
      if (in && src.bias != nullptr) {
        const char* e = src.bias + int64_t(j) * src.bias_step;
        bv = src.bias_fp32 ? __ldg(reinterpret_cast<const float*>(e)) : ElemInfo<Element>::to_float(e);
      }
      st.bias[c] = bv;
    }
  }
  // The block's smallest bound: the consumers skip the per-element test when all their queries
  // are below it (bounded_block_needs_mask). Read back from shared memory: folded into the loop
  // above, it held registers beside the loads in flight (the backward's producer warps keep 40).
  __syncwarp();
  int end_min = INT_MAX;
  CUTE_UNROLL
  for (int c = lane; c < kBlockN; c += 32) end_min = min(end_min, st.end[c]);
  end_min = __reduce_min_sync(0xffffffffu, end_min);
  if (lane == 0) st.end_min = end_min;
}

}  // namespace dmattn::cuda::sm90
