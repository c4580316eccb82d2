// The narrow decode kernel on Hopper (docs/decode.md, "The narrow kernel"): up to kNarrowRows
// packed query rows (one query of a GQA group of up to 8 heads, two queries of 4, ...) against
// two key splits' keys (below), with or without mask / bias entries, head dims up to 128. decode_sm90.h's kernel puts the
// packed rows on wgmma's M, 64 rows of which a decoding step fills 4: every warp then runs the
// online softmax over a 64 x 64 score tile a stage (32 scores a thread) for 4 live rows, and its
// chain of work a stage -- not the memory -- sets the rate of a CTA. Here the products run
// transposed, the keys as M and the rows as N = 8:
//   S^T = K Q^T      (64 keys x 8 rows; K, Q from shared memory)
//   O^T += V^T P^T   (D x 8; V read transposed from the stage, P^T through shared memory)
// so that a thread holds 4 scores a stage and 8 (D = 128) of O^T. The keys of a row lie across
// the warpgroup: each stage's row maxima are reduced over the lanes that share the row, then over
// the four warps through shared memory; every thread then takes the same maximum, so P^T of the
// whole stage has one scale a row and O^T, complete in every thread, needs no merge. Each thread
// keeps partial sums over its own keys, reduced once at the end. Three CTA barriers a stage: the
// ring's, the maxima's and P^T's. The copies (one CTA-wide cp.async ring of three 64-key stages),
// the splits, the transform and the stores are those of the other decode kernels. Mask / bias
// entries (any layout, as the mma.sync kernels read them) are a thread's 4 entries a stage,
// loaded into registers a stage ahead and kept raw until their stage. One CTA streams K / V at
// the memory's pace (two to an SM hide no more), so each reads the keys of two of the split
// heuristic's splits where the GPU stays full (run_decode: with_narrow_splits).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "cuda/decode/decode_rows_kernel.h"
#include "cuda/sm90/decode_sm90.h"
#include "cuda/sm90/gmma.h"

namespace dmattn::cuda {

namespace decode_detail {

inline constexpr int kNarrowRows = kDecodeNarrowRows;  // (decode_args.h)
inline constexpr int kNarrowStageKeys = 64;

// One warpgroup; three stages of 64 keys of K and V (32 KB a stage at kD = 128), then Q (8 rows),
// P^T (8 rows x 64 keys) and the maxima's exchange (4 warps x 8 rows): 100 KB at 128, two CTAs an
// SM (50 KB at 64).
template <typename Element, int kD>
struct DecodeNarrowTile {
  static_assert(kD == 64 || kD == 128, "decode_narrow: head dims 64 and 128");
  static constexpr int kThreads = 128;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kStageKeys = kNarrowStageKeys;
  static constexpr int kStages = 3;
  static constexpr int kTileElems = kStageKeys * kD;  // K or V of a stage
  static constexpr int kStageBytes = 2 * kTileElems * 2;
  static constexpr int kQOffset = kStages * kStageBytes;
  static constexpr int kPOffset = kQOffset + (kNarrowRows * kD * 2 + 1023) / 1024 * 1024;
  static constexpr int kRedOffset = kPOffset + kNarrowRows * kStageKeys * 2;
  static constexpr int kSmemBytes = kRedOffset + kWarps * kNarrowRows * 4;
  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using LayoutK = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kStageKeys>, cute::Int<kD>>{}));
  using LayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kNarrowRows>, cute::Int<kD>>{}));
  // V (keys, D) seen as (D, keys): the MN-major A operand of O^T += V^T P^T.
  using LayoutVt = decltype(cute::composition(
      LayoutK{}, cute::make_layout(cute::Shape<cute::Int<kD>, cute::Int<kStageKeys>>{},
                                   cute::Stride<cute::Int<kStageKeys>, cute::_1>{})));
  // P^T as (rows, keys), K-major: one 128-byte-swizzled atom.
  using LayoutPt =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kNarrowRows>, cute::Int<kStageKeys>>{}));
  using MmaS = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<Element, Element, float,
                                       cute::Shape<cute::_64, cute::Int<kNarrowRows>, cute::Int<kD>>>()));
  using MmaO = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<Element, Element, float,
                                       cute::Shape<cute::_64, cute::Int<kNarrowRows>, cute::Int<kStageKeys>>,
                                       cute::GMMA::Major::MN, cute::GMMA::Major::K>()));
  static_assert(is_sw128_layout<LayoutK, kStageKeys, kD>(), "the copies' addresses follow the tiles' layout");
};

