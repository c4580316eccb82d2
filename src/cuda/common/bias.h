// Bias and bool-mask reads from their shared-memory tiles (loads: operand_tile.h), two
// adjacent columns at a time (the pair a thread owns in an mma accumulator row).
// The bias is in q's dtype or fp32; it is added to the scaled (and soft-capped) score.
#pragma once

#include "cuda/common/utils.h"

namespace dmattn::cuda {

// p points at an even column of a row whose pitch is even: 4- or 8-byte aligned.
template <typename BiasT>
__device__ __forceinline__ void read_bias_pair(const BiasT* p, float& b0, float& b1) {
  if constexpr (std::is_same_v<BiasT, float>) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    b0 = v.x;
    b1 = v.y;
  } else {
    ElemInfo<BiasT>::to_float2(p, b0, b1);
  }
}

__device__ __forceinline__ void read_mask_pair(const uint8_t* p, bool& m0, bool& m1) {
  const uint16_t v = *reinterpret_cast<const uint16_t*>(p);
  m0 = (v & 0xff) != 0;
  m1 = (v >> 8) != 0;
}

}  // namespace dmattn::cuda
