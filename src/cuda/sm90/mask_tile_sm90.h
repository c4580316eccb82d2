// The mask tile of the warp-specialized Hopper forward (FwdWsScores::kFullMask): which masks
// TMA loads as tiles, and a (kTileRows, 128) tile of a boolean mask (one byte an element,
// nonzero: the key is kept), which TMA writes in the 8-bit 128-byte swizzle
// (GMMA::Layout_K_SW128_Atom<uint8_t>: 16-byte chunk c of row r at c ^ (r % 8)), applied to one
// warpgroup's scores in the accumulator layout.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/fwd_args.h"

namespace dmattn::cuda::sm90 {

// A mask whose (rows, keys) tiles TMA loads: one byte an element, one row per query, contiguous
// keys, 16-byte multiples as strides and base.
inline bool tma_mask_tiles_ok(const OperandArgs& m) {
  return m.esize == 1 && !m.row_bcast && m.stride_k == 1 && m.stride_q % 16 == 0 && m.stride_h % 16 == 0 &&
         m.stride_b % 16 == 0 && reinterpret_cast<uintptr_t>(m.ptr) % 16 == 0;
}

// Byte offset of element (r, c) in the swizzled tile.
constexpr int mask_sw128_offset(int r, int c) { return r * 128 + ((((c >> 4) ^ (r & 7))) << 4) + (c & 15); }

// Whether `Layout` (a (rows, 128[, stages]) tile of bytes) is the one above.
template <class Layout, int kRows>
constexpr bool is_mask_sw128_layout() {
  using Linear = decltype(Layout{}.layout_b());
  if (!std::is_same_v<decltype(Layout{}.layout_a()), cute::Swizzle<3, 4, 3>>) return false;
  for (int r = 0; r < kRows; r += 3)
    for (int c = 0; c < 128; c += 5) {
      const int linear = int(cute::take<0, 2>(Linear{})(r, c));
      // (the swizzle XORs bits 4-6 of the offset with bits 7-9)
      if ((linear ^ (((linear >> 7) & 7) << 4)) != mask_sw128_offset(r, c)) return false;
    }
  return true;
}

// s = -inf where the mask is false, on one warpgroup's 64 x 128 accumulator (row/col view;
// coord: (row, col) in the tile). The accumulator gives each thread, per 8-key group j, the
// pair of keys 8j + 2 (lane % 4) + {0, 1} of two rows: one 16-bit load each (the pair's two
// bytes), at an offset that is the row's base XOR a constant per 16-key chunk. The rows of a
// warp's load sit in 8 different chunk positions: no bank conflicts.
template <int kTileRows, class S, class C>
__device__ __forceinline__ void apply_mask_sw128(S& s, C const& coord, const uint8_t* s_mask) {
  using namespace cute;
  constexpr int kPairs = decltype(size<1>(s))::value / 2;  // 8-key groups
  static_assert(decltype(size<0>(s))::value == 2 && kPairs == 16, "a 64 x 128 accumulator of one warpgroup");
  const uint32_t tile = cute::cast_smem_ptr_to_uint(s_mask);
  const int col0 = get<1>(coord(0, 0));  // 2 (lane % 4)
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = get<0>(coord(r, 0));
    const uint32_t base = tile + row * 128 + col0;
    const uint32_t xs = uint32_t(row & 7) << 4;
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

}  // namespace dmattn::cuda::sm90
