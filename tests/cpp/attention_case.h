// One attention test case: its configuration, the tensors (randomly filled, optionally in
// non-contiguous layouts), running forward + backward through make_*_params and the CPU
// backend, and the comparison against the float64 reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "dmattn/api.h"
#include "naive_reference.h"
#include "test_tensor.h"

namespace dmattn::test {

struct CaseConfig {
  DType dtype = DType::kFloat32;
  int64_t batch = 1, seqlen_q = 1, seqlen_k = 1, heads = 1, heads_kv = 1, dim = 8;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  double scale = std::nan("");  // NaN = default 1/sqrt(D)
  double softcap = 0;
  std::optional<std::vector<int64_t>> mask_shape;  // rank <= 4, right-aligned
  std::optional<std::vector<int64_t>> bias_shape;
  DType bias_dtype = DType::kFloat32;
  bool bias_grad = true;
  double mask_keep = 0.75;          // probability a mask element is true
  double empty_mask_rows = 0;       // probability a whole mask row (all keys) is false
  double bias_neg_inf = 0;          // probability a bias element is -inf
  double bias_lowest = 0;           // probability a bias element is finfo(bias dtype).min
  bool strided = false;             // non-contiguous layouts everywhere allowed
  uint64_t seed = 1;
};

inline const char* short_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat64: return "f64";
    default: return "?";
  }
}

inline std::string shape_string(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? "," : "") << s[i];
  return os.str() + ")";
}

inline std::string describe(const CaseConfig& c) {
  std::ostringstream os;
  os << short_name(c.dtype) << " B=" << c.batch << " Sq=" << c.seqlen_q << " Sk=" << c.seqlen_k
     << " H=" << c.heads << " Hkv=" << c.heads_kv << " D=" << c.dim << " causal=" << c.causal
     << " window=(" << c.window_left << "," << c.window_right << ") scale=" << c.scale
     << " softcap=" << c.softcap;
  if (c.mask_shape) {
    os << " mask" << shape_string(*c.mask_shape) << " empty_rows=" << c.empty_mask_rows;
  }
  if (c.bias_shape) {
    os << " bias" << shape_string(*c.bias_shape) << ":" << short_name(c.bias_dtype)
       << (c.bias_grad ? "+grad" : "") << " -inf=" << c.bias_neg_inf << " min=" << c.bias_lowest;
  }
  os << (c.strided ? " strided" : "") << " seed=" << c.seed;
  return os.str();
}

inline double lowest_finite(DType d) {
  switch (d) {
    case DType::kFloat16: return -65504.0;
    case DType::kBFloat16: return -0x1.FEp127;
    case DType::kFloat64: return std::numeric_limits<double>::lowest();
    default: return std::numeric_limits<float>::lowest();
  }
}

// Unit roundoff of a dtype.
inline double unit_roundoff(DType d) {
  switch (d) {
    case DType::kFloat16: return 0x1p-11;
    case DType::kBFloat16: return 0x1p-8;
    case DType::kFloat64: return 0x1p-53;
    default: return 0x1p-24;
  }
}

// The tensors of one case.
struct CaseTensors {
  TestTensor q, k, v, out, lse, dout, dq, dk, dv, mask, bias, dbias;
  bool has_mask = false, has_bias = false, has_dbias = false;
};

inline Layout seq_layout(bool strided, std::mt19937_64& rng) {
  if (!strided) return {};
  // Physical (B, H, S, D) or (S, B, H, D) with padding; the last dim stays contiguous.
  if (rng() % 2) return {{0, 2, 1, 3}, 3};
  return {{1, 0, 2, 3}, 5};
}

inline Layout operand_layout(int64_t rank, bool strided, std::mt19937_64& rng) {
  if (!strided) return {};
  Layout layout;
  layout.order.resize(rank);
  std::iota(layout.order.begin(), layout.order.end(), 0);
  std::shuffle(layout.order.begin(), layout.order.end(), rng);  // even the key dim may stride
  layout.pad = 2;
  return layout;
}

