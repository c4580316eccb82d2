// Query-major backward kernels: one CTA per (query block, head, batch) walks the key blocks in a
// fixed order, recomputing S and dP with the same tiles and transform as bwd_kernel.h.
//  kStats = false (dQ): P, dS' as the main kernel, dQ = scale * dS' K accumulated in registers,
//    written once with saturation. No atomics: used for deterministic=True and the exact path.
//  kStats = true (exact path, pass 0): the row statistics m = max_j s_ij, l = sum_j exp(s_ij - m)
//    and Delta = sum_j P_ij dP_ij, recomputed in fp32 like the CPU backend: unlike
//    rowsum(dO * O) with the stored fp16/bf16 O, this Delta makes sum_j dS_ij cancel exactly (a
//    row with one allowed key gets dS = 0; a bias reduced over keys gets no rounding noise of
//    O), and m, log2 l stay separate, so a row whose keys all carry a finfo.min bias keeps
//    P = 1/n where exp(s - lse) would give 1.
// Packed variable-length batches (seq_bounds.h): a CTA whose query block starts past its
// sequence's end exits; the others stop at the sequence's last query and key.
// Gathered keys (f.kpos, key_positions.h): the key-block range by binary search over the
// positions, each block's positions tile loaded beside K.
#pragma once

#include "cuda/common/bwd_args.h"
#include "cuda/common/bwd_common.h"
#include "cuda/sm80/bwd_tile.h"
#include "cuda/common/copy.h"
#include "cuda/sm80/gemm.h"
#include "cuda/common/key_positions.h"
#include "cuda/common/operand_tile.h"
#include "cuda/common/score_terms.h"
#include "cuda/common/seq_bounds.h"

