// Pieces shared by the backward kernels: the query-block range of a key block, the score
// recomputation (same transform as the forward), P = exp(s - lse) and dS = P * (dP - Delta).
#pragma once

#include <cmath>

#include "cuda/common/bias.h"
#include "cuda/common/fwd_args.h"
#include "cuda/common/mask.h"
#include "cuda/common/score_mask.h"
#include "cuda/common/utils.h"

namespace dmattn::cuda {

// Query blocks [m_lo, m_hi) holding a query that may attend a key of [n0, n0 + block_n)
// (inverse of WindowMask::key_block_range). Empty when m_hi <= m_lo.
__device__ __forceinline__ void bwd_query_block_range(const WindowMask& w, int n0, int block_n, int block_m,
                                                      int& m_lo, int& m_hi) {
  const int64_t n_last = min(int64_t(n0) + block_n, w.seqlen_k) - 1;
  const int64_t off = w.seqlen_k - w.seqlen_q;
  int64_t lo = 0, hi = w.seqlen_q;  // queries [lo, hi)
  if (w.right >= 0) lo = max(lo, int64_t(n0) - off - w.right);
  if (w.left >= 0) hi = min(hi, n_last - off + w.left + 1);
  if (n_last < n0 || hi <= lo) {
    m_lo = m_hi = 0;
    return;
  }
  m_lo = int(lo / block_m);
  m_hi = int((hi + block_m - 1) / block_m);
}

// Score transform of one (query block, key block) tile, in place on the accumulator row/col
// view, exactly as the forward: s = scale * qk; softcap; s += bias; -inf where not allowed
// (mask, window, tails, bias == -inf). A disallowed score is replaced, never offset.
// kSoftcap: t = tanh(scale * qk / softcap) is kept in `tt` for the chain rule.
template <bool kMaskBias, bool kPosMask, bool kSoftcap, typename BiasT, int kBlockN, class S, class C, class TT>
__device__ __forceinline__ void bwd_transform_scores(S& s, C const& coord, TT& tt, const FwdArgs& a, int m0, int n0,
                                                     const WindowMask& win, const char* s_bias, int bias_pitch,
                                                     const char* s_mask, int mask_pitch, const PositionTest* pt) {
  using namespace cute;
  if constexpr (kSoftcap) {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) {
      const float t = tanhf(s(i) * a.scale_div_softcap);
      tt(i) = t;
      s(i) = a.softcap * t;
    }
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) s(i) *= a.scale;
  }
  mask_and_bias_scores<kMaskBias, kPosMask, BiasT, kBlockN>(s, coord, m0, n0, win, s_bias, bias_pitch, s_mask,
                                                           mask_pitch, pt);
}

// Dispatches the transform on (pos_mask, bias dtype). pt: gathered keys' positions test of
// these columns (key_positions.h), null without gathered keys; read only when pos_mask.
template <bool kMaskBias, bool kSoftcap, typename Element, int kBlockN, class S, class C, class TT>
__device__ __forceinline__ void bwd_scores(S& s, C const& coord, TT& tt, const FwdArgs& a, int m0, int n0,
                                           bool pos_mask, const WindowMask& win, const char* s_bias, int bias_pitch,
                                           const char* s_mask, int mask_pitch, const PositionTest* pt = nullptr) {
  if constexpr (kMaskBias) {
    if (a.bias_fp32) {
      if (pos_mask) bwd_transform_scores<true, true, kSoftcap, float, kBlockN>(s, coord, tt, a, m0, n0, win, s_bias, bias_pitch, s_mask, mask_pitch, pt);
      else bwd_transform_scores<true, false, kSoftcap, float, kBlockN>(s, coord, tt, a, m0, n0, win, s_bias, bias_pitch, s_mask, mask_pitch, pt);
    } else {
      if (pos_mask) bwd_transform_scores<true, true, kSoftcap, Element, kBlockN>(s, coord, tt, a, m0, n0, win, s_bias, bias_pitch, s_mask, mask_pitch, pt);
      else bwd_transform_scores<true, false, kSoftcap, Element, kBlockN>(s, coord, tt, a, m0, n0, win, s_bias, bias_pitch, s_mask, mask_pitch, pt);
    }
  } else {
    if (pos_mask) bwd_transform_scores<false, true, kSoftcap, Element, kBlockN>(s, coord, tt, a, m0, n0, win, nullptr, 0, nullptr, 0, pt);
    else bwd_transform_scores<false, false, kSoftcap, Element, kBlockN>(s, coord, tt, a, m0, n0, win, nullptr, 0, nullptr, 0, pt);
  }
}

