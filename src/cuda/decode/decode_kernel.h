// Split-KV decode kernels (docs/decode.md): one CTA per (query-row chunk, key split, kv head,
// batch) computes the rows of every query head of its kv head (GQA packing) against its share
// of the keys; with several splits a second kernel merges the partial rows by their lse.
//
// Decode reads each key once for a few query rows, so it is bound by memory bandwidth as long
// as the instructions per key stay few: the products run on tensor cores (mma.sync m16n8k16,
// the 16 packed rows as M), each warp streams its own tiles of 16 keys through a private
// cp.async ring (no CTA barrier in the loop) and keeps its own online softmax; the CTA's warps
// merge their partial rows at the end.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "cuda/decode/decode_args.h"
#include "cuda/common/pdl.h"
#include "cuda/common/utils.h"

namespace dmattn::cuda {

namespace decode_detail {

// One sequence of the batch as a CTA sees it: where its rows lie in memory (bm: the batch
// index of the tensors, 0 for a packed batch; q0 / k0: its first query / key row there), its
// lengths, and its key splits (0: not this launch's sequence, the CTA has nothing to do).
struct DecodeSeq {
  int bm;
  int64_t q0, k0;
  int len_q, len_k, splits;
};
// chunk_rows: the launch's row chunk (kDecodeRows or kDecodeChunkRows).
__device__ __forceinline__ DecodeSeq decode_seq(const DecodeArgs& a, int b, int chunk_rows) {
  DecodeSeq s;
  if (a.cu_seqlens_q != nullptr) {
    s.bm = 0;
    s.q0 = a.cu_seqlens_q[b];
    s.k0 = a.cu_seqlens_k[b];
    s.len_q = a.cu_seqlens_q[b + 1] - static_cast<int>(s.q0);
    s.len_k = a.cu_seqlens_k[b + 1] - static_cast<int>(s.k0);
    const int rows = s.len_q * a.group;
    const int chunks = (rows + chunk_rows - 1) / chunk_rows;
    const int m = max(1, min(kDecodeMaxSplits, s.len_k / kDecodeMinKeysPerSplit));
    s.splits = rows > a.rows_lo && rows <= a.rows_hi && chunks <= kDecodePackedMaxChunks
                   ? a.split_table[chunks - 1][m - 1]
                   : 0;
  } else {
    s.bm = b;
    s.q0 = s.k0 = 0;
    s.len_q = a.seqlen_q;
    s.len_k = a.seqused_k != nullptr ? max(0, min(a.seqused_k[b], a.seqlen_k)) : a.seqlen_k;
    s.splits = a.num_splits;
  }
  return s;
}

// Row qi (its query index within the sequence) of head h in the splits' partial rows.
__device__ __forceinline__ int64_t partial_row(const DecodeArgs& a, const DecodeSeq& seq, int split, int h, int qi) {
  const bool packed = a.cu_seqlens_q != nullptr;
  const int64_t batch = packed ? 1 : a.batch, rows = packed ? a.total_q : a.seqlen_q;
  return ((int64_t(split) * batch + seq.bm) * a.num_heads + h) * rows + seq.q0 + qi;
}

// Where row `row` of page `page` (the batch, when contiguous) starts for kv head kvh, in
// elements from the K / V base.
struct KeyRow {
  int64_t k, v;
};
__device__ __forceinline__ KeyRow key_row_at(const DecodeArgs& a, int64_t page, int64_t row, int kvh) {
  return {page * a.k_st.batch_stride + row * a.k_st.row_stride + kvh * a.k_st.head_stride,
          page * a.v_st.batch_stride + row * a.v_st.row_stride + kvh * a.v_st.head_stride};
}

// Whether keys are found one by one (a table read per key): gathered rows, or pages smaller
// than a tile of `tile_keys`.
__device__ __forceinline__ bool keys_per_row(const DecodeArgs& a, int tile_keys) {
  return a.key_rows != nullptr || (a.block_table != nullptr && a.page_size < tile_keys);
}

// Where key j of the sequence's kv head kvh starts (gathered, paged or contiguous); false for
// a gathered row outside the source, which the caller reads as zeros.
__device__ __forceinline__ bool key_row(const DecodeArgs& a, const DecodeSeq& seq, int kvh, int j, KeyRow& at) {
  const int b = seq.bm;
  int64_t page = b, row = seq.k0 + j;
  if (a.key_rows != nullptr) {
    row = a.key_rows[b * a.kr_sb + kvh * a.kr_sh + j];
    if (row < 0 || row >= a.kr_rows) return false;
  } else if (a.block_table != nullptr) {
    const int p = j / a.page_size;
    page = a.block_table[b * a.bt_stride + p];
    row = j - p * a.page_size;
  }
  at = key_row_at(a, page, row, kvh);
  return true;
}

// The keys [begin, end) that split `split` of a row chunk (rows r0 .. r0 + nrows - 1 of the
// sequence) reads: the sequence's keys the chunk's queries may see (window / causal), cut into
// its splits' parts that start on whole tiles of tile_keys keys. off: the key index aligned
// with query 0.
struct SplitKeys {
  int64_t off;
  int begin, end;
};
__device__ __forceinline__ SplitKeys split_keys(const DecodeArgs& a, const DecodeSeq& seq, int r0, int nrows,
                                                int split, int tile_keys) {
  const int len = seq.len_k;
  const int64_t off = int64_t(len) - seq.len_q;
  const int i_first = r0 / a.group, i_last = (r0 + nrows - 1) / a.group;
  int64_t lo = 0, hi = len;
  if (a.window_left >= 0) lo = max(lo, i_first + off - a.window_left);
  if (a.window_right >= 0) hi = min(hi, i_last + off + a.window_right + 1);
  // Splits start on whole tiles of keys (lo rounded down: the keys before the window's start
  // are in the cache and fail the window test), so that tiles never straddle a split.
  lo &= ~int64_t(tile_keys - 1);
  const int64_t n = hi > lo ? hi - lo : 0;
  const int64_t per_split = ((n + seq.splits - 1) / seq.splits + tile_keys - 1) & ~int64_t(tile_keys - 1);
  return {off, static_cast<int>(min(hi, lo + split * per_split)), static_cast<int>(min(hi, lo + (split + 1) * per_split))};
}

// A step's mask and bias entries of the thread's kKeys / 2 scores (rows lane / 4 + 8 hf, keys
// jt + 8 nt + 2 (lane % 4) + e at index kKeys / 4 hf + 2 nt + e), loaded one step ahead and kept
// raw (no conversion or test that would wait for the load) until the step uses them, so that
// their latency hides behind a step of work. Keys past the split's end are not read; the bias is
// read whatever the mask says (no dependent load) and ignored where the key is masked.
template <int kKeys = 16>
struct StepOperandsOf {
  static constexpr int kEntries = kKeys / 2;
  uint32_t bias[kEntries];  // raw bits: a float32, or a 16-bit element in the low half
  uint8_t mask[kEntries];   // 1 where there is no mask
};
using StepOperands = StepOperandsOf<16>;

// Where the thread's two rows start in the mask and the bias (element offsets; key j adds j sk).
struct OperandRows {
  int64_t mask[2], bias[2];
};

// (A packed batch's mask and bias are key-side: sq = 0, the sequence's keys from row k0.)
__device__ __forceinline__ int64_t operand_row(const DecodeOperand& op, const DecodeSeq& seq, int h, int i) {
  return seq.bm * op.sb + (h / op.head_div) * op.sh + (seq.q0 + i) * op.sq + seq.k0 * op.sk;
}
__device__ __forceinline__ OperandRows operand_rows(const DecodeArgs& a, const DecodeSeq& seq, const int (&row_h)[2],
                                                    const int (&row_i)[2]) {
  OperandRows r;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    r.mask[hf] = operand_row(a.mask, seq, row_h[hf], row_i[hf]);
    r.bias[hf] = operand_row(a.bias, seq, row_h[hf], row_i[hf]);
  }
  return r;
}

// Entry x of op: key key_of(x) of the thread's row row_of(x) (0 or 1, its row in `rows`); keys at
// or past ke are not read (mask 1, bias 0).
template <int kKeys, class KeyOf, class RowOf>
__device__ __forceinline__ void load_operand_entries(const DecodeArgs& a, const OperandRows& rows, int ke,
                                                     StepOperandsOf<kKeys>& op, KeyOf key_of, RowOf row_of) {
#pragma unroll
  for (int x = 0; x < StepOperandsOf<kKeys>::kEntries; ++x) {
    const int hf = row_of(x), j = key_of(x);
    const bool in = j < ke;
    op.mask[x] = 1;
    if (in && a.mask.ptr != nullptr) op.mask[x] = a.mask.ptr[rows.mask[hf] + j * a.mask.sk];
    op.bias[x] = 0;
    if (in && a.bias.ptr != nullptr) {
      const int64_t e = rows.bias[hf] + j * a.bias.sk;
      op.bias[x] = a.bias_fp32 ? reinterpret_cast<const uint32_t*>(a.bias.ptr)[e]
                               : uint32_t(reinterpret_cast<const uint16_t*>(a.bias.ptr)[e]);
    }
  }
}

// The entries of an mma.sync step of kKeys keys from jt (the layout above).
template <int kKeys>
__device__ __forceinline__ void load_step_operands(const DecodeArgs& a, const OperandRows& rows, int jt, int ke,
                                                   int lane, StepOperandsOf<kKeys>& op) {
  constexpr int kHalf = kKeys / 4;  // entries of one row
  load_operand_entries(
      a, rows, ke, op, [&](int x) { return jt + (x % kHalf / 2) * 8 + (lane % 4) * 2 + x % 2; },
      [](int x) { return x / kHalf; });
}

template <typename Element>
__device__ __forceinline__ float operand_bias(const DecodeArgs& a, uint32_t raw) {
  if (a.bias_fp32) return __uint_as_float(raw);
  const uint16_t bits = static_cast<uint16_t>(raw);
  return ElemInfo<Element>::to_float(&bits);
}

// The transform of one score (docs/semantics.md): scale, softcap, bias, then the allowed test
// (split, mask, window); a disallowed key gives -inf (replaced, never offset). In natural-log
// units: a score near -FLT_MAX (a finfo.min bias on an allowed key) stays finite, as the
// general kernels keep it (in log2 units it would overflow to -inf, and a row of such keys
// would count as empty).
// kChecks = false: a tile inside the split and inside every row's window (tile_inside), without
// softcap: the same arithmetic without the per-key tests (allowed is then the mask's alone).
template <bool kOperands, bool kChecks = true>
__device__ __forceinline__ float transform_score(const DecodeArgs& a, float s, int i, int j, int64_t off,
                                                 bool allowed, float bias) {
  s *= a.q_scale;
  bool ok = allowed;
  if constexpr (kChecks) {
    if (a.softcap > 0.f) s = a.softcap * tanhf(s);
    if (a.window_left >= 0) ok = ok && j >= i + off - a.window_left;
    if (a.window_right >= 0) ok = ok && j <= i + off + a.window_right;
  }
  if (kOperands) s += bias;
  return ok ? s : -INFINITY;
}

inline constexpr float kDecodeLog2e = 1.4426950408889634f;
inline constexpr float kDecodeLn2 = 0.6931471805599453f;

// Whether keys [jt, jt + keys) all lie before the split's end ke and inside the window (causal
// included) of every query i_first .. i_last, with no softcap: such a tile's scores take
// transform_score<..., false> (warp-uniform: the same for all the warp's rows).
__device__ __forceinline__ bool tile_inside(const DecodeArgs& a, int64_t off, int i_first, int i_last, int jt,
                                            int keys, int ke) {
  if (jt + keys > ke || a.softcap > 0.f) return false;
  if (a.window_left >= 0 && jt < i_last + off - a.window_left) return false;
  if (a.window_right >= 0 && jt + keys - 1 > i_first + off + a.window_right) return false;
  return true;
}

template <typename Element> struct DecodeMma;
template <> struct DecodeMma<cutlass::bfloat16_t> { using Op = cute::SM80_16x8x16_F32BF16BF16F32_TN; };
template <> struct DecodeMma<cutlass::half_t> { using Op = cute::SM80_16x8x16_F32F16F16F32_TN; };

// Geometry per head-dim bucket kD (64 / 128 / 256). A warp step is 16 keys: two n-tiles of the
// score product, one k-step of the value product. Up to kD = 128, four warps with three
// stages each (two steps of K / V in flight while the third is computed) and q in registers;
// at kD = 256 the accumulators are twice as large, so two warps with two stages, and q's A
// fragments are read from shared memory per k-step (in registers they spilled). K / V rings of
// 48 / 96 / 64 KB a CTA (+ 8 KB of q at 256, + 9 / 9 / 3 KB with the operand ring): two CTAs fit
// an H100 SM; an sm_86 / sm_89 block (99 KB) holds every variant but the operand ring at 128.
template <int kD>
struct DecodeTile {
  static constexpr bool kQInSmem = kD > 128;
  // Mask / bias entries loaded a step ahead (two register sets); at 256 they are loaded at the
  // start of their own step (one set: the registers are spent).
  static constexpr bool kPrefetchOperands = kD <= 128;
  static constexpr int kWarps = kD > 128 ? 2 : 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeys = 16;
  static constexpr int kStages = kD > 128 ? 2 : 3;
  static constexpr int kChunks = kD / 8;                  // 16-byte chunks of a K / V row
  static constexpr int kChunksPerLane = kKeys * kChunks / 32;
  static constexpr int kStageElems = 2 * kKeys * kD;      // K rows, then V rows
  // With DecodeOperands::kRing a stage also holds the step's 16-bit bias entries and mask bytes
  // of the 16 rows (16 x 16 each), after V.
  static constexpr int kOperandBytes = kDecodeRows * kKeys * 2 + kDecodeRows * kKeys;
  static constexpr int stage_bytes(bool ring) { return kStageElems * 2 + (ring ? kOperandBytes : 0); }
  static constexpr int kMergeBytes = kWarps * kDecodeRows * kD * 4;
  static constexpr int kQBytes = kQInSmem ? kDecodeRows * kD * 2 : 0;  // after the ring
  static constexpr int q_offset(bool ring) {
    return kWarps * kStages * stage_bytes(ring) > kMergeBytes ? kWarps * kStages * stage_bytes(ring) : kMergeBytes;
  }
  static constexpr int smem_bytes(bool ring) { return q_offset(ring) + kQBytes; }
  static_assert(kChunks >= 8, "the swizzle spreads 8 rows over 8 chunks");
};

// Element offset of chunk c of row r in a K / V tile: the chunk index XOR the row's low three
// bits, so that the 8 rows an ldmatrix reads at one logical chunk hit 8 different bank groups.
template <int kD>
__device__ __forceinline__ int tile_offset(int r, int c) {
  return r * kD + ((c ^ (r & 7)) << 3);
}

template <typename Element>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  const auto h = ElemInfo<Element>::pack(a, b);
  uint32_t w;
  memcpy(&w, &h, sizeof(w));
  return w;
}

