// The split-KV decode kernel on Hopper's warpgroup MMA (docs/decode.md, "On Hopper"), for every
// call without mask / bias entries up to head dim 128: decode_rows_kernel.h's work (one CTA per
// (64-row chunk, key split, kv head, batch), every key of the split read once for the chunk's
// rows through one CTA-wide cp.async ring) with the products on wgmma. The 64 packed rows are
// wgmma's M, so one warpgroup holds them (a chunk with fewer rows, a single query's 4 heads say,
// pads them with zero queries): S = Q K^T with Q and K from shared memory, O += P V with P from
// registers and V from shared memory (read transposed), both in the 128-byte-swizzled layout the
// copies write. The tensor cores read K and V in place: no ldmatrix and no per-warp operand
// traffic (the mma.sync kernels' warps each read every K / V row into registers), which leaves a
// warp's instructions to the softmax. Each thread holds the m16n8 accumulator layout of
// decode_kernel.h (rows lane / 4 + 8 hf of its warp's 16), so the score transform, the online
// softmax and the epilogue are those kernels'. kBias: a bias of q's 16-bit type along the keys,
// added by a second product for up to 16 rows or loaded by each thread for more
// (decode_bias_sm90.h); calls with other mask / bias entries take the mma.sync kernels.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "cuda/common/copy.h"
#include "cuda/decode/decode_balanced.h"
#include "cuda/decode/decode_rows_kernel.h"
#include "cuda/sm90/decode_bias_sm90.h"
#include "cuda/sm90/gmma.h"
#include "cuda/sm90/pack_gqa_sm90.h"

namespace dmattn::cuda {

namespace decode_detail {

// The bias forms of the kernel (decode_bias_sm90.h): none, the one-hot product (up to kBiasRows
// rows), each thread's entries loaded into registers (more rows), or those of a bool mask with
// or without the bias (more rows).
enum class DecodeBias : int { kNone, kProduct, kEntries, kEntriesMask };

// One warpgroup (64 rows), Q (16 KB at kD = 128) and three stages of 64 keys of K and V
// (32 KB a stage at 128): 112 KB, two CTAs an SM.
template <typename Element, int kD>
struct DecodeSm90Tile {
  static_assert(kD == 64 || kD == 128, "decode_sm90: head dims 64 and 128");
  static constexpr int kThreads = 128;
  static constexpr int kRows = 64;
  static constexpr int kStageKeys = 64;
  static constexpr int kStages = 3;
  static constexpr int kTileElems = kStageKeys * kD;  // K or V of a stage
  static constexpr int kStageBytes = 2 * kTileElems * 2;
  static constexpr int kQBytes = kRows * kD * 2;
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes;
  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using LayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kRows>, cute::Int<kD>>{}));
  using LayoutK = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kStageKeys>, cute::Int<kD>>{}));
  // V (keys, D) seen as (D, keys): the MN-major B operand of O += P V.
  using LayoutVt = decltype(cute::composition(
      LayoutK{}, cute::make_layout(cute::Shape<cute::Int<kD>, cute::Int<kStageKeys>>{},
                                   cute::Stride<cute::Int<kStageKeys>, cute::_1>{})));
  using MmaS = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<Element, Element, float,
                                       cute::Shape<cute::_64, cute::Int<kStageKeys>, cute::Int<kD>>>()));
  using MmaO = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::rs_op_selector<Element, Element, float,
                                       cute::Shape<cute::_64, cute::Int<kD>, cute::Int<kStageKeys>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  static_assert(is_sw128_layout<LayoutK, kStageKeys, kD>() && is_sw128_layout<LayoutQ, kRows, kD>(),
                "the copies' addresses follow the tiles' layout");
  // kProduct: the stages' bias rows (N = keys, K = rows, MN-major) in Q's padding rows kBiasRows ..
  // of its first 64 columns (Q's rows there are 128-byte lines, kBiasRows of them a tile), the
  // one-hot A operand's 64 x 16 accumulator shape, and the product S_bias = OneHot Bias^T.
  using LayoutBias = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Element>{},
                                                  cute::Shape<cute::Int<kStageKeys>, cute::Int<kBiasRows>>{}));
  static constexpr int kBiasBase = kBiasRows * 128;
  static_assert(kBiasBase + kStages * kBiasTileBytes <= kRows * 128 && kStageKeys == 64,
                "the bias stages fit Q's padding rows");
  static_assert(is_bias_tile_layout<LayoutBias>(), "the bias copies' addresses follow the tile's layout");
  using MmaOneHot = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::ss_op_selector<Element, Element, float,
                                       cute::Shape<cute::_64, cute::Int<kBiasRows>, cute::_16>>()));
  using MmaBias = decltype(cute::make_tiled_mma(
      cute::SM90::GMMA::rs_op_selector<Element, Element, float,
                                       cute::Shape<cute::_64, cute::Int<kStageKeys>, cute::Int<kBiasRows>>,
                                       cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
};

// Element offset of 16-byte chunk c of row r in a (kRows, kD) tile of the layout above.
template <int kRows>
__device__ __forceinline__ int sw128_chunk_offset(int r, int c) {
  return (c / 8) * (kRows * 64) + r * 64 + (((c % 8) ^ (r % 8)) << 3);
}

}  // namespace decode_detail

