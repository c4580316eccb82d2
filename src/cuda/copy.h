// Global -> shared loads of Q / K / V tiles: 16-byte cp.async chunks, zero-filled beyond the
// valid rows (sequence tails) and columns (head dims below the instantiated one).
#pragma once

#include "cuda/utils.h"

namespace dmattn::cuda {

// Loads a (kRows, kCols) tile whose row r starts at gmem + r * row_stride into the swizzled
// shared tensor s. Rows >= rows_valid and columns >= cols_valid are zero.
template <int kRows, int kCols, int kThreads, class SmemTensor, typename Element>
__device__ __forceinline__ void load_rows_async(SmemTensor& s, const Element* gmem, int64_t row_stride,
                                                int rows_valid, int cols_valid, int tid) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0);
  CUTE_UNROLL
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const int idx = it * kThreads + tid;
    const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
    const bool ok = r < rows_valid && c < cols_valid;
    const Element* src = ok ? gmem + r * row_stride + c : gmem;
    cp_async_16(&s(r, c), src, ok ? 16 : 0);
  }
}

}  // namespace dmattn::cuda
