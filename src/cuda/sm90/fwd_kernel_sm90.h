// The general Hopper forward kernel (sm_90a): what the warp-specialized kernel
// (fwd_ws_kernel_sm90.h) does not take (fp32 full biases, a full bias or mask with anything
// else, masks TMA cannot tile; fwd_ws_supports), and everything when DMATTN_FWD_SM90_WS=0.
// One CTA of two warpgroups per (128-query block, head, batch), wgmma for S = Q K^T (both
// operands in shared memory) and O += P V (P from registers), cp.async loads with zero-filled
// tails (copy.h), key blocks walked from the last to the first like the sm80 kernel
// (fwd_kernel.h), whose score transform, online softmax, block skipping and epilogue it reuses:
// the accumulator layout of wgmma has the same per-quad row ownership as mma.sync's.
// Plain scores (no mask / bias / softcap), K and V double buffered, one barrier per block:
//   block n:  issue loads K[n-1], V[n];  issue S = Q K[n]^T, then O += P[n+1] V[n+1];
//             wait S; softmax of S (the rescale of O deferred); wait O; rescale O; P[n] = S
//   so the loads land and the P V product runs while the softmax computes.
//   With a 16-bit bias and nothing else (run_fwd's bias fast path), the bias tile of block n - 1
//   is issued with K[n-1] into the other of two swizzled tiles (bias_tile_sm90.h) and block n's
//   scores become scale * qk + bias before the softmax (scale 1 there, safe subtraction).
// Mask / bias / softcap, single K and V buffers (the mask and bias tiles need the space), the
// bias and the mask look-ahead one block ahead (nn: the next live block):
//   block n:  wait K[n], bias[n], mask look-ahead; decide nn; barrier;
//             issue V[n], bias[nn] (second buffer), mask look-ahead of nn;
//             S = Q K[n]^T; barrier; issue K[nn]; transform, softmax;
//             wait V[n]; barrier; O += P V[n]
//   so the bias tile (the largest load: 128 x 128 x 2 bytes per block, straight from HBM)
//   streams in during a whole block of compute instead of the S GEMM alone, and V[n] during
//   the S GEMM, the transform and the softmax. A bias with no room for two tiles (fp32 at full
//   size: launch_fwd_kernel's a.bias_db = false) keeps one buffer, issued with V[n] and waited
//   before the transform, as before.
// Packed variable-length batches and gathered keys (a.kpos) as in the sm80 kernel: rows,
// lengths and window from SeqBounds, the block range of gathered keys from KeyPositionRow, and a
// kBlockN int32 positions tile per key block for the per-element test. The mask / bias kernel
// loads it with V and reads it after the following barrier, as the sm80 kernel does; the plain
// kernel transforms block n before V[n] has landed, so there the tile travels with K (one per
// K buffer, Tile::kStagesKV tiles at a.smem_kpos_off).
// Compiled for every target, with a body only for sm_90a (wgmma does not exist elsewhere);
// run_fwd launches it only on compute capability 9.0 devices.
#pragma once

#include "cuda/fwd_kernel.h"
#include "cuda/sm90/bias_tile_sm90.h"
#include "cuda/sm90/fwd_tile_sm90.h"
#include "cuda/sm90/gmma.h"

