// Gated attention's gate in the warp-specialized Hopper kernels (docs/semantics.md, "Gated
// attention"; the math of the sm80-class kernels' score_terms.h): the alpha rows of a query
// block and the delta rows of a key block come through the key rows' pipeline stages (one
// producer warp loads them, load_gate_rows), and
//   forward and backward:  s += scale * g(alpha_i delta_j) (add_gate_scores),
//                          on the final scores (after the scale, softcap and key bias), before
//                          the tests on positions and bounds;
//   backward:              the gradients, gate_grads_sm90.h;
//   gate skipping:         a skipped cell runs without the gate's value (gate_keep_row); the
//                          forward runs no product there either.
// (The rows' sources, gate_alpha_source / gate_delta_source: score_terms.h.)
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/common/fwd_args.h"
#include "cuda/common/score_terms.h"

namespace dmattn::cuda::sm90 {

// Rows [first, first + kRows) of a source into dst (fp32), by the 32 lanes of one warp; 0 from
// `count` rows on (past the sequence: never NaN, so that a zero G times them stays zero).
template <typename Element, int kRows>
__device__ __forceinline__ void load_gate_rows(float* dst, const GateRowSource& src, int first, int count) {
  for (int r = opaque_int(threadIdx.x & 31); r < kRows; r += 32)
    dst[r] = r < count ? gate_load<Element>(src.base, int64_t(first + r) * src.step, src.fp32) : 0.f;
}

// s += scale * g(alpha_row delta_col) on the accumulator's row/col view (coord: (row, col)
// within the tile), alpha from a kBlockM row of the stage and delta from a kBlockN row (column
// pairs adjacent: read as float2). A -inf score (a key bias's) stays -inf: g is finite or -inf
// for every product but NaN (GateMath), and a NaN gate at a masked position may reach its row
// (docs/semantics.md, "NaN"). One code path for both gate functions (GateMath's numbers): the
// callers' score lambdas stay small enough to be inlined (two unrolled copies kept them out of
// line, their accumulators in local memory).
template <class S, class C>
__device__ __forceinline__ void add_gate_scores(S& s, C const& coord, const float* s_alpha, const float* s_delta,
                                                float scale, bool linear) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(s))::value;
  const GateMath gm = GateMath::of(linear);
  const float scale_ln2 = scale * GateMath::kLn2;  // (g in log2 units)
  float alpha2[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) alpha2[r] = s_alpha[get<0>(coord(r, 0))] * GateMath::kLog2e;
  CUTE_UNROLL
  for (int c = 0; c < size<1>(s); c += 2) {
    const float2 d = *reinterpret_cast<const float2*>(s_delta + get<1>(coord(0, c)));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      s(r, c) = fmaf(scale_ln2, gm.value_log2(alpha2[r] * d.x), s(r, c));
      s(r, c + 1) = fmaf(scale_ln2, gm.value_log2(alpha2[r] * d.y), s(r, c + 1));
    }
  }
}

// Gate skipping (docs/semantics.md, "Gate skipping"): the cells of the query rows [m0, m0 + rows)
// of (batch b, query head h), rows within one cell (the kernels' query tiles divide it), where
// cell n is key block n of kGateCell keys; null without skipping. Every consumer of a tile reads
// the same cells, so that they skip the same blocks and keep their turns on the tensor cores.
// (32-bit index arithmetic: the map holds fewer than 2^31 cells, set_gate_keep checks it.)
__device__ __forceinline__ const uint8_t* gate_keep_row(const GateArgs& g, int b, int h, int m0) {
  if (g.keep == nullptr) return nullptr;
  return g.keep + (b * int(g.keep_bs) + h * int(g.keep_hs) + (m0 / kGateCell) * int(g.keep_ms));
}

// Whether key block n (of kGateCell keys) of a keep row is computed.
__device__ __forceinline__ bool gate_keeps(const uint8_t* keep_row, int n) {
  return keep_row == nullptr || __ldg(keep_row + n) != 0;
}

}  // namespace dmattn::cuda::sm90
