// The main backward kernel (FlashAttention-2 style, key-block major): one CTA per (key block,
// kv head, batch). It loads K and V of its key block once, then walks every query head of the
// GQA group and every query block the window lets reach the key block (Q / dO double buffered,
// the next pair prefetched while the current one is computed), recomputing
//   S = QK^T (same transform as the forward), P = exp(s - m) / l, dP = dO V^T,
//   dS = P * (dP - Delta), dS' = dS * softcap'
// and accumulating in fp32 registers dV += P^T dO and dK += dS'^T Q over the whole group
// (no expanded copy; deterministic), written once at the end with saturation. dQ += dS' K goes
// to the fp32 dq_accum through atomics (or, deterministic mode, to the query-major kernel of
// bwd_dq_kernel.h). dbias: see BwdDbiasMode.
// Packed variable-length batches (seq_bounds.h): the grid spans the longest sequence; a CTA whose
// key block starts past its sequence's keys exits (those rows belong to no one), every other CTA
// of the sequence writes its dK / dV / dbias columns, zeros included (a sequence without queries).
// Gathered keys (f.kpos, key_positions.h): the key block's positions tile is loaded once per
// (batch, kv head), and the query blocks walked follow from its first and last valid positions
// (none for a block of padding rows). Every query head of the group reads the same positions
// (the host refuses one positions row per query head when the group is larger than 1).
// The gate and windows with sinks (score_terms.h; the kTerms variants, with kMaskBias: the others
// keep their registers): applied after the transform; the gate's dalpha row sums of each tile go
// to dalpha_accum (bwd_dalpha_add), its ddelta column sums stay in registers over the (batch, kv
// head) and are stored at its end.
#pragma once

#include "cuda/common/bwd_args.h"
#include "cuda/common/bwd_common.h"
#include "cuda/common/bwd_parts.h"
#include "cuda/sm80/bwd_tile.h"
#include "cuda/common/copy.h"
#include "cuda/sm80/gemm.h"
#include "cuda/common/key_positions.h"
#include "cuda/common/operand_tile.h"
#include "cuda/common/score_terms.h"
#include "cuda/common/seq_bounds.h"

