// The gate of gated attention on the CPU (ForwardParams::gate, docs/semantics.md "Gated
// attention"): scale * g(alpha_i * delta_j) joins the scores like a bias, and its gradient
// reaches alpha and delta through g'.
//
// alpha and delta are tiny next to the scores ((B, S, H) against (B, H, Sq, Sk)), so they are
// read with a runtime dtype switch rather than another template dimension of the backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/element_types.h"
#include "dmattn/params.h"

namespace dmattn::cpu {

// One element of a float tensor of runtime dtype (float32, float16, bfloat16, float64).
template <typename Acc>
Acc load_scalar(const void* base, DType dtype, int64_t offset) {
  switch (dtype) {
    case DType::kFloat16: return load_as<Acc>(static_cast<const Half*>(base)[offset]);
    case DType::kBFloat16: return load_as<Acc>(static_cast<const BFloat16*>(base)[offset]);
    case DType::kFloat64: return load_as<Acc>(static_cast<const double*>(base)[offset]);
    default: return load_as<Acc>(static_cast<const float*>(base)[offset]);
  }
}

// Stores x into a float tensor of runtime dtype, saturating like every other output.
template <typename Acc>
void store_scalar(void* base, DType dtype, int64_t offset, Acc x) {
  switch (dtype) {
    case DType::kFloat16: return store_saturating(static_cast<Half*>(base) + offset, static_cast<float>(x));
    case DType::kBFloat16:
      return store_saturating(static_cast<BFloat16*>(base) + offset, static_cast<float>(x));
    case DType::kFloat64: return store_saturating(static_cast<double*>(base) + offset, x);
    default: return store_saturating(static_cast<float*>(base) + offset, x);
  }
}

template <typename Acc>
struct GateTerm {
  GateOperand op;
  int64_t group = 1;  // query heads per kv head: delta's head is h / group

  GateTerm(const ForwardParams& p) : op(p.gate), group(p.group_size()) {}

  bool present() const { return op.present(); }
  bool logsigmoid() const { return op.fn == GateFn::kLogSigmoid; }

  Acc alpha(int64_t b, int64_t i, int64_t h) const {
    return load_scalar<Acc>(op.alpha, op.alpha_dtype, op.alpha_strides.offset(b, i, h));
  }
  Acc delta(int64_t b, int64_t j, int64_t h) const {
    return load_scalar<Acc>(op.delta, op.delta_dtype, op.delta_strides.offset(b, j, h / group));
  }

  // g(x): logsigmoid(x) = min(x, 0) - log1p(exp(-|x|)) (no overflow for any x), or x, a product
  // past Acc's range (+inf) taken as its largest finite value as the CUDA kernels take fp32's
  // (a NaN stays NaN; -inf stays -inf: that key gets no weight).
  Acc value(Acc x) const {
    if (!logsigmoid()) return std::min(x, std::numeric_limits<Acc>::max());
    return std::min(x, Acc(0)) - std::log1p(std::exp(-std::abs(x)));
  }
  // g'(x): sigmoid(-x) = 1 - sigmoid(x), or 1.
  Acc derivative(Acc x) const {
    if (!logsigmoid()) return Acc(1);
    const Acc e = std::exp(-std::abs(x));  // in (0, 1]
    return x >= 0 ? e / (Acc(1) + e) : Acc(1) / (Acc(1) + e);
  }
};

}  // namespace dmattn::cpu
