// Gated attention's gate and windows with sinks on the sm80-class kernels (docs/semantics.md,
// "Gated attention", "Windows with sinks"), on one key block's scores in the accumulator's
// row/col view, after the scale, softcap, bias and the position tests of the kernel:
//   s += scale * g(alpha_i * delta_j)  where s is not -inf (a masked score stays masked)
//   s  = -inf                          where the window with sinks hides key j from query i, or
//                                      gate skipping skipped their cell
// and, in the backward, the gate's gradient from dS (before softcap's chain: the gate is added
// after the cap): with G = scale * g'(alpha_i delta_j) dS_ij, dalpha_i = sum_j G delta_j and
// ddelta_j = sum_i G alpha_i. alpha and delta are read through the L1 cache (a row or a column
// value per thread and block: tiny next to the K / V traffic).
#pragma once

#include <cmath>

#include "cuda/common/fwd_args.h"
#include "cuda/common/utils.h"

namespace dmattn::cuda {

template <typename Element>
__device__ __forceinline__ float gate_load(const char* base, int64_t off, bool fp32) {
  return fp32 ? __ldg(reinterpret_cast<const float*>(base) + off)
              : ElemInfo<Element>::to_float(reinterpret_cast<const Element*>(base) + off);
}

// The gate's function as numbers of the launch, so that one code path serves both functions
// without a select or a branch per element (the Hopper kernels, gate_sm90.h and
// gate_grads_sm90.h, whose score code must stay small enough to be inlined):
//   g(x)  = min(x, cap) - k log(1 + exp(-|x|))    logsigmoid: cap 0, k 1; linear: cap FLT_MAX, k 0
//   g'(x) = 1 - k / 2 - (k / 2) tanh(x / 2)       (sigmoid(-x) = (1 - tanh(x / 2)) / 2)
// (the logarithm and the tanh are finite for every x but NaN: k = 0 removes them, and a NaN x
// stays NaN either way; the linear gate's cap turns a product beyond fp32's range into the
// largest finite value: g is never +inf, so that a -inf score stays -inf with g added and the
// Hopper kernels need no test for it). g takes the product in log2 units, x2 = x log2(e), and g'
// half the product, x / 2 (the row's alpha pre-scaled once), so that each exponential, logarithm
// and tanh is one MUFU op: g costs five other instructions a score beside two MUFU ops, g' two
// beside one (the MUFU units' rate, 16 a cycle per multiprocessor, is what the gate's scores are
// short of: the softmax's one exponential a score already takes a fifth of the cycles of the
// products). g' through tanh.approx (relative error about 2^-11): an absolute error below 2.5e-4
// in g', which lies in [0, 1]; bf16's own rounding of G is 2^-9 relative.
struct GateMath {
  static constexpr float kLog2e = 1.4426950408889634f;  // the product's factor into log2 units
  static constexpr float kLn2 = 0.69314718055994531f;   // g's factor out of them
  float cap, k, half_k, one_minus_half_k;

  static __device__ __forceinline__ GateMath of(bool linear) {
    return linear ? GateMath{3.402823466e38f, 0.f, 0.f, 1.f} : GateMath{0.f, 1.f, 0.5f, 0.5f};
  }
  // g(x) log2(e) from x2 = x log2(e): min(x2, cap) - k log2(1 + 2^-|x2|).
  __device__ __forceinline__ float value_log2(float x2) const {
    return fmaf(-k, fast_log2(1.f + fast_exp2(-fabsf(x2))), fminf(x2, cap));
  }
  // g'(x) from xh = x / 2.
  __device__ __forceinline__ float slope_half(float xh) const {
    return fmaf(-half_k, fast_tanh(xh), one_minus_half_k);
  }
};

// One (batch, head)'s alpha or delta from a sequence's first row: element j at base + j * step
// (elements of q's type or fp32). base null: no gate.
struct GateRowSource {
  const char* base = nullptr;
  int64_t step = 0;
  bool fp32 = false;
};

// alpha of query head h, batch b, rows from the sequence's first query row q0.
__device__ __forceinline__ GateRowSource gate_alpha_source(const FwdArgs& a, int b, int h, int q0) {
  const GateArgs& g = a.gate;
  if (g.alpha == nullptr) return {};
  const int64_t off = int64_t(b) * g.alpha_bs + int64_t(q0) * g.alpha_rs + int64_t(h) * g.alpha_hs;
  return {g.alpha + off * (g.alpha_fp32 ? 4 : 2), g.alpha_rs, g.alpha_fp32};
}

// delta of query head h's kv head, batch b, rows from the sequence's first key row k0.
__device__ __forceinline__ GateRowSource gate_delta_source(const FwdArgs& a, int b, int h, int k0) {
  const GateArgs& g = a.gate;
  if (g.alpha == nullptr) return {};
  const int64_t off = int64_t(b) * g.delta_bs + int64_t(k0) * g.delta_rs + int64_t(h / a.group) * g.delta_hs;
  return {g.delta + off * (g.delta_fp32 ? 4 : 2), g.delta_rs, g.delta_fp32};
}

// One (batch, query head)'s gate rows and window, from the sequence's first query / key row.
struct ScoreTermsRow {
  const char* alpha = nullptr;  // null: no gate
  const char* delta = nullptr;
  int64_t alpha_rs = 0, delta_rs = 0;
  bool windows = false;
  int sink = 0, near = 0, gap = 0, far = 0;
  int offset = 0;  // len_k - len_q: causal alignment (bottom-right)
  const uint8_t* keep = nullptr;  // gate skipping: the (batch, head)'s cells, null = exact
  int64_t keep_ms = 0;