// Q's packed rows c0 .. c0 + cta_rows - 1 into the (8, kD) tile at sq, one 16-byte chunk a
// thread (row r: query (c0 + r) / group, head kvh * group + (c0 + r) % group); zeros past the
// CTA's rows, the sequence's queries and head_dim.
template <typename Element, int kD>
__device__ __forceinline__ void load_narrow_q(const DecodeArgs& a, const DecodeSeq& seq, int kvh, int c0,
                                              int cta_rows, Element* sq) {
  constexpr int kChunks = kD / 8;
  const int t = threadIdx.x;
  if (t >= kNarrowRows * kChunks) return;
  const int r = t / kChunks, c = t % kChunks;
  const int row = c0 + r, p = row / a.group, g = row - p * a.group;
  const bool ok = r < cta_rows && p < seq.len_q && c * 8 < a.head_dim;
  const Element* q = static_cast<const Element*>(a.q);
  const Element* src = ok ? q + seq.bm * a.q_st.batch_stride + (seq.q0 + p) * a.q_st.row_stride +
                                int64_t(kvh * a.group + g) * a.q_st.head_stride + c * 8
                          : q;
  cp_async_16(sq + sw128_chunk_offset<kNarrowRows>(r, c), src, ok ? 16 : 0);
}

// Element offset of P^T's (row r, key k) in LayoutPt: the 128-byte swizzle, the key's 16-byte
// chunk XOR the row (sw128_chunk_offset's).
__device__ __forceinline__ int narrow_p_offset(int r, int k) { return r * 64 + ((((k >> 3) ^ r) & 7) << 3) + (k & 7); }

// The maximum of v over the 8 lanes that share a row of the transposed score tile (lane % 4).
__device__ __forceinline__ float narrow_row_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 4));
  v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, 8));
  return fmaxf(v, __shfl_xor_sync(0xffffffff, v, 16));
}
__device__ __forceinline__ float narrow_row_sum(float v) {
  v += __shfl_xor_sync(0xffffffff, v, 4);
  v += __shfl_xor_sync(0xffffffff, v, 8);
  return v + __shfl_xor_sync(0xffffffff, v, 16);
}

// The mask / bias entries of the thread's 4 scores of the stage at key jt (S^T's values: keys
// key[i], the thread's rows i % 2), raw (StepOperandsOf's).
using NarrowOperands = StepOperandsOf<8>;
__device__ __forceinline__ void load_narrow_operands(const DecodeArgs& a, const OperandRows& rows, int jt, int ke,
                                                     const int (&key)[4], NarrowOperands& op) {
  load_operand_entries(a, rows, ke, op, [&](int x) { return jt + key[x]; }, [](int x) { return x % 2; });
}

}  // namespace decode_detail

