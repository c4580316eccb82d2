// A bias of 16-bit entries on the Hopper decode kernel (decode_sm90.h), in one of two forms:
// - Up to kBiasRows packed rows (DecodeBias::kProduct): the tensor cores add it. A stage's bias
//   rows (the chunk's packed rows, at most kBiasRows, by 64 keys) are the B operand of a second
//   product beside S = Q K^T, whose A operand is a one-hot matrix in registers (row r picks bias
//   row r): S_bias = OneHot x Bias^T lands in an accumulator of its own with each score's entry
//   exactly (1 x entry plus zeros, in fp32), in the layout of S. The score transform then takes it
//   as the mma.sync kernels take their entries (transform_score), without a load, conversion or
//   address a score on the softmax's chain.
//   - Where the rows live: the decode tile's Q holds at most kBiasRows real rows (the rest of its
//     64 are padding whose scores are never stored), so a stage's rows (2 KB) sit in Q's padding
//     rows 16-63 of its first 64 columns, three stages' worth; two CTAs an SM still fit.
//   - How they arrive: each thread loads one 16-byte chunk of one row into registers a stage
//     ahead (one vector load where the chunk is whole and aligned, else element by element: any
//     alignment, so that a packed batch's sequences, which start anywhere, take this kernel as
//     their calls alone do) and stores it into the stage's slot one stage later; keys at or past
//     the split's end and rows past the chunk's are zeros.
//   - Entries that are not finite: 0 x inf is NaN, so an infinite or NaN entry turns its key's
//     column of S_bias into NaN for every row. A stage where any lane sees such a value (one test
//     a stage in the common case) re-reads each affected score's own entry from the tile.
// - More rows (DecodeBias::kEntries: a chunk of up to 64, whose Q leaves no padding rows for the
//   bias stages, and two CTAs an SM leave no shared memory for more): each thread reads the
//   entries of its own scores into registers (BiasEntryPairs: its two rows' keys in pairs, one
//   32-bit load a pair where the row is 4-byte aligned), a stage ahead of their use, and the
//   transform adds them as the mma.sync kernels add loaded entries. A per-key bias (B, H, 1, Sk)
//   gives the chunk's queries of one head the same row, so most of those loads hit L1.
// - A bool mask along the keys, with or without such a bias, beside more than 16 rows
//   (DecodeBias::kEntriesMask): its bytes the same way (MaskEntryPairs), a masked key's score
//   -inf as in the mma.sync kernels. (A mask cannot ride the product: 0 x -inf.)
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/decode/decode_kernel.h"

namespace dmattn::cuda::decode_detail {

// The rows a stage's bias tile holds (wgmma's k16: the one-hot product's K), and its bytes.
inline constexpr int kBiasRows = 16;
inline constexpr int kBiasTileBytes = kBiasRows * 64 * 2;

// Byte offset of 16-byte chunk c (keys 8c .. 8c + 7) of bias row k in a stage's tile: the
// MN-major 128-byte-swizzled layout of a (64 keys, 16 rows) B operand, row k's 64 keys one
// 128-byte line, its chunks XOR k % 8.
__host__ __device__ constexpr int bias_chunk_byte(int k, int c) { return k * 128 + ((c ^ (k & 7)) << 4); }

// Whether `Layout` ((64 keys, 16 rows) of 16-bit elements) is the one above.
template <class Layout>
constexpr bool is_bias_tile_layout() {
  using Linear = decltype(Layout{}.layout_b());
  if (!std::is_same_v<decltype(Layout{}.layout_a()), cute::Swizzle<3, 4, 3>>) return false;
  for (int n = 0; n < 64; n += 5)
    for (int k = 0; k < kBiasRows; ++k)
      if (2 * int(Linear{}(n, k)) != k * 128 + n * 2) return false;
  return true;
}

// One thread's share of the bias tiles (128 threads: row k = tid / 8, chunk c = tid % 8), the
// chunk staged in registers between its load and its store.
template <typename Element>
struct BiasRowCopies {
  const Element* row = nullptr;  // row k's entry of the sequence's key 0; null past the chunk's rows
  int k = 0, c = 0;
  uint4 staged = make_uint4(0u, 0u, 0u, 0u);