// Random inputs for a case; outputs are allocated (and poisoned later, in run_case).
inline CaseTensors make_case_tensors(const CaseConfig& c) {
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  CaseTensors t;
  const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, D = c.dim;
  t.q = TestTensor(c.dtype, {B, Sq, c.heads, D}, seq_layout(c.strided, rng));
  t.k = TestTensor(c.dtype, {B, Sk, c.heads_kv, D}, seq_layout(c.strided, rng));
  t.v = TestTensor(c.dtype, {B, Sk, c.heads_kv, D}, seq_layout(c.strided, rng));
  t.dout = TestTensor(c.dtype, {B, Sq, c.heads, D}, seq_layout(c.strided, rng));
  t.out = TestTensor(c.dtype, {B, Sq, c.heads, D}, seq_layout(c.strided, rng));
  t.dq = TestTensor(c.dtype, {B, Sq, c.heads, D}, seq_layout(c.strided, rng));
  t.dk = TestTensor(c.dtype, {B, Sk, c.heads_kv, D}, seq_layout(c.strided, rng));
  t.dv = TestTensor(c.dtype, {B, Sk, c.heads_kv, D}, seq_layout(c.strided, rng));
  const DType stat = c.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  t.lse = TestTensor(stat, {B, c.heads, Sq});
  // Never zeros: N(0, 1) inputs.
  for (TestTensor* x : {&t.q, &t.k, &t.v, &t.dout}) {
    for (int64_t e = 0; e < x->numel(); ++e) x->set(e, normal(rng));
  }
  if (c.mask_shape) {
    t.has_mask = true;
    const auto& shape = *c.mask_shape;
    t.mask = TestTensor(DType::kBool, shape, operand_layout(shape.size(), c.strided, rng));
    const int64_t keys = shape.empty() ? 1 : shape.back();
    for (int64_t row = 0; row * keys < t.mask.numel(); ++row) {
      const bool empty = uniform(rng) < c.empty_mask_rows;
      for (int64_t j = 0; j < keys; ++j) {
        t.mask.set(row * keys + j, !empty && uniform(rng) < c.mask_keep);
      }
    }
  }
  if (c.bias_shape) {
    t.has_bias = true;
    const auto& shape = *c.bias_shape;
    t.bias = TestTensor(c.bias_dtype, shape, operand_layout(shape.size(), c.strided, rng));
    for (int64_t e = 0; e < t.bias.numel(); ++e) {
      const double u = uniform(rng);
      double value = 1.5 * normal(rng);
      if (u < c.bias_neg_inf) value = -std::numeric_limits<double>::infinity();
      else if (u < c.bias_neg_inf + c.bias_lowest) value = lowest_finite(c.bias_dtype);
      t.bias.set(e, value);
    }
    if (c.bias_grad) {
      t.has_dbias = true;
      t.dbias = TestTensor(c.bias_dtype, shape, operand_layout(shape.size(), c.strided, rng));
    }
  }
  return t;
}

inline AttentionOptions options_of(const CaseConfig& c) {
  AttentionOptions o;
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.scale = c.scale;
  o.softcap = c.softcap;
  o.deterministic = true;
  return o;
}

// Poisons every output, then runs forward and backward (backward consumes the forward's out
// and lse, as autograd would).
inline void run_case(const CaseConfig& c, CaseTensors& t) {
  for (TestTensor* x : {&t.out, &t.lse, &t.dq, &t.dk, &t.dv}) x->poison();
  if (t.has_dbias) t.dbias.poison();
  TensorDesc q = t.q.desc(), k = t.k.desc(), v = t.v.desc(), out = t.out.desc(),
             lse = t.lse.desc(), dout = t.dout.desc(), dq = t.dq.desc(), dk = t.dk.desc(),
             dv = t.dv.desc(), mask = t.mask.desc(), bias = t.bias.desc(), dbias = t.dbias.desc();
  const TensorDesc* mask_ptr = t.has_mask ? &mask : nullptr;
  const TensorDesc* bias_ptr = t.has_bias ? &bias : nullptr;
  const TensorDesc* dbias_ptr = t.has_dbias ? &dbias : nullptr;
  const AttentionOptions options = options_of(c);
  cpu::forward(make_forward_params(q, k, v, out, lse, mask_ptr, bias_ptr, options));
  cpu::backward(make_backward_params(q, k, v, out, lse, mask_ptr, bias_ptr, dout, dq, dk, dv,
                                     dbias_ptr, nullptr, nullptr, nullptr, options));
}

inline RefOperand ref_operand(const TestTensor& t) {
  RefOperand op;
  op.present = true;
  op.values = t.values();
  const int64_t pad = 4 - t.rank();
  for (int64_t d = 0; d < t.rank(); ++d) op.size[pad + d] = t.shape()[d];
  return op;
}

inline RefResult reference_of(const CaseConfig& c, const CaseTensors& t) {
  RefProblem pr;
  pr.batch = c.batch, pr.seqlen_q = c.seqlen_q, pr.seqlen_k = c.seqlen_k;
  pr.heads = c.heads, pr.heads_kv = c.heads_kv, pr.dim = c.dim;
  pr.scale = std::isnan(c.scale) ? 1.0 / std::sqrt(static_cast<double>(c.dim)) : c.scale;
  pr.softcap = c.softcap;
  pr.window_left = c.window_left;
  pr.window_right = c.causal ? 0 : c.window_right;
  pr.q = t.q.values(), pr.k = t.k.values(), pr.v = t.v.values(), pr.dout = t.dout.values();
  if (t.has_mask) pr.mask = ref_operand(t.mask);
  if (t.has_bias) pr.bias = ref_operand(t.bias);
  return naive_attention_reference(pr);
}