namespace dmattn::cuda::sm90 {

template <class Tile, bool kMaskBias>
__global__ void __launch_bounds__(Tile::kNThreads, 1) fwd_kernel_sm90(const __grid_constant__ FwdArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename Tile::Element;
  constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kHeadDim = Tile::kHeadDim;
  constexpr int kThreads = Tile::kNThreads;

  extern __shared__ __align__(1024) char smem[];
  const int tid = threadIdx.x;
  const int m_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int m0 = m_block * kBlockM;
  const SeqBounds seq(a, b);
  if (m0 >= seq.len_q()) return;  // packed batch: past the end of a shorter sequence
  const int h_kv = h / a.group;

  int n_min, n_max;
  const bool gathered = a.kpos.ptr != nullptr;  // (never packed)
  if (gathered) KeyPositionRow(a, b, h).key_block_range(m0, kBlockM, kBlockN, n_min, n_max);
  else seq.window().key_block_range(m0, kBlockM, kBlockN, n_min, n_max);
  int32_t* const s_pos = reinterpret_cast<int32_t*>(smem + a.smem_kpos_off);

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Tile::SmemLayoutQ{});
  // K / V buffer i (Tile::kStagesKV of each), and V buffer i viewed as (D, keys).
  auto sK_at = [&](int i) {
    return make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffK + i * Tile::kKVBytes)),
                       typename Tile::SmemLayoutKV{});
  };
  auto sV_at = [&](int i) {
    return make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem + Tile::kOffV + i * Tile::kKVBytes)),
                       typename Tile::SmemLayoutKV{});
  };
  auto sVt_at = [&](int i) { return make_tensor(sV_at(i).data(), typename Tile::SmemLayoutVt{}); };
  Tensor sK = sK_at(0);  // the single buffers of the mask / bias kernel
  Tensor sV = sV_at(0);

  typename Tile::TiledMmaS mma_s;
  typename Tile::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // shared-memory descriptors
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tOrVt = thr_o.partition_fragment_B(sVt_at(0));
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);
  Tensor acc_o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));

  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_s.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;

  OnlineSoftmax<kRows> softmax;
  softmax.init();
  constexpr float kLog2e = 1.4426950408889634f;
  // The plain kernel's bias fast path (run_fwd: a 16-bit bias, no mask, no softcap): the bias
  // tile of each key block travels with K (double buffered like it), s = scale * qk + bias.
  const bool plain_bias = !kMaskBias && a.bias.ptr != nullptr;
  const float score_scale = kMaskBias || plain_bias ? 1.f : a.scale;

  // The plain kernel's loop over key blocks n, n - 1, ..., n_min (see the top of the file).
  auto plain_loop = [&](int n, const Element* gQ, const Element* gK, const Element* gV) {
    Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    Tensor rP = make_tensor<Element>(acc_s.layout());
    Tensor tOrP = make_tensor(rP.data(), acc_to_a(rP.layout()));
    int kcur = 0, vcur = 0;
    bool have_p = false;  // P of the previous block waits in rP for its V (in buffer vcur)
    OperandTile<kBlockM, kBlockN, kThreads> bias_tile;
    if (plain_bias) bias_tile.init(a.bias, b, h, m0, seq.len_q(), kBlockN, seq.k0());
    auto s_bias_at = [&](int i) { return smem + a.smem_bias_off + i * a.smem_bias_stride; };

    load_rows_async<kBlockM, kHeadDim, kThreads>(sQ, gQ, a.q_rs, seq.rows_valid(m0, kBlockM), a.head_dim, tid);
    {
      Tensor sK0 = sK_at(0);
      load_rows_async<kBlockN, kHeadDim, kThreads>(sK0, gK + int64_t(n * kBlockN) * a.k_rs, a.k_rs,
                                                   seq.len_k() - n * kBlockN, a.head_dim, tid);
    }
    if (gathered)
      load_positions_tile_async<kBlockN, kThreads, kMaskBias>(s_pos, positions_row(a.kpos, b, h), a.seqlen_k, n * kBlockN, tid, ends_row(a.kpos, b, h), kBlockN);
    if (plain_bias) load_bias_tile_swizzled(s_bias_at(0), bias_tile, n * kBlockN, seq.len_k(), tid);
    cp_async_commit();
    cp_async_wait<0>();
    fence_smem_for_wgmma();
    __syncthreads();
    while (true) {
      const int n0 = n * kBlockN;
      const int nn = n - 1;
      // The buffers written here were last read by the products of the previous block, which
      // every warpgroup waited for before the barrier that ended it.
      if (nn >= n_min) {
        Tensor sKn = sK_at(kcur ^ 1);
        load_rows_async<kBlockN, kHeadDim, kThreads>(sKn, gK + int64_t(nn * kBlockN) * a.k_rs, a.k_rs,
                                                     seq.len_k() - nn * kBlockN, a.head_dim, tid);
        if (gathered)
          load_positions_tile_async<kBlockN, kThreads, kMaskBias>(s_pos + (kcur ^ 1) * kBlockN, positions_row(a.kpos, b, h),
                                                       a.seqlen_k, nn * kBlockN, tid, ends_row(a.kpos, b, h), kBlockN);
        if (plain_bias) load_bias_tile_swizzled(s_bias_at(kcur ^ 1), bias_tile, nn * kBlockN, seq.len_k(), tid);
      }
      {
        Tensor sVn = sV_at(vcur ^ 1);
        load_rows_async<kBlockN, kHeadDim, kThreads>(sVn, gV + int64_t(n0) * a.v_rs, a.v_rs, seq.len_k() - n0,
                                                     a.head_dim, tid);
      }
      cp_async_commit();

      Tensor tSrK = thr_s.partition_fragment_B(sK_at(kcur));
      gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_s, tSrQ, tSrK, acc_s);
      if (have_p) {
        Tensor tOrVt = thr_o.partition_fragment_B(sVt_at(vcur));
        gemm_issue</*kZeroInit=*/false, /*kRegA=*/true>(mma_o, tOrP, tOrVt, acc_o);
        gemm_wait<1>(acc_s);  // S done (the older batch); P V may still run
      } else {
        gemm_wait<0>(acc_s);
      }
      // The test's operand is a compile-time null or the address of a local in each branch, so
      // that the local stays in registers (a pointer chosen at run time put it on the stack).
      // s = scale * qk + bias[n] first (bias[n] landed with K[n]); the tests below only write -inf.
      if (plain_bias) add_bias_swizzled<Element, kBlockN>(s_rc, tScS_rc, s_bias_at(kcur), a.bias.row_bcast, a.scale);
      const WindowMask win = seq.window();
      if (gathered) {
        const PositionTest kp_test{s_pos + kcur * kBlockN, position_window(a), kBlockN};  // landed with K[n]
        if (positions_block_needs_mask<kBlockN>(kp_test.win, kp_test.s_pos, m0, kBlockM, kMaskBias && a.kpos.ends != nullptr))
          transform_scores_ex<false, true, Element, kBlockN, false>(s_rc, tScS_rc, a, m0, n0, win, nullptr, 0, nullptr, 0,
                                                                    &kp_test);
      } else if (win.block_needs_mask(m0, kBlockM, kBlockN, n)) {
        transform_scores_ex<false, true, Element, kBlockN, false>(s_rc, tScS_rc, a, m0, n0, win, nullptr, 0, nullptr, 0);
      }
      float alpha[kRows];
      // With a bias the scores are final (scale 1) and may be near -FLT_MAX (a finfo.min bias):
      // the safe subtraction, exp2((s - m) log2 e).
      if (plain_bias) softmax.template update_scaled_deferred<true>(s_rc, kLog2e, alpha);
      else softmax.template update_scaled_deferred<false>(s_rc, a.scale * kLog2e, alpha);
      gemm_wait<0>(acc_o);  // P V done: rP and O are free
      softmax.rescale(acc_o_rc, alpha);
      convert_fragment<Element, false>(acc_s, rP);
      have_p = true;

      cp_async_wait<0>();
      fence_smem_for_wgmma();
      __syncthreads();  // K[nn], V[n] visible; every warpgroup is done with K[n] and V[n + 1]
                        // (and the positions of n)
      kcur ^= 1;
      vcur ^= 1;
      if (nn < n_min) break;
      n = nn;
    }
    Tensor tOrVt = thr_o.partition_fragment_B(sVt_at(vcur));
    gemm_issue</*kZeroInit=*/false, /*kRegA=*/true>(mma_o, tOrP, tOrVt, acc_o);
    gemm_wait<0>(acc_o);
  };

  if (n_max > n_min) {
    const Element* gQ = static_cast<const Element*>(a.q) + int64_t(b) * a.q_bs + int64_t(seq.q0() + m0) * a.q_rs + int64_t(h) * a.q_hs;
    const Element* gK = static_cast<const Element*>(a.k) + int64_t(b) * a.k_bs + int64_t(seq.k0()) * a.k_rs + int64_t(h_kv) * a.k_hs;
    const Element* gV = static_cast<const Element*>(a.v) + int64_t(b) * a.v_bs + int64_t(seq.k0()) * a.v_rs + int64_t(h_kv) * a.v_hs;

    OperandTile<kBlockM, kBlockN, kThreads> mask_tile, bias_tile;
    const bool has_mask = kMaskBias && a.mask.ptr != nullptr;
    const bool has_bias = kMaskBias && a.bias.ptr != nullptr;
    char* const s_mask_base = smem + a.smem_mask_off;
    char* const s_bias_base = smem + a.smem_bias_off;
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

    if constexpr (!kMaskBias) {
      if (n >= n_min) plain_loop(n, gQ, gK, gV);
    } else if (n >= n_min) {
      // Mask / bias loop (schedule at the top of the file). Shared-memory buffers, placed by
      // launch_fwd_kernel: single K and V; three mask tiles (mcur: block n, mnext: the
      // look-ahead tile that decides nn, mfree: where nn's look-ahead goes); one or two bias
      // tiles (bias_db: the launcher found room for two, i.e. a 16-bit or query-broadcast bias).
      // The buffer indices all derive from one counter of blocks done (it): mask tiles rotate
      // mcur = it % 3, mnext = (it + 1) % 3, mfree = (it + 2) % 3, the bias tiles alternate
      // it & 1. (Three separate loop-carried indices cost 56 bytes of spills at 255 registers.)
      // cp.async groups committed per block, oldest first, always all four (possibly empty), so
      // that cp_async_wait<2> means "everything but the two newest groups":
      //   G1  positions tile of n, bias[n] when single buffered   (read by the transform)
      //   G2  V[n]                                                (read by P V)
      //   G3  bias[nn] when double buffered, mask look-ahead nn-1 (read next block)
      //   G4  K[nn]                                               (read next block)
      const bool bias_db = has_bias && a.bias_db;
      int it = 0;
      constexpr int mnext0 = 1;  // mnext of the first block (it = 0)
      auto load_bias = [&](int buf, int nb) {
        bias_tile.load_any(s_bias_base + buf * a.smem_bias_stride, Tile::kBiasPitch, nb * kBlockN, seq.len_k(), tid);
      };
      load_rows_async<kBlockM, kHeadDim, kThreads>(sQ, gQ, a.q_rs, seq.rows_valid(m0, kBlockM), a.head_dim, tid);
      load_rows_async<kBlockN, kHeadDim, kThreads>(sK, gK + int64_t(n * kBlockN) * a.k_rs, a.k_rs,
                                                   seq.len_k() - n * kBlockN, a.head_dim, tid);
      if (bias_db) load_bias(0, n);
      if (has_mask && n > n_min)
        mask_tile.template load_as<1>(s_mask_base + mnext0 * a.smem_mask_stride, Tile::kMaskPitch, (n - 1) * kBlockN,
                                      seq.len_k(), tid);
      cp_async_commit();
      while (true) {
        const int n0 = n * kBlockN;
        const int mcur = it % 3, mnext = mcur == 2 ? 0 : mcur + 1, mfree = 3 - mcur - mnext;
        const int bbuf = bias_db ? (it & 1) : 0;
        // Top: K[n] (and Q), bias[n] and the look-ahead mask tile landed (G3 / G4 of the last
        // block, issued a whole block ago); the barrier also means every warpgroup is done with
        // V, the positions tile, bias[n + 1] and mask[n + 1] of the last block. The look-ahead
        // decides the next live block nn here (next_live_key_block's barrier is this barrier),
        // so that nn's bias and look-ahead tile can be issued now, one block ahead.
        cp_async_wait<0>();      // K[n] landed: fenced before the barrier that publishes it
        fence_smem_for_wgmma();
        int nn = n - 1;
        if (has_mask && n > n_min) {
          nn = next_live_key_block(mask_tile, s_mask_base + mnext * a.smem_mask_stride, Tile::kMaskPitch, n - 1,
                                   n_min, seq.len_k(), tid);
        } else {
          __syncthreads();
        }
        if (gathered) load_positions_tile_async<kBlockN, kThreads, kMaskBias>(s_pos, positions_row(a.kpos, b, h), a.seqlen_k, n0, tid, ends_row(a.kpos, b, h), kBlockN);
        if (has_bias && !bias_db) load_bias(0, n);
        cp_async_commit();  // G1
        load_rows_async<kBlockN, kHeadDim, kThreads>(sV, gV + int64_t(n0) * a.v_rs, a.v_rs, seq.len_k() - n0, a.head_dim, tid);
        cp_async_commit();  // G2
        if (nn >= n_min) {
          if (bias_db) load_bias(bbuf ^ 1, nn);
          if (has_mask && nn > n_min)
            mask_tile.template load_as<1>(s_mask_base + mfree * a.smem_mask_stride, Tile::kMaskPitch, (nn - 1) * kBlockN,
                                          seq.len_k(), tid);
        }
        cp_async_commit();  // G3

        Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
        gemm_issue</*kZeroInit=*/true, /*kRegA=*/false>(mma_s, tSrQ, tSrK, acc_s);
        gemm_wait<0>(acc_s);

        // Middle: this thread's G1 landed (V[n] and the look-ahead may still be in flight); after
        // the barrier every G1 is visible and every warpgroup is done with K[n].
        cp_async_wait<2>();
        __syncthreads();
        if (nn >= n_min)
          load_rows_async<kBlockN, kHeadDim, kThreads>(sK, gK + int64_t(nn * kBlockN) * a.k_rs, a.k_rs,
                                                       seq.len_k() - nn * kBlockN, a.head_dim, tid);
        cp_async_commit();  // G4 (empty after the last block: the count stays right)

        Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
        const char* sb = has_bias ? s_bias_base + bbuf * a.smem_bias_stride : nullptr;
        const char* sm = has_mask ? s_mask_base + mcur * a.smem_mask_stride : nullptr;
        const WindowMask win = seq.window();
        if (gathered) {  // (one call per branch: see the plain loop)
          const PositionTest kp_test{s_pos, position_window(a), kBlockN};  // from the constant params
          transform_general_scores<Element, kBlockN>(
              s_rc, tScS_rc, a, m0, n0, positions_block_needs_mask<kBlockN>(kp_test.win, s_pos, m0, kBlockM, kMaskBias && a.kpos.ends != nullptr), win, sb,
              bias_tile.pitch, sm, mask_tile.pitch, &kp_test);
        } else {
          transform_general_scores<Element, kBlockN>(s_rc, tScS_rc, a, m0, n0, win.block_needs_mask(m0, kBlockM, kBlockN, n),
                                                     win, sb, bias_tile.pitch, sm, mask_tile.pitch);
        }
        softmax.template update<true>(s_rc, acc_o_rc);

        Tensor rP = make_tensor<Element>(acc_s.layout());
        convert_fragment<Element, false>(acc_s, rP);
        Tensor tOrP = make_tensor(rP.data(), acc_to_a(rP.layout()));
        // V[n] (G2) had the S GEMM, the transform and the softmax to land; G3 / G4 stay in flight.
        // ptxas hoists a plain wait and barrier above the whole softmax (no data dependence),
        // which then no longer overlaps the V load: `never` reads every row's running sum (a
        // sum of exponentials: never negative, and NaN < 0 is false too), and guards the wait
        // and feeds the barrier, so that both stay after the softmax. The wait always runs.
        bool never = false;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) never |= softmax.row_sum[r] < 0.f;
        if (!never) cp_async_wait<2>();
        fence_smem_for_wgmma();
        __syncthreads_or(never);
        gemm_issue</*kZeroInit=*/false, /*kRegA=*/true>(mma_o, tOrP, tOrVt, acc_o);
        gemm_wait<0>(acc_o);

        if (nn < n_min) break;
        n = nn;
        ++it;
      }
    }
    __syncthreads();  // every warpgroup is done with sQ (and the mask buffers) before sQ holds O
  }

  float lse[kRows];
  int rows[kRows];
  softmax.finalize(acc_o_rc, lse, score_scale);
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) rows[r] = get<0>(tScS_rc(r, 0));

  Element* gO = static_cast<Element*>(a.out) + int64_t(b) * a.o_bs + int64_t(seq.q0() + m0) * a.o_rs + int64_t(h) * a.o_hs;
  float* g_lse = a.lse + seq.stat_offset(h) + m0;
  fwd_epilogue<Tile>(acc_o, sQ, thr_o, lse, rows, gO, a.o_rs, g_lse, seq.rows_valid(m0, kBlockM), a.head_dim, tid);
#endif
}

}  // namespace dmattn::cuda::sm90
