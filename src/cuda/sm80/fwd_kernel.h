// The forward kernel (FlashAttention-2 style): one CTA per (query block, head, batch),
// key blocks walked from the last to the first, K of the next block prefetched while the
// current block's softmax and P V run. Composes copy.h, gemm.h, mask.h, operand_tile.h,
// bias.h, softmax.h and fwd_epilogue.h.
//   <Tile, false>:        plain scaled scores (no mask, bias, softcap), the scale folded into the
//                         softmax's exponent (fewest registers).
//   <Tile, true, true>:   the init kernel: a bool mask and/or a bias, no softcap. The bias and
//                         the mask initialize the QK^T accumulator (init_scores), so nothing
//                         runs between the MMAs and the softmax but the window / tail test.
//   <Tile, true, false>:  the general kernel: anything, softcap included (the bias is added
//                         after the softcap, transform_scores); the bias tile may be double
//                         buffered.
// Each variant has its own tile (FwdTile's kKind), chosen by run_fwd.
// Packed variable-length batches: the grid spans the longest sequence; each CTA takes its
// sequence's rows and lengths from seq_bounds() and exits when its query block starts past them.
// Key blocks outside the causal / window range are never visited; with a bool mask, blocks
// whose mask tile is all false are skipped too (block_skip.h): no K, V or bias load, no MMA.
// Gathered keys (a.kpos, key_positions.h; the plain and general kernels): the range comes from
// a binary search over the positions, and each block's positions tile lands with its V.
// The gate and windows with sinks (score_terms.h): the general kernel's kTerms variant, after its
// transform (a variant of its own: the other variants keep their registers).
#pragma once

#include <cfloat>

#include "cuda/common/bias.h"
#include "cuda/sm80/block_skip.h"
#include "cuda/common/copy.h"
#include "cuda/common/fwd_args.h"
#include "cuda/sm80/fwd_epilogue.h"
#include "cuda/sm80/fwd_tile.h"
#include "cuda/sm80/gemm.h"
#include "cuda/common/key_positions.h"
#include "cuda/common/mask.h"
#include "cuda/common/operand_tile.h"
#include "cuda/common/score_mask.h"
#include "cuda/common/score_terms.h"
#include "cuda/common/seq_bounds.h"
#include "cuda/common/softmax.h"