// The thread's two accumulator rows (mma's rows lane / 4 and lane / 4 + 8) of the 16-row tile
// starting at packed row r0 (row = query i * group + head g): their query and query head. Rows
// past the tile's nrows repeat its last row (in-bounds operand reads, results never stored).
__device__ __forceinline__ void accumulator_rows(const DecodeArgs& a, int kvh, int r0, int nrows, int lane,
                                                 int (&row_i)[2], int (&row_h)[2]) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int row = r0 + min(lane / 4 + 8 * hf, nrows - 1);
    row_i[hf] = row / a.group;
    row_h[hf] = kvh * a.group + row % a.group;
  }
}

// q elements d, d + 1 of row r of the 16-row tile starting at packed row r0 (0 past its nrows
// rows and past head_dim).
template <typename Element>
__device__ __forceinline__ uint32_t q_pair(const DecodeArgs& a, const DecodeSeq& seq, int kvh, int r0, int nrows,
                                           int r, int d) {
  if (r >= nrows || d >= a.head_dim) return 0u;
  const int row = r0 + r, i = row / a.group, h = kvh * a.group + row % a.group;
  return *reinterpret_cast<const uint32_t*>(static_cast<const Element*>(a.q) + seq.bm * a.q_st.batch_stride +
                                            (seq.q0 + i) * a.q_st.row_stride + h * a.q_st.head_stride + d);
}