// Grid (num_splits, heads_kv, batch) (row_chunks 1), DecodeNarrowTile's kThreads threads and
// kSmemBytes of dynamic shared memory; at most kNarrowRows packed rows a sequence, keys found a
// stage at a time (keys_by_stage) or, with kIndexed, indexed (key_rows, no pages); kOperands:
// with mask / bias entries. (kIndexed is a variant of its own: the index's loads and the copies
// behind a run-time test cost the other calls' loop its schedule.)
template <typename Element, int kD, bool kOperands, bool kIndexed = false>
__global__ void __launch_bounds__(128, 2) decode_narrow_sm90_kernel(const DecodeArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using namespace decode_detail;
  using Tile = DecodeNarrowTile<Element, kD>;
  constexpr int kStageKeys = Tile::kStageKeys, kStages = Tile::kStages;
  launch_dependents();  // (the splits' merge may be placed now: it waits for this grid's end)
  const RowsChunk rc = rows_chunk(a, kNarrowRows);
  if (rc.idle()) return;
  const DecodeSeq& seq = rc.seq;
  const int kvh = rc.kvh, warp = rc.warp, lane = rc.lane;
  const int split = rc.split;
  const SplitKeys keys = split_keys(a, seq, rc.c0, rc.cta_rows, split, kStageKeys);
  const int kb = keys.begin, ke = keys.end;
  const int i_first = rc.c0 / a.group, i_last = (rc.c0 + rc.cta_rows - 1) / a.group;

  extern __shared__ __align__(1024) char decode_narrow_smem[];
  Element* sq = reinterpret_cast<Element*>(decode_narrow_smem + Tile::kQOffset);
  Element* sp = reinterpret_cast<Element*>(decode_narrow_smem + Tile::kPOffset);
  float* red = reinterpret_cast<float*>(decode_narrow_smem + Tile::kRedOffset);  // [warp][row]

  load_narrow_q<Element, kD>(a, seq, kvh, rc.c0, rc.cta_rows, sq);
  cp_async_commit();
  // (the ring's copies as decode_sm90.h's: held in a shared helper, its members cost that
  // kernel 14 registers)
  const int stages = ke > kb ? (ke - kb + kStageKeys - 1) / kStageKeys : 0;
  const StageCopies<Element, kD, kStageKeys, Tile::kThreads> copies(
      a, [](int r, int c) { return sw128_chunk_offset<kStageKeys>(r, c); }, 64);
  // A stage's pages (a paged cache) or its keys' source rows (indexed keys), read a stage before
  // its copies are issued (the table's or the index's load is then not on the copies' path).
  using Rows = typename decltype(copies)::Rows;
  const bool paged = !kIndexed && pages_by_stage<kStageKeys>(a);
  const auto pages_of = [&](int it) {
    return paged ? stage_pages<kStageKeys>(a, seq, kb + it * kStageKeys, ke) : StagePages{0, 0, 0};
  };
  const auto rows_of = [&](int it) {
    Rows r{};
    if constexpr (kIndexed) r = copies.rows_of(a, seq, kvh, kb + it * kStageKeys, ke);
    return r;
  };
  const auto stage_k = [&](int it) {
    return reinterpret_cast<Element*>(decode_narrow_smem + (it % kStages) * Tile::kStageBytes);
  };
  const auto issue = [&](int it, const StagePages& pages, const Rows& rows) {
    if (it < stages) {
      if constexpr (kIndexed) copies.issue_rows(a, seq, kvh, rows, stage_k(it));
      else copies.issue(a, seq, kvh, kb + it * kStageKeys, ke, stage_k(it), &pages);
    }
    cp_async_commit();
  };
  issue(0, pages_of(0), rows_of(0));
  issue(1, pages_of(1), rows_of(1));
  StagePages pages_ahead = pages_of(2);
  Rows rows_ahead = rows_of(2);

  typename Tile::MmaS mma_s;
  typename Tile::MmaO mma_o;
  auto wg_s = mma_s.get_thread_slice(0);
  auto wg_o = mma_o.get_thread_slice(0);
  Tensor acc_s = partition_fragment_C(mma_s, Shape<_64, Int<kNarrowRows>>{});
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kD>, Int<kNarrowRows>>{});
  // The accumulators' coordinates: S^T's (key, row) and O^T's (d, row). Value i of either lies
  // in row 2 (lane % 4) + i % 2 (the n8 tile's column pairs): the thread's two rows, e = i % 2.
  const Tensor tScS = mma_s.get_thread_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<_64, Int<kNarrowRows>>{}));
  const Tensor tOcO = mma_o.get_thread_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kD>, Int<kNarrowRows>>{}));
  static_assert(decltype(size(acc_s))::value == 4, "S^T: two keys by two rows a thread");
  const int row0 = 2 * (lane % 4);  // the thread's rows row0, row0 + 1
  int qi[2], qh[2];  // their queries and heads (a row past the CTA's: its last row's)
  CUTE_UNROLL
  for (int e = 0; e < 2; ++e) {
    const int row = min(rc.c0 + min(row0 + e, rc.cta_rows - 1), seq.len_q * a.group - 1);
    qi[e] = row / a.group, qh[e] = kvh * a.group + row % a.group;
  }
  int key[4];  // the stage's keys of S^T's values
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) key[i] = get<0>(tScS(i));

  Tensor sQ = make_tensor(make_smem_ptr(sq), typename Tile::LayoutQ{});
  Tensor sPt = make_tensor(make_smem_ptr(sp), typename Tile::LayoutPt{});
  Tensor tSsQ = wg_s.partition_fragment_B(sQ);
  Tensor tOsPt = wg_o.partition_fragment_B(sPt);
  clear(acc_o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // natural-log maxima; this thread's sums
  const OperandRows op_rows = kOperands ? operand_rows(a, seq, qh, qi) : OperandRows{};

  // Stage t, its entries in cur; loads stage t + 1's into next.
  const auto stage = [&](int t, const NarrowOperands& cur, NarrowOperands& next) {
    const int jt = kb + t * kStageKeys;
    if constexpr (kOperands) {
      if (t + 1 < stages) load_narrow_operands(a, op_rows, jt + kStageKeys, ke, key, next);
    }
    cp_async_wait<1>();            // stage t's copies (and Q's) have landed; stage t + 1's may be in flight
    sm90::gemm_wait<0>(acc_o);     // stage t - 1's P V product: its V and P^T are free after the barrier
    sm90::fence_smem_for_wgmma();  // (this thread's copies, for the tensor cores' reads)
    __syncthreads();
    issue(t + 2, pages_ahead, rows_ahead);
    pages_ahead = pages_of(t + 3);
    rows_ahead = rows_of(t + 3);
    Element* tile = stage_k(t);
    Tensor sK = make_tensor(make_smem_ptr(tile), typename Tile::LayoutK{});
    Tensor tSsK = wg_s.partition_fragment_A(sK);
    sm90::gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_s, tSsK, tSsQ, acc_s);
    sm90::gemm_wait<0>(acc_s);

    // The transform (decode_kernel.h's): inside the split and every row's window without a
    // softcap, no per-key tests -- without entries the raw products (their maxima scaled: the
    // same maxima) and one FMA a score; else each score transformed and tested.
    const bool inside = tile_inside(a, keys.off, i_first, i_last, jt, kStageKeys, ke);
    const bool raw = !kOperands && a.q_scale > 0.f && inside;
    float s[4];
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      s[i] = acc_s(i);
      const int j = jt + key[i];
      if constexpr (kOperands) {
        const float bias = operand_bias<Element>(a, cur.bias[i]);
        const bool allowed = cur.mask[i] != 0;
        s[i] = inside ? transform_score<true, false>(a, s[i], qi[i % 2], j, keys.off, allowed, bias)
                      : transform_score<true, true>(a, s[i], qi[i % 2], j, keys.off, allowed && j < ke, bias);
      } else if (!raw) {
        s[i] = transform_score<false, true>(a, s[i], qi[i % 2], j, keys.off, j < ke, 0.f);
      }
    }
    float mx[2];
    CUTE_UNROLL
    for (int e = 0; e < 2; ++e) mx[e] = narrow_row_max(fmaxf(s[e], s[e + 2]));
    if (lane < 4) *reinterpret_cast<float2*>(red + warp * kNarrowRows + row0) = make_float2(mx[0], mx[1]);
    __syncthreads();
    float mu[2], alpha[2];
    CUTE_UNROLL
    for (int e = 0; e < 2; ++e) {
      float stage_max = red[row0 + e];
      CUTE_UNROLL
      for (int w = 1; w < Tile::kWarps; ++w) stage_max = fmaxf(stage_max, red[w * kNarrowRows + row0 + e]);
      if (raw) stage_max *= a.q_scale;
      const float mx_new = fmaxf(m[e], stage_max);
      mu[e] = mx_new == -INFINITY ? 0.f : mx_new;  // (a row without an allowed key so far: p = 0)
      alpha[e] = fast_exp2((m[e] - mu[e]) * kDecodeLog2e);
      m[e] = mx_new;
    }
    const float scale_log2 = a.q_scale * kDecodeLog2e;
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int e = i % 2;
      // (the subtraction first where the scores are transformed: exact near -FLT_MAX)
      const float p = fast_exp2(raw ? fmaf(s[i], scale_log2, -mu[e] * kDecodeLog2e) : (s[i] - mu[e]) * kDecodeLog2e);
      s[i] = p;
      sp[narrow_p_offset(row0 + e, key[i])] = Element(p);  // (by offset: through sPt, 64-bit generic stores)
    }
    CUTE_UNROLL
    for (int e = 0; e < 2; ++e) l[e] = l[e] * alpha[e] + s[e] + s[e + 2];
    sm90::fence_smem_for_wgmma();
    __syncthreads();
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= alpha[i % 2];
    Tensor sVt = make_tensor(make_smem_ptr(tile + Tile::kTileElems), typename Tile::LayoutVt{});
    Tensor tOsVt = wg_o.partition_fragment_A(sVt);
    sm90::gemm_issue</*kZeroInit=*/false, /*kRegA=*/false>(mma_o, tOsVt, tOsPt, acc_o);
  };
  // With entries, two stages an iteration, the entries' registers swapping roles (a copy would
  // wait for the loads in flight).
  NarrowOperands op_a{}, op_b{};
  if constexpr (kOperands) {
    if (stages > 0) load_narrow_operands(a, op_rows, kb, ke, key, op_a);
    for (int t = 0; t < stages; t += 2) {
      stage(t, op_a, op_b);
      if (t + 1 < stages) stage(t + 1, op_b, op_a);
    }
  } else {
    for (int t = 0; t < stages; ++t) stage(t, op_a, op_b);
  }
  sm90::gemm_wait<0>(acc_o);
  cp_async_wait<0>();

  // The rows' sums over every thread's keys (the last stage's readers of `red` are past its
  // barrier), then the rows normalized and stored as store_rows does: into the output with one
  // split, else the split's partial rows; an empty row is 0 with lse -inf, a NaN sum stays NaN.
  float sum[2];
  CUTE_UNROLL
  for (int e = 0; e < 2; ++e) l[e] = narrow_row_sum(l[e]);
  if (lane < 4) *reinterpret_cast<float2*>(red + warp * kNarrowRows + row0) = make_float2(l[0], l[1]);
  __syncthreads();
  CUTE_UNROLL
  for (int e = 0; e < 2; ++e) {
    sum[e] = 0.f;
    CUTE_UNROLL
    for (int w = 0; w < Tile::kWarps; ++w) sum[e] += red[w * kNarrowRows + row0 + e];
  }
  const bool direct = a.num_splits == 1;
  CUTE_UNROLL
  for (int e = 0; e < 2; ++e) {
    const int r = row0 + e;
    if (r >= rc.cta_rows) continue;
    const int row = rc.c0 + r, q = row / a.group, h = kvh * a.group + row % a.group;
    const bool empty = sum[e] == 0.f;
    const int64_t prow = partial_row(a, seq, split, h, q);
    Element* dst = static_cast<Element*>(a.out) + seq.bm * a.o_st.batch_stride + (seq.q0 + q) * a.o_st.row_stride +
                   h * a.o_st.head_stride;
    CUTE_UNROLL
    for (int i = e; i < size(acc_o); i += 2) {
      const int d = get<0>(tOcO(i));
      if (d >= a.head_dim) continue;
      const float out = empty ? 0.f : acc_o(i) / sum[e];
      if (direct) dst[d] = Element(saturate_keep_nan<Element>(out));
      else a.part_out[prow * a.head_dim + d] = out;
    }
    if (warp == 0 && lane < 4) {
      const float lse = empty ? -INFINITY : (m[e] == -INFINITY ? 0.f : m[e]) + __log2f(sum[e]) * kDecodeLn2;
      if (direct) a.lse[seq.bm * a.lse_bs + h * a.lse_hs + seq.q0 + q] = lse;
      else a.part_lse[prow] = lse;
    }
  }
#endif
}

}  // namespace dmattn::cuda
