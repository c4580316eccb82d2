// The mask tile of the warp-specialized Hopper forward (FwdWsScores::kFullMask): which masks
// TMA loads as tiles, and a (kTileRows, 128 or 64) tile of a boolean mask (one byte an element,
// nonzero: the key is kept), which TMA writes in the 8-bit 128-byte swizzle
// (GMMA::Layout_K_SW128_Atom<uint8_t>: 16-byte chunk c of row r at c ^ (r % 8)) or, for 64-key
// blocks, the 64-byte one (Layout_K_SW64_Atom<uint8_t>: chunk c of row r at c ^ ((r / 2) % 4)),
// applied to one warpgroup's scores in the accumulator layout. And for a query-broadcast mask (key rows), the
// key-block range between its first and last true key (key_mask_block_range).
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "cuda/common/fwd_args.h"

namespace dmattn::cuda::sm90 {

// A mask whose (rows, keys) tiles TMA loads: one byte an element, one row per query, contiguous
// keys, 16-byte multiples as strides and base.
inline bool tma_mask_tiles_ok(const OperandArgs& m) {
  return m.esize == 1 && !m.row_bcast && m.stride_k == 1 && m.stride_q % 16 == 0 && m.stride_h % 16 == 0 &&
         m.stride_b % 16 == 0 && reinterpret_cast<uintptr_t>(m.ptr) % 16 == 0;
}

// The 16-byte chunk position that row r's chunks are XORed with: rows of 128 bytes (the
// 128-byte swizzle) or 64 (the 64-byte swizzle: rows in pairs share a 128-byte line).
template <int kRowBytes>
constexpr int mask_row_swizzle(int r) {
  static_assert(kRowBytes == 128 || kRowBytes == 64);
  return kRowBytes == 128 ? r & 7 : (r >> 1) & 3;
}

// Byte offset of element (r, c) in a swizzled tile of kRowBytes-byte rows.
template <int kRowBytes = 128>
constexpr int mask_sw_offset(int r, int c) {
  return r * kRowBytes + ((((c >> 4) ^ mask_row_swizzle<kRowBytes>(r))) << 4) + (c & 15);
}

// Whether `Layout` (a (rows, kRowBytes[, stages]) tile of bytes) is the one above.
template <class Layout, int kRows, int kRowBytes = 128>
constexpr bool is_mask_sw_layout() {
  using Linear = decltype(Layout{}.layout_b());
  // (the swizzle XORs the chunk bits 4.. of the offset with the bits 3 above them)
  using Swizzle = std::conditional_t<kRowBytes == 128, cute::Swizzle<3, 4, 3>, cute::Swizzle<2, 4, 3>>;
  if (!std::is_same_v<decltype(Layout{}.layout_a()), Swizzle>) return false;
  constexpr int kChunkBits = kRowBytes == 128 ? 7 : 3;
  for (int r = 0; r < kRows; r += 3)
    for (int c = 0; c < kRowBytes; c += 5) {
      const int linear = int(cute::take<0, 2>(Linear{})(r, c));
      if ((linear ^ (((linear >> 7) & kChunkBits) << 4)) != mask_sw_offset<kRowBytes>(r, c)) return false;
    }
  return true;
}

// s = -inf where the mask is false, on one warpgroup's 64 x kRowBytes accumulator (row/col view;
// coord: (row, col) in the tile), the mask tile's rows kRowBytes bytes in the swizzle above. The
// accumulator gives each thread, per 8-key group j, the pair of keys 8j + 2 (lane % 4) + {0, 1}
// of two rows: one 16-bit load each (the pair's two bytes), at an offset that is the row's base
// XOR a constant per 16-key chunk. The 8 rows of a warp's load sit in 8 different 16-byte
// positions of a 128-byte line (64-byte rows: two rows a line, each pair of rows at its own
// chunk XOR): no bank conflicts.
template <int kTileRows, int kRowBytes = 128, class S, class C>
__device__ __forceinline__ void apply_mask_sw(S& s, C const& coord, const uint8_t* s_mask) {
  using namespace cute;
  constexpr int kPairs = decltype(size<1>(s))::value / 2;  // 8-key groups
  static_assert(decltype(size<0>(s))::value == 2 && kPairs * 8 == kRowBytes,
                "a 64 x kRowBytes accumulator of one warpgroup");
  const uint32_t tile = cute::cast_smem_ptr_to_uint(s_mask);
  const int col0 = get<1>(coord(0, 0));  // 2 (lane % 4)
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = get<0>(coord(r, 0));
    const uint32_t base = tile + row * kRowBytes + col0;
    const uint32_t xs = uint32_t(mask_row_swizzle<kRowBytes>(row)) << 4;
    CUTE_UNROLL
    for (int j = 0; j < kPairs; ++j) {
      const uint32_t addr = (base + ((uint32_t(j >> 1) << 4) ^ xs)) + 8 * (j & 1);
      uint16_t w;
      asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(w) : "r"(addr));
      if ((w & 0x00ffu) == 0) s(r, 2 * j) = -INFINITY;
      if ((w & 0xff00u) == 0) s(r, 2 * j + 1) = -INFINITY;
    }
  }
}