// q's A fragments of every k-step of the 16-row tile starting at packed row r0, into registers:
// [ks][0] = (row lane / 4, columns 16 ks + 2 (lane % 4) + {0, 1}), [1] the same for row + 8,
// [2] / [3] those 8 columns further (0 past the tile's nrows rows and past head_dim).
template <typename Element, int kSteps>
__device__ __forceinline__ void load_q_fragments(const DecodeArgs& a, const DecodeSeq& seq, int kvh, int r0,
                                                 int nrows, int lane, uint32_t (&qa)[kSteps][4]) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      qa[ks][e] = q_pair<Element>(a, seq, kvh, r0, nrows, lane / 4 + 8 * (e & 1),
                                  ks * 16 + (lane % 4) * 2 + 8 * (e >> 1));
    }
  }
}

// q's A fragment of k-step ks from a 16-row tile in shared memory (tile_offset layout): matrix
// lane / 8 holds rows 8 (lane / 8 % 2) + lane % 8 at chunk 2 ks + lane / 16.
template <int kD, typename Element>
__device__ __forceinline__ void q_smem_fragment(const Element* sq, int ks, int lane, uint32_t (&f)[4]) {
  const int r = (lane / 8 % 2) * 8 + lane % 8, c = ks * 2 + lane / 16;
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(sq + tile_offset<kD>(r, c)), f[0], f[1], f[2],
                                f[3]);
}

