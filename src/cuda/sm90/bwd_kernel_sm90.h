// The Hopper backward kernel (sm_90a, wgmma): the sm80-class kernel's scheme (bwd_kernel.h: one
// CTA per (key block, kv head, batch), K / V loaded once, every query head of the GQA group and
// every query block the window or the positions let reach the key block walked with Q / dO
// double buffered) with its five products on wgmma (bwd_tile_sm90.h says who computes what).
// One iteration (query block t):
//   wait Q/dO[t] (+ mask / bias tiles); barrier; issue Q/dO[t + 1] (+ the mask / bias tiles of
//   t + 1 when two buffer sets fit: BwdTileSm90::mb_sets)
//   issue S = Q K^T and dP = dO V^T together; transform S while dP runs; P, dS, dbias
//   P, dS -> shared memory; barrier; (one mask / bias buffer set) issue the mask / bias tiles of t + 1
//   issue dV += P^T dO, dK += dS^T Q, dQ = dS K together; wait; dQ atomics
// The score transform, P / dS, dbias, dQ atomics and the dK / dV stores are the sm80 kernel's
// (bwd_common.h, bwd_parts.h): the wgmma accumulator has mma.sync's per-quad row ownership.
// kBiasPath (BwdBiasPath): the bias fast path (run_bwd: a 16-bit bias alone, no mask, no softcap;
// dbias written tile by tile, not wanted, or -- a variant of its own -- reduced over the queries):
// the plain kernel's code (operand descriptors rebuilt in the loop) plus one unpadded, row-swizzled
// bias tile per Q / dO buffer (sm90/bias_tile_sm90.h, as the forward's fast path), loaded with
// Q / dO of the same query block and added to the scaled scores. No ptxas spills in either
// variant (the dQ atomics' offsets recomputed each query block, the column sums as a wgmma),
// against ~210-230 B in the general mask / bias kernel (kMaskBias), which holds its descriptors
// (docs/design.md, "Hopper backward").
// Compiled for every target, with a body only for sm_90a; run_bwd launches it on compute
// capability 9.0 devices.
#pragma once

#include "cuda/common/bwd_args.h"
#include "cuda/common/bwd_common.h"
#include "cuda/common/bwd_parts.h"
#include "cuda/common/copy.h"
#include "cuda/common/cta_order.h"
#include "cuda/common/key_positions.h"
#include "cuda/common/operand_tile.h"
#include "cuda/common/seq_bounds.h"
#include "cuda/sm90/bias_tile_sm90.h"
#include "cuda/sm90/dbias_colsum_sm90.h"
#include "cuda/sm90/bwd_tile_sm90.h"
#include "cuda/sm90/gmma.h"

