// Query heads of one KV head packed into the rows of a forward tile (FwdWsTile::kPackGqa): with
// few queries per sequence (chunked prefill, speculative decoding) a tile of one head holds
// mostly rows past the sequence, and every head of a group reads the same K and V again. Packed,
// row r of the group's virtual rows is query r / group of head r % group (the heads fastest, so
// that positions grow with r and a tile covers a short run of them): the tile fills with the
// group's rows, and each K / V block is read once for all of its heads.
// Every row's scores, softmax and output are computed as in a tile of its own head (the same
// products, the same key blocks in the same order; a block that only another row of the tile
// needs gives this row's scores -inf and changes none of its values), so packing changes no
// bit of the results. (Of finite inputs: a NaN or Inf in V at a key a row does not attend may
// reach that row through P = 0, as in any tile that another row's keys share; docs/semantics.md
// leaves that open.)
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/common/copy.h"
#include "cuda/common/mask.h"

namespace dmattn::cuda::sm90 {

// The rows that a sequence of len_q queries fills in the tiles: len_q, or len_q x group with the
// query heads packed.
template <bool kPackGqa>
__device__ __forceinline__ int tile_rows_of(int len_q, int group) {
  return kPackGqa ? len_q * group : len_q;
}

// Offset of tile row i (a row of tile_rows_of) from the sequence's first query of the tile's
// first head, in a tensor of row_stride between queries and head_stride between heads: query i,
// or, packed, query i / group of head i % group of the group.
template <bool kPackGqa>
__device__ __forceinline__ int64_t tile_row_offset(int i, int group, int64_t row_stride, int64_t head_stride) {
  if constexpr (kPackGqa) {
    const int q = i / group;
    return int64_t(q) * row_stride + int64_t(i - q * group) * head_stride;
  } else {
    return int64_t(i) * row_stride;
  }
}

// The queries (positions in the sequence) of tile rows [m0, m0 + block_m): [first, first + count),
// bounded by the sequence's end where the window's key range is taken (WindowMask clamps).
// Unpacked (group 1) the rows themselves.
__device__ __forceinline__ void packed_query_span(int m0, int block_m, int group, int& first, int& count) {
  first = m0 / group;
  count = (m0 + block_m - 1) / group + 1 - first;
}

// Q of a packed tile (kRows rows of kCols columns, 16-bit) into the 128-byte-swizzled K-major
// layout at shared address s_tile, by one warp's cp.async: tile row r is query p = (m0 + r) /
// group of head g = (m0 + r) % group, read from q_group + p * row_stride + g * head_stride
// (q_group: the group's first head at the sequence's first query). Rows of queries >= len_q
// and columns >= cols_valid are zeros. Two lanes a row, 16 rows per step (as gather_rows_sw128).
// kRowsWritten: only the tile's first rows (the rest of it is left as it is).
template <int kRows, int kCols, typename Element, int kRowsWritten = kRows>
__device__ __forceinline__ void load_packed_q_sw128(uint32_t s_tile, const Element* q_group, int64_t row_stride,
                                                    int64_t head_stride, int m0, int group, int len_q,
                                                    int cols_valid, int lane) {
  static_assert(sizeof(Element) == 2 && kCols % 64 == 0 && kRows % 16 == 0 && kRowsWritten % 16 == 0 &&
                kRowsWritten <= kRows);
  const int odd = lane & 1;
  const int k_end = (cols_valid / 8 - odd + 1) / 2;  // this lane's chunks 2k + odd inside the columns
#pragma unroll 1
  for (int r = lane / 2; r < kRowsWritten; r += 16) {
    const int p = (m0 + r) / group, g = m0 + r - p * group;
    const bool ok = p < len_q;
    const Element* src = ok ? q_group + int64_t(p) * row_stride + int64_t(g) * head_stride + odd * 8 : q_group;
    copy_row_chunks_sw128<kRows, kCols>(s_tile, r, src, ok ? 16 : 0, k_end, odd);
  }
}

// The window / causal / key-tail test of a packed tile's key block n0.. (scores s with
// coordinates `coord` in the (row, column) view of the accumulator): each row on its own query
// (m0 + row) / group.
template <int kBlockN, class S, class C>
__device__ __forceinline__ void mask_packed_rows(S& s, C const& coord, int m0, int group, int n0,
                                                 const WindowMask& win) {
  using namespace cute;
  const int col0 = get<1>(coord(0, 0));
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    int lo, hi;
    win.column_range((m0 + get<0>(coord(r, 0))) / group, n0 + col0, kBlockN, lo, hi);
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      const int cc = get<1>(coord(r, c)) - col0;  // compile-time after folding
      if (cc < lo || cc >= hi) s(r, c) = -INFINITY;
    }
  }
}

}  // namespace dmattn::cuda::sm90