// A warp's running state of its 16 rows before the first key: accumulators o 0, row maxima m
// -inf, sums l 0.
template <int kNd>
__device__ __forceinline__ void start_rows(float (&o)[kNd][4], float (&m)[2], float (&l)[2]) {
#pragma unroll
  for (int dn = 0; dn < kNd; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.f;
}

// The rest of row half hf's online-softmax step once its new maximum mx (natural-log units,
// the old maximum included) is known: the factor alpha that rescales the old sum and
// accumulators, m, the probabilities exp2(exponent(s, mu)) in place of the scores (mu: mx, or 0
// for a row whose maximum is -inf so far: its masked keys give p = 0, NaN scores NaN) and the
// sum l.
template <int kNt, class Exponent>
__device__ __forceinline__ void softmax_row_step(float (&s)[kNt][4], int hf, float mx, float& m, float& l,
                                                 float& alpha, Exponent exponent) {
  const float mu = mx == -INFINITY ? 0.f : mx;
  alpha = fast_exp2((m - mu) * kDecodeLog2e);
  m = mx;
  float sum = 0.f;
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = s[nt][2 * hf + e];
      x = fast_exp2(exponent(x, mu));
      sum += x;
    }
  }
  l = l * alpha + sum;
}

// Online softmax of a tile's scores s (kKeys / 8 n-tiles), per accumulator row (hf: row
// lane / 4 + 8 hf): transform (mask / bias entries in op), new row maxima m (natural-log units),
// the factors alpha that rescale the old sums / accumulators, s replaced by the probabilities
// exp2((s - m) log2 e) (the subtraction first: exact for scores near -FLT_MAX, as the general
// kernels' safe subtraction), sums l. A row whose maximum is -inf so far subtracts 0 instead:
// its masked keys give p = 0, NaN scores NaN.
// entries(hf, nt, e, allowed, bias): the entries of score s[nt][2 hf + e] (allowed: the mask's
// answer, bias its bias), read by the caller's way (online_softmax: loaded raw a step ahead).
template <bool kOperands, int kKeys, bool kChecks, class Entries>
__device__ __forceinline__ void online_softmax_with(const DecodeArgs& a, float (&s)[kKeys / 8][4], int jt, int ke,
                                                    int64_t off, const int (&row_i)[2], float (&m)[2],
                                                    float (&l)[2], float (&alpha)[2], int lane,
                                                    const Entries& entries) {
  constexpr int kNt = kKeys / 8;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float mx = m[hf];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = jt + nt * 8 + (lane % 4) * 2 + e;
        bool allowed = true;
        float bias = 0.f;
        if constexpr (kOperands) entries(hf, nt, e, allowed, bias);
        float& x = s[nt][2 * hf + e];
        x = transform_score<kOperands, kChecks>(a, x, row_i[hf], j, off, allowed && (!kChecks || j < ke), bias);
        mx = fmaxf(mx, x);
      }
    }
    softmax_row_step(s, hf, quad_max(mx), m[hf], l[hf], alpha[hf],
                     [](float x, float mu) { return (x - mu) * kDecodeLog2e; });
  }
}
template <typename Element, bool kOperands, int kKeys, bool kChecks>
__device__ __forceinline__ void online_softmax(const DecodeArgs& a, float (&s)[kKeys / 8][4], int jt, int ke,
                                               int64_t off, const int (&row_i)[2], const StepOperandsOf<kKeys>& op,
                                               float (&m)[2], float (&l)[2], float (&alpha)[2], int lane) {
  constexpr int kNt = kKeys / 8;
  online_softmax_with<kOperands, kKeys, kChecks>(
      a, s, jt, ke, off, row_i, m, l, alpha, lane, [&](int hf, int nt, int e, bool& allowed, float& bias) {
        const int x_idx = 2 * kNt * hf + 2 * nt + e;
        allowed = op.mask[x_idx] != 0;
        bias = operand_bias<Element>(a, op.bias[x_idx]);
      });
}