// The first and last set byte of a 16-byte chunk holding keys j0 .. j0 + 15 (INT_MAX / -1
// without one): bit 7 of each byte of `nz` tells whether the byte is nonzero.
__device__ __forceinline__ void set_bytes_range(const uint4& v, int j0, int& first, int& last) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const uint32_t nz = (((w[i] & 0x7f7f7f7fu) + 0x7f7f7f7fu) | w[i]) & 0x80808080u;
    if (nz != 0) {
      first = min(first, j0 + i * 4 + (__ffs(nz) - 1) / 8);
      last = max(last, j0 + i * 4 + (31 - __clz(nz)) / 8);
    }
  }
}

// The key blocks of [n_min, n_max) between the first and the last true key of a
// query-broadcast mask's row (`row`, `step` bytes between keys, `count` keys): the blocks of a
// padded batch's padding are never loaded; an empty range where no key of it is true.
// Warp-cooperative (every lane calls it; all find the same range): each round tests 512 keys
// from each end, 16 a lane (one 16-byte load where the row allows).
template <int kBlockN>
__device__ __forceinline__ void key_mask_block_range(const uint8_t* row, int64_t step, int count, int& n_min,
                                                     int& n_max) {
  const int lane = threadIdx.x & 31;
  const int lo = n_min * kBlockN, hi = min(count, n_max * kBlockN);
  if (hi <= lo) return;
  const bool vec = step == 1 && reinterpret_cast<uintptr_t>(row) % 16 == 0;
  // (keys j0 .. j0 + 15 of [lo, hi))
  auto scan_chunk = [&](int j0, int& first, int& last) {
    if (vec && j0 >= lo && j0 + 16 <= hi) {
      set_bytes_range(__ldg(reinterpret_cast<const uint4*>(row + j0)), j0, first, last);
      return;
    }
    for (int c = 0; c < 16; ++c) {
      const int j = j0 + c;
      if (j >= lo && j < hi && __ldg(row + int64_t(j) * step) != 0) {
        first = min(first, j);
        last = max(last, j);
      }
    }
  };
  const int top = lo + (hi - lo + 15) / 16 * 16;  // (the backward chunks end on the forward ones' grid)
  int first = INT_MAX, last = -1;
  for (int r = 0;; ++r) {
    // (the forward chunks give only the first key, the backward ones only the last: a forward
    // chunk's last true key need not be the row's)
    int f = INT_MAX, l = -1, f_unused = INT_MAX, l_unused = -1;
    const int fwd = lo + (r * 32 + lane) * 16, bwd = top - (r * 32 + lane + 1) * 16;
    if (first == INT_MAX && fwd < hi) scan_chunk(fwd, f, l_unused);
    if (last < 0 && bwd + 16 > lo) scan_chunk(bwd, f_unused, l);
    first = min(first, __reduce_min_sync(0xffffffffu, f));
    last = max(last, __reduce_max_sync(0xffffffffu, l));
    if ((first != INT_MAX && last >= 0) || lo + (r + 1) * 512 >= hi) break;
  }
  if (first == INT_MAX) {
    n_max = n_min;
    return;
  }
  n_min = first / kBlockN;
  n_max = last / kBlockN + 1;
}

}  // namespace dmattn::cuda::sm90