namespace dmattn::cuda {

// Score transform of one key block, in place on the accumulator row/col view:
//   s = scale * qk; softcap; s += bias; s = -inf where not allowed (mask, window, tail,
//   bias == -inf). A disallowed score is replaced, never offset.
// The position part (bias, mask, window, -inf) is mask_and_bias_scores (score_mask.h).
//   kScale = false: the scale is left out (no softcap, no bias: the softmax folds it into its
//   exponent, OnlineSoftmax::update_scaled); only the -inf replacement is applied.
template <bool kMaskBias, bool kPosMask, typename BiasT, int kBlockN, bool kScale, class S, class C>
__device__ __forceinline__ void transform_scores_ex(S& s, C const& coord, const FwdArgs& a, int m0, int n0,
                                                    const WindowMask& win, const char* s_bias, int bias_pitch,
                                                    const char* s_mask, int mask_pitch,
                                                    const PositionTest* pt = nullptr) {
  using namespace cute;
  if constexpr (kScale) {
    if (a.softcap != 0.f) {
      CUTE_UNROLL
      for (int i = 0; i < size(s); ++i) s(i) = a.softcap * tanhf(s(i) * a.scale_div_softcap);
    } else {
      CUTE_UNROLL
      for (int i = 0; i < size(s); ++i) s(i) *= a.scale;
    }
  }
  mask_and_bias_scores<kMaskBias, kPosMask, BiasT, kBlockN>(s, coord, m0, n0, win, s_bias, bias_pitch, s_mask,
                                                           mask_pitch, pt);
}

template <bool kMaskBias, bool kPosMask, typename BiasT, int kBlockN, class S, class C>
__device__ __forceinline__ void transform_scores(S& s, C const& coord, const FwdArgs& a, int m0, int n0,
                                                 const WindowMask& win, const char* s_bias, int bias_pitch,
                                                 const char* s_mask, int mask_pitch,
                                                 const PositionTest* pt = nullptr) {
  transform_scores_ex<kMaskBias, kPosMask, BiasT, kBlockN, true>(s, coord, a, m0, n0, win, s_bias, bias_pitch,
                                                                  s_mask, mask_pitch, pt);
}

// The general kernels' transform of one key block (mask / bias / softcap), dispatched on the
// bias dtype and on whether the block needs the position test (window, tails; pt: gathered
// keys' positions, null otherwise). Shared by the sm80-class and the sm90 forward kernels.
template <typename Element, int kBlockN, class S, class C>
__device__ __forceinline__ void transform_general_scores(S& s, C const& coord, const FwdArgs& a, int m0, int n0,
                                                         bool pos_mask, const WindowMask& win, const char* s_bias,
                                                         int bias_pitch, const char* s_mask, int mask_pitch,
                                                         const PositionTest* pt = nullptr) {
  if (a.bias_fp32) {
    if (pos_mask) transform_scores<true, true, float, kBlockN>(s, coord, a, m0, n0, win, s_bias, bias_pitch, s_mask, mask_pitch, pt);
    else transform_scores<true, false, float, kBlockN>(s, coord, a, m0, n0, win, s_bias, bias_pitch, s_mask, mask_pitch);
  } else {
    if (pos_mask) transform_scores<true, true, Element, kBlockN>(s, coord, a, m0, n0, win, s_bias, bias_pitch, s_mask, mask_pitch, pt);
    else transform_scores<true, false, Element, kBlockN>(s, coord, a, m0, n0, win, s_bias, bias_pitch, s_mask, mask_pitch);
  }
}

// Accumulator initialization of one key block for the init kernel (mask and/or bias, no
// softcap): acc = bias / scale where allowed, -inf where the mask is false or the bias is -inf.
// The QK^T MMAs then accumulate on top, giving qk + bias / scale, and the softmax folds the
// scale into its exponent (update_scaled): s = scale * qk + bias without a pass over the scores
// after the MMAs, and without holding bias values in registers next to the live scores.
// bias / scale is clamped to -FLT_MAX: a finfo.min bias stays a finite, allowed score (the
// softmax's safe subtraction keeps rows made only of them uniform), never -inf.
template <typename BiasT, class S, class C>
__device__ __forceinline__ void init_scores(S& s, C const& coord, const char* s_bias, int bias_pitch,
                                            const char* s_mask, int mask_pitch, float inv_scale) {
  using namespace cute;
  const int col0 = get<1>(coord(0, 0));
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    const int row = get<0>(coord(r, 0));
    const BiasT* brow = s_bias ? reinterpret_cast<const BiasT*>(s_bias) + row * bias_pitch + col0 : nullptr;
    const uint8_t* mrow = s_mask ? reinterpret_cast<const uint8_t*>(s_mask) + row * mask_pitch + col0 : nullptr;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); c += 2) {
      const int cc = get<1>(coord(r, c)) - col0;
      float x0 = 0.f, x1 = 0.f;
      if (brow) {
        float b0, b1;
        read_bias_pair(brow + cc, b0, b1);
        x0 = b0 * inv_scale;
        x0 = b0 == -INFINITY ? -INFINITY : (x0 < -FLT_MAX ? -FLT_MAX : x0);
        x1 = b1 * inv_scale;
        x1 = b1 == -INFINITY ? -INFINITY : (x1 < -FLT_MAX ? -FLT_MAX : x1);
      }
      if (mrow) {
        bool m0, m1;
        read_mask_pair(mrow + cc, m0, m1);
        x0 = m0 ? x0 : -INFINITY;
        x1 = m1 ? x1 : -INFINITY;
      }
      s(r, c) = x0;
      s(r, c + 1) = x1;
    }
  }
}