// online_softmax for a tile inside the split and every row's window (tile_inside) without mask
// / bias entries, at a positive scale, in two instructions fewer a score: the maxima taken on
// the raw products (the same maxima: rounding keeps the order, so the largest scaled product is
// the largest product scaled), then one FFMA and one exp2 a score, exp2(s scale log2 e -
// m log2 e), the probabilities within rounding of online_softmax's. (online_softmax subtracts
// first, exact for scores near -FLT_MAX, which only a bias brings; here every score is a finite
// product or NaN, and a NaN still reaches its row's sum.)
template <int kKeys>
__device__ __forceinline__ void online_softmax_inside(float scale, float (&s)[kKeys / 8][4], float (&m)[2],
                                                      float (&l)[2], float (&alpha)[2]) {
  constexpr int kNt = kKeys / 8;
  const float scale_log2 = scale * kDecodeLog2e;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float raw = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) raw = fmaxf(raw, fmaxf(s[nt][2 * hf], s[nt][2 * hf + 1]));
    softmax_row_step(s, hf, fmaxf(m[hf], quad_max(raw) * scale), m[hf], l[hf], alpha[hf],
                     [scale_log2](float x, float mu) { return fmaf(x, scale_log2, -mu * kDecodeLog2e); });
  }
}

// The accumulators' rows scaled by the online softmax's factors alpha (rows lane / 4 + 8 hf).
// Once the row maxima settle, alpha is exactly 1 for the rest of the keys: the scaling is then
// skipped for the whole warp (a NaN alpha is != 1 and still reaches the accumulators).
template <int kNd>
__device__ __forceinline__ void rescale_rows(float (&o)[kNd][4], const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int dn = 0; dn < kNd; ++dn) {
      o[dn][0] *= alpha[0], o[dn][1] *= alpha[0];
      o[dn][2] *= alpha[1], o[dn][3] *= alpha[1];
    }
  }
}

// The scores of one tile of kKeys keys (16, 32 or 64) against a warp's 16 rows: s = q K^T (K
// rows at sk; q's A fragment of k-step ks from q_fragment(ks, f)), raw (before the transform).
template <typename Element, int kD, int kKeys, typename QFragment>
__device__ __forceinline__ void tile_scores(const Element* sk, const QFragment& q_fragment,
                                            float (&s)[kKeys / 8][4], int lane) {
  using Mma = typename DecodeMma<Element>::Op;
  constexpr int kNt = kKeys / 8;  // n-tiles of the score product
  // s[nt] = q (16 rows) x K^T (8 keys of n-tile nt); K rows as the B operand by ldmatrix
  // (matrix lane / 8: chunk 4 kk + lane / 8 of key 8 nt + lane % 8).
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kD / 32; ++kk) {
      uint32_t kf[4];
      const int r = nt * 8 + lane % 8, c = kk * 4 + lane / 8;
      cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(sk + tile_offset<kD>(r, c)), kf[0],
                                    kf[1], kf[2], kf[3]);
      uint32_t q0[4], q1[4];
      q_fragment(2 * kk, q0);
      q_fragment(2 * kk + 1, q1);
      Mma::fma(s[nt][0], s[nt][1], s[nt][2], s[nt][3], q0[0], q0[1], q0[2], q0[3], kf[0], kf[1], s[nt][0],
               s[nt][1], s[nt][2], s[nt][3]);
      Mma::fma(s[nt][0], s[nt][1], s[nt][2], s[nt][3], q1[0], q1[1], q1[2], q1[3], kf[2], kf[3], s[nt][0],
               s[nt][1], s[nt][2], s[nt][3]);
    }
  }
}

