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
  // The thread index goes through an empty asm so that the per-chunk addresses are recomputed
  // at each call (a few integer ops) instead of being hoisted out of the caller's key loop and
  // held in (or spilled from) registers for its whole length.
  int t = tid;
  asm volatile("" : "+r"(t));
  if constexpr (kThreads % kChunksPerRow == 0 && (kThreads / kChunksPerRow) % 8 == 0) {
    // Every chunk of this thread sits in the same column; rows advance in steps of a multiple of
    // 8, which moves a swizzled (8-row atom) tile by a constant offset.
    constexpr int kRowStep = kThreads / kChunksPerRow;
    const int r0 = t / kChunksPerRow, c = (t % kChunksPerRow) * 8;
    Element* s0 = &s(r0, c);
    const int64_t step_off = &s(kRowStep, 0) - &s(0, 0);
    const Element* g0 = gmem + r0 * row_stride + c;
    CUTE_UNROLL
    for (int it = 0; it < kChunks / kThreads; ++it) {
      const int r = r0 + it * kRowStep;
      const bool ok = r < rows_valid && c < cols_valid;
      const Element* src = ok ? g0 + int64_t(it * kRowStep) * row_stride : gmem;
      cp_async_16(s0 + it * step_off, src, ok ? 16 : 0);
    }
  } else {
    CUTE_UNROLL
    for (int it = 0; it < kChunks / kThreads; ++it) {
      const int idx = it * kThreads + t;
      const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
      const bool ok = r < rows_valid && c < cols_valid;
      const Element* src = ok ? gmem + r * row_stride + c : gmem;
      cp_async_16(&s(r, c), src, ok ? 16 : 0);
    }
  }
}

}  // namespace dmattn::cuda