// The rows c0 .. c0 + cta_rows - 1 of kv head kvh of one sequence against its keys
// [keys.begin, keys.end) (on whole stages from keys.begin), written as output (direct) or as
// the partial rows of split `split` (balanced: the slot): one CTA's work, or one part of a
// balanced share. The caller's threads are the CTA's, all of them.
template <typename Element, int kD, decode_detail::DecodeBias kBias, bool kBalanced>
__device__ __forceinline__ void decode_sm90_rows(const DecodeArgs& a, const decode_detail::DecodeSeq& seq, int kvh,
                                                 int c0, int cta_rows, int split, decode_detail::SplitKeys keys,
                                                 bool direct, int warp, int lane) {
  using namespace cute;
  using namespace decode_detail;
  using Tile = DecodeSm90Tile<Element, kD>;
  constexpr int kStageKeys = Tile::kStageKeys, kStages = Tile::kStages;
  constexpr int kNs = kStageKeys / 8, kNd = kD / 8;  // n8 column groups of S and of O
  constexpr bool kProduct = kBias == DecodeBias::kProduct, kMask = kBias == DecodeBias::kEntriesMask;
  constexpr bool kEntries = kBias == DecodeBias::kEntries || kMask;

  const int kb = keys.begin, ke = keys.end;
  // The warp's 16 rows of the 64; a warp past the chunk's rows computes zero rows it never stores.
  const int r0 = c0 + warp * kDecodeRows, nrows = min(kDecodeRows, c0 + cta_rows - r0);
  int row_i[2], row_h[2];
  accumulator_rows(a, kvh, nrows > 0 ? r0 : c0, nrows > 0 ? nrows : 1, lane, row_i, row_h);
  // The CTA's queries: a stage inside every row's window takes the scores without per-key tests
  // (the same answer for the whole warpgroup).
  const int i_first = c0 / a.group, i_last = (c0 + cta_rows - 1) / a.group;

  extern __shared__ __align__(1024) char decode_sm90_smem[];
  Element* sq = reinterpret_cast<Element*>(decode_sm90_smem);
  const auto stage_k = [&](int it) {
    return reinterpret_cast<Element*>(decode_sm90_smem + Tile::kQBytes + (it % kStages) * Tile::kStageBytes);
  };
  // Q's 64 packed rows (query (c0 + r) / group, head kvh * group + (c0 + r) % group; zeros past
  // the sequence's queries and past head_dim) by warp 0, in the first copy group. (kProduct:
  // its first kBiasRows rows, the rest holding the bias stages.)
  if (warp == 0) {
    const Element* q_group = static_cast<const Element*>(a.q) + seq.bm * a.q_st.batch_stride +
                             seq.q0 * a.q_st.row_stride + int64_t(kvh) * a.group * a.q_st.head_stride;
    sm90::load_packed_q_sw128<Tile::kRows, kD, Element, kProduct ? kBiasRows : Tile::kRows>(
        cute::cast_smem_ptr_to_uint(sq), q_group, a.q_st.row_stride, a.q_st.head_stride, c0, a.group, seq.len_q,
        a.head_dim, lane);
  }
  cp_async_commit();
  const int stages = ke > kb ? (ke - kb + kStageKeys - 1) / kStageKeys : 0;
  const StageCopies<Element, kD, kStageKeys, Tile::kThreads> copies(
      a, [](int r, int c) { return sw128_chunk_offset<kStageKeys>(r, c); }, 64);
  // A paged cache's table entries are read a stage ahead of the copies that use them.
  const bool paged = pages_by_stage<kStageKeys>(a);
  const auto pages_of = [&](int it) {
    return paged ? stage_pages<kStageKeys>(a, seq, kb + it * kStageKeys, ke) : StagePages{0, 0, 0};
  };
  const auto issue = [&](int it, const StagePages& pages) {
    if (it < stages) copies.issue(a, seq, kvh, kb + it * kStageKeys, ke, stage_k(it), &pages);
    cp_async_commit();
  };
  issue(0, pages_of(0));
  issue(1, pages_of(1));
  StagePages pages_ahead = pages_of(2);
  // kProduct: stage it's rows are stored one stage after their load (stage 0's at once, the
  // first barrier publishes them), into slot it % kStages.
  const auto bias_tile = [&](int it) { return decode_sm90_smem + Tile::kBiasBase + (it % kStages) * kBiasTileBytes; };
  BiasRowCopies<Element> bias_rows(a, seq, kvh, c0, kProduct ? cta_rows : 0, threadIdx.x);
  if constexpr (kProduct) {
    bias_rows.load(kb, ke);
    bias_rows.store(bias_tile(0));
    if (stages > 1) bias_rows.load(kb + kStageKeys, ke);
  }
  // kEntries: the entries of stage t in registers from the end of step t - 1 on (kMask: the
  // mask's too, and the bias's where there is one, else zeros).
  BiasEntryPairs<Element, kStageKeys> bias_pairs(a, seq, row_h, row_i);
  MaskEntryPairs<kStageKeys> mask_pairs(a, seq, row_h, row_i);
  const bool has_bias = !kMask || a.bias.ptr != nullptr;
  const auto load_entries = [&](int jt) {
    if (has_bias) bias_pairs.load(jt, ke, lane);
    if constexpr (kMask) mask_pairs.load(jt, ke, lane);
  };
  if constexpr (kEntries) {
    if (!has_bias) bias_pairs.clear();
    if (stages > 0) load_entries(kb);
  }

  typename Tile::MmaS mma_s;
  typename Tile::MmaO mma_o;
  auto wg_s = mma_s.get_thread_slice(0);
  auto wg_o = mma_o.get_thread_slice(0);
  Tensor acc_s = partition_fragment_C(mma_s, Shape<_64, Int<kStageKeys>>{});
  Tensor acc_o = partition_fragment_C(mma_o, Shape<_64, Int<kD>>{});
  static_assert(decltype(size(acc_s))::value == kNs * 4 && decltype(size(acc_o))::value == kNd * 4,
                "one m16n8 accumulator per n8 column group");
  // The accumulators as decode_kernel.h's arrays: register i is column group i / 4, row half
  // (i / 2) % 2 and column (i % 2) of its pair, the m16n8 layout of the warp's 16 rows.
  float (&s)[kNs][4] = *reinterpret_cast<float(*)[kNs][4]>(raw_pointer_cast(acc_s.data()));
  float (&o)[kNd][4] = *reinterpret_cast<float(*)[kNd][4]>(raw_pointer_cast(acc_o.data()));
  Tensor rP = make_tensor<Element>(acc_s.layout());
  Tensor tOrP = make_tensor(rP.data(), sm90::acc_to_a(rP.layout()));
  float m[2], l[2];
  start_rows(o, m, l);
  const StepOperandsOf<kStageKeys> no_operands{};

  Tensor sQ = make_tensor(make_smem_ptr(sq), typename Tile::LayoutQ{});
  Tensor tSrQ = wg_s.partition_fragment_A(sQ);
  // kProduct: the one-hot A operand (registers) and S_bias's accumulator, in S's layout.
  typename Tile::MmaBias mma_b;
  auto wg_b = mma_b.get_thread_slice(0);
  Tensor acc_b = partition_fragment_C(mma_b, Shape<_64, Int<kStageKeys>>{});
  float (&bias)[kNs][4] = *reinterpret_cast<float(*)[kNs][4]>(raw_pointer_cast(acc_b.data()));
  Tensor r_one_hot = make_tensor<Element>(partition_fragment_C(typename Tile::MmaOneHot{}, Shape<_64, Int<kBiasRows>>{}).layout());
  Tensor tArOneHot = make_tensor(r_one_hot.data(), sm90::acc_to_a(r_one_hot.layout()));
  if constexpr (kProduct) fill_one_hot(r_one_hot, warp, lane);
  for (int t = 0; t < stages; ++t) {
    cp_async_wait<1>();            // stage t's copies (and Q's) have landed; stage t + 1's may be in flight
    // Stage t - 1's PV product, issued at the end of the last step, ran while this thread waited
    // for the copies: done before the barrier, which then also frees its V for the refill (and O
    // for the rescale below).
    sm90::gemm_wait<0>(acc_o);
    sm90::fence_smem_for_wgmma();  // (this thread's writes, for the tensor cores' reads)
    __syncthreads();               // everyone's; all are done with stage t - 1, whose slot is refilled now
    issue(t + 2, pages_ahead);
    pages_ahead = pages_of(t + 3);
    if constexpr (kProduct) {  // stage t + 1's rows into their slot (free: stage t - 2 is done), t + 2's loaded
      bias_rows.store(bias_tile(t + 1));
      if (t + 2 < stages) bias_rows.load(kb + (t + 2) * kStageKeys, ke);
    }
    Element* tile = stage_k(t);
    Tensor sK = make_tensor(make_smem_ptr(tile), typename Tile::LayoutK{});
    Tensor tSrK = wg_s.partition_fragment_B(sK);
    sm90::gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_s, tSrQ, tSrK, acc_s);
    if constexpr (kProduct) {
      Tensor sBias = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(bias_tile(t))), typename Tile::LayoutBias{});
      sm90::gemm_issue</*kZeroInit=*/true, /*kRegA=*/true>(mma_b, tArOneHot, wg_b.partition_fragment_B(sBias), acc_b);
      sm90::gemm_wait<0>(acc_b);
    }
    sm90::gemm_wait<0>(acc_s);

    const int jt = kb + t * kStageKeys;
    float alpha[2];
    if constexpr (kProduct) {
      fix_nonfinite_bias<Element>(bias, bias_tile(t), warp, lane);
      if (tile_inside(a, keys.off, i_first, i_last, jt, kStageKeys, ke)) {
        online_softmax_bias<kStageKeys, false>(a, s, bias, jt, ke, keys.off, row_i, m, l, alpha, lane);
      } else {
        online_softmax_bias<kStageKeys, true>(a, s, bias, jt, ke, keys.off, row_i, m, l, alpha, lane);
      }
    } else if constexpr (kEntries) {
      const auto entries = [&](int hf, int nt, int e, bool& allowed, float& b) {
        b = bias_pairs.entry(hf, nt, e);
        if constexpr (kMask) allowed = mask_pairs.allowed(hf, nt, e);
      };
      if (tile_inside(a, keys.off, i_first, i_last, jt, kStageKeys, ke)) {
        online_softmax_with<true, kStageKeys, false>(a, s, jt, ke, keys.off, row_i, m, l, alpha, lane,
                                                     entries);
      } else {
        online_softmax_with<true, kStageKeys, true>(a, s, jt, ke, keys.off, row_i, m, l, alpha, lane,
                                                    entries);
      }
    } else if (tile_inside(a, keys.off, i_first, i_last, jt, kStageKeys, ke)) {
      if (a.q_scale > 0.f) online_softmax_inside<kStageKeys>(a.q_scale, s, m, l, alpha);
      else online_softmax<Element, false, kStageKeys, false>(a, s, jt, ke, keys.off, row_i, no_operands, m, l, alpha, lane);
    } else {
      online_softmax<Element, false, kStageKeys, true>(a, s, jt, ke, keys.off, row_i, no_operands, m, l, alpha, lane);
    }
    rescale_rows(o, alpha);