namespace dmattn::cuda {

template <class Tile, bool kMaskBias, bool kSoftcap, bool kTerms = false>
__global__ void __launch_bounds__(Tile::kNThreads, 1) bwd_kernel(const __grid_constant__ BwdArgs a) {
  static_assert(!kTerms || kMaskBias);
  using namespace cute;
  using Element = typename Tile::Element;
  constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kHeadDim = Tile::kHeadDim;
  constexpr int kHalfN = Tile::kHalfN;
  constexpr int kThreads = Tile::kNThreads;
  constexpr int kQElems = kBlockM * kHeadDim;
  const FwdArgs& f = a.f;

  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x;
  const int n_block = blockIdx.x;
  const int n0 = n_block * kBlockN;
  const int group = f.group;
  const int b_begin = a.fold_batch ? 0 : int(blockIdx.z);
  const int b_end = a.fold_batch ? f.batch : b_begin + 1;
  const int kv_begin = a.fold_heads ? 0 : int(blockIdx.y);
  const int kv_end = a.fold_heads ? a.num_heads_kv : kv_begin + 1;
  // fold_batch is never set for a packed batch: the lengths (and window) of b_begin hold for
  // every b walked; the row offsets come from each b's own SeqBounds inside the loop.
  const SeqBounds first(f, b_begin);
  if (n0 >= first.len_k()) return;  // packed batch: past the end of a shorter sequence's keys
  // Key columns of this block inside the sequence (re-read where used: seq_bounds.h).
  auto cols_valid = [&] { return min(kBlockN, first.len_k() - n0); };

  // Query blocks that reach this key block under causal / window (gathered keys: per (batch,
  // kv head) from the positions, below).
  int win_m_lo, win_m_hi;
  bwd_query_block_range(first.window(), n0, kBlockN, kBlockM, win_m_lo, win_m_hi);
  const bool gathered = f.kpos.ptr != nullptr;
  int32_t* const s_pos = reinterpret_cast<int32_t*>(smem + f.smem_kpos_off);

  Element* const sQbase = reinterpret_cast<Element*>(smem + Tile::kOffQ);
  Element* const sdObase = reinterpret_cast<Element*>(smem + Tile::kOffdO);
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffK)), typename Tile::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffV)), typename Tile::SmemLayoutKV{});
  Tensor sKt = make_tensor(sK.data(), typename Tile::SmemLayoutKt{});
  Tensor sKtNoSwz = make_tensor(sK.data().get(), typename Tile::SmemLayoutKtNoSwizzle{});
  Tensor sP = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffP)), typename Tile::SmemLayoutPdS{});
  Tensor sPt = make_tensor(sP.data(), typename Tile::SmemLayoutPdSt{});
  Tensor sPtNoSwz = make_tensor(sP.data().get(), typename Tile::SmemLayoutPdStNoSwizzle{});
  Tensor sdS = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffdS)), typename Tile::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(sdS.data(), typename Tile::SmemLayoutPdSt{});
  Tensor sdStNoSwz = make_tensor(sdS.data().get(), typename Tile::SmemLayoutPdStNoSwizzle{});
  char* s_bias = smem + Tile::kOffBias;
  char* s_mask = smem + Tile::mask_offset(f.bias.ptr != nullptr, f.bias_fp32);
  float* s_col = reinterpret_cast<float*>(smem + Tile::kOffColSum);

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
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);

  Tensor sQtNoSwz0 = make_tensor(sQbase, typename Tile::SmemLayoutQdOtNoSwizzle{});
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ_at(0));
  auto kv_half = [&](auto& t, int j) { return local_tile(t, Shape<Int<kHalfN>, Int<kHeadDim>>{}, make_coord(j, 0)); };
  auto pds_half = [&](auto& t, int j) { return local_tile(t, Shape<Int<kBlockM>, Int<kHalfN>>{}, make_coord(0, j)); };
  Tensor tSrK = thr_sdp.partition_fragment_B(kv_half(sK, 0));
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO_at(0));
  Tensor tdPrV = thr_sdp.partition_fragment_B(kv_half(sV, 0));
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPtNoSwz);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sQtNoSwz0);
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdStNoSwz);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQtNoSwz0);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKtNoSwz);

  auto copy_sdp_a = make_tiled_copy_A(typename Tile::LdsmCopy{}, mma_sdp);
  auto copy_sdp_b = make_tiled_copy_B(typename Tile::LdsmCopy{}, mma_sdp);
  auto copy_dkv_a = make_tiled_copy_A(typename Tile::LdsmCopyT{}, mma_dkv);
  auto copy_dkv_b = make_tiled_copy_B(typename Tile::LdsmCopyT{}, mma_dkv);
  auto copy_dq_a = make_tiled_copy_A(typename Tile::LdsmCopy{}, mma_dq);
  auto copy_dq_b = make_tiled_copy_B(typename Tile::LdsmCopyT{}, mma_dq);
  auto store_pds = make_tiled_copy_C(typename Tile::StoreCopyC{}, mma_sdp);
  auto thr_store_pds = store_pds.get_thread_slice(tid);

  Tensor tdVsPt = copy_dkv_a.get_thread_slice(tid).partition_S(sPt);
  Tensor tdKsdSt = copy_dkv_a.get_thread_slice(tid).partition_S(sdSt);
  Tensor tdQsdS = copy_dq_a.get_thread_slice(tid).partition_S(sdS);
  Tensor tdQsKt = copy_dq_b.get_thread_slice(tid).partition_S(sKt);

  // Coordinates within one (kBlockM, kHalfN) half; column 64 j + c in the key block.
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kHalfN>>{});
  Tensor tScS = thr_sdp.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor cdQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor tdQcdQ = thr_dq.partition_C(cdQ);

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;  // per half

  const int mode = a.dbias_mode;
  const bool bias_per_head = a.bsize_h == f.num_heads && a.bias_head_div == 1;
  const bool colsum_per_head = mode == kDbColSum && bias_per_head && group > 1;
  // dbias from the bf16/fp16 dS tile in shared memory (coalesced) instead of registers.
  const bool direct_from_smem = mode == kDbDirect && !kSoftcap && !f.bias_fp32;
  float colsum[Tile::kHalves * kCols];
  // The gate (score_terms.h): its window / gate terms, and its gradients when wanted (dalpha /
  // ddelta come only with a gate: set_score_terms).
  const bool gate_grads = kTerms && (a.dalpha != nullptr || a.ddelta != nullptr);
  float gcol[Tile::kHalves * kCols];
  static_assert(Tile::kColSumBytes >= (kThreads / 32 / Tile::kAtomMSdP) * kBlockM * 4, "s_col holds the gate's row sums");

  // Column sums of one (batch, bias head): reduced over the CTA, then stored or added.
  auto colsum_flush = [&](int b, int h) {
    bwd_colsum_flush<Element, kBlockN, kHalfN, Tile::kAtomMSdP, kThreads>(a, colsum, tScS_rc, s_col, b, h, n0,
                                                                          cols_valid(), tid);
  };

  for (int b = b_begin; b < b_end; ++b) {
    const SeqBounds seq(f, b);
    for (int kvh = kv_begin; kvh < kv_end; ++kvh) {
      // Query blocks [m_lo, m_hi) that reach this key block. Gathered keys: from the block's
      // positions (the previous (batch, kv head) ended with a barrier: the tile is free).
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
      CUTE_UNROLL
      for (int c = 0; c < Tile::kHalves * kCols; ++c) colsum[c] = gcol[c] = 0.f;

      const Element* gQb = static_cast<const Element*>(f.q) + int64_t(b) * f.q_bs + int64_t(seq.q0()) * f.q_rs;
      const Element* gdOb = static_cast<const Element*>(a.dout) + int64_t(b) * a.do_bs + int64_t(seq.q0()) * a.do_rs;
      OperandTile<kBlockM, kBlockN, kThreads> mask_tile, bias_tile;

      // The CTAs of one (batch, kv head) start their walk at different query blocks, so that
      // their dQ atomics do not all hit the same rows of dq_accum at the same time.
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
      };
      auto issue_mask_bias_loads = [&](int t) {
        if constexpr (kMaskBias) {
          const int h = kvh * group + t / n_m;
          const int m0 = m_of(t) * kBlockM;
          if (f.mask.ptr) {
            mask_tile.init(f.mask, b, h, m0, seq.len_q(), Tile::kMaskPitch, seq.k0());
            mask_tile.load(s_mask, Tile::kMaskPitch, n0, seq.len_k(), tid);
          }
          if (f.bias.ptr) {
            bias_tile.init(f.bias, b, h, m0, seq.len_q(), Tile::kBiasPitch, seq.k0());
            bias_tile.load(s_bias, Tile::kBiasPitch, n0, seq.len_k(), tid);
          }
        }
      };

      if (n_iter > 0) {
        const Element* gK = static_cast<const Element*>(f.k) + int64_t(b) * f.k_bs + int64_t(seq.k0() + n0) * f.k_rs + int64_t(kvh) * f.k_hs;
        const Element* gV = static_cast<const Element*>(f.v) + int64_t(b) * f.v_bs + int64_t(seq.k0() + n0) * f.v_rs + int64_t(kvh) * f.v_hs;
        load_rows_async<kBlockN, kHeadDim, kThreads>(sK, gK, f.k_rs, cols_valid(), f.head_dim, tid);
        load_rows_async<kBlockN, kHeadDim, kThreads>(sV, gV, f.v_rs, cols_valid(), f.head_dim, tid);
        issue_q_loads(0, 0);
        issue_mask_bias_loads(0);
        cp_async_commit();
      }

      for (int t = 0; t < n_iter; ++t) {
        const int buf = Tile::kQBuffers == 2 ? (t & 1) : 0;
        const int h = kvh * group + t / n_m;
        const int m_block = m_of(t);
        const int m0 = m_block * kBlockM;
        const int rows_valid = seq.rows_valid(m0, kBlockM);

        cp_async_wait<0>();
        __syncthreads();  // Q/dO[t], mask/bias[t] landed; all warps are done with iteration t - 1
        if (Tile::kQBuffers == 2 && t + 1 < n_iter) {
          issue_q_loads(t + 1, buf ^ 1);
          cp_async_commit();
        }

        const int64_t row_stat = seq.stat_offset(h) + m0;
        float row_m[kRows], row_log2l[kRows], delta[kRows];
        bwd_load_row_stats(tScS_rc, a.row_m + row_stat, a.row_log2l ? a.row_log2l + row_stat : nullptr,
                           a.delta + row_stat, rows_valid, row_m, row_log2l, delta);

        Tensor sQ = sQ_at(buf);
        Tensor sdO = sdO_at(buf);
        Tensor tSsQ = copy_sdp_a.get_thread_slice(tid).partition_S(sQ);
        Tensor tdPsdO = copy_sdp_a.get_thread_slice(tid).partition_S(sdO);

        const bool pos_mask = gathered ? positions_block_needs_mask<kBlockN>(position_window(f), s_pos, m0, kBlockM, kMaskBias && f.kpos.ends != nullptr)
                                       : seq.window().block_needs_mask(m0, kBlockM, kBlockN, n_block);
        ScoreTermsRow terms;
        if constexpr (kTerms) terms = score_terms_row(f, b, h, seq.q0(), seq.k0(), seq.len_q(), seq.len_k());
        float grow[kRows];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) grow[r] = 0.f;
        // Unrolled without mask / bias; a loop with them (the transform is larger: fewer spills).
        constexpr int kHalfUnroll = kMaskBias ? 1 : Tile::kHalves;
#pragma unroll kHalfUnroll
        for (int j = 0; j < Tile::kHalves; ++j) {
          const int c_off = j * kHalfN;
          Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kHalfN>>{});
          clear(acc_s);
          {
            Tensor tSsK = copy_sdp_b.get_thread_slice(tid).partition_S(kv_half(sK, j));
            gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma_sdp, copy_sdp_a, copy_sdp_b, tid);
          }
          Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kHalfN>>{});
          clear(acc_dp);
          if (!(a.exp_flags & 8)) {
            Tensor tdPsV = copy_sdp_b.get_thread_slice(tid).partition_S(kv_half(sV, j));
            gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, mma_sdp, copy_sdp_a, copy_sdp_b, tid);
          }

          Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
          Tensor dp_rc = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
          Tensor tt = make_tensor<float>(acc_s.layout());
          Tensor tt_rc = make_tensor(tt.data(), acc_rowcol(tt.layout()));
          const char* sb = f.bias.ptr ? s_bias + c_off * (f.bias_fp32 ? 4 : 2) : nullptr;
          const char* sm = f.mask.ptr ? s_mask + c_off : nullptr;
          const PositionTest half_test{s_pos + c_off, position_window(f), kBlockN};
          bwd_scores<kMaskBias, kSoftcap, Element, kHalfN>(s_rc, tScS_rc, tt_rc, f, m0, n0 + c_off, pos_mask, seq.window(),
                                                           sb, bias_tile.pitch, sm, mask_tile.pitch,
                                                           gathered ? &half_test : nullptr);
          if constexpr (kTerms)
            apply_score_terms<Element>(s_rc, tScS_rc, f, terms, m0, n0 + c_off, rows_valid, cols_valid() - c_off);
          bwd_p_ds(s_rc, dp_rc, row_m, row_log2l, delta);

          // ---- dbias from registers (dS before the softcap chain: the bias is added after it)
          bwd_dbias_from_scores<Element, Tile::kHalves>(a, direct_from_smem, b, h, m0, n0, c_off, j, rows_valid,
                                                        cols_valid(), dp_rc, tScS_rc, colsum);
          // ---- the gate's gradients (dS before the softcap chain too: the gate is added after it)
          if (gate_grads)
            accumulate_gate_grads<Element, Tile::kHalves>(dp_rc, tScS_rc, f, terms, m0, n0 + c_off, rows_valid,
                                                          cols_valid() - c_off, j, grow, gcol);
          if constexpr (kSoftcap) bwd_softcap_chain(acc_dp, tt);

          Tensor rP = make_tensor<Element>(acc_s.layout());
          convert_fragment<Element, false>(acc_s, rP);
          Tensor rdS = make_tensor<Element>(acc_dp.layout());
          convert_fragment<Element, true>(acc_dp, rdS);
          Tensor sP_j = pds_half(sP, j);
          Tensor sdS_j = pds_half(sdS, j);
          copy(store_pds, thr_store_pds.retile_S(rP), thr_store_pds.partition_D(sP_j));
          copy(store_pds, thr_store_pds.retile_S(rdS), thr_store_pds.partition_D(sdS_j));
        }
        if (gate_grads) bwd_dalpha_stage<kBlockM, Tile::kAtomMSdP>(grow, tScS_rc, s_col, tid);
        __syncthreads();  // sP, sdS visible; the mask / bias tiles are free
        if (gate_grads) {  // (s_col free again before the column-sum flushes below, which reuse it)
          if (a.dalpha != nullptr)
            bwd_dalpha_add<kBlockM, kThreads / 32 / Tile::kAtomMSdP, kThreads>(a, s_col, seq, h, m0, rows_valid, n_block, tid);
          __syncthreads();
        }
        if constexpr (kMaskBias) {
          if (t + 1 < n_iter) {
            issue_mask_bias_loads(t + 1);
            cp_async_commit();
          }
        }

        if (direct_from_smem)
          bwd_dbias_from_tile<Element, kBlockM, kBlockN, kThreads>(a, sdS, b, h, m0, n0, rows_valid, cols_valid(), tid);

        {
          Tensor sdOt = sdOt_at(buf);
          Tensor tdVsdOt = copy_dkv_b.get_thread_slice(tid).partition_S(sdOt);
          if (!(a.exp_flags & 2)) gemm_ss(acc_dv, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt, mma_dkv, copy_dkv_a, copy_dkv_b, tid);
        }
        {
          Tensor sQt = sQt_at(buf);
          Tensor tdKsQt = copy_dkv_b.get_thread_slice(tid).partition_S(sQt);
          if (!(a.exp_flags & 4)) gemm_ss(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt, mma_dkv, copy_dkv_a, copy_dkv_b, tid);
        }
        if (a.dq_accum != nullptr && !(a.exp_flags & 1)) {
          Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
          clear(acc_dq);
          gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_dq, copy_dq_a, copy_dq_b, tid);
          float* gdq = a.dq_accum + (seq.batch_row() + m0) * f.num_heads * f.head_dim + int64_t(h) * f.head_dim;
          bwd_dq_atomic_add(acc_dq, tdQcdQ, gdq, int64_t(f.num_heads) * f.head_dim, rows_valid, f.head_dim, tid);
        }

        if (colsum_per_head && t % n_m == n_m - 1) colsum_flush(b, h);
        if (Tile::kQBuffers == 1 && t + 1 < n_iter) {  // one buffer: the next Q / dO after this block
          __syncthreads();
          issue_q_loads(t + 1, 0);
          cp_async_commit();
        }
      }

      // ---- end of (batch, kv head): dbias pieces nothing reached, then dK / dV.
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
      if (gate_grads && a.ddelta != nullptr)
        bwd_ddelta_flush<Element, kBlockN, kHalfN, Tile::kAtomMSdP, kThreads>(a, gcol, tScS_rc, s_col, b, kvh, n0,
                                                                             cols_valid(), tid);

      __syncthreads();  // every warp is done with the Q / dO buffers (reused for staging)
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= f.scale;
      Tensor sdKst = make_tensor(make_smem_ptr(sQbase), typename Tile::SmemLayoutKV{});
      Tensor sdVst = make_tensor(make_smem_ptr(sdObase), typename Tile::SmemLayoutKV{});
      {
        Tensor rdK = make_tensor<Element>(acc_dk.layout());
        convert_fragment<Element, true>(acc_dk, rdK);
        Tensor rdV = make_tensor<Element>(acc_dv.layout());
        convert_fragment<Element, true>(acc_dv, rdV);
        copy(rdK, thr_dkv.partition_C(sdKst));
        copy(rdV, thr_dkv.partition_C(sdVst));
      }
      __syncthreads();
      Element* gdK = static_cast<Element*>(a.dk) + int64_t(b) * a.dk_bs + int64_t(seq.k0() + n0) * a.dk_rs + int64_t(kvh) * a.dk_hs;
      Element* gdV = static_cast<Element*>(a.dv) + int64_t(b) * a.dv_bs + int64_t(seq.k0() + n0) * a.dv_rs + int64_t(kvh) * a.dv_hs;
      bwd_store_dkdv<Element, kBlockN, kHeadDim, kThreads>(sdKst, sdVst, gdK, a.dk_rs, gdV, a.dv_rs, cols_valid(),
                                                           f.head_dim, tid);
      __syncthreads();  // staging done before the next (batch, kv head) reuses shared memory
    }
  }
}

}  // namespace dmattn::cuda