// Softmax statistics and Delta of the rows a thread owns. P = exp(s - m) / l is computed as
// exp2((s - m) * log2e - log2(l)):
//   lse path:   m = lse (from the forward), log2 l = 0 (g_log2l null);
//   exact path: m, log2 l from bwd_stats (recomputed; keeps log l even when |m| is huge).
// A row outside Sq or with no allowed key gets m = +inf, so that P is exactly 0 there and -inf
// never meets -inf; its Delta is 0. The test is m == -inf exactly: a NaN row (NaN lse, or NaN
// log2 l and Delta) keeps P and dS NaN.
// kReadAll: every row of the tile is readable (a shared-memory stage of kBlockM rows, those past
// the sequence unwritten): all are loaded and the rows outside are replaced after the loads, so
// that the loads carry no branch and their uses can be scheduled away from them (behind a
// branch per row, each use waited on its shared load right after it).
template <int kRows, bool kReadAll = false, class C>
__device__ __forceinline__ void bwd_load_row_stats(C const& coord, const float* g_m, const float* g_log2l,
                                                   const float* g_delta, int rows_valid, float (&m)[kRows],
                                                   float (&log2l)[kRows], float (&delta)[kRows]) {
  using namespace cute;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(coord(r, 0));
    float mm = INFINITY, ll = 0.f, d = 0.f;
    if constexpr (kReadAll) {
      const float lm = g_m[row], lll = g_log2l ? g_log2l[row] : 0.f, ld = g_delta[row];
      const bool in = row < rows_valid;
      mm = in && lm != -INFINITY ? lm : INFINITY;
      ll = in ? lll : 0.f;
      d = in ? ld : 0.f;
    } else if (row < rows_valid) {
      mm = g_m[row];
      if (g_log2l) ll = g_log2l[row];
      d = g_delta[row];
      if (mm == -INFINITY) mm = INFINITY;
    }
    m[r] = mm;
    log2l[r] = ll;
    delta[r] = d;
  }
}

// s (scores) -> P = exp(s - m) / l, computed as exp2((s - m) * log2e - log2 l): the difference first, so
// a score near -FLT_MAX (finfo.min bias on an allowed key) never overflows when scaled.
// dp -> dS = P * (dP - Delta), exactly 0 wherever P is 0. Where P == 1 exactly (the key holds
// the whole row's mass, every other P_k < 2^-24), dS = P * sum_k P_k (dP_j - dP_k) is below
// fp32 resolution: it is set to 0 rather than left to the rounding noise of Delta, which comes
// from the stored low-precision O (a row with a single allowed key must get exactly 0: x = 0
// there, and exp2(0) = 1 exactly). P = min(exp2(x), 1) is exactly 1 only where exp2 rounds to 1,
// x above about -2^-24 (ex2.approx's own error included): the other keys of the row then hold
// about 2^-24 of its mass or less, so dS is at fp32 resolution there too. dS tests P itself:
// no per-element flag is held between the two, which the kernels schedule around the dP
// product, and no test on x comes before the exponent (it cost a compare and a constant per
// score).
template <int kRows, class S, class DP>
__device__ __forceinline__ void bwd_p_ds(S& s, DP& dp, const float (&m)[kRows], const float (&log2l)[kRows],
                                         const float (&delta)[kRows]) {
  using namespace cute;
  constexpr float kLog2e = 1.4426950408889634f;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      // ex2.approx like the forward's softmax (exp2f's range handling was ~1/7 of the Hopper
      // backward's instructions); the min keeps a NaN and caps the rounding of x > 0 (lse path).
      const float x = (s(r, c) - m[r]) * kLog2e - log2l[r];
      s(r, c) = min_keep_nan(fast_exp2(x), 1.f);
    }
  }
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      const float p = s(r, c);
      dp(r, c) = p == 1.f ? 0.f : p * (dp(r, c) - delta[r]);
    }
  }
}

// dS -> dS * (1 - t^2): the derivative of softcap * tanh(x / softcap).
template <class DS, class TT>
__device__ __forceinline__ void bwd_softcap_chain(DS& ds, TT const& tt) {
  using namespace cute;
  CUTE_UNROLL
  for (int i = 0; i < size(ds); ++i) ds(i) *= 1.f - tt(i) * tt(i);
}

// Element (or float) store of an fp32 value, saturating for the 16-bit types (saturate_keep_nan:
// a NaN stays NaN).
template <typename T>
__device__ __forceinline__ void store_sat(T* p, float v) {
  if constexpr (std::is_same_v<T, float>) {
    *p = v;
  } else {
    *p = T(saturate_keep_nan<T>(v));
  }
}

}  // namespace dmattn::cuda