#pragma unroll
    for (int i = 0; i < size(rP); ++i) rP(i) = static_cast<Element>(acc_s(i));
    Tensor sVt = make_tensor(make_smem_ptr(tile + Tile::kTileElems), typename Tile::LayoutVt{});
    Tensor tOrVt = wg_o.partition_fragment_B(sVt);
    sm90::gemm_issue</*kZeroInit=*/false, /*kRegA=*/true>(mma_o, tOrP, tOrVt, acc_o);
    // (the next stage's entries, their loads in flight while the product runs and the next
    // stage's copies and scores are waited for)
    if constexpr (kEntries) {
      if (t + 1 < stages) load_entries(jt + kStageKeys);
    }
  }
  sm90::gemm_wait<0>(acc_o);
  cp_async_wait<0>();
  if (nrows <= 0) return;
  store_rows<Element, kBalanced>(a, seq, split, kvh, r0, nrows, lane, o, m, l, direct);
}

// Grid (row_chunks * num_splits, heads_kv, batch) with 64-row chunks, or (kBalanced: the
// balanced form, decode_balanced.h) (balanced_ctas), DecodeSm90Tile's kThreads threads and
// kSmemBytes of dynamic shared memory; no mask / bias entries, or a bias that
// decode_sm90_bias_form (decode_launch.h) gives kBias for (the balanced form: kProduct's). (The
// balanced form is an instantiation of its own: the split form's code stays as short as without
// it.)
template <typename Element, int kD, decode_detail::DecodeBias kBias = decode_detail::DecodeBias::kNone,
          bool kBalanced = false>
