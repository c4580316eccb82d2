// Online softmax over key blocks for the rows a thread owns (accumulator row/col view).
// Scores arrive in natural-log units with -inf at disallowed positions. The running max is
// guarded: a row whose max is still -inf uses 0, so -inf never meets -inf.
//   kSafeSub: p = exp2((s - m) * log2e), exact for scores near -FLT_MAX (a finfo.min bias on
//   an allowed key); otherwise p = exp2(s * log2e - m * log2e) in one FMA.
//   update_scaled_deferred<kSafeSub, kFmaWhenSmall>: the safe subtraction only when a row of
//   the warp has a max beyond kFmaMaxAbs, else the one FMA (bias scores: see there).
//   exp2 is ex2.approx.ftz (fast_exp2): probabilities below 2^-126 flush to 0.
#pragma once

#include <cmath>

#include "cuda/common/utils.h"

namespace dmattn::cuda {

template <int kRows>
struct OnlineSoftmax {
  static constexpr float kLog2e = 1.4426950408889634f;
  float row_max[kRows];
  float row_sum[kRows];  // per-thread partial sums; reduced over the quad in finalize()

  __device__ __forceinline__ void init() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
  }

  // s: (kRows, cols) scores of one key block, overwritten with probabilities.
  // o: (kRows, D) output accumulator, rescaled when the max grows.
  template <bool kSafeSub, class S, class O>
  __device__ __forceinline__ void update(S& s, O& o) {
    update_scaled<kSafeSub>(s, o, kLog2e);
  }

  // As update(), for scores s whose natural-log value is s * score_scale (score_scale > 0):
  // the softmax scale folds into the exponent, p = exp2(s * sl2 - m * sl2) with sl2 =
  // score_scale * log2(e), one FMA per element (kSafeSub: exp2((s - m) * sl2)). The running
  // max stays in s units; finalize() with the same score_scale turns it into the LSE.
  template <bool kSafeSub, class S, class O>
  __device__ __forceinline__ void update_scaled(S& s, O& o, float sl2) {
    float alpha[kRows];
    update_scaled_deferred<kSafeSub>(s, sl2, alpha);
    rescale(o, alpha);
  }

  // update_scaled() without touching o: the factors o must be multiplied by are returned in
  // alpha (rescale()), so that o can still be in use (an asynchronous P V product in flight)
  // while the probabilities of the next block are computed.
  // kFmaWhenSmall (with kSafeSub): the safe subtraction only where it matters. Scores with a
  // bias are final and may sit near -FLT_MAX, but a row whose max is at most kFmaMaxAbs in
  // magnitude takes the one-FMA exponent: m * sl2 is then finite, a score near -FLT_MAX gives
  // exp2(-inf) = 0 as it should, and the FMA's error in the exponent stays below
  // ulp(kFmaMaxAbs * log2 e) = 2^-11 (a relative 1.4e-4 on p, under bf16's and fp16's own
  // rounding of P). One vote per warp picks the loop, so the branch never diverges (per-row
  // branches measured slower than no FMA at all); the FMA saves an FMUL a score, one of the
  // seven or eight instructions a biased score costs.
  static constexpr float kFmaMaxAbs = 4096.f;

  template <bool kSafeSub, bool kFmaWhenSmall = false, class S>
  __device__ __forceinline__ void update_scaled_deferred(S& s, float sl2, float (&alpha)[kRows]) {
    using namespace cute;
    if constexpr (kSafeSub && kFmaWhenSmall) {
      float m_use[kRows];
      bool small = true;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        m_use[r] = update_max(s, r, sl2, alpha[r]);
        small = small && fabsf(m_use[r]) <= kFmaMaxAbs;
      }
      if (__all_sync(0xffffffffu, small)) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) exponentiate<false>(s, r, m_use[r], sl2);
      } else {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) exponentiate<true>(s, r, m_use[r], sl2);
      }
    } else {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) exponentiate<kSafeSub>(s, r, update_max(s, r, sl2, alpha[r]), sl2);
    }
  }

  // The new running max of row r (the value the exponents subtract: 0 while it is -inf) and
  // the factor alpha that the row's sum (here) and output (rescale()) take.
  template <class S>
  __device__ __forceinline__ float update_max(const S& s, int r, float sl2, float& alpha) {
    using namespace cute;
    float m = row_max[r];
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) m = fmaxf(m, s(r, c));
    m = quad_max(m);
    const float m_use = m == -INFINITY ? 0.f : m;
    alpha = fast_exp2((row_max[r] - m_use) * sl2);  // -inf old max -> 0
    row_sum[r] *= alpha;
    row_max[r] = m;
    return m_use;
  }

  // Row r of s becomes its probabilities exp(s - m), added to the row's sum.
  template <bool kSafeSub, class S>
  __device__ __forceinline__ void exponentiate(S& s, int r, float m_use, float sl2) {
    using namespace cute;
    const float m_scaled = m_use * sl2;
    float sum = 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      const float p = kSafeSub ? fast_exp2((s(r, c) - m_use) * sl2) : fast_exp2(fmaf(s(r, c), sl2, -m_scaled));
      s(r, c) = p;
      sum += p;
    }
    row_sum[r] += sum;
  }

  // rescale(), skipped when no row of the warp changed its max (every alpha exactly 1:
  // exp2(0)), as in most blocks past the first few: an FMUL an output element saved, for a vote
  // and a branch.
  template <class O>
  __device__ __forceinline__ void rescale_if_needed(O& o, const float (&alpha)[kRows]) {
    bool unchanged = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) unchanged = unchanged && alpha[r] == 1.f;
    if (!__all_sync(0xffffffffu, unchanged)) rescale(o, alpha);
  }

  template <class O>
  __device__ __forceinline__ void rescale(O& o, const float (&alpha)[kRows]) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= alpha[r];
    }
  }

  // Normalizes o; lse[r] = m + log(l), -inf (and o = 0) for a row with no allowed key (l == 0).
  // A NaN score (a NaN in q, k or the bias) is no allowed key's absence: fmaxf leaves it out of
  // the max, but p = exp2(NaN) makes l NaN, and with it o and lse (NaN in, NaN out).
  template <class O>
  __device__ __forceinline__ void finalize(O& o, float (&lse)[kRows]) {
    finalize(o, lse, 1.f);
  }

  // After update_scaled(): the running max is in s units, lse[r] = m * score_scale + log(l).
  template <class O>
  __device__ __forceinline__ void finalize(O& o, float (&lse)[kRows], float score_scale) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float l = quad_sum(row_sum[r]);
      const bool empty = l == 0.f;  // not !(l > 0.f): that would take a NaN sum for empty
      const float inv = empty ? 0.f : 1.f / l;
      lse[r] = empty ? -INFINITY : row_max[r] * score_scale + logf(l);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv;
    }
  }
};

}  // namespace dmattn::cuda