// The rest of a tile once its scores s are in: their transform (mask / bias entries in op), the
// online softmax update of the row maxima m, sums l and accumulators o, then o += P V (V rows at
// sv). Keys jt .. jt + kKeys - 1; those at or past ke are disallowed. inside: tile_inside's
// answer for the tile (its scores skip the per-key tests).
template <typename Element, int kD, bool kOperands, int kKeys>
__device__ __forceinline__ void tile_update(const DecodeArgs& a, float (&s)[kKeys / 8][4], const Element* sv, int jt,
                                            int ke, int64_t off, const int (&row_i)[2],
                                            const StepOperandsOf<kKeys>& op, float (&m)[2], float (&l)[2],
                                            float (&o)[kD / 8][4], int lane, bool inside) {
  using Mma = typename DecodeMma<Element>::Op;
  float alpha[2];
  if (inside) {
    online_softmax<Element, kOperands, kKeys, false>(a, s, jt, ke, off, row_i, op, m, l, alpha, lane);
  } else {
    online_softmax<Element, kOperands, kKeys, true>(a, s, jt, ke, off, row_i, op, m, l, alpha, lane);
  }
  rescale_rows(o, alpha);

  // Values: o += P (16 rows x 16 keys of k-step kt, the score accumulators repacked as the A
  // operand) x V; V rows as the B operand by transposing ldmatrix (matrix lane / 8: keys
  // 16 kt + 8 (lane / 8 % 2) + lane % 8 at chunk 2 dd + lane / 16).
#pragma unroll
  for (int kt = 0; kt < kKeys / 16; ++kt) {
    const uint32_t pa[4] = {pack2<Element>(s[2 * kt][0], s[2 * kt][1]), pack2<Element>(s[2 * kt][2], s[2 * kt][3]),
                            pack2<Element>(s[2 * kt + 1][0], s[2 * kt + 1][1]),
                            pack2<Element>(s[2 * kt + 1][2], s[2 * kt + 1][3])};
#pragma unroll
    for (int dd = 0; dd < kD / 16; ++dd) {
      uint32_t vf[4];
      const int r = kt * 16 + (lane / 8 % 2) * 8 + lane % 8, c = dd * 2 + lane / 16;
      cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(sv + tile_offset<kD>(r, c)), vf[0],
                                    vf[1], vf[2], vf[3]);
      Mma::fma(o[2 * dd][0], o[2 * dd][1], o[2 * dd][2], o[2 * dd][3], pa[0], pa[1], pa[2], pa[3], vf[0], vf[1],
               o[2 * dd][0], o[2 * dd][1], o[2 * dd][2], o[2 * dd][3]);
      Mma::fma(o[2 * dd + 1][0], o[2 * dd + 1][1], o[2 * dd + 1][2], o[2 * dd + 1][3], pa[0], pa[1], pa[2], pa[3],
               vf[2], vf[3], o[2 * dd + 1][0], o[2 * dd + 1][1], o[2 * dd + 1][2], o[2 * dd + 1][3]);
    }
  }
}

// One tile of kKeys keys against a warp's 16 rows: tile_scores, then tile_update. Wider tiles
// give the tensor cores more independent products and rescale the accumulators less often.
template <typename Element, int kD, bool kOperands, int kKeys = 16, typename QFragment>
__device__ __forceinline__ void attend_tile(const DecodeArgs& a, const Element* sk, const Element* sv, int jt, int ke,
                                            int64_t off, const int (&row_i)[2], const StepOperandsOf<kKeys>& op,
                                            const QFragment& q_fragment, float (&m)[2], float (&l)[2],
                                            float (&o)[kD / 8][4], int lane, bool inside) {
  float s[kKeys / 8][4];
  tile_scores<Element, kD, kKeys>(sk, q_fragment, s, lane);
  tile_update<Element, kD, kOperands, kKeys>(a, s, sv, jt, ke, off, row_i, op, m, l, o, lane, inside);
}

}  // namespace decode_detail

