// Bias tiles in shared memory and their addition to the scores.
// The cp.async tile of the general Hopper backward (bwd_kernel_sm90.h, bias fast path: a 16-bit
// bias, no mask, no softcap): unpadded rows of kBlockN elements, so that two
// tiles (the current key block's and the next one's, loaded with K) fit beside double-buffered K
// and V (160 + 2 x 32 KB at D = 128). Without padding, the accumulator-layout reads would hit one
// bank group 8 times (a warp reads one 16-byte chunk from each of 8 rows 256 bytes apart), so the
// 16-byte chunks are XOR-swizzled by the row: chunk c of row r lives at chunk c ^ (r % 8). A
// query-broadcast bias keeps one row (r = 0: no swizzle). Out-of-range elements are 0 (the key
// tail is masked by the window test, rows past Sq are never stored).
// The TMA tile of the warp-specialized kernels (add_bias_sw128): wgmma's 128-byte swizzle, of
// 16-bit elements or (the forward's fp32 bias) of floats.
#pragma once

#include <cute/tensor.hpp>

#include "cuda/common/operand_tile.h"
#include "cuda/common/utils.h"

namespace dmattn::cuda::sm90 {

// Byte offset of 16-bit element (r, c) in a swizzled tile.
template <int kBlockN>
__device__ __forceinline__ int bias_swizzled_offset(int r, int c) {
  return r * kBlockN * 2 + ((((c >> 3) ^ (r & 7))) << 4) + (c & 7) * 2;
}

// Issues the copy of key block [n0, n0 + kBlockN) of the bias (tile: OperandTile initialized for
// this query block, pitch != 0 unless query-broadcast) into `smem`: cp.async on the 16-byte path
// (the caller commits and waits), element-wise loads and shared stores otherwise (visible after
// the caller's barrier). kVecOnly: the caller guarantees the 16-byte path (t.vec); the
// element-wise branch is then not compiled (in the backward's loop its mere presence made ptxas
// hold addresses across the loop: 216 B of spills).
template <int kBlockM, int kBlockN, int kThreads, bool kVecOnly = false>
__device__ __forceinline__ void load_bias_tile_swizzled(char* smem, const OperandTile<kBlockM, kBlockN, kThreads>& t,
                                                        int n0, int seqlen_k, int tid) {
  const int rows = t.pitch == 0 ? 1 : kBlockM;
  const int cols_valid = min(kBlockN, seqlen_k - n0);
  if (kVecOnly || t.vec) {
    // Thread tid copies chunk column c of rows r0 + k * kRowStep: one column, one swizzle (r % 8
    // is the same for all its rows), pointers advanced by a constant (no per-chunk index math).
    constexpr int kChunksPerRow = kBlockN / 8;
    constexpr int kRowStep = kThreads / kChunksPerRow;
    static_assert(kThreads % kChunksPerRow == 0 && kBlockM % kRowStep == 0 && kRowStep % 8 == 0);
    const int r0 = tid / kChunksPerRow, c = (tid % kChunksPerRow) * 8;
    const char* g0 = t.base + int64_t(n0) * 2;
    int col_bytes = (cols_valid - c) * 2;
    col_bytes = col_bytes < 0 ? 0 : (col_bytes > 16 ? 16 : col_bytes);
    const char* src = g0 + (int64_t(r0) * t.stride_q + c) * 2;
    const int64_t src_step = int64_t(kRowStep) * t.stride_q * 2;
    char* dst = smem + bias_swizzled_offset<kBlockN>(r0, c);
    if (rows == 1) {  // query-broadcast: one row
      if (r0 == 0) cp_async_16(dst, col_bytes > 0 ? src : g0, col_bytes);
      return;
    }
    CUTE_UNROLL
    for (int k = 0; k < kBlockM / kRowStep; ++k) {
      const int bytes = r0 + k * kRowStep < t.rows_valid ? col_bytes : 0;
      cp_async_16(dst + k * kRowStep * kBlockN * 2, bytes > 0 ? src : g0, bytes);
      src += src_step;
    }
  } else if constexpr (!kVecOnly) {
    for (int idx = tid; idx < rows * kBlockN; idx += kThreads) {
      const int r = idx / kBlockN, c = idx % kBlockN;
      const bool ok = r < t.rows_valid && c < cols_valid;
      const char* src = t.base + (int64_t(r) * t.stride_q + int64_t(n0 + c) * t.stride_k) * 2;
      *reinterpret_cast<uint16_t*>(smem + bias_swizzled_offset<kBlockN>(r, c)) =
          ok ? __ldg(reinterpret_cast<const uint16_t*>(src)) : uint16_t(0);
    }
  }
}

// s = s * scale + bias on the accumulator row/col view (coord: (row, col) in the block). A -inf
// bias gives a -inf score through the fma itself (a finite qk), a finfo.min bias a finite one.
// Each thread's columns are col0 + 8 j + {0, 1} (wgmma's accumulator layout, col0 < 8): pair j
// is in chunk j, at byte 2 col0 of it.
template <typename Element, int kBlockN, class S, class C>
__device__ __forceinline__ void add_bias_swizzled(S& s, C const& coord, const char* s_bias, bool row_bcast,
                                                  float scale) {
  using namespace cute;
  const int col0 = get<1>(coord(0, 0));
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    const int row = row_bcast ? 0 : get<0>(coord(r, 0));
    const char* p = s_bias + row * kBlockN * 2 + col0 * 2;
    const int xs = (row & 7) << 4;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); c += 2) {
      const int cc = get<1>(coord(r, c)) - col0;  // 8 j, compile-time after folding
      float b0, b1;
      ElemInfo<Element>::to_float2(p + (((cc >> 3) << 4) ^ xs), b0, b1);
      s(r, c) = fmaf(s(r, c), scale, b0);
      s(r, c + 1) = fmaf(s(r, c + 1), scale, b1);
    }
  }
}