  // Row k is packed row c0 + k of the chunk (query i, head h of kv head kvh).
  __device__ __forceinline__ BiasRowCopies(const DecodeArgs& a, const DecodeSeq& seq, int kvh, int c0, int cta_rows,
                                           int tid)
      : k(tid / 8), c(tid % 8) {
    if (k < cta_rows) {
      const int r = c0 + k, i = r / a.group, h = kvh * a.group + r % a.group;
      row = reinterpret_cast<const Element*>(a.bias.ptr) + operand_row(a.bias, seq, h, i);
    }
  }
  // Keys jt + 8c .. jt + 8c + 7 of the row (zeros at or past ke) into the registers.
  __device__ __forceinline__ void load(int jt, int ke) {
    const int j0 = jt + 8 * c;
    staged = make_uint4(0u, 0u, 0u, 0u);
    if (row == nullptr || j0 >= ke) return;
    const Element* p = row + j0;
    if (j0 + 8 <= ke && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      staged = __ldg(reinterpret_cast<const uint4*>(p));
      return;
    }
    const unsigned short* e = reinterpret_cast<const unsigned short*>(p);
    uint32_t w[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint32_t lo = j0 + 2 * u < ke ? __ldg(e + 2 * u) : 0u;
      const uint32_t hi = j0 + 2 * u + 1 < ke ? __ldg(e + 2 * u + 1) : 0u;
      w[u] = lo | (hi << 16);
    }
    staged = make_uint4(w[0], w[1], w[2], w[3]);
  }
  // The staged chunk into a stage's tile (its writes fenced for the tensor cores by the caller).
  __device__ __forceinline__ void store(char* tile) const {
    *reinterpret_cast<uint4*>(tile + bias_chunk_byte(k, c)) = staged;
  }
};

// The one-hot A operand (64 rows x 16, 16-bit) in the accumulator layout of a 64 x 16 product
// (register i: column (i / 4) 8 + 2 (lane % 4) + i % 2, row 16 warp + lane / 4 + 8 ((i / 2) % 2)):
// 1 where the row equals the column (rows below kBiasRows), else 0.
template <class Tensor>
__device__ __forceinline__ void fill_one_hot(Tensor& t, int warp, int lane) {
  static_assert(decltype(cute::size(t))::value == 8, "one k16 slice of a 64-row A operand");
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = 16 * warp + lane / 4 + 8 * ((i / 2) % 2), col = (i / 4) * 8 + 2 * (lane % 4) + i % 2;
    t(i) = static_cast<typename Tensor::value_type>(row == col ? 1.f : 0.f);
  }
}

// The stage's S_bias in the m16n8 view (b[nt][v]: row lane / 4 + 8 (v / 2) of the warp's 16,
// key 8 nt + 2 (lane % 4) + v % 2) with every non-finite value replaced by the score's own
// entry from the tile (rows past kBiasRows: 0, their results are never stored).
template <typename Element, int kNs>
__device__ __forceinline__ void fix_nonfinite_bias(float (&b)[kNs][4], const char* tile, int warp, int lane) {
  constexpr uint32_t kExp = 0x7f800000u;
  uint32_t top = 0;
#pragma unroll
  for (int nt = 0; nt < kNs; ++nt)
#pragma unroll
    for (int v = 0; v < 4; ++v) top = max(top, __float_as_uint(b[nt][v]) & kExp);
  if (!__any_sync(0xffffffffu, top == kExp)) return;
#pragma unroll
  for (int nt = 0; nt < kNs; ++nt) {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      if ((__float_as_uint(b[nt][v]) & kExp) != kExp) continue;
      const int k = 16 * warp + lane / 4 + 8 * (v / 2), n = 8 * nt + 2 * (lane % 4) + v % 2;
      b[nt][v] = k < kBiasRows ? ElemInfo<Element>::to_float(tile + bias_chunk_byte(k, n / 8) + (n % 8) * 2) : 0.f;
    }
  }
}

// Where a thread's two rows (lane / 4 and lane / 4 + 8 of the m16n8 view) start in an operand of
// T entries, and whether both start on a boundary of two entries, so that a pair of neighbouring
// keys is one load.
template <typename T>
struct EntryRows {
  const T* row[2];
  bool aligned;

  __device__ __forceinline__ EntryRows(const DecodeOperand& op, const DecodeSeq& seq, const int (&row_h)[2],
                                       const int (&row_i)[2]) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      row[hf] = reinterpret_cast<const T*>(op.ptr) + operand_row(op, seq, row_h[hf], row_i[hf]);
    aligned = ((reinterpret_cast<uintptr_t>(row[0]) | reinterpret_cast<uintptr_t>(row[1])) & (2 * sizeof(T) - 1)) == 0;
  }
};

// The thread's entries of a stage of kKeys keys (DecodeBias::kEntries), in pairs: pair[hf][nt]
// holds keys jt + 8 nt + 2 (lane % 4) + {0, 1} of its row lane / 4 + 8 hf (the m16n8 view of
// S), raw 16-bit bits, zeros at or past the split's end. Loaded a stage ahead of the transform.
template <typename Element, int kKeys>
struct BiasEntryPairs : EntryRows<uint16_t> {
  uint32_t pair[2][kKeys / 8];