__global__ void __launch_bounds__(128, 2) decode_sm90_kernel(const DecodeArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace decode_detail;
  using Tile = DecodeSm90Tile<Element, kD>;
  static_assert(Tile::kStageKeys == kBalancedStageKeys, "the balanced shares count this kernel's stages");
  launch_dependents();  // (the splits' merge may be placed now: it waits for this grid's end)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if constexpr (kBalanced) {
    bool first = true;
    for_each_balanced_part(a, [&](const BalancedPart& part) {
      // (every thread's reads of the last part's Q and stages are done before they are refilled)
      if (!first) __syncthreads();
      first = false;
      decode_sm90_rows<Element, kD, kBias, true>(a, part.seq, part.kvh, 0, part.seq.len_q * a.group, part.slot,
                                                 part.keys, part.direct, warp, lane);
    });
  } else {
    const RowsChunk rc = rows_chunk(a, Tile::kRows);
    if (rc.idle()) return;
    // Splits on whole stages, so that a stage never straddles two.
    const SplitKeys keys = split_keys(a, rc.seq, rc.c0, rc.cta_rows, rc.split, Tile::kStageKeys);
    decode_sm90_rows<Element, kD, kBias, false>(a, rc.seq, rc.kvh, rc.c0, rc.cta_rows, rc.split, keys,
                                                a.num_splits == 1, warp, lane);
  }
#endif
}

}  // namespace dmattn::cuda
