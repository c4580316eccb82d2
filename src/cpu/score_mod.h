// Per-element score modification: scale, softcap, the gate of gated attention (gate.h), bias,
// and which positions are allowed (mask, causal/sliding window and windows with sinks on the
// key positions (key_rows.h), the gathered rows' query bound key_ends, bias != -inf, the gate's
// skipped cells).
//
// A disallowed position is *replaced* by -inf, never offset by a sentinel, so a finite score
// can never overflow and a disallowed position contributes nothing whatever its bias holds.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/element_types.h"
#include "cpu/gate.h"
#include "cpu/key_rows.h"
#include "cpu/tile_math.h"
#include "dmattn/params.h"

namespace dmattn::cpu {

// First index of the kBlockK-aligned key block containing `key` (blocks stay aligned so the
// forward and both backward passes see the same tiling as the GPU kernels).
inline int64_t aligned_block_start(int64_t index, int64_t block) { return index / block * block; }

template <typename Acc, typename BiasT>
struct ScoreMod {
  Acc scale = 1, softcap = 0;
  KeyRows keys;  // the causal/window rule on rows of k/v
  BroadcastOperand mask;  // mask.ptr: bool bytes, or null
  BroadcastOperand bias;  // bias.ptr: BiasT, or null
  GateTerm<Acc> gate;     // gated attention's scale * g(alpha_i delta_j), or absent

  explicit ScoreMod(const ForwardParams& p)
      : scale(static_cast<Acc>(p.scale)), softcap(static_cast<Acc>(p.softcap)), keys(p),
        mask(p.mask), bias(p.bias), gate(p) {}

  // Turns one tile of raw dot products <q_i, k_j> (rows x cols at query i0, key j0, leading
  // dimension kBlockK) into final scores in place; disallowed positions become -inf.
  // softcap_grad (nullable, same layout) receives d(capped)/d(scaled score): 1 - tanh^2
  // where the score is allowed and softcap is on, 1 otherwise.
  void apply(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
             Acc* tile, Acc* softcap_grad) const {
    constexpr Acc kNegInf = -std::numeric_limits<Acc>::infinity();
    const auto* mask_base = static_cast<const uint8_t*>(mask.ptr);
    const auto* bias_base = static_cast<const BiasT*>(bias.ptr);
    Acc delta[kBlockK];  // the gate's delta of this block's keys
    if (gate.present()) {
      for (int64_t c = 0; c < cols; ++c) delta[c] = gate.delta(b, j0 + c, h);
    }
    const LocalWindows* windows = keys.windows();
    const SinkWindow sink_window = windows ? SinkWindow::of(*windows, h) : SinkWindow{};
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      Acc* s = tile + r * kBlockK;
      Acc* grad = softcap_grad ? softcap_grad + r * kBlockK : nullptr;
      const IndexRange allowed = keys.for_queries(b, h, {i, i + 1});
      const int64_t allowed_begin = std::clamp<int64_t>(allowed.begin - j0, 0, cols);
      const int64_t allowed_end = std::clamp<int64_t>(allowed.end - j0, allowed_begin, cols);

      for (int64_t c = 0; c < allowed_begin; ++c) s[c] = kNegInf;
      for (int64_t c = allowed_end; c < cols; ++c) s[c] = kNegInf;
      if (grad) std::fill(grad, grad + cols, Acc(1));

      if (softcap > 0) {
        const Acc inv_softcap = Acc(1) / softcap;
        for (int64_t c = allowed_begin; c < allowed_end; ++c) {
          const Acc t = std::tanh(scale * s[c] * inv_softcap);
          s[c] = softcap * t;
          // 1 - tanh^2, as PyTorch's tanh backward and the GPU kernels compute it: its error
          // is absolute (~1 ulp of 1), so where tanh saturates it is 0 rather than the tiny
          // sech^2 -- matching every other implementation there.
          if (grad) grad[c] = Acc(1) - t * t;
        }
      } else {
        for (int64_t c = allowed_begin; c < allowed_end; ++c) s[c] *= scale;
      }

      if (gate.present()) {  // after the cap, like the bias; scaled like the dot product
        const Acc alpha = gate.alpha(b, i, h);
        for (int64_t c = allowed_begin; c < allowed_end; ++c) s[c] += scale * gate.value(alpha * delta[c]);
      }
      if (bias_base) {
        const BiasT* bias_row = bias_base + bias.offset(b, h, i, j0);
        for (int64_t c = allowed_begin; c < allowed_end; ++c) {
          const Acc value = load_as<Acc>(bias_row[c * bias.stride_k]);
          // -inf bias means "not allowed": replaced (not added), so that it masks a NaN score
          // too.
          s[c] = value == -std::numeric_limits<Acc>::infinity() ? kNegInf : s[c] + value;
        }
      }
      // The mask and the key ends come after the bias and replace the score, so that a
      // disallowed position stays exactly -inf whatever the bias holds there (NaN included).
      if (const int32_t* ends = keys.ends_row(b, h)) {
        for (int64_t c = allowed_begin; c < allowed_end; ++c) {
          if (i >= ends[j0 + c]) s[c] = kNegInf;
        }
      }
      if (mask_base) {
        const uint8_t* m = mask_base + mask.offset(b, h, i, j0);
        for (int64_t c = allowed_begin; c < allowed_end; ++c) {
          if (!m[c * mask.stride_k]) s[c] = kNegInf;
        }
      }
      if (windows) {
        for (int64_t c = allowed_begin; c < allowed_end; ++c) {
          if (!sink_window.allows(i + keys.offset() - (j0 + c), j0 + c)) s[c] = kNegInf;
        }
      }
      if (gate.op.keep != nullptr) {  // gate skipping: a skipped cell's pairs count as masked
        for (int64_t c = allowed_begin; c < allowed_end; ++c) {
          if (!gate.op.keeps(b, h, i, j0 + c)) s[c] = kNegInf;
        }
      }
    }
  }
};

}  // namespace dmattn::cpu
