// Global -> shared loads of Q / K / V tiles: 16-byte cp.async chunks, zero-filled beyond the
// valid rows (sequence tails) and columns (head dims below the instantiated one).
#pragma once

#include <type_traits>

#include "cuda/common/utils.h"

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
  const int t = opaque_int(tid);
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

// wgmma's 128-byte-swizzled K-major layout of 16-bit elements (cute::GMMA::Layout_K_SW128_Atom
// tiled over kRows rows first, from a 1024-byte aligned base): element (row, col) at byte
// sw128_linear_offset(row, col) ^ ((row % 8) << 4) -- 64-column halves of kRows 128-byte rows,
// the 16-byte chunk k of row r at chunk k ^ (r % 8) (CuTe's Swizzle<3, 4, 3> on byte
// addresses). The kernels that write it directly check it against their CuTe layout
// (is_sw128_layout, in a static_assert).
template <int kRows>
__host__ __device__ constexpr int sw128_linear_offset(int row, int col) {
  return (col / 64) * (kRows * 128) + row * 128 + (col % 64) * 2;
}
// Whether `Layout` (a K-major tile of 16-bit elements, (rows, cols[, stages])) is the one above.
template <class Layout, int kRows, int kCols>
constexpr bool is_sw128_layout() {
  using Linear = decltype(Layout{}.layout_b());
  if (!std::is_same_v<decltype(Layout{}.layout_a()), cute::Swizzle<3, 4, 3>>) return false;
  for (int r = 0; r < kRows; r += 7)
    for (int c = 0; c < kCols; c += 9)
      if (2 * int(cute::take<0, 2>(Linear{})(r, c)) != sw128_linear_offset<kRows>(r, c)) return false;
  return true;
}

// One lane's half of tile row r in the 128-byte-swizzled layout above (a pair of lanes copies a
// row: `odd` picks its 16-byte chunks 2k + odd), by cp.async from src (the lane's first chunk
// of the row), `bytes` (16 or 0: zeros) a chunk for its chunks k < k_end, zeros past them.
template <int kRows, int kCols, typename Element>
__device__ __forceinline__ void copy_row_chunks_sw128(uint32_t s_tile, int r, const Element* src, int bytes, int k_end,
                                                      int odd) {
  constexpr int kChunksPerLane = kCols / 16;  // (16-byte chunks of 8 elements, two lanes a row)
  const uint32_t dst_row = s_tile + r * 128;
  const int swz = (r % 8) ^ odd;  // chunk 2k + odd of the row sits at chunk (2k % 8) ^ swz of its half
  CUTE_UNROLL
  for (int k = 0; k < kChunksPerLane; ++k) {
    const uint32_t dst = dst_row + (2 * k / 8) * (kRows * 128) + (((2 * k) % 8 ^ swz) << 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src + 16 * k),
                 "r"(k < k_end ? bytes : 0));
  }
}

// The row indices of a gathered (kRows, ...) tile as gather_rows_sw128 takes them: kWarps warps
// share the tile, warp w the rows [w, w + 1) * kRows / kWarps, whose indices its lanes hold 32
// rows at a time (lane l: row l of each group of 32; one coalesced load per group). Rows >=
// rows_valid get -1.
template <int kRows, int kWarps>
struct GatherRowIndices {
  static constexpr int kSlab = kRows / kWarps;
  static_assert(kRows % kWarps == 0 && kSlab % 32 == 0);
  static constexpr int kGroups = kSlab / 32;
  int idx[kGroups];
  __device__ __forceinline__ void load(const int32_t* index, int rows_valid, int warp, int lane) {
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      const int r = warp * kSlab + g * 32 + lane;
      idx[g] = r < rows_valid ? __ldg(index + r) : -1;
    }
  }
};

// Gathers a (kRows, kCols) tile of 16-bit elements into the 128-byte-swizzled K-major layout
// (above) at shared address s_tile: tile row r is row `index` of gmem (row stride
// row_stride), the indices as GatherRowIndices loaded them (the caller loads them ahead, so that
// the copies never wait for them); an index outside [0, src_rows) and columns >= cols_valid give
// zeros. The two lanes of a pair copy the even and the odd 16-byte chunks of their row, so that
// each copy instruction reads whole 32-byte sectors of 16 rows; a copy is then one address XOR
// and the cp.async, its source offset an immediate.
template <int kRows, int kCols, int kWarps, typename Element>
__device__ __forceinline__ void gather_rows_sw128(uint32_t s_tile, const Element* gmem, int64_t row_stride,
                                                  const GatherRowIndices<kRows, kWarps>& index, int src_rows,
                                                  int cols_valid, int warp, int lane) {
  static_assert(sizeof(Element) == 2 && kCols % 64 == 0);
  using Indices = GatherRowIndices<kRows, kWarps>;
  const int odd = lane & 1;
  // This lane's chunks 2k + odd are inside the columns for k < k_end.
  const int k_end = (cols_valid / 8 - odd + 1) / 2;
  // Copy i: rows 32 g + 16 h + l / 2 of the warp's for lane l (g = i / 2, h = i % 2), whose index
  // lane 16 h + l / 2 holds in idx[g]; one row at a time (unrolled, the rows' addresses outgrew
  // the producer's registers).
#pragma unroll 1
  for (int i = 0; i < 2 * Indices::kGroups; ++i) {
    const int g = i / 2, h = i % 2;
    int held = index.idx[0];  // (a select chain: a run-time index into idx would be local memory)
    CUTE_UNROLL
    for (int gg = 1; gg < Indices::kGroups; ++gg) held = g == gg ? index.idx[gg] : held;
    const int r = warp * Indices::kSlab + g * 32 + h * 16 + lane / 2;
    const int j = __shfl_sync(0xffffffffu, held, 16 * h + lane / 2);
    const bool ok = j >= 0 && j < src_rows;
    const Element* src = ok ? gmem + int64_t(j) * row_stride + odd * 8 : gmem;
    copy_row_chunks_sw128<kRows, kCols>(s_tile, r, src, ok ? 16 : 0, k_end, odd);
  }
}

}  // namespace dmattn::cuda