// s = s * scale + bias on one warpgroup's 64 x N accumulator (row/col view; coord: (row, col) in
// the tile), the bias read from a (kTileRows, 64 j) tile in the 128-byte swizzled K-major layout
// of wgmma's operands (tile_to_shape of the SW128 atom: 64-key halves of kTileRows 128-byte
// rows, 16-byte chunk c of row r at c ^ (r % 8)), which TMA writes directly. The accumulator's
// keys start at a multiple of 64 (the forward's whole key block, or one backward consumer's
// half). A -inf bias gives a -inf score through the fma (a finite qk).
// The accumulator gives each thread, per 8-key group j, the pair of keys 8j + 2 (lane % 4) +
// {0, 1} of rows lane / 4 and lane / 4 + 8 of its warp's 16 (s(r, 2j + {0, 1})): ldmatrix's
// fragment of an 8 x 8 matrix. So one ldmatrix.x4 reads the bias of 16 keys (four 8 x 8
// matrices: rows +0 / +8, keys +0 / +8), each lane naming one 16-byte row chunk (lanes 8i..8i+7:
// matrix i), where 32-bit loads took four instructions and their addresses.
template <typename Element, int kTileRows, class S, class C>
__device__ __forceinline__ void add_bias_sw128(S& s, C const& coord, const Element* s_bias, float scale) {
  using namespace cute;
  constexpr int kKeys = decltype(size<1>(s))::value * 4;  // the accumulator's N
  static_assert(decltype(size<0>(s))::value == 2 && kKeys % 64 == 0, "a 64 x 64 j accumulator of one warpgroup");
  const int lane = threadIdx.x % 32;
  const int warp_rows = get<0>(coord(0, 0)) & ~15;              // the warp's 16 rows
  const int half0 = get<1>(coord(0, 0)) >> 6;                   // the 64-key half of its first key
  const int row = warp_rows + (lane & 7) + ((lane >> 3) & 1) * 8;  // the row chunk this lane names
  // Chunk 2k + (lane >> 4) of a 64-key half (k = 0..3: 16 keys each), swizzled: (2k) ^ xs.
  const int xs = (lane >> 4) ^ (row & 7);
  const uint32_t base = cute::cast_smem_ptr_to_uint(s_bias) + half0 * (kTileRows * 128) + row * 128;
  CUTE_UNROLL
  for (int jj = 0; jj < kKeys / 16; ++jj) {
    const uint32_t addr = base + (jj >> 2) * (kTileRows * 128) + ((((jj & 3) << 1) ^ xs) << 4);
    uint32_t w[4];
    asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(addr));
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {  // matrix i: row lane / 4 + 8 (i & 1), keys 16 jj + 8 (i >> 1) + 2 (lane % 4)
      const int r = i & 1, c = 4 * jj + 2 * (i >> 1);
      float b0, b1;
      ElemInfo<Element>::word_to_float2(w[i], b0, b1);
      s(r, c) = fmaf(s(r, c), scale, b0);
      s(r, c + 1) = fmaf(s(r, c + 1), scale, b1);
    }
  }
}

// The same for an fp32 bias tile: (kTileRows, 32 j) in the 128-byte swizzle of 4-byte elements
// (tile_to_shape of Layout_K_SW128_Atom<float>: 32-key column blocks of kTileRows 128-byte rows,
// 16-byte chunk c of row r at c ^ (r % 8)). A thread's pair of keys 8j + 2 (lane % 4) + {0, 1}
// is one 8-byte load: chunk 2 (j % 4) + (lane % 4) / 2 of its 32-key block, at byte 8 (lane % 2)
// of it. A warp's load covers 8 rows, two chunks each, at 16 distinct chunk positions of two
// 128-byte lines: its 256 bytes in two wavefronts, the least they take. (ldmatrix, which moves
// 16-bit pairs, would hand each lane single floats of other columns.) The accumulator's keys
// start at a multiple of 32.
template <int kTileRows, class S, class C>
__device__ __forceinline__ void add_bias_sw128(S& s, C const& coord, const float* s_bias, float scale) {
  using namespace cute;
  constexpr int kGroups = decltype(size<1>(s))::value / 2;  // 8-key groups
  static_assert(decltype(size<0>(s))::value == 2 && kGroups % 4 == 0, "a 64 x 32 j accumulator of one warpgroup");
  const int c0 = get<1>(coord(0, 0));  // 32 b + 2 (lane % 4)
  const uint32_t tile = cute::cast_smem_ptr_to_uint(s_bias) + (c0 >> 5) * (kTileRows * 128) + (c0 & 2) * 4;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = get<0>(coord(r, 0));
    const uint32_t base = tile + row * 128;
    const uint32_t xs = uint32_t(((c0 & 31) >> 2) ^ (row & 7));  // (the chunk's low bit, then the row's XOR)
    CUTE_UNROLL
    for (int j = 0; j < kGroups; ++j) {
      const uint32_t addr = base + (j >> 2) * (kTileRows * 128) + (((uint32_t(j & 3) << 1) ^ xs) << 4);
      float b0, b1;
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(b0), "=f"(b1) : "r"(addr));
      s(r, 2 * j) = fmaf(s(r, 2 * j), scale, b0);
      s(r, 2 * j + 1) = fmaf(s(r, 2 * j + 1), scale, b1);
    }
  }
}

}  // namespace dmattn::cuda::sm90