  // Query i and key j's cell computed (gate skipping; i, j inside the sequence).
  __device__ __forceinline__ bool keeps(int i, int j) const {
    return __ldg(keep + (i / kGateCell) * keep_ms + j / kGateCell) != 0;
  }

  // Key j (index in the sequence) visible to query i under the window with sinks.
  __device__ __forceinline__ bool visible(int i, int j) const {
    const int d = i + offset - j;
    return d >= 0 && (j < sink || d < near || (d >= near + gap && d - near - gap < far));
  }
};

// q0 / k0: the sequence's first rows (packed batches), len_q / len_k its lengths.
__device__ __forceinline__ ScoreTermsRow score_terms_row(const FwdArgs& a, int b, int h, int q0, int k0, int len_q,
                                                         int len_k) {
  ScoreTermsRow t;
  if (a.gate.alpha != nullptr) {
    const GateRowSource alpha = gate_alpha_source(a, b, h, q0), delta = gate_delta_source(a, b, h, k0);
    t.alpha = alpha.base;
    t.delta = delta.base;
    t.alpha_rs = alpha.step;
    t.delta_rs = delta.step;
    if (a.gate.keep != nullptr) {
      t.keep = a.gate.keep + int64_t(b) * a.gate.keep_bs + int64_t(h) * a.gate.keep_hs;
      t.keep_ms = a.gate.keep_ms;
    }
  }
  if (a.windows != nullptr) {
    const int32_t* w = a.windows + int64_t(h / a.windows_head_div) * a.windows_hs;
    // (a negative entry, which only a CUDA tensor can carry past the validation, counts as 0)
    t.windows = true;
    t.sink = max(__ldg(w), 0), t.near = max(__ldg(w + 1), 0), t.gap = max(__ldg(w + 2), 0), t.far = max(__ldg(w + 3), 0);
  }
  t.offset = len_k - len_q;
  return t;
}

// The gate and the window on scores s (row/col view, coord: (row, col) within the view), whose
// row 0 is query i0 and column 0 key j0 of the sequence; rows_valid / cols_valid: how many rows /
// columns from there lie inside it (the others are -inf already, and their alpha / delta are
// not read).
template <typename Element, class S, class C>
__device__ __forceinline__ void apply_score_terms(S& s, C const& coord, const FwdArgs& a, const ScoreTermsRow& t,
                                                  int i0, int j0, int rows_valid, int cols_valid) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(s))::value;
  const GateMath gm = GateMath::of(a.gate.linear);
  const float scale_ln2 = a.scale * GateMath::kLn2;  // (g in log2 units)
  float alpha2[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(coord(r, 0));
    alpha2[r] = t.alpha != nullptr && row < rows_valid
                    ? gate_load<Element>(t.alpha, (i0 + row) * t.alpha_rs, a.gate.alpha_fp32) * GateMath::kLog2e
                    : 0.f;
  }
  CUTE_UNROLL
  for (int c = 0; c < size<1>(s); ++c) {
    const int col = get<1>(coord(0, c));
    const float delta =
        t.alpha != nullptr && col < cols_valid ? gate_load<Element>(t.delta, (j0 + col) * t.delta_rs, a.gate.delta_fp32) : 0.f;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float x = s(r, c);
      if (t.alpha != nullptr && x != -INFINITY) x = fmaf(scale_ln2, gm.value_log2(alpha2[r] * delta), x);
      if (t.windows && !t.visible(i0 + get<0>(coord(r, 0)), j0 + col)) x = -INFINITY;
      // (a skipped cell's pairs count as masked; rows and columns past the sequence are -inf
      // already, and their cells lie past the map)
      if (t.keep != nullptr && get<0>(coord(r, 0)) < rows_valid && col < cols_valid &&
          !t.keeps(i0 + get<0>(coord(r, 0)), j0 + col))
        x = -INFINITY;
      s(r, c) = x;
    }
  }
}

// The gate's gradient from dS (row/col view like apply_score_terms's): row_sum[r] += sum_c G
// delta_c, and col_sum[slice * kCols + c] += sum_r G alpha_r for the view's columns (the view is
// slice `slice` of the key block: the array is indexed at compile-time offsets, the loop over the
// slices picking the live one, so that it stays in registers), G = scale * g'(alpha_r delta_c)
// dS (0 where dS is 0).
template <typename Element, int kSlices, int kRows, int kN, class DS, class C>
__device__ __forceinline__ void accumulate_gate_grads(const DS& ds, C const& coord, const FwdArgs& a,
                                                      const ScoreTermsRow& t, int i0, int j0, int rows_valid,
                                                      int cols_valid, int slice, float (&row_sum)[kRows],
                                                      float (&col_sum)[kN]) {
  using namespace cute;
  constexpr int kCols = decltype(size<1>(ds))::value;
  static_assert(kN == kSlices * kCols);
  const GateMath gm = GateMath::of(a.gate.linear);
  float alpha[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(coord(r, 0));
    alpha[r] = row < rows_valid ? gate_load<Element>(t.alpha, (i0 + row) * t.alpha_rs, a.gate.alpha_fp32) : 0.f;
  }
  CUTE_UNROLL
  for (int s = 0; s < kSlices; ++s) {
    if (slice != s) continue;
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      const int col = get<1>(coord(0, c));
      const float delta = col < cols_valid ? gate_load<Element>(t.delta, (j0 + col) * t.delta_rs, a.gate.delta_fp32) : 0.f;
      float cs = 0.f;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const float d = ds(r, c);
        const float g = d != 0.f ? a.scale * gm.slope_half(0.5f * alpha[r] * delta) * d : 0.f;
        row_sum[r] = fmaf(g, delta, row_sum[r]);
        cs = fmaf(g, alpha[r], cs);
      }
      col_sum[s * kCols + c] += cs;
    }
  }
}

}  // namespace dmattn::cuda