namespace dmattn::cuda::sm90 {

enum BwdBiasPath : int {
  kBiasPathOff = 0,     // the plain kernel (kMaskBias false) or the general mask / bias kernel
  kBiasPathDirect = 1,  // bias fast path, dbias kDbDirect or kDbNone
  kBiasPathColSum = 2,  // bias fast path, dbias kDbColSum
};

template <class Tile, bool kMaskBias, bool kSoftcap, int kBiasPath = kBiasPathOff>
__global__ void __launch_bounds__(Tile::kNThreads, 1) bwd_kernel_sm90(const __grid_constant__ BwdArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  constexpr bool kBias16 = kBiasPath != kBiasPathOff;
  static_assert(!(kBias16 && (kMaskBias || kSoftcap)), "the bias fast path is a bias alone");
  constexpr bool kDbias = kMaskBias || kBias16;                     // dbias produced in this kernel
  // Query-broadcast dbias (kDbColSum): the general kernel adds the column sums of dS into shared
  // memory every query block (colsum_add_smem); the fast path's variant takes them as one more
  // product (kColSumMma, BwdTileSm90::TiledMmaColSum), added to one shared row after the
  // products' wait (colsum_acc_add_smem). (The direct variant keeps
  // the shared-memory column sums' zeroing and flushes, which never run there: without them
  // ptxas spilled 92 B instead of 20.)
  constexpr bool kColSumMma = kBiasPath == kBiasPathColSum;
  using Element = typename Tile::Element;
  constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kHeadDim = Tile::kHeadDim;
  constexpr int kThreads = Tile::kNThreads;
  constexpr int kQElems = kBlockM * kHeadDim;
  const FwdArgs& f = a.f;

  extern __shared__ __align__(1024) char smem[];
  const int tid = threadIdx.x;
  const CtaCoords cta = bwd_cta_coords(a);
  const int n_block = bwd_cta_n_block();
  const int n0 = n_block * kBlockN;
  const int group = f.group;
  const int b_begin = a.fold_batch ? 0 : cta.z;
  const int b_end = a.fold_batch ? f.batch : b_begin + 1;
  const int kv_begin = a.fold_heads ? 0 : cta.y;
  const int kv_end = a.fold_heads ? a.num_heads_kv : kv_begin + 1;
  // (fold_batch is never set for a packed batch: see bwd_kernel.h)
  const SeqBounds first(f, b_begin);
  if (n0 >= first.len_k()) return;  // packed batch: past the end of a shorter sequence's keys
  auto cols_valid = [&] { return min(kBlockN, first.len_k() - n0); };

  int win_m_lo, win_m_hi;
  bwd_query_block_range(first.window(), n0, kBlockN, kBlockM, win_m_lo, win_m_hi);
  const bool gathered = f.kpos.ptr != nullptr;
  int32_t* const s_pos = reinterpret_cast<int32_t*>(smem + f.smem_kpos_off);

  Element* const sQbase = reinterpret_cast<Element*>(smem + Tile::kOffQ);
  Element* const sdObase = reinterpret_cast<Element*>(smem + Tile::kOffdO);
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffK)), typename Tile::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffV)), typename Tile::SmemLayoutKV{});
  Tensor sKt = make_tensor(sK.data(), typename Tile::SmemLayoutKt{});
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffP)), typename Tile::SmemLayoutPdS{});
  Tensor sPt = make_tensor(sP.data(), typename Tile::SmemLayoutPdSt{});
  Tensor sdS = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffdS)), typename Tile::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(sdS.data(), typename Tile::SmemLayoutPdSt{});
  // Mask / bias tile set of query block t: set t % 2 when two fit (same choice as run_bwd's
  // shared-memory size), else the single set, loaded after the middle barrier.
  // (recomputed from the arguments where used: nothing more held in registers across the loop)
  auto mb_double = [&] {
    return Tile::mb_sets_used(f.mask.ptr != nullptr, f.bias.ptr != nullptr, f.bias_fp32, a.exp_flags) == 2;
  };
  auto s_bias_at = [&](int t) {
    const int set_bytes = Tile::mb_set_bytes(f.mask.ptr != nullptr, f.bias.ptr != nullptr, f.bias_fp32);
    return smem + Tile::kOffBias + (mb_double() ? (t & 1) * set_bytes : 0);
  };
  auto s_mask_at = [&](int t) {
    return s_bias_at(t) + (Tile::mask_offset(f.bias.ptr != nullptr, f.bias_fp32) - Tile::kOffBias);
  };
  // Bias fast path: the swizzled tile of query block t, beside Q / dO[t % 2].
  auto s_bias16_at = [&](int t) { return smem + Tile::kOffBias + (t & 1) * Tile::kBias16TileBytes; };
  float* s_col = reinterpret_cast<float*>(smem + Tile::kOffColSum);
  auto s_stats_at = [&](int buf) { return reinterpret_cast<float*>(smem + Tile::kOffStats) + buf * Tile::kStatsFloats; };

  auto sQ_at = [&](int buf) {
    return make_tensor(make_smem_ptr(sQbase + buf * kQElems), typename Tile::SmemLayoutQdO{});
  };
  auto sdO_at = [&](int buf) {
    return make_tensor(make_smem_ptr(sdObase + buf * kQElems), typename Tile::SmemLayoutQdO{});
  };
  auto sQt_at = [&](int buf) {
    return make_tensor(make_smem_ptr(sQbase + buf * kQElems), typename Tile::SmemLayoutQdOt{});
  };
  auto sdOt_at = [&](int buf) {
    return make_tensor(make_smem_ptr(sdObase + buf * kQElems), typename Tile::SmemLayoutQdOt{});
  };

  typename Tile::TiledMmaSdP mma_sdp;
  typename Tile::TiledMmadKV mma_dkv;
  typename Tile::TiledMmadQ mma_dq;
  typename Tile::TiledMmaColSum mma_cs;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  auto thr_cs = mma_cs.get_thread_slice(tid);

  // Operand descriptors that do not depend on the Q / dO buffer. The plain kernels rebuild them
  // where used from an opaque copy of the shared-memory base (a few integer operations each): held
  // across the loop, ptxas spilled them, and their reloads from local memory (L2: little L1 is
  // left beside 200 KB of shared memory) stalled the first product of every query block (ncu);
  // rebuilt, the plain kernel has no spills. The mask / bias kernels hold them (rebuilt there,
  // their other spills grow, 244 -> 400 B).
  auto fresh = [&](int off, auto layout) {
    char* p = smem;
    asm volatile("" : "+l"(p));
    return make_tensor(make_smem_ptr(reinterpret_cast<Element*>(p + off)), layout);
  };
  const auto held_SdP = cute::make_tuple(thr_sdp.partition_fragment_B(sK), thr_sdp.partition_fragment_B(sV));
  const auto held_dKV = cute::make_tuple(thr_dkv.partition_fragment_A(sPt), thr_dkv.partition_fragment_A(sdSt));
  const auto held_dQ = cute::make_tuple(thr_dq.partition_fragment_A(sdS), thr_dq.partition_fragment_B(sKt));
  auto operands_SdP = [&] {
    if constexpr (kMaskBias) return held_SdP;
    else return cute::make_tuple(thr_sdp.partition_fragment_B(fresh(Tile::kOffK, typename Tile::SmemLayoutKV{})),
                                 thr_sdp.partition_fragment_B(fresh(Tile::kOffV, typename Tile::SmemLayoutKV{})));
  };
  auto operands_dKV = [&] {
    if constexpr (kMaskBias) return held_dKV;
    else return cute::make_tuple(thr_dkv.partition_fragment_A(fresh(Tile::kOffP, typename Tile::SmemLayoutPdSt{})),
                                 thr_dkv.partition_fragment_A(fresh(Tile::kOffdS, typename Tile::SmemLayoutPdSt{})));
  };
  auto operands_dQ = [&] {
    if constexpr (kMaskBias) return held_dQ;
    else return cute::make_tuple(thr_dq.partition_fragment_A(fresh(Tile::kOffdS, typename Tile::SmemLayoutPdS{})),
                                 thr_dq.partition_fragment_B(fresh(Tile::kOffK, typename Tile::SmemLayoutKt{})));
  };

  // (row, col) of each score element in the (kBlockM, kBlockN) block, and of dQ.
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_sdp.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor cdQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor tdQcdQ = thr_dq.partition_C(cdQ);

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;

  const int mode = a.dbias_mode;
  const bool bias_per_head = a.bsize_h == f.num_heads && a.bias_head_div == 1;
  const bool colsum_per_head = mode == kDbColSum && bias_per_head && group > 1;
  const bool direct_from_smem = kDbias && mode == kDbDirect && !kSoftcap && !f.bias_fp32;
  auto cta_sync = [] { __syncthreads(); };
  auto colsum_flush = [&](int b, int h) {
    if constexpr (kColSumMma) {
      colsum_flush_smem<Element, kBlockN, 1, kThreads>(a, s_col, b, h, n0, cols_valid(), tid, cta_sync);
    } else {
      colsum_flush_smem<Element, kBlockN, Tile::kWarpsPerCol, kThreads>(a, s_col, b, h, n0, cols_valid(), tid, cta_sync);
    }
  };
  if constexpr (kColSumMma) {
    // The ones tile (published to wgmma by the fence and barrier that open every query block).
    Element* ones = reinterpret_cast<Element*>(smem + Tile::kOffOnes);
    for (int i = tid; i < cosize(typename Tile::SmemLayoutOnes{}); i += kThreads) ones[i] = Element(1.f);
    for (int i = tid; i < kBlockN; i += kThreads) s_col[i] = 0.f;  // (as below, one row)
  } else if constexpr (kDbias) {
    // The column sums start at zero (each flush clears them again); the first barrier of the
    // loop, or the flush's own, orders this before any add.
    if (mode == kDbColSum)
      for (int i = tid; i < Tile::kWarpsPerCol * kBlockN; i += kThreads) s_col[i] = 0.f;
  }

  for (int b = b_begin; b < b_end; ++b) {
    const SeqBounds seq(f, b);
    for (int kvh = kv_begin; kvh < kv_end; ++kvh) {
      int m_lo = win_m_lo, m_hi = win_m_hi;
      if (gathered) {
        const KeyPositionRow kp_row(f, b, kvh * group);
        load_positions_tile<kBlockN, kThreads, kMaskBias>(s_pos, kp_row.row, kp_row.count, n0, tid, ends_row(f.kpos, b, kvh * group), kBlockN);
        const int n_valid = positions_tile_valid_count<kBlockN>(s_pos, f.kpos.seqlen_k_original, tid);
        kp_row.query_block_range(s_pos[0], s_pos[n_valid > 0 ? n_valid - 1 : 0], n_valid, kBlockM, m_lo, m_hi);
      }
      const int n_m = max(m_hi - m_lo, 0);
      const int n_iter = n_m * group;

      clear(acc_dk);
      clear(acc_dv);

      const Element* gQb = static_cast<const Element*>(f.q) + int64_t(b) * f.q_bs + int64_t(seq.q0()) * f.q_rs;
      const Element* gdOb = static_cast<const Element*>(a.dout) + int64_t(b) * a.do_bs + int64_t(seq.q0()) * a.do_rs;

      // Staggered start of the query-block walk (dQ atomics of neighbouring CTAs apart).
      const int rot = n_m > 0 ? (n_block * 7) % n_m : 0;
      auto m_of = [&](int t) { const int i = t % n_m + rot; return m_lo + (i >= n_m ? i - n_m : i); };
      auto issue_q_loads = [&](int t, int buf) {
        const int h = kvh * group + t / n_m;
        const int m0 = m_of(t) * kBlockM;
        Tensor sQ = sQ_at(buf);
        Tensor sdO = sdO_at(buf);
        load_rows_async<kBlockM, kHeadDim, kThreads>(sQ, gQb + int64_t(m0) * f.q_rs + int64_t(h) * f.q_hs, f.q_rs,
                                                     seq.len_q() - m0, f.head_dim, tid);
        load_rows_async<kBlockM, kHeadDim, kThreads>(sdO, gdOb + int64_t(m0) * a.do_rs + int64_t(h) * a.do_hs, a.do_rs,
                                                     seq.len_q() - m0, f.head_dim, tid);
        const int64_t row_stat = seq.stat_offset(h) + m0;
        bwd_row_stats_async<kBlockM, kThreads>(s_stats_at(buf), a.row_m + row_stat,
                                               a.row_log2l ? a.row_log2l + row_stat : nullptr, a.delta + row_stat,
                                               seq.rows_valid(m0, kBlockM), tid);
      };
      auto issue_bias16_load = [&](int t) {
        if constexpr (kBias16) {  // (into the tile of Q / dO[t]'s buffer: t % 2)
          const int h = kvh * group + t / n_m;
          const int m0 = m_of(t) * kBlockM;
          // (16-byte path only: run_bwd takes this path for a vec bias of a dense batch. The
          // element-wise branch, compiled in, made ptxas hold addresses across the loop: 216 B
          // of spills, against 20 without.)
          OperandTile<kBlockM, kBlockN, kThreads> bias_tile;
          bias_tile.init(f.bias, b, h, m0, seq.len_q(), kBlockN, seq.k0());
          load_bias_tile_swizzled<kBlockM, kBlockN, kThreads, /*kVecOnly=*/true>(s_bias16_at(t), bias_tile, n0,
                                                                                seq.len_k(), tid);
        }
      };
      auto issue_mask_bias_loads = [&](int t) {
        if constexpr (kMaskBias) {
          const int h = kvh * group + t / n_m;
          const int m0 = m_of(t) * kBlockM;
          // (tile objects local to the load: nothing of them stays in registers across the loop.
          // The generic load, not load_as: the latter's unrolled constant-offset copies are
          // hoisted out of the query-block loop and spill, 316 -> 900 B)
          if (f.mask.ptr) {
            OperandTile<kBlockM, kBlockN, kThreads> mask_tile;
            mask_tile.init(f.mask, b, h, m0, seq.len_q(), Tile::kMaskPitch, seq.k0());
            mask_tile.load(s_mask_at(t), Tile::kMaskPitch, n0, seq.len_k(), tid);
          }
          if (f.bias.ptr) {
            OperandTile<kBlockM, kBlockN, kThreads> bias_tile;
            bias_tile.init(f.bias, b, h, m0, seq.len_q(), Tile::kBiasPitch, seq.k0());
            bias_tile.load(s_bias_at(t), Tile::kBiasPitch, n0, seq.len_k(), tid);
          }
        }
      };

      if (n_iter > 0) {
        const Element* gK = static_cast<const Element*>(f.k) + int64_t(b) * f.k_bs + int64_t(seq.k0() + n0) * f.k_rs + int64_t(kvh) * f.k_hs;
        const Element* gV = static_cast<const Element*>(f.v) + int64_t(b) * f.v_bs + int64_t(seq.k0() + n0) * f.v_rs + int64_t(kvh) * f.v_hs;
        load_rows_async<kBlockN, kHeadDim, kThreads>(sK, gK, f.k_rs, cols_valid(), f.head_dim, tid);
        load_rows_async<kBlockN, kHeadDim, kThreads>(sV, gV, f.v_rs, cols_valid(), f.head_dim, tid);
        issue_q_loads(0, 0);
        issue_bias16_load(0);
        issue_mask_bias_loads(0);
        cp_async_commit();
      }

      for (int t = 0; t < n_iter; ++t) {
        const int buf = t & 1;
        const int h = kvh * group + t / n_m;
        const int m0 = m_of(t) * kBlockM;
        const int rows_valid = seq.rows_valid(m0, kBlockM);

        cp_async_wait<0>();
        fence_smem_for_wgmma();
        __syncthreads();  // Q/dO[t], mask/bias[t] landed; every product of iteration t - 1 is done
        if (t + 1 < n_iter) {
          issue_q_loads(t + 1, buf ^ 1);
          issue_bias16_load(t + 1);  // (its buffer was last read by the transform of t - 1)
          // Two mask / bias sets: t + 1's set was last read by the transform of t - 1, which the
          // barrier above closed; its load overlaps all of iteration t.
          if (kMaskBias && mb_double()) issue_mask_bias_loads(t + 1);
          cp_async_commit();
        }

        Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
        Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
        {
          Tensor tSrQ = thr_sdp.partition_fragment_A(sQ_at(buf));
          Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO_at(buf));
          const auto [tSrK, tdPrV] = operands_SdP();
          gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_sdp, tSrQ, tSrK, acc_s);
          gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_sdp, tdPrdO, tdPrV, acc_dp);
        }

        float row_m[kRows], row_log2l[kRows], delta[kRows];
        {  // (landed with Q / dO[t])
          const float* st = s_stats_at(buf);
          bwd_load_row_stats(tScS_rc, st, a.row_log2l ? st + kBlockM : nullptr, st + 2 * kBlockM, rows_valid, row_m,
                             row_log2l, delta);
        }
        const bool pos_mask = gathered ? positions_block_needs_mask<kBlockN>(position_window(f), s_pos, m0, kBlockM, kMaskBias && f.kpos.ends != nullptr)
                                       : seq.window().block_needs_mask(m0, kBlockM, kBlockN, n_block);

        gemm_wait<1>(acc_s);  // S done; dP may still run
        Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
        Tensor dp_rc = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
        Tensor tt = make_tensor<float>(acc_s.layout());
        Tensor tt_rc = make_tensor(tt.data(), acc_rowcol(tt.layout()));
        if constexpr (kMaskBias) {
          // The test's address is taken, so it lives in local memory: written only for gathered
          // keys (written unconditionally, it cost 5 local 8-byte stores every query block).
          PositionTest block_test;
          if (gathered) block_test = PositionTest{s_pos, position_window(f), kBlockN};
          bwd_scores<kMaskBias, kSoftcap, Element, kBlockN>(s_rc, tScS_rc, tt_rc, f, m0, n0, pos_mask, seq.window(),
                                                            f.bias.ptr ? s_bias_at(t) : nullptr,
                                                            f.bias.row_bcast ? 0 : Tile::kBiasPitch,
                                                            f.mask.ptr ? s_mask_at(t) : nullptr,
                                                            f.mask.row_bcast ? 0 : Tile::kMaskPitch,
                                                            gathered ? &block_test : nullptr);
        } else if constexpr (kBias16) {
          // s = scale * qk, then + bias (bias[t] landed with Q / dO[t]): two roundings, as the
          // general transform (the exact path's statistics kernel computes m and l with it: a
          // single-key row must give P = 1 exactly). Then only the window / tail / positions
          // tests, which write -inf.
          CUTE_UNROLL
          for (int i = 0; i < size(acc_s); ++i) acc_s(i) *= f.scale;
          add_bias_swizzled<Element, kBlockN>(s_rc, tScS_rc, s_bias16_at(t), f.bias.row_bcast, 1.f);
          const PositionTest block_test{s_pos, position_window(f), kBlockN};
          if (pos_mask)
            mask_and_bias_scores<false, true, Element, kBlockN>(s_rc, tScS_rc, m0, n0, seq.window(), nullptr, 0,
                                                               nullptr, 0, gathered ? &block_test : nullptr);
        } else {  // (the plain kernels' code as it was)
          const PositionTest block_test{s_pos, position_window(f), kBlockN};
          bwd_scores<kMaskBias, kSoftcap, Element, kBlockN>(s_rc, tScS_rc, tt_rc, f, m0, n0, pos_mask, seq.window(),
                                                            nullptr, 0, nullptr, 0, gathered ? &block_test : nullptr);
        }
        gemm_wait<0>(acc_dp);
        bwd_p_ds(s_rc, dp_rc, row_m, row_log2l, delta);
        if constexpr (kDbias) {  // (no bias, no dbias)
          if (kMaskBias && mode == kDbColSum) {
            colsum_add_smem<kBlockN, Tile::kWarpsPerCol>(dp_rc, tScS_rc, s_col, tid);
          } else if constexpr (kMaskBias) {  // (kBias16: kDbDirect from the dS tile below, or none)
            float no_colsum[kCols];  // (not read: the column sums take the branch above)
            bwd_dbias_from_scores<Element, 1>(a, direct_from_smem, b, h, m0, n0, 0, 0, rows_valid, cols_valid(), dp_rc,
                                              tScS_rc, no_colsum);
          }
        }
        if constexpr (kSoftcap) bwd_softcap_chain(acc_dp, tt);
        {
          Tensor rP = make_tensor<Element>(acc_s.layout());
          convert_fragment<Element, false>(acc_s, rP);
          Tensor rdS = make_tensor<Element>(acc_dp.layout());
          convert_fragment<Element, true>(acc_dp, rdS);
          copy(rP, thr_sdp.partition_C(sP));
          copy(rdS, thr_sdp.partition_C(sdS));
        }
        fence_smem_for_wgmma();
        __syncthreads();  // sP, sdS visible to both warpgroups; the mask / bias tiles of t are free
        if constexpr (kMaskBias) {
          if (!mb_double() && t + 1 < n_iter) {
            issue_mask_bias_loads(t + 1);
            cp_async_commit();
          }
        }

        {
          Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt_at(buf));
          Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt_at(buf));
          const auto [tdVrPt, tdKrdSt] = operands_dKV();
          gemm_issue</*kZeroInit=*/false, /*kRegA=*/false>(mma_dkv, tdVrPt, tdVrdOt, acc_dv);
          gemm_issue</*kZeroInit=*/false, /*kRegA=*/false>(mma_dkv, tdKrdSt, tdKrQt, acc_dk);
        }
        // kColSumMma: this query block's column sums (each of the 8 columns holds them), added to
        // the shared-memory row as soon as the products are done, before the dQ atomics: held
        // across the loop, or through the atomics, the 4 registers made ptxas spill the atomics'
        // addresses (84-120 B, ~3 us per query block).
        Tensor acc_db = partition_fragment_C(mma_cs, Shape<Int<kBlockN>, _8>{});
        if constexpr (kColSumMma) {
          Tensor tCSrdSt = thr_cs.partition_fragment_A(fresh(Tile::kOffdS, typename Tile::SmemLayoutPdSt{}));
          Tensor tCSrOnes = thr_cs.partition_fragment_B(fresh(Tile::kOffOnes, typename Tile::SmemLayoutOnes{}));
          gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_cs, tCSrdSt, tCSrOnes, acc_db);
        }
        if (a.dq_accum != nullptr) {
          Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
          const auto [tdQrdS, tdQrKt] = operands_dQ();
          gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_dq, tdQrdS, tdQrKt, acc_dq);
          gemm_wait<0>(acc_dq);
          warpgroup_fence_operand(acc_dk);
          warpgroup_fence_operand(acc_dv);
          if constexpr (kColSumMma) {
            warpgroup_fence_operand(acc_db);
            colsum_acc_add_smem(acc_db, s_col, tid);
          }
          float* gdq = a.dq_accum + (seq.batch_row() + m0) * f.num_heads * f.head_dim + int64_t(h) * f.head_dim;
          if constexpr (kBias16) {
            // The atomics' (row, column) pairs and row stride from an opaque thread index and
            // stride: recomputed here (a few integer operations) rather than hoisted out of the
            // loop, where ptxas held their offsets in registers or, in these kernels, spilled
            // them and reloaded each before its reduction (20 / 84 B of spills -> 0; ~3 us per
            // query block in the column-sum variant). (The plain kernel has no spills with the
            // hoisted form; the general mask / bias kernels spill more with this one.)
            int tid_dq = tid, dq_rs = f.num_heads * f.head_dim;
            asm volatile("" : "+r"(tid_dq), "+r"(dq_rs));
            Tensor tdQcdQ_here = mma_dq.get_thread_slice(tid_dq).partition_C(cdQ);
            bwd_dq_atomic_add(acc_dq, tdQcdQ_here, gdq, int64_t(dq_rs), rows_valid, f.head_dim, tid_dq);
          } else {
            bwd_dq_atomic_add(acc_dq, tdQcdQ, gdq, int64_t(f.num_heads) * f.head_dim, rows_valid, f.head_dim, tid);
          }
        } else {
          gemm_wait<0>(acc_dk);
          warpgroup_fence_operand(acc_dv);
          if constexpr (kColSumMma) {
            warpgroup_fence_operand(acc_db);
            colsum_acc_add_smem(acc_db, s_col, tid);
          }
        }
        // dbias from the dS tile once the products are done (while they run, its registers
        // would sit next to dK, dV and dQ's: spills)
        if (direct_from_smem)
          bwd_dbias_from_tile<Element, kBlockM, kBlockN, kThreads>(a, sdS, b, h, m0, n0, rows_valid, cols_valid(), tid);

        if constexpr (kDbias) {
          if (colsum_per_head && t % n_m == n_m - 1) colsum_flush(b, h);
        }
      }

      // ---- end of (batch, kv head): dbias pieces nothing reached, then dK / dV.
      if constexpr (kDbias) {
        if (mode == kDbColSum) {
          if (colsum_per_head) {
            if (n_iter == 0)
              for (int h = kvh * group; h < (kvh + 1) * group; ++h) colsum_flush(b, h);
          } else {
            colsum_flush(b, kvh * group);
          }
        } else if (mode == kDbDirect) {
          bwd_dbias_zero_unreached<Element, kBlockM, kThreads>(a, seq, b, kvh, m_lo, m_hi, n0, cols_valid(), tid);
        }
      }

      // dK / dV straight from the accumulators (pairs of columns, 4-byte stores): staging them in
      // shared memory, like the sm80 kernel, needs registers for both converted copies and their
      // swizzled addresses at once, which spilled across the whole kernel.
      Element* gdK = static_cast<Element*>(a.dk) + int64_t(b) * a.dk_bs + int64_t(seq.k0() + n0) * a.dk_rs + int64_t(kvh) * a.dk_hs;
      Element* gdV = static_cast<Element*>(a.dv) + int64_t(b) * a.dv_bs + int64_t(seq.k0() + n0) * a.dv_rs + int64_t(kvh) * a.dv_hs;
      {
        Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});
        Tensor tcKV = thr_dkv.partition_C(cKV);
        bwd_store_acc_pairs<Element>(acc_dk, tcKV, gdK, a.dk_rs, cols_valid(), f.head_dim, f.scale);
        bwd_store_acc_pairs<Element>(acc_dv, tcKV, gdV, a.dv_rs, cols_valid(), f.head_dim, 1.f);
      }
      __syncthreads();  // every product is done with K / V before the next (batch, kv head) loads them
    }
  }
#endif
}

}  // namespace dmattn::cuda::sm90
