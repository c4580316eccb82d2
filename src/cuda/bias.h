// Bias and bool-mask reads from their shared-memory tiles (see operand_tile.h for the loads).
// The bias is in q's dtype or fp32; it is added to the scaled (and soft-capped) score.
#pragma once

#include "cuda/utils.h"

namespace dmattn::cuda {

template <typename BiasT>
__device__ __forceinline__ float read_bias(const char* smem, int pitch, int row, int col) {
  const BiasT* p = reinterpret_cast<const BiasT*>(smem) + row * pitch + col;
  if constexpr (std::is_same_v<BiasT, float>) return *p;
  else return ElemInfo<BiasT>::to_float(p);
}

__device__ __forceinline__ bool read_mask(const char* smem, int pitch, int row, int col) {
  return reinterpret_cast<const uint8_t*>(smem)[row * pitch + col] != 0;
}

}  // namespace dmattn::cuda