  __device__ __forceinline__ BiasEntryPairs(const DecodeArgs& a, const DecodeSeq& seq, const int (&row_h)[2],
                                            const int (&row_i)[2])
      : EntryRows<uint16_t>(a.bias, seq, row_h, row_i) {}
  // Keys from jt (even: stages start on whole stages) up to ke. (Where both rows read the same
  // entries -- a per-key bias whose group of heads divides 8 gives a thread's two rows, 8 apart,
  // one head -- the second row's are the first's.)
  __device__ __forceinline__ void load(int jt, int ke, int lane) {
    const int j0 = jt + 2 * (lane % 4);
    if (aligned && jt + kKeys <= ke) {
      if (row[0] == row[1]) {
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
          pair[0][nt] = pair[1][nt] = __ldg(reinterpret_cast<const uint32_t*>(row[0] + j0 + 8 * nt));
        return;
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt)
          pair[hf][nt] = __ldg(reinterpret_cast<const uint32_t*>(row[hf] + j0 + 8 * nt));
      return;
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
        const int j = j0 + 8 * nt;
        const uint32_t lo = j < ke ? __ldg(row[hf] + j) : 0u, hi = j + 1 < ke ? __ldg(row[hf] + j + 1) : 0u;
        pair[hf][nt] = lo | (hi << 16);
      }
  }
  __device__ __forceinline__ float entry(int hf, int nt, int e) const {
    const uint16_t bits = static_cast<uint16_t>(pair[hf][nt] >> (16 * e));
    return ElemInfo<Element>::to_float(&bits);
  }
  // No bias (a mask's call): every entry 0.
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) pair[hf][nt] = 0u;
  }
};

// A bool mask's entries of the same scores (DecodeBias::kEntriesMask), a pair of bytes a pair of
// keys: word[hf][nt / 2] holds pair nt in its half nt % 2, key e of the pair in byte e of the
// half. One 16-bit load a pair where both rows start on 2-byte boundaries; zeros (masked) at or
// past the split's end.
template <int kKeys>
struct MaskEntryPairs : EntryRows<uint8_t> {
  uint32_t word[2][kKeys / 16];

  __device__ __forceinline__ MaskEntryPairs(const DecodeArgs& a, const DecodeSeq& seq, const int (&row_h)[2],
                                            const int (&row_i)[2])
      : EntryRows<uint8_t>(a.mask, seq, row_h, row_i) {}
  __device__ __forceinline__ void load(int jt, int ke, int lane) {
    const int j0 = jt + 2 * (lane % 4);
    const bool whole = aligned && jt + kKeys <= ke;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int w = 0; w < kKeys / 16; ++w) {
        uint32_t halves[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int j = j0 + 8 * (2 * w + u);
          if (whole) {
            halves[u] = __ldg(reinterpret_cast<const unsigned short*>(row[hf] + j));
          } else {
            const uint32_t lo = j < ke ? __ldg(row[hf] + j) : 0u, hi = j + 1 < ke ? __ldg(row[hf] + j + 1) : 0u;
            halves[u] = lo | (hi << 8);
          }
        }
        word[hf][w] = halves[0] | (halves[1] << 16);
      }
  }
  __device__ __forceinline__ bool allowed(int hf, int nt, int e) const {
    return ((word[hf][nt / 2] >> (16 * (nt % 2) + 8 * e)) & 0xffu) != 0u;
  }
};

// online_softmax (decode_kernel.h) with the bias entries of the stage's scores in b (the m16n8
// view above) instead of loaded entries: the same transform (transform_score: scale, softcap,
// the entry, the tests) and the same subtract-first exponent, so that a finfo.min entry stays
// finite and a -inf one gives p = 0.
template <int kKeys, bool kChecks>
__device__ __forceinline__ void online_softmax_bias(const DecodeArgs& a, float (&s)[kKeys / 8][4],
                                                    const float (&b)[kKeys / 8][4], int jt, int ke, int64_t off,
                                                    const int (&row_i)[2], float (&m)[2], float (&l)[2],
                                                    float (&alpha)[2], int lane) {
  online_softmax_with</*kOperands=*/true, kKeys, kChecks>(
      a, s, jt, ke, off, row_i, m, l, alpha, lane,
      [&](int hf, int nt, int e, bool&, float& bias) { bias = b[nt][2 * hf + e]; });
}

}  // namespace dmattn::cuda::decode_detail