namespace dmattn::cuda {

template <class Tile, bool kMaskBias, bool kSoftcap, bool kStats, bool kTerms = false>
__global__ void __launch_bounds__(Tile::kNThreads, 1) bwd_dq_kernel(const __grid_constant__ BwdArgs a) {
  using namespace cute;
  using Element = typename Tile::Element;
  constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kHeadDim = Tile::kHeadDim;
  constexpr int kThreads = Tile::kNThreads;
  const FwdArgs& f = a.f;

  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x;
  const int m_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int m0 = m_block * kBlockM;
  const SeqBounds seq(f, b);
  if (m0 >= seq.len_q()) return;  // packed batch: past the end of a shorter sequence
  const int h_kv = h / f.group;

  int n_min, n_max;
  const bool gathered = f.kpos.ptr != nullptr;  // (never packed)
  if (gathered) KeyPositionRow(f, b, h).key_block_range(m0, kBlockM, kBlockN, n_min, n_max);
  else seq.window().key_block_range(m0, kBlockM, kBlockN, n_min, n_max);
  int32_t* const s_pos = reinterpret_cast<int32_t*>(smem + f.smem_kpos_off);

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffQ)), typename Tile::SmemLayoutQdO{});
  Tensor sdO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffdO)), typename Tile::SmemLayoutQdO{});
  Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffK)), typename Tile::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffV)), typename Tile::SmemLayoutKV{});
  Tensor sKt = make_tensor(sK.data(), typename Tile::SmemLayoutKt{});
  Tensor sKtNoSwz = make_tensor(sK.data().get(), typename Tile::SmemLayoutKtNoSwizzle{});
  Tensor sdS = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffdS)), typename Tile::SmemLayoutPdS{});
  char* s_bias = smem + Tile::kOffBias;
  char* s_mask = smem + Tile::mask_offset(f.bias.ptr != nullptr, f.bias_fp32);

  typename Tile::TiledMmaSdP mma_sdp;
  typename Tile::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKtNoSwz);

  auto copy_sdp_a = make_tiled_copy_A(typename Tile::LdsmCopy{}, mma_sdp);
  auto copy_sdp_b = make_tiled_copy_B(typename Tile::LdsmCopy{}, mma_sdp);
  auto copy_dq_a = make_tiled_copy_A(typename Tile::LdsmCopy{}, mma_dq);
  auto copy_dq_b = make_tiled_copy_B(typename Tile::LdsmCopyT{}, mma_dq);
  auto store_pds = make_tiled_copy_C(typename Tile::StoreCopyC{}, mma_sdp);
  auto thr_store_pds = store_pds.get_thread_slice(tid);

  Tensor tSsQ = copy_sdp_a.get_thread_slice(tid).partition_S(sQ);
  Tensor tdPsdO = copy_sdp_a.get_thread_slice(tid).partition_S(sdO);
  Tensor tSsK = copy_sdp_b.get_thread_slice(tid).partition_S(sK);
  Tensor tdPsV = copy_sdp_b.get_thread_slice(tid).partition_S(sV);
  Tensor tdQsdS = copy_dq_a.get_thread_slice(tid).partition_S(sdS);
  Tensor tdQsKt = copy_dq_b.get_thread_slice(tid).partition_S(sKt);
  Tensor tPsdS = thr_store_pds.partition_D(sdS);

  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_sdp.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;

  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_dq);
  // Row 0 of this block in lse / Delta / the statistics (re-read where used: seq_bounds.h).
  auto row_stat = [&] { return seq.stat_offset(h) + m0; };
  // kStats: this thread's running (max, sum of exp, sum of exp * dP) over its columns.
  float t_m[kRows], t_l[kRows], t_d[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) { t_m[r] = -INFINITY; t_l[r] = 0.f; t_d[r] = 0.f; }

  if (n_max > n_min) {
    const Element* gQ = static_cast<const Element*>(f.q) + int64_t(b) * f.q_bs + int64_t(seq.q0() + m0) * f.q_rs + int64_t(h) * f.q_hs;
    const Element* gdO = static_cast<const Element*>(a.dout) + int64_t(b) * a.do_bs + int64_t(seq.q0() + m0) * a.do_rs + int64_t(h) * a.do_hs;
    const Element* gK = static_cast<const Element*>(f.k) + int64_t(b) * f.k_bs + int64_t(seq.k0()) * f.k_rs + int64_t(h_kv) * f.k_hs;
    const Element* gV = static_cast<const Element*>(f.v) + int64_t(b) * f.v_bs + int64_t(seq.k0()) * f.v_rs + int64_t(h_kv) * f.v_hs;
    OperandTile<kBlockM, kBlockN, kThreads> mask_tile, bias_tile;
    if constexpr (kMaskBias) {
      if (f.mask.ptr) mask_tile.init(f.mask, b, h, m0, seq.len_q(), Tile::kMaskPitch, seq.k0());
      if (f.bias.ptr) bias_tile.init(f.bias, b, h, m0, seq.len_q(), Tile::kBiasPitch, seq.k0());
    }
    load_rows_async<kBlockM, kHeadDim, kThreads>(sQ, gQ, f.q_rs, seq.rows_valid(m0, kBlockM), f.head_dim, tid);
    load_rows_async<kBlockM, kHeadDim, kThreads>(sdO, gdO, a.do_rs, seq.rows_valid(m0, kBlockM), f.head_dim, tid);
    cp_async_commit();

    float row_m[kRows], row_log2l[kRows], delta[kRows];
    if constexpr (kStats) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) { t_m[r] = -INFINITY; t_l[r] = 0.f; t_d[r] = 0.f; }
    } else {
      const int64_t rs = row_stat();
      bwd_load_row_stats(tScS_rc, a.row_m + rs, a.row_log2l ? a.row_log2l + rs : nullptr, a.delta + rs,
                         seq.rows_valid(m0, kBlockM), row_m, row_log2l, delta);
    }

    for (int n = n_min; n < n_max; ++n) {
      const int n0 = n * kBlockN;
      __syncthreads();  // everyone is done with K / V / dS / mask / bias of the last block
      load_rows_async<kBlockN, kHeadDim, kThreads>(sK, gK + int64_t(n0) * f.k_rs, f.k_rs, seq.len_k() - n0, f.head_dim, tid);
      load_rows_async<kBlockN, kHeadDim, kThreads>(sV, gV + int64_t(n0) * f.v_rs, f.v_rs, seq.len_k() - n0, f.head_dim, tid);
      if constexpr (kMaskBias) {
        if (f.mask.ptr) mask_tile.load(s_mask, Tile::kMaskPitch, n0, seq.len_k(), tid);
        if (f.bias.ptr) bias_tile.load(s_bias, Tile::kBiasPitch, n0, seq.len_k(), tid);
      }
      if (gathered) load_positions_tile_async<kBlockN, kThreads, kMaskBias>(s_pos, positions_row(f.kpos, b, h), f.seqlen_k, n0, tid, ends_row(f.kpos, b, h), kBlockN);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();

      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma_sdp, copy_sdp_a, copy_sdp_b, tid);
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_dp);
      gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, mma_sdp, copy_sdp_a, copy_sdp_b, tid);

      Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      Tensor dp_rc = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
      Tensor tt = make_tensor<float>(acc_s.layout());
      Tensor tt_rc = make_tensor(tt.data(), acc_rowcol(tt.layout()));
      const PositionTest kp_test{s_pos, position_window(f), kBlockN};  // from the constant params
      const bool pos_mask = gathered ? positions_block_needs_mask<kBlockN>(position_window(f), s_pos, m0, kBlockM, kMaskBias && f.kpos.ends != nullptr)
                                     : seq.window().block_needs_mask(m0, kBlockM, kBlockN, n);
      bwd_scores<kMaskBias, kSoftcap, Element, kBlockN>(s_rc, tScS_rc, tt_rc, f, m0, n0, pos_mask, seq.window(),
                                                        f.bias.ptr ? s_bias : nullptr, bias_tile.pitch,
                                                        f.mask.ptr ? s_mask : nullptr, mask_tile.pitch,
                                                        gathered ? &kp_test : nullptr);
      if constexpr (kTerms) {  // the gate and windows with sinks (score_terms.h)
        static_assert(kMaskBias);
        const ScoreTermsRow terms = score_terms_row(f, b, h, seq.q0(), seq.k0(), seq.len_q(), seq.len_k());
        apply_score_terms<Element>(s_rc, tScS_rc, f, terms, m0, n0, seq.len_q() - m0, seq.len_k() - n0);
      }
      if constexpr (kStats) {
        constexpr float kLog2e = 1.4426950408889634f;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          float bm = t_m[r];
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s_rc); ++c) bm = fmaxf(bm, s_rc(r, c));
          // Nothing allowed yet in this thread's columns: bm = -inf, exp2 of the differences
          // from 0 instead, so that -inf scores give 0 and NaN scores (which fmaxf leaves out of
          // the max) still make l and d NaN (NaN in, NaN out), as the forward's softmax.
          const float bm_use = bm == -INFINITY ? 0.f : bm;
          const float alpha = exp2f((t_m[r] - bm_use) * kLog2e);  // old max -inf -> 0
          float l = 0.f, d = 0.f;
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s_rc); ++c) {
            const float e = exp2f((s_rc(r, c) - bm_use) * kLog2e);
            l += e;
            d = fmaf(e, dp_rc(r, c), d);
          }
          t_l[r] = t_l[r] * alpha + l;
          t_d[r] = t_d[r] * alpha + d;
          t_m[r] = bm;
        }
        continue;
      } else {
        bwd_p_ds(s_rc, dp_rc, row_m, row_log2l, delta);
      }
      if constexpr (kSoftcap) bwd_softcap_chain(acc_dp, tt);
      {
        Tensor rdS = make_tensor<Element>(acc_dp.layout());
        convert_fragment<Element, true>(acc_dp, rdS);
        copy(store_pds, thr_store_pds.retile_S(rdS), tPsdS);
      }
      __syncthreads();
      gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_dq, copy_dq_a, copy_dq_b, tid);
    }
    __syncthreads();  // all warps are done with sQ before it is reused for staging
  }

  if constexpr (kStats) {
    // Merge the per-thread statistics of each row: over the quad, then over the warps.
    constexpr float kLog2e = 1.4426950408889634f;
    // (m = -inf on both sides: the factors are 0, and a NaN l or d still reaches the sum.)
    auto merge = [&](float& m1, float& l1, float& d1, float m2, float l2, float d2) {
      const float mx = fmaxf(m1, m2);
      const float mx_use = mx == -INFINITY ? 0.f : mx;
      const float a1 = exp2f((m1 - mx_use) * kLog2e), a2 = exp2f((m2 - mx_use) * kLog2e);
      l1 = l1 * a1 + l2 * a2;
      d1 = d1 * a1 + d2 * a2;
      m1 = mx;
    };
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int x = 1; x <= 2; x <<= 1) {
        const float m2 = __shfl_xor_sync(0xffffffff, t_m[r], x);
        const float l2 = __shfl_xor_sync(0xffffffff, t_l[r], x);
        const float d2 = __shfl_xor_sync(0xffffffff, t_d[r], x);
        merge(t_m[r], t_l[r], t_d[r], m2, l2, d2);
      }
    }
    constexpr int kWarps = kThreads / 32;
    float* red = reinterpret_cast<float*>(smem + Tile::kOffP);  // [kBlockM][kWarps][3]
    for (int i = tid; i < kBlockM * kWarps; i += kThreads) {
      red[3 * i] = -INFINITY;
      red[3 * i + 1] = 0.f;
      red[3 * i + 2] = 0.f;
    }
    __syncthreads();
    if ((tid & 3) == 0) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float* e = red + 3 * (get<0>(tScS_rc(r, 0)) * kWarps + tid / 32);
        e[0] = t_m[r];
        e[1] = t_l[r];
        e[2] = t_d[r];
      }
    }
    __syncthreads();
    const int64_t rs = row_stat();
    const int rows_valid = seq.rows_valid(m0, kBlockM);
    for (int row = tid; row < rows_valid; row += kThreads) {
      float m1 = -INFINITY, l1 = 0.f, d1 = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float* e = red + 3 * (row * kWarps + w);
        merge(m1, l1, d1, e[0], e[1], e[2]);
      }
      // Empty: l == 0 exactly (a NaN l is a NaN row: its log2 l and Delta stay NaN, and so do its
      // P and dS wherever its scores are computed).
      const bool empty = l1 == 0.f;
      a.stats_m[rs + row] = empty ? INFINITY : m1;
      a.stats_log2l[rs + row] = empty ? 0.f : log2f(l1);
      a.delta[rs + row] = empty ? 0.f : d1 / l1;
    }
  } else {
    // (An else, not a return at the end of the branch above: after a return this epilogue is
    // unreachable code in the kStats instantiations, which nvcc warns about, #128-D.)
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) *= f.scale;
    Tensor rdQ = make_tensor<Element>(acc_dq.layout());
    convert_fragment<Element, true>(acc_dq, rdQ);
    copy(rdQ, thr_dq.partition_C(sQ));
    __syncthreads();
    Element* gdQ = static_cast<Element*>(a.dq) + int64_t(b) * a.dq_bs + int64_t(seq.q0() + m0) * a.dq_rs + int64_t(h) * a.dq_hs;
    constexpr int kChunksPerRow = kHeadDim / 8;
    const int rows_valid = seq.rows_valid(m0, kBlockM);
    CUTE_UNROLL
    for (int it = 0; it < kBlockM * kChunksPerRow / kThreads; ++it) {
      const int idx = it * kThreads + tid;
      const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
      if (r < rows_valid && c < f.head_dim)
        *reinterpret_cast<uint4*>(gdQ + int64_t(r) * a.dq_rs + c) = *reinterpret_cast<const uint4*>(&sQ(r, c));
    }
  }
}

}  // namespace dmattn::cuda