// Grid (row_chunks * num_splits, heads_kv, batch), DecodeTile<kD>::kThreads threads, its
// smem_bytes(kOps == kRing) of dynamic shared memory. kD: head dims up to it (chunks past
// head_dim are zero); kOps: how mask / bias entries are read (decode_args.h).
template <typename Element, int kD, DecodeOperands kOps>
__global__ void __launch_bounds__(decode_detail::DecodeTile<kD>::kThreads, 2) decode_kernel(const DecodeArgs a) {
  using namespace decode_detail;
  using Tile = DecodeTile<kD>;
  constexpr bool kOperands = kOps != DecodeOperands::kNone, kRing = kOps == DecodeOperands::kRing;
  constexpr int kStageBytes = Tile::stage_bytes(kRing);
  using Mma = typename DecodeMma<Element>::Op;
  constexpr int kWarps = Tile::kWarps, kKeys = Tile::kKeys, kStages = Tile::kStages, kChunks = Tile::kChunks;
  constexpr int kNd = kD / 8;  // n-tiles of the value product (8 head-dim columns each)

  launch_dependents();  // (the splits' merge may be placed now: it waits for this grid's end)
  const int chunk = blockIdx.x % a.row_chunks, split = blockIdx.x / a.row_chunks;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const DecodeSeq seq = decode_seq(a, b, kDecodeRows);
  const int r0 = chunk * kDecodeRows;
  const int nrows = min(kDecodeRows, seq.len_q * a.group - r0);
  if (seq.splits == 0 || nrows <= 0) return;  // (a packed batch: another launch's sequence, or a shorter one)

  const SplitKeys keys = split_keys(a, seq, r0, nrows, split, kKeys);
  const int64_t off = keys.off;
  const int kb = keys.begin, ke = keys.end;

  int row_i[2], row_h[2];
  accumulator_rows(a, kvh, r0, nrows, lane, row_i, row_h);
  const int i_first = r0 / a.group, i_last = (r0 + nrows - 1) / a.group;  // the chunk's queries

  // q as the A operand of every k-step (rows past the chunk's end and columns past head_dim 0):
  // up to kD = 128 read once from global memory into registers (load_q_fragments); at 256 staged
  // in shared memory and read per k-step.
  extern __shared__ __align__(16) char decode_smem[];
  Element* sq = reinterpret_cast<Element*>(decode_smem + Tile::q_offset(kRing));
  constexpr int kQRegSteps = Tile::kQInSmem ? 1 : kD / 16;
  uint32_t qa[kQRegSteps][4];
  if constexpr (Tile::kQInSmem) {
    for (int idx = threadIdx.x; idx < kDecodeRows * kD / 2; idx += Tile::kThreads) {
      const int r = idx / (kD / 2), d = idx % (kD / 2) * 2;
      *reinterpret_cast<uint32_t*>(sq + tile_offset<kD>(r, d / 8) + d % 8) =
          q_pair<Element>(a, seq, kvh, r0, nrows, r, d);
    }
    __syncthreads();
  } else {
    load_q_fragments<Element>(a, seq, kvh, r0, nrows, lane, qa);
  }
  // The A fragment of k-step ks.
  const auto q_fragment = [&](int ks, uint32_t (&f)[4]) {
    if constexpr (Tile::kQInSmem) {
      q_smem_fragment<kD>(sq, ks, lane, f);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) f[e] = qa[ks][e];
    }
  };

  float o[kNd][4], m[2], l[2];
  start_rows(o, m, l);

  // Warp w takes tiles w, w + kWarps, ... of the split's keys (the warps stream neighbouring
  // tiles side by side). Keys past the split's end are zero-filled, never read: their rows may
  // lie behind the batch's length.
  char* ring = decode_smem + warp * kStages * kStageBytes;
  const auto stage_k = [&](int it) { return reinterpret_cast<Element*>(ring + (it % kStages) * kStageBytes); };
  // kRing: the source rows of the lane's operand chunks (bias: row lane / 2, keys 8 (lane % 2)
  // onwards; mask: row lane, lanes < 16), rows past the chunk's end repeating its last.
  int64_t ring_bias_row = 0, ring_mask_row = 0;
  if constexpr (kRing) {
    const auto source_row = [&](const DecodeOperand& op, int r) -> int64_t {
      if (op.ptr == nullptr) return 0;
      const int row = r0 + min(r, nrows - 1), i = row / a.group, h = kvh * a.group + row % a.group;
      return operand_row(op, seq, h, i);
    };
    ring_bias_row = source_row(a.bias, lane / 2);
    ring_mask_row = source_row(a.mask, lane % 16);
  }
  const int tiles = ke > kb ? (ke - kb + kKeys - 1) / kKeys : 0;
  const int nit = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;
  const Element* kbase = static_cast<const Element*>(a.k);
  const Element* vbase = static_cast<const Element*>(a.v);
  const auto issue = [&](int it) {
    if (it < nit) {
      const int jt = kb + (it * kWarps + warp) * kKeys;
      // Paged: the tile's keys lie on the page of jt and, past its end, on the next one (a page
      // holds at least a tile), so one or two table reads a step; smaller pages read per key.
      int64_t page0 = seq.bm, page1 = seq.bm;
      int64_t row0 = seq.k0 + jt;
      const bool paged = a.block_table != nullptr, per_row = keys_per_row(a, kKeys);
      if (paged && !per_row) {
        const int p = jt / a.page_size;
        row0 = jt - p * a.page_size;
        page0 = a.block_table[b * a.bt_stride + p];
        const int last = min(ke, jt + kKeys) - 1;
        page1 = last - jt + row0 >= a.page_size ? a.block_table[b * a.bt_stride + p + 1] : page0;
      }
      Element* sk = stage_k(it);
      Element* sv = sk + kKeys * kD;
#pragma unroll 4
      for (int u = 0; u < Tile::kChunksPerLane; ++u) {
        const int idx = u * 32 + lane, r = idx / kChunks, c = idx % kChunks;
        const int j = jt + r;
        bool ok = j < ke && c * 8 < a.head_dim;
        int64_t kofs = 0, vofs = 0;
        if (ok) {
          int64_t page = page0;
          int64_t row = row0 + r;
          if (per_row) {
            KeyRow at{0, 0};
            ok = key_row(a, seq, kvh, j, at);
            kofs = at.k, vofs = at.v;
          } else {
            if (paged && row >= a.page_size) page = page1, row -= a.page_size;
            const KeyRow at = key_row_at(a, page, row, kvh);
            kofs = at.k, vofs = at.v;
          }
        }
        const int so = tile_offset<kD>(r, c);
        cp_async_16(sk + so, kbase + kofs + c * 8, ok ? 16 : 0);
        cp_async_16(sv + so, vbase + vofs + c * 8, ok ? 16 : 0);
      }
      if constexpr (kRing) {  // 16-byte chunks; keys past the split's end zero-filled, not read
        char* sop = reinterpret_cast<char*>(sv + kKeys * kD);
        if (a.bias.ptr != nullptr) {
          const int key0 = jt + (lane % 2) * 8, n_in = max(0, min(8, ke - key0));
          cp_async_16(sop + (lane / 2) * kKeys * 2 + (lane % 2) * 16,
                      reinterpret_cast<const uint16_t*>(a.bias.ptr) + ring_bias_row + key0, n_in * 2);
        }
        if (a.mask.ptr != nullptr && lane < kDecodeRows) {
          cp_async_16(sop + kDecodeRows * kKeys * 2 + lane * kKeys, a.mask.ptr + ring_mask_row + jt,
                      max(0, min(kKeys, ke - jt)));
        }
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) issue(st);

  const auto tile_start = [&](int it) { return kb + (it * kWarps + warp) * kKeys; };
  const OperandRows op_rows = operand_rows(a, seq, row_h, row_i);
  // One step: tile it, with its operands in cur; loads step it + 1's into next.
  const auto step = [&](int it, StepOperands& cur, StepOperands& next) {
    if constexpr (kOps == DecodeOperands::kRegisters && Tile::kPrefetchOperands) {
      if (it + 1 < nit) load_step_operands(a, op_rows, tile_start(it + 1), ke, lane, next);
    } else if constexpr (kOps == DecodeOperands::kRegisters) {
      load_step_operands(a, op_rows, tile_start(it), ke, lane, cur);
    }
    cp_async_wait<kStages - 2>();  // this step's group (the thread's own copies) has landed
    __syncwarp();                  // ... and the other lanes' too; the slot refilled next is free
    issue(it + kStages - 1);
    const Element* sk = stage_k(it);
    const Element* sv = sk + kKeys * kD;
    const int jt = tile_start(it);
    if constexpr (kRing) {  // the step's operand entries from the ring (16-bit bias, bool mask)
      const char* sop = reinterpret_cast<const char*>(sv + kKeys * kD);
#pragma unroll
      for (int pr = 0; pr < 4; ++pr) {
        const int r = lane / 4 + 8 * (pr / 2), key = (pr % 2) * 8 + (lane % 4) * 2, x = 2 * pr;
        const uint32_t w = *reinterpret_cast<const uint32_t*>(sop + (r * kKeys + key) * 2);
        const uint16_t mw = *reinterpret_cast<const uint16_t*>(sop + kDecodeRows * kKeys * 2 + r * kKeys + key);
        cur.bias[x] = a.bias.ptr != nullptr ? (w & 0xffffu) : 0u;
        cur.bias[x + 1] = a.bias.ptr != nullptr ? (w >> 16) : 0u;
        cur.mask[x] = a.mask.ptr != nullptr ? static_cast<uint8_t>(mw) : uint8_t(1);
        cur.mask[x + 1] = a.mask.ptr != nullptr ? static_cast<uint8_t>(mw >> 8) : uint8_t(1);
      }
    }
    attend_tile<Element, kD, kOperands>(a, sk, sv, jt, ke, off, row_i, cur, q_fragment, m, l, o, lane,
                                        tile_inside(a, off, i_first, i_last, jt, kKeys, ke));
  };
  // With the operands a step ahead, two steps an iteration, the operand registers swapping roles
  // (a copy would wait for the loads in flight).
  StepOperands op_a, op_b;
  if constexpr (kOps == DecodeOperands::kRegisters && Tile::kPrefetchOperands) {
    if (nit > 0) load_step_operands(a, op_rows, tile_start(0), ke, lane, op_a);
    for (int it = 0; it < nit; it += 2) {
      step(it, op_a, op_b);
      if (it + 1 < nit) step(it + 1, op_b, op_a);
    }
  } else {
    for (int it = 0; it < nit; ++it) step(it, op_a, op_b);
  }

  // Merge the warps' partial rows through shared memory (the ring's, once every copy landed).
  cp_async_wait<0>();
  __syncthreads();
  __shared__ float sm_m[kWarps][kDecodeRows], sm_l[kWarps][kDecodeRows], sm_w[kWarps][kDecodeRows];
  __shared__ float sm_row_l[kDecodeRows], sm_row_m[kDecodeRows];
  auto& sm_o = *reinterpret_cast<float(*)[kWarps][kDecodeRows][kD]>(decode_smem);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = lane / 4 + 8 * hf;
    const float row_l = quad_sum(l[hf]);
    if (lane % 4 == 0) sm_m[warp][r] = m[hf], sm_l[warp][r] = row_l;
#pragma unroll
    for (int dn = 0; dn < kNd; ++dn) {
      *reinterpret_cast<float2*>(&sm_o[warp][r][dn * 8 + (lane % 4) * 2]) = make_float2(o[dn][2 * hf], o[dn][2 * hf + 1]);
    }
  }
  __syncthreads();
  if (threadIdx.x < kDecodeRows) {
    const int r = threadIdx.x;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][r]);
    const float mu = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = fast_exp2((sm_m[w][r] - mu) * kDecodeLog2e);
      sm_w[w][r] = wt;
      sum += sm_l[w][r] * wt;
    }
    sm_row_m[r] = mu;
    sm_row_l[r] = sum;
  }
  __syncthreads();

  const bool direct = a.num_splits == 1;
  for (int idx = threadIdx.x; idx < kDecodeRows * kD; idx += Tile::kThreads) {
    const int r = idx / kD, d = idx % kD;
    if (r >= nrows || d >= a.head_dim) continue;
    const float sum = sm_row_l[r];
    float out = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) out = fmaf(sm_o[w][r][d], sm_w[w][r], out);
    // An empty row (no allowed key in this split) is 0 with lse -inf; a NaN sum stays NaN.
    const bool empty = sum == 0.f;
    out = empty ? 0.f : out / sum;
    const int row = r0 + r, qi = row / a.group, h = kvh * a.group + row % a.group;
    const float lse = empty ? -INFINITY : sm_row_m[r] + __log2f(sum) * kDecodeLn2;
    if (direct) {
      Element* dst = static_cast<Element*>(a.out) + seq.bm * a.o_st.batch_stride +
                     (seq.q0 + qi) * a.o_st.row_stride + h * a.o_st.head_stride;
      dst[d] = Element(saturate_keep_nan<Element>(out));
      if (d == 0) a.lse[seq.bm * a.lse_bs + h * a.lse_hs + seq.q0 + qi] = lse;
    } else {
      const int64_t prow = partial_row(a, seq, split, h, qi);
      a.part_out[prow * a.head_dim + d] = out;
      if (d == 0) a.part_lse[prow] = lse;
    }
  }
}

}  // namespace dmattn::cuda