// One CTA of the forward (fwd_kernel's body).
template <class Tile, bool kMaskBias, bool kInit, bool kTerms>
__device__ __forceinline__ void fwd_block(const FwdArgs& a) {
  static_assert(!kInit || kMaskBias);
  static_assert(!kTerms || (kMaskBias && !kInit));
  using namespace cute;
  using Element = typename Tile::Element;
  constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kHeadDim = Tile::kHeadDim;
  constexpr int kThreads = Tile::kNThreads;

  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x;
  // Query blocks in reverse: under a causal mask the last blocks see the most keys; starting
  // them first balances the tail of the grid.
  const int m_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int m0 = m_block * kBlockM;
  const SeqBounds seq(a, b);
  if (m0 >= seq.len_q()) return;  // packed batch: past the end of a shorter sequence
  const int h_kv = h / a.group;

  int n_min, n_max;
  // Gathered keys (never packed): the block range from the positions of this (b, h); each key
  // block's positions go to a tile in smem (s_pos), read by the per-element test (pt).
  const bool gathered = a.kpos.ptr != nullptr;
  if (gathered) KeyPositionRow(a, b, h).key_block_range(m0, kBlockM, kBlockN, n_min, n_max);
  else seq.window().key_block_range(m0, kBlockM, kBlockN, n_min, n_max);
  int32_t* const s_pos = reinterpret_cast<int32_t*>(smem + a.smem_kpos_off);

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Tile::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffK)), typename Tile::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffV)), typename Tile::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Tile::SmemLayoutVt{});
  Tensor sVtNoSwz = make_tensor(sV.data().get(), typename Tile::SmemLayoutVtNoSwizzle{});

  typename Tile::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwz);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);
  Tensor acc_o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));

  auto copy_q = make_tiled_copy_A(typename Tile::LdsmCopy{}, tiled_mma);
  auto copy_k = make_tiled_copy_B(typename Tile::LdsmCopy{}, tiled_mma);
  auto copy_v = make_tiled_copy_B(typename Tile::LdsmCopyT{}, tiled_mma);

  // (row, col) of each score element in the block.
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_mma.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;

  OnlineSoftmax<kRows> softmax;
  softmax.init();
  // Plain scores (kMaskBias = false: no mask, no bias, no softcap): the scale folds into the
  // softmax exponent.
  constexpr float kLog2e = 1.4426950408889634f;
  const float score_scale = kMaskBias && !kInit ? 1.f : a.scale;

  if (n_max > n_min) {
    const Element* gQ = static_cast<const Element*>(a.q) + int64_t(b) * a.q_bs + int64_t(seq.q0() + m0) * a.q_rs + int64_t(h) * a.q_hs;
    const Element* gK = static_cast<const Element*>(a.k) + int64_t(b) * a.k_bs + int64_t(seq.k0()) * a.k_rs + int64_t(h_kv) * a.k_hs;
    const Element* gV = static_cast<const Element*>(a.v) + int64_t(b) * a.v_bs + int64_t(seq.k0()) * a.v_rs + int64_t(h_kv) * a.v_hs;

    OperandTile<kBlockM, kBlockN, kThreads> mask_tile, bias_tile;
    const bool has_mask = kMaskBias && a.mask.ptr != nullptr;
    const bool has_bias = kMaskBias && a.bias.ptr != nullptr;
    const bool bias_db = !kInit && has_bias && a.bias_db;
    char* const s_mask_base = smem + a.smem_mask_off;
    char* const s_bias_base = smem + a.smem_bias_off;
    int mbuf = 0, bbuf = 0;  // current mask / bias buffer
    int n = n_max - 1;
    if constexpr (kMaskBias) {
      if (has_mask) mask_tile.init(a.mask, b, h, m0, seq.len_q(), Tile::kMaskPitch, seq.k0());
      if (has_bias) bias_tile.init(a.bias, b, h, m0, seq.len_q(), Tile::kBiasPitch, seq.k0());
      if (has_mask) {  // first key block with a true mask element (block_skip.h)
        mask_tile.template load_as<1>(s_mask_base, Tile::kMaskPitch, n * kBlockN, seq.len_k(), tid);
        cp_async_commit();
        n = next_live_key_block(mask_tile, s_mask_base, Tile::kMaskPitch, n, n_min, seq.len_k(), tid);
      }
    }

    if (n < n_min) {
      // no key block with an allowed key: out = 0, lse = -inf
    } else if constexpr (kInit) {
      // Init kernel. Every load of the next blocks is issued at the top of an iteration, where
      // only the output accumulator is live (few registers), and lands during the QK^T MMAs:
      //   top:    wait K[n]; decide the next live block nn from the look-ahead mask tile
      //           (block_skip.h, the barrier); issue V[n], bias[nn], mask[nn - 1];
      //           acc = init_scores(bias[n], mask[n]); acc += Q K[n]^T
      //   middle: wait; barrier; issue K[nn]; window / tail test; softmax; acc_o += P V[n]
      // Buffers: mask x3 (current, next, look-ahead), bias x2 (current, next).
      Tensor tSsQ = copy_q.get_thread_slice(tid).partition_S(sQ);
      Tensor tSsK = copy_k.get_thread_slice(tid).partition_S(sK);
      Tensor tOsVt = copy_v.get_thread_slice(tid).partition_S(sVt);
      int mcur = 0, mnext = 1, bcur = 0;
      auto load_bias = [&](char* dst, int n0_) {
        if (a.bias_fp32) bias_tile.template load_as<4>(dst, Tile::kBiasPitch, n0_, seq.len_k(), tid);
        else bias_tile.template load_as<2>(dst, Tile::kBiasPitch, n0_, seq.len_k(), tid);
      };
      load_rows_async<kBlockM, kHeadDim, kThreads>(sQ, gQ, a.q_rs, seq.rows_valid(m0, kBlockM), a.head_dim, tid);
      load_rows_async<kBlockN, kHeadDim, kThreads>(sK, gK + int64_t(n * kBlockN) * a.k_rs, a.k_rs,
                                                   seq.len_k() - n * kBlockN, a.head_dim, tid);
      if (has_bias) load_bias(s_bias_base, n * kBlockN);
      if (has_mask && n > n_min)
        mask_tile.template load_as<1>(s_mask_base + mnext * a.smem_mask_stride, Tile::kMaskPitch, (n - 1) * kBlockN, seq.len_k(), tid);
      cp_async_commit();
      const float inv_scale = 1.f / a.scale;
      while (true) {
        const int n0 = n * kBlockN;
        int nn = n - 1;
        if (has_mask && n > n_min) {
          nn = next_live_key_block(mask_tile, s_mask_base + mnext * a.smem_mask_stride, Tile::kMaskPitch, n - 1,
                                   n_min, seq.len_k(), tid);
        } else {
          cp_async_wait<0>();
          __syncthreads();
        }
        // K[n], bias[n], mask[n], mask[nn] visible; everyone is done with V and the buffers
        // of the last block.
        const int mfree = 3 - mcur - mnext;
        load_rows_async<kBlockN, kHeadDim, kThreads>(sV, gV + int64_t(n0) * a.v_rs, a.v_rs, seq.len_k() - n0, a.head_dim, tid);
        if (nn >= n_min) {
          if (has_bias)
            load_bias(s_bias_base + (bcur ^ 1) * a.smem_bias_stride, nn * kBlockN);
          if (has_mask && nn > n_min)
            mask_tile.template load_as<1>(s_mask_base + mfree * a.smem_mask_stride, Tile::kMaskPitch, (nn - 1) * kBlockN, seq.len_k(), tid);
        }
        cp_async_commit();

        Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
        Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
        {
          const char* sb = has_bias ? s_bias_base + bcur * a.smem_bias_stride : nullptr;
          const char* sm = has_mask ? s_mask_base + mcur * a.smem_mask_stride : nullptr;
          if (a.bias_fp32) init_scores<float>(s_rc, tScS_rc, sb, bias_tile.pitch, sm, mask_tile.pitch, inv_scale);
          else init_scores<Element>(s_rc, tScS_rc, sb, bias_tile.pitch, sm, mask_tile.pitch, inv_scale);
        }
        gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, copy_q, copy_k, tid);

        cp_async_wait<0>();
        __syncthreads();  // V[n] landed; everyone is done with K[n]
        if (nn >= n_min) {
          load_rows_async<kBlockN, kHeadDim, kThreads>(sK, gK + int64_t(nn * kBlockN) * a.k_rs, a.k_rs,
                                                       seq.len_k() - nn * kBlockN, a.head_dim, tid);
          cp_async_commit();
        }

        const WindowMask win = seq.window();
        if (win.block_needs_mask(m0, kBlockM, kBlockN, n))
          transform_scores_ex<false, true, Element, kBlockN, false>(s_rc, tScS_rc, a, m0, n0, win, nullptr, 0, nullptr, 0);
        softmax.template update_scaled<true>(s_rc, acc_o_rc, a.scale * kLog2e);

        Tensor rP = make_tensor<Element>(acc_s.layout());
        convert_fragment<Element, false>(acc_s, rP);
        Tensor tOrP = make_tensor(rP.data(), acc_to_a(rP.layout()));
        gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, copy_v, tid);

        if (nn < n_min) break;
        n = nn;
        bcur ^= 1;
        mcur = mnext;
        mnext = mfree;
      }
    } else if (n >= n_min) {
        load_rows_async<kBlockM, kHeadDim, kThreads>(sQ, gQ, a.q_rs, seq.rows_valid(m0, kBlockM), a.head_dim, tid);
        load_rows_async<kBlockN, kHeadDim, kThreads>(sK, gK + int64_t(n * kBlockN) * a.k_rs, a.k_rs,
                                                     seq.len_k() - n * kBlockN, a.head_dim, tid);
        cp_async_commit();
        if constexpr (kMaskBias) {
          if (bias_db) {
            bias_tile.load_any(s_bias_base, Tile::kBiasPitch, n * kBlockN, seq.len_k(), tid);
            cp_async_commit();
          }
        }

        while (true) {
          const int n0 = n * kBlockN;
          Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
          clear(acc_s);
          // K[n] landed (the double-buffered bias of block n may still be in flight: it is the
          // newest group); everyone is done with V / mask / bias of the last block.
          if (bias_db) cp_async_wait<1>();
          else cp_async_wait<0>();
          __syncthreads();
          load_rows_async<kBlockN, kHeadDim, kThreads>(sV, gV + int64_t(n0) * a.v_rs, a.v_rs, seq.len_k() - n0, a.head_dim, tid);
          // Read after the barrier below; the last block's tile was read before the one above.
          if (gathered) load_positions_tile_async<kBlockN, kThreads, kMaskBias>(s_pos, positions_row(a.kpos, b, h), a.seqlen_k, n0, tid, ends_row(a.kpos, b, h), kBlockN);
          if constexpr (kMaskBias) {
            if (has_bias && !bias_db) bias_tile.template load_any</*kRolled=*/true>(s_bias_base, Tile::kBiasPitch, n0, seq.len_k(), tid);
            // The next block's mask tile, one block ahead, into the other buffer.
            if (has_mask && n > n_min)
              mask_tile.template load_any</*kRolled=*/true>(s_mask_base + (mbuf ^ 1) * a.smem_mask_stride, Tile::kMaskPitch, n0 - kBlockN, seq.len_k(), tid);
          }
          cp_async_commit();

          // The fragments' shared-memory addresses (kOpaqueLoopAddresses) from a thread index
          // the compiler cannot see through, at each block: derived from tid, they were hoisted
          // out of the key loop and held (or spilled) through it.
          const int ltid = Tile::kOpaqueLoopAddresses ? opaque_int(tid) : tid;
          gemm_ss<Tile::kGemmPrefetch>(acc_s, tSrQ, tSrK, copy_q.get_thread_slice(ltid).partition_S(sQ),
                                       copy_k.get_thread_slice(ltid).partition_S(sK), tiled_mma, copy_q, copy_k, ltid);

          // V[n], mask, bias landed; everyone is done with K[n]. Next block to run: nn.
          int nn = n - 1;
          bool synced = false;
          if constexpr (kMaskBias) {
            if (has_mask && n > n_min) {
              nn = next_live_key_block(mask_tile, s_mask_base + (mbuf ^ 1) * a.smem_mask_stride, Tile::kMaskPitch,
                                       n - 1, n_min, seq.len_k(), tid);
              synced = true;
            }
          }
          if (!synced) {
            cp_async_wait<0>();
            __syncthreads();
          }
          if (nn >= n_min) {
            const int n0_next = nn * kBlockN;
            load_rows_async<kBlockN, kHeadDim, kThreads>(sK, gK + int64_t(n0_next) * a.k_rs, a.k_rs, seq.len_k() - n0_next, a.head_dim, tid);
            cp_async_commit();
            if constexpr (kMaskBias) {
              if (bias_db) {
                bias_tile.template load_any</*kRolled=*/true>(s_bias_base + (bbuf ^ 1) * a.smem_bias_stride, Tile::kBiasPitch, n0_next, seq.len_k(), tid);
                cp_async_commit();
              }
            }
          }

          Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
          const WindowMask win = seq.window();
          const PositionTest kp_test{s_pos, position_window(a), kBlockN};  // from the constant params
          const PositionTest* const pt = gathered ? &kp_test : nullptr;
          const bool pos_mask = gathered ? positions_block_needs_mask<kBlockN>(position_window(a), s_pos, m0, kBlockM, kMaskBias && a.kpos.ends != nullptr)
                                         : win.block_needs_mask(m0, kBlockM, kBlockN, n);
          if constexpr (kMaskBias) {
            const char* sb = has_bias ? s_bias_base + bbuf * a.smem_bias_stride : nullptr;
            const char* sm = has_mask ? s_mask_base + mbuf * a.smem_mask_stride : nullptr;
            transform_general_scores<Element, kBlockN>(s_rc, tScS_rc, a, m0, n0, pos_mask, win, sb, bias_tile.pitch, sm,
                                                       mask_tile.pitch, pt);
            if constexpr (kTerms) {  // (score_terms.h; built per block: no registers held)
              const ScoreTermsRow terms = score_terms_row(a, b, h, seq.q0(), seq.k0(), seq.len_q(), seq.len_k());
              apply_score_terms<Element>(s_rc, tScS_rc, a, terms, m0, n0, seq.len_q() - m0, seq.len_k() - n0);
            }
            softmax.template update<true>(s_rc, acc_o_rc);
          } else {
            if (pos_mask) transform_scores_ex<false, true, Element, kBlockN, false>(s_rc, tScS_rc, a, m0, n0, win, nullptr, 0, nullptr, 0, pt);
            softmax.template update_scaled<false>(s_rc, acc_o_rc, a.scale * kLog2e);
          }

          Tensor rP = make_tensor<Element>(acc_s.layout());
          convert_fragment<Element, false>(acc_s, rP);
          Tensor tOrP = make_tensor(rP.data(), acc_to_a(rP.layout()));
          const int vtid = Tile::kOpaqueLoopAddresses ? opaque_int(tid) : tid;
          gemm_rs<Tile::kGemmPrefetch>(acc_o, tOrP, tOrVt, copy_v.get_thread_slice(vtid).partition_S(sVt), tiled_mma,
                                       copy_v, vtid);

          if (nn < n_min) break;
          n = nn;
          mbuf ^= 1;
          if (bias_db) bbuf ^= 1;
        }
      }
    __syncthreads();  // all warps are done with sQ (and the mask buffers) before sQ holds O
  }

  float lse[kRows];
  int rows[kRows];
  softmax.finalize(acc_o_rc, lse, score_scale);
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) rows[r] = get<0>(tScS_rc(r, 0));

  Element* gO = static_cast<Element*>(a.out) + int64_t(b) * a.o_bs + int64_t(seq.q0() + m0) * a.o_rs + int64_t(h) * a.o_hs;
  float* g_lse = a.lse + seq.stat_offset(h) + m0;
  fwd_epilogue<Tile>(acc_o, sQ, thr_mma, lse, rows, gO, a.o_rs, g_lse, seq.rows_valid(m0, kBlockM), a.head_dim, tid);
}

// The kernel, with a body only in the device code its tile's configuration is for
// (fwd_tile_compiled_here: the kHopper tiles in the sm_90a code, the others elsewhere).
template <class Tile, bool kMaskBias, bool kInit = false, bool kTerms = false>
__global__ void __launch_bounds__(Tile::kNThreads, 1) fwd_kernel(const __grid_constant__ FwdArgs a) {
  if constexpr (fwd_tile_compiled_here<Tile>()) fwd_block<Tile, kMaskBias, kInit, kTerms>(a);
}

}  // namespace dmattn::cuda
