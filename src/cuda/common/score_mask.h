// The position part of the score transform, shared by the forward and backward kernels: adds
// the bias and replaces disallowed scores (mask false, outside the causal/sliding window or the
// key tail, bias == -inf) by -inf -- replaced, never offset by a sentinel. Runs in place on
// the accumulator row/col view of already scaled (and soft-capped) scores; bias and mask come
// from their shared-memory tiles (operand_tile.h), read two adjacent columns at a time.
// Per row, the window becomes a column range [lo, hi) relative to the thread's first column,
// so the per-element tests compare against compile-time offsets (no per-element registers).
// With gathered keys (pt non-null, kPosMask) the window part instead tests each column's
// original position, read from the key block's positions tile, against the row's allowed
// position range (key_positions.h). The two variants are separate inlined bodies, so that the
// one without positions keeps its registers.
#pragma once

#include <type_traits>

#include "cuda/common/bias.h"
#include "cuda/common/key_positions.h"
#include "cuda/common/mask.h"

namespace dmattn::cuda {

// kBias / kMask: which tiles are present, known at compile time inside the body (a run-time null
// test per element pair compiled to 64-bit pointer compares and materialized booleans, ~25
// instructions a pair; mask_and_bias_scores dispatches once per key block instead).
template <bool kBias, bool kMask, bool kPosMask, bool kPositions, bool kEnds, typename BiasT, int kBlockN, class S,
          class C>
__device__ __forceinline__ void mask_and_bias_scores_impl(S& s, C const& coord, int m0, int n0, const WindowMask& win,
                                                          const char* s_bias, int bias_pitch, const char* s_mask,
                                                          int mask_pitch, const PositionTest* pt) {
  using namespace cute;
  if constexpr (kBias || kMask || kPosMask) {
    const int col0 = get<1>(coord(0, 0));
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      const int row = get<0>(coord(r, 0));
      int lo = 0, hi = kBlockN;  // kPositions: a range of positions, else of columns
      if constexpr (kPositions) position_range(pt->win, m0 + row, lo, hi);
      else if constexpr (kPosMask) win.column_range(m0 + row, n0 + col0, kBlockN, lo, hi);
      const BiasT* brow = kBias ? reinterpret_cast<const BiasT*>(s_bias) + row * bias_pitch + col0 : nullptr;
      const uint8_t* mrow = kMask ? reinterpret_cast<const uint8_t*>(s_mask) + row * mask_pitch + col0 : nullptr;
      // Columns come in adjacent pairs (c, c + 1): one 32/64-bit shared load per pair.
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); c += 2) {
        const int cc = get<1>(coord(r, c)) - col0;  // compile-time after folding, even
        float x0 = s(r, c), x1 = s(r, c + 1);
        bool ok0 = true, ok1 = true;
        if constexpr (kBias) {
          float b0, b1;
          read_bias_pair(brow + cc, b0, b1);
          x0 += b0;  // a -inf bias gives -inf (the score is finite): no test needed
          x1 += b1;
        }
        if constexpr (kMask) {
          bool m0, m1;
          read_mask_pair(mrow + cc, m0, m1);
          ok0 = m0;
          ok1 = m1;
        }
        if constexpr (kPositions) {  // an even column: an 8-byte aligned pair of positions
          const int2 p = *reinterpret_cast<const int2*>(pt->s_pos + col0 + cc);
          ok0 = ok0 && p.x >= lo && p.x < hi;
          ok1 = ok1 && p.y >= lo && p.y < hi;
          if constexpr (kEnds) {  // key ends: the query must lie below the row's bound
            const int2 e = *reinterpret_cast<const int2*>(pt->s_pos + pt->end_delta + col0 + cc);
            ok0 = ok0 && m0 + row < e.x;
            ok1 = ok1 && m0 + row < e.y;
          }
        } else if constexpr (kPosMask) {
          ok0 = ok0 && cc >= lo && cc < hi;
          ok1 = ok1 && cc + 1 >= lo && cc + 1 < hi;
        }
        s(r, c) = ok0 ? x0 : -INFINITY;
        s(r, c + 1) = ok1 ? x1 : -INFINITY;
      }
    }
  }
}

// s_bias / s_mask: the tiles, null when absent (read only when kMaskBias). pt: gathered keys'
// positions test of these columns, null without gathered keys (read only when kPosMask); its
// key ends are tested only in the mask / bias variants (kMaskBias: the launchers send key ends
// there), so that the plain kernels keep their registers.
template <bool kMaskBias, bool kPosMask, typename BiasT, int kBlockN, class S, class C>
__device__ __forceinline__ void mask_and_bias_scores(S& s, C const& coord, int m0, int n0, const WindowMask& win,
                                                     const char* s_bias, int bias_pitch, const char* s_mask,
                                                     int mask_pitch, const PositionTest* pt = nullptr) {
  auto run = [&](auto bias_present, auto mask_present) {
    constexpr bool kB = decltype(bias_present)::value, kM = decltype(mask_present)::value;
    if constexpr (kPosMask) {
      if (pt) {
        mask_and_bias_scores_impl<kB, kM, true, true, kMaskBias, BiasT, kBlockN>(s, coord, m0, n0, win, s_bias,
                                                                                bias_pitch, s_mask, mask_pitch, pt);
        return;
      }
    }
    mask_and_bias_scores_impl<kB, kM, kPosMask, false, false, BiasT, kBlockN>(s, coord, m0, n0, win, s_bias,
                                                                             bias_pitch, s_mask, mask_pitch, nullptr);
  };
  using T = std::true_type;
  using F = std::false_type;
  if constexpr (kMaskBias) {
    if (s_bias != nullptr && s_mask != nullptr) run(T{}, T{});
    else if (s_bias != nullptr) run(T{}, F{});
    else if (s_mask != nullptr) run(F{}, T{});
    else run(F{}, F{});  // (softcap alone)
  } else {
    run(F{}, F{});
  }
}

}  // namespace dmattn::cuda