inline double smallest_subnormal(DType d) {
  switch (d) {
    case DType::kFloat16: return 0x1p-24;
    case DType::kBFloat16: return 0x1p-133;
    case DType::kFloat64: return 0x1p-1074;
    default: return 0x1p-149;
  }
}

// |got - ref| <= rel * mag elementwise (so a reference that is exactly 0 because nothing
// contributes must be exactly 0), finite results, -inf exactly where ref is -inf, and every
// byte outside the logical elements untouched.
inline void expect_close(const char* name, const TestTensor& got, const std::vector<double>& ref,
                         const std::vector<double>& mag, double rel, const std::string& where) {
  // Results below the output type's subnormal range legitimately flush towards 0.
  const double underflow = smallest_subnormal(got.dtype());
  ASSERT_EQ(static_cast<size_t>(got.numel()), ref.size()) << name;
  EXPECT_TRUE(got.padding_untouched()) << name << " wrote outside its elements; " << where;
  int64_t failures = 0;
  for (int64_t e = 0; e < got.numel(); ++e) {
    const double g = got.get(e);
    const double allowed = rel * mag[e] + (mag[e] > 0 ? underflow : 0.0);
    const bool ok = std::isinf(ref[e]) ? g == ref[e]
                                       : std::isfinite(g) && std::fabs(g - ref[e]) <= allowed;
    if (!ok && ++failures <= 3) {
      ADD_FAILURE() << name << "[" << e << "] = " << g << ", reference " << ref[e]
                    << ", allowed error " << allowed << " (magnitude " << mag[e] << "); "
                    << where;
    }
  }
  EXPECT_EQ(failures, 0) << name << ": " << failures << " of " << got.numel()
                         << " elements out of tolerance; " << where;
}

// Relative tolerance per unit of magnitude: fp32 (fp64 for fp64 inputs) accumulation error
// plus the final rounding to the output dtype. (Measured worst case over the suite: about a
// quarter of this.)
inline double tolerance_for(DType dtype, DType output_dtype) {
  const DType acc = dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  return 16 * unit_roundoff(acc) + 2 * unit_roundoff(output_dtype);
}

// How errors are scaled: per element by the reference's magnitude (the default; exact zeros
// stay exact), or by the largest |reference| of each tensor. The latter is for rows whose
// scores are all swamped by a huge bias: every implementation (and the float64 reference)
// rounds them to one value, which the per-element error model would not trust at all.
enum class ErrorScale { kPerElement, kTensorMax };

inline std::vector<double> tensor_max_scale(const std::vector<double>& ref) {
  double largest = 0;
  for (double x : ref) {
    if (std::isfinite(x)) largest = std::max(largest, std::fabs(x));
  }
  return std::vector<double>(ref.size(), largest);
}

// Runs the case on the given tensors (poisoning the outputs first) and compares everything
// with the reference.
inline void check_tensors_against_reference(const CaseConfig& c, CaseTensors& t,
                                            ErrorScale scale = ErrorScale::kPerElement) {
  run_case(c, t);
  const RefResult r = reference_of(c, t);
  const std::string where = describe(c);
  auto mag = [&](const std::vector<double>& ref, const std::vector<double>& per_element) {
    return scale == ErrorScale::kPerElement ? per_element : tensor_max_scale(ref);
  };
  const double tol = tolerance_for(c.dtype, c.dtype);
  const DType stat = c.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  expect_close("out", t.out, r.out, mag(r.out, r.out_mag), tol, where);
  expect_close("lse", t.lse, r.lse, mag(r.lse, r.lse_mag), tolerance_for(stat, stat), where);
  expect_close("dq", t.dq, r.dq, mag(r.dq, r.dq_mag), tol, where);
  expect_close("dk", t.dk, r.dk, mag(r.dk, r.dk_mag), tol, where);
  expect_close("dv", t.dv, r.dv, mag(r.dv, r.dv_mag), tol, where);
  if (t.has_dbias) {
    expect_close("dbias", t.dbias, r.dbias, mag(r.dbias, r.dbias_mag),
                 tolerance_for(c.dtype, c.bias_dtype), where);
  }
}

inline void check_case_against_reference(const CaseConfig& c) {
  CaseTensors t = make_case_tensors(c);
  check_tensors_against_reference(c, t);
}

}  // namespace dmattn::test
