// GoogleTest suite of gathered keys (ForwardParams::key_positions) on the CPU: for a key set
// shared by all queries of each (batch, head) -- a (B, Hs, 1, Sk) mask -- the dense masked
// path and the gather path (k, v, bias rows of the kept keys plus their positions, through
// run_forward / run_backward) must agree within fp32 (fp64) rounding on out, lse and, after
// scattering the gathered gradients back onto the original rows, dq, dk, dv and dbias.
// Padding rows must receive exactly zero gradients. Also: the validation errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attention_case.h"
#include "dmattn/api.h"
#include "test_tensor.h"

namespace dmattn::test {
namespace {

struct GatherConfig {
  CaseConfig dense;           // its mask_shape / bias_shape are (B, 1 or Hkv, 1, Sk)
  int64_t extra_padding = 0;  // padding rows beyond the largest kept set
};

// Row-major flat index of (i0, i1, i2, i3) in a 4-D shape.
int64_t flat4(const std::vector<int64_t>& s, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return ((i0 * s[1] + i1) * s[2] + i2) * s[3] + i3;
}

TensorDesc int32_tensor(std::vector<int32_t>& values, const std::vector<int64_t>& shape) {
  TensorDesc d;
  d.data = values.data();
  d.dtype = DType::kInt32;
  d.shape = shape;
  d.strides.assign(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) {
    d.strides[i] = d.strides[i + 1] * shape[i + 1];
  }
  return d;
}

// The gather path's inputs and outputs for one dense case.
struct Gathered {
  int64_t set_heads = 1, rows = 0;  // positions (B, set_heads, rows)
  std::vector<int32_t> positions;
  TestTensor k, v, bias, out, lse, dq, dk, dv, dbias;

  int32_t position(int64_t b, int64_t kv_head, int64_t j) const {
    return positions[(b * set_heads + (set_heads == 1 ? 0 : kv_head)) * rows + j];
  }
};

Gathered gather_case(const GatherConfig& g, const CaseTensors& t) {
  const CaseConfig& c = g.dense;
  const std::vector<int64_t>& mask_shape = *c.mask_shape;
  Gathered out;
  out.set_heads = mask_shape[1];
  std::vector<std::vector<int32_t>> kept(c.batch * out.set_heads);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t s = 0; s < out.set_heads; ++s) {
      for (int64_t j = 0; j < c.seqlen_k; ++j) {
        if (t.mask.get(flat4(mask_shape, b, s, 0, j)) != 0) kept[b * out.set_heads + s].push_back(j);
      }
    }
  }
  for (const auto& row : kept) out.rows = std::max<int64_t>(out.rows, row.size());
  out.rows += g.extra_padding;
  for (auto& row : kept) {
    row.resize(out.rows, -1);
    out.positions.insert(out.positions.end(), row.begin(), row.end());
  }

  std::mt19937_64 rng(c.seed + 17);
  std::normal_distribution<double> normal(0.0, 1.0);
  const int64_t B = c.batch, K = out.rows, Hkv = c.heads_kv, D = c.dim;
  const std::vector<int64_t> kv_shape = {B, c.seqlen_k, Hkv, D}, rows_shape = {B, K, Hkv, D};
  out.k = TestTensor(c.dtype, rows_shape);
  out.v = TestTensor(c.dtype, rows_shape);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < K; ++j) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const int32_t pos = out.position(b, h, j);
        for (int64_t d = 0; d < D; ++d) {
          const int64_t e = flat4(rows_shape, b, j, h, d);
          // Padding rows hold arbitrary finite values; they must not contribute.
          out.k.set(e, pos < 0 ? 4 * normal(rng) : t.k.get(flat4(kv_shape, b, pos, h, d)));
          out.v.set(e, pos < 0 ? 4 * normal(rng) : t.v.get(flat4(kv_shape, b, pos, h, d)));
        }
      }
    }
  }
  if (t.has_bias) {
    const std::vector<int64_t>& bias_shape = *c.bias_shape;
    const int64_t heads = std::max(bias_shape[1], out.set_heads);
    out.bias = TestTensor(c.bias_dtype, {B, heads, 1, K});
    out.dbias = TestTensor(c.bias_dtype, {B, heads, 1, K});
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < K; ++j) {
          const int32_t pos = out.position(b, h, j);
          const int64_t bias_head = bias_shape[1] == 1 ? 0 : h;
          out.bias.set(flat4({B, heads, 1, K}, b, h, 0, j),
                       pos < 0 ? 1e4 : t.bias.get(flat4(bias_shape, b, bias_head, 0, pos)));
        }
      }
    }
  }
  out.out = TestTensor(c.dtype, {B, c.seqlen_q, c.heads, D});
  out.dq = TestTensor(c.dtype, {B, c.seqlen_q, c.heads, D});
  out.dk = TestTensor(c.dtype, rows_shape);
  out.dv = TestTensor(c.dtype, rows_shape);
  out.lse = TestTensor(t.lse.dtype(), {B, c.heads, c.seqlen_q});
  return out;
}

void run_gathered(const CaseConfig& c, CaseTensors& t, Gathered& g) {
  for (TestTensor* x : {&g.out, &g.lse, &g.dq, &g.dk, &g.dv}) x->poison();
  if (t.has_bias) g.dbias.poison();
  TensorDesc q = t.q.desc(), k = g.k.desc(), v = g.v.desc(), out = g.out.desc(),
             lse = g.lse.desc(), dout = t.dout.desc(), dq = g.dq.desc(), dk = g.dk.desc(),
             dv = g.dv.desc(), bias = g.bias.desc(), dbias = g.dbias.desc();
  TensorDesc positions = int32_tensor(g.positions, {c.batch, g.set_heads, g.rows});
  const GatheredKeys gathered{&positions, c.seqlen_k};
  const TensorDesc* bias_ptr = t.has_bias ? &bias : nullptr;
  const AttentionOptions options = options_of(c);
  run_forward(make_forward_params(q, k, v, out, lse, nullptr, bias_ptr, options, gathered));
  run_backward(make_backward_params(q, k, v, out, lse, nullptr, bias_ptr, dout, dq, dk, dv,
                                    t.has_bias ? &dbias : nullptr, nullptr, nullptr, nullptr,
                                    options, gathered));
}

// A gathered gradient summed back onto the original rows (dense layout, row-major doubles).
// Padding rows must be exactly zero.
std::vector<double> scatter_rows(const Gathered& g, const TestTensor& rows, int64_t seqlen_k,
                                 const std::string& name) {
  const std::vector<int64_t>& s = rows.shape();  // (B, K, Hkv, D)
  std::vector<double> dense(s[0] * seqlen_k * s[2] * s[3], 0.0);
  for (int64_t b = 0; b < s[0]; ++b) {
    for (int64_t j = 0; j < s[1]; ++j) {
      for (int64_t h = 0; h < s[2]; ++h) {
        const int32_t pos = g.position(b, h, j);
        for (int64_t d = 0; d < s[3]; ++d) {
          const double value = rows.get(flat4(s, b, j, h, d));
          if (pos < 0) {
            EXPECT_EQ(value, 0.0) << name << " of padding row " << j;
          } else {
            dense[flat4({s[0], seqlen_k, s[2], s[3]}, b, pos, h, d)] += value;
          }
        }
      }
    }
  }
  return dense;
}

std::vector<double> scatter_dbias(const Gathered& g, const std::vector<int64_t>& bias_shape) {
  const std::vector<int64_t>& s = g.dbias.shape();  // (B, heads, 1, K)
  std::vector<double> dense(bias_shape[0] * bias_shape[1] * bias_shape[3], 0.0);
  for (int64_t b = 0; b < s[0]; ++b) {
    for (int64_t h = 0; h < s[1]; ++h) {
      for (int64_t j = 0; j < s[3]; ++j) {
        const int32_t pos = g.position(b, h, j);
        const double value = g.dbias.get(flat4(s, b, h, 0, j));
        if (pos < 0) {
          EXPECT_EQ(value, 0.0) << "dbias of padding row " << j;
        } else {
          dense[flat4(bias_shape, b, bias_shape[1] == 1 ? 0 : h, 0, pos)] += value;
        }
      }
    }
  }
  return dense;
}

// Same -inf entries; finite ones within `rel` of the tensor's largest magnitude.
void expect_matches(const char* name, const std::vector<double>& got,
                    const std::vector<double>& expected, double rel) {
  ASSERT_EQ(got.size(), expected.size()) << name;
  double largest = 0;
  for (double x : expected) {
    if (std::isfinite(x)) largest = std::max(largest, std::fabs(x));
  }
  int64_t failures = 0;
  for (size_t e = 0; e < got.size(); ++e) {
    const bool ok = std::isinf(expected[e])
                        ? got[e] == expected[e]
                        : std::isfinite(got[e]) && std::fabs(got[e] - expected[e]) <= rel * largest;
    if (!ok && ++failures <= 3) {
      ADD_FAILURE() << name << "[" << e << "] = " << got[e] << ", dense path " << expected[e]
                    << " (tolerance " << rel * largest << ")";
    }
  }
  EXPECT_EQ(failures, 0) << name;
}

void check_gather_matches_dense(const GatherConfig& g) {
  const CaseConfig& c = g.dense;
  SCOPED_TRACE(describe(c) + " extra_padding=" + std::to_string(g.extra_padding));
  CaseTensors t = make_case_tensors(c);
  run_case(c, t);
  Gathered gathered = gather_case(g, t);
  run_gathered(c, t, gathered);
  // Both paths accumulate in fp32 (fp64), in different orders; then round to the dtype.
  const double rel = 4 * tolerance_for(c.dtype, c.dtype);
  expect_matches("out", gathered.out.values(), t.out.values(), rel);
  expect_matches("lse", gathered.lse.values(), t.lse.values(), rel);
  expect_matches("dq", gathered.dq.values(), t.dq.values(), rel);
  expect_matches("dk", scatter_rows(gathered, gathered.dk, c.seqlen_k, "dk"), t.dk.values(), rel);
  expect_matches("dv", scatter_rows(gathered, gathered.dv, c.seqlen_k, "dv"), t.dv.values(), rel);
  if (t.has_bias) {
    expect_matches("dbias", scatter_dbias(gathered, *c.bias_shape), t.dbias.values(),
                   4 * tolerance_for(c.dtype, c.bias_dtype));
  }
}

template <typename T>
T pick(std::mt19937_64& rng, const std::vector<T>& choices) {
  return choices[rng() % choices.size()];
}

GatherConfig random_gather_config(std::mt19937_64& rng, DType dtype) {
  GatherConfig g;
  CaseConfig& c = g.dense;
  c.dtype = dtype;
  c.seed = rng();
  c.batch = pick<int64_t>(rng, {1, 2});
  c.heads_kv = pick<int64_t>(rng, {1, 2});
  c.heads = c.heads_kv * pick<int64_t>(rng, {1, 2});
  c.dim = pick<int64_t>(rng, {8, 40});
  c.seqlen_q = pick<int64_t>(rng, {1, 9, 70});
  c.seqlen_k = pick<int64_t>(rng, {1, 30, 150});
  c.causal = rng() % 3 == 0;
  if (rng() % 3 == 0) {
    c.window_left = pick<int64_t>(rng, {-1, 0, 5, 40});
    c.window_right = pick<int64_t>(rng, {-1, 0, 3});
  }
  if (rng() % 4 == 0) c.softcap = 5.0;
  const int64_t set_heads = pick<int64_t>(rng, {1, c.heads_kv});
  c.mask_shape = std::vector<int64_t>{c.batch, set_heads, 1, c.seqlen_k};
  c.mask_keep = pick<double>(rng, {0.05, 0.3, 0.9});
  c.empty_mask_rows = rng() % 4 == 0 ? 0.3 : 0.0;
  if (rng() % 4 != 0) {
    c.bias_shape = std::vector<int64_t>{c.batch, pick<int64_t>(rng, {1, c.heads_kv}), 1, c.seqlen_k};
    c.bias_dtype = dtype;
    c.bias_neg_inf = rng() % 4 == 0 ? 0.1 : 0.0;
  }
  g.extra_padding = pick<int64_t>(rng, {0, 0, 3});
  return g;
}

void run_random_gather_configs(DType dtype, int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int n = 0; n < count; ++n) {
    check_gather_matches_dense(random_gather_config(rng, dtype));
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(CpuKeyPositions, RandomFloat32) { run_random_gather_configs(DType::kFloat32, 60, 11); }
TEST(CpuKeyPositions, RandomFloat64) { run_random_gather_configs(DType::kFloat64, 30, 12); }
TEST(CpuKeyPositions, RandomBFloat16) { run_random_gather_configs(DType::kBFloat16, 20, 13); }

// Causal with a short kept set at the end of the keys: the early queries keep nothing
// (lse -inf, out 0, zero gradients), and every kept key lies in their future.
TEST(CpuKeyPositions, CausalEarlyQueriesKeepNothing) {
  GatherConfig g;
  CaseConfig& c = g.dense;
  c.batch = 2, c.heads = 4, c.heads_kv = 2, c.seqlen_q = 80, c.seqlen_k = 80, c.dim = 16;
  c.causal = true;
  c.mask_shape = std::vector<int64_t>{2, 2, 1, 80};
  c.mask_keep = 0.04;
  c.bias_shape = std::vector<int64_t>{2, 1, 1, 80};
  g.extra_padding = 2;
  check_gather_matches_dense(g);
}

// ---- Validation.

struct PositionsCase {
  std::vector<int32_t> values = {0, 2, 5, -1, 1, 3, -1, -1};  // (1, 2, 4) over 6 keys
  std::vector<int64_t> shape = {1, 2, 4};
  DType dtype = DType::kInt32;
  int64_t seqlen_k_original = 6;
};

Error positions_error(const PositionsCase& p) {
  TestTensor q(DType::kFloat32, {1, 3, 2, 8}), k(DType::kFloat32, {1, 4, 2, 8});
  TestTensor v(DType::kFloat32, {1, 4, 2, 8}), out(DType::kFloat32, {1, 3, 2, 8});
  TestTensor lse(DType::kFloat32, {1, 2, 3});
  std::vector<int32_t> values = p.values;
  TensorDesc positions = int32_tensor(values, p.shape);
  positions.dtype = p.dtype;
  try {
    make_forward_params(q.desc(), k.desc(), v.desc(), out.desc(), lse.desc(), nullptr, nullptr,
                        AttentionOptions{}, GatheredKeys{&positions, p.seqlen_k_original});
  } catch (const Error& e) {
    return e;
  }
  return Error(ErrorKind::kRuntime, "no error");
}

void expect_error(const PositionsCase& p, ErrorKind kind, const std::string& message_part) {
  const Error e = positions_error(p);
  EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
  EXPECT_NE(std::string(e.what()).find(message_part), std::string::npos)
      << "message \"" << e.what() << "\" lacks \"" << message_part << "\"";
}

TEST(CpuKeyPositions, ValidPositionsAreAccepted) {
  EXPECT_STREQ(positions_error(PositionsCase{}).what(), "no error");
  PositionsCase shared;  // one set for every head, broadcast over the batch
  shared.values = {0, 1, 2, 3}, shared.shape = {1, 1, 4};
  EXPECT_STREQ(positions_error(shared).what(), "no error");
}

// The valid PositionsCase with one edit.
template <typename Edit>
PositionsCase edited(Edit edit) {
  PositionsCase p;
  edit(p);
  return p;
}

TEST(CpuKeyPositions, MalformedPositionsAreErrors) {
  expect_error(edited([](auto& p) { p.dtype = DType::kFloat32; }), ErrorKind::kType,
               "key_positions: expected dtype int32, got float32");
  expect_error(edited([](auto& p) { p.shape = {1, 8}; }), ErrorKind::kValue,
               "key_positions: expected a 3-D tensor");
  expect_error(edited([](auto& p) { p.shape = {1, 1, 8}; }), ErrorKind::kValue,
               "key_positions: expected shape (1 or 1, 1, 2 or 2, 4 = k.shape[1]), got (1, 1, 8)");
  expect_error(edited([](auto& p) { p.shape = {2, 1, 4}; }), ErrorKind::kValue,
               "key_positions: expected shape");
  expect_error(edited([](auto& p) { p.values = {0, 2, 2, -1, 1, 3, -1, -1}; }), ErrorKind::kValue,
               "key_positions: expected strictly increasing positions within each (batch, head), "
               "got 2 then 2 at [0, 0, 2]");
  expect_error(edited([](auto& p) { p.values = {0, 2, 5, -1, 1, -1, 3, -1}; }), ErrorKind::kValue,
               "padding (< 0 or >= seqlen_k_original = 6) must come last");
  // 7 >= seqlen_k_original is a padding row too, and a valid 2 follows it.
  expect_error(edited([](auto& p) { p.values = {0, 7, 2, -1, 1, 3, -1, -1}; }), ErrorKind::kValue,
               "must come last");
  expect_error(edited([](auto& p) { p.seqlen_k_original = -1; }), ErrorKind::kValue,
               "seqlen_k_original: expected >= 0");
  // With 5 keys the position 5 is merely a padding row, followed by padding: valid.
  EXPECT_STREQ(positions_error(edited([](auto& p) { p.seqlen_k_original = 5; })).what(),
               "no error");
}

TEST(CpuKeyPositions, ParamsFollowTheDocumentedLayout) {
  TestTensor q(DType::kFloat32, {2, 3, 4, 8}), k(DType::kFloat32, {2, 5, 2, 8});
  TestTensor v(DType::kFloat32, {2, 5, 2, 8}), out(DType::kFloat32, {2, 3, 4, 8});
  TestTensor lse(DType::kFloat32, {2, 4, 3});
  std::vector<int32_t> values = {0, 1, 2, 3, 4, 0, 2, 4, 6, 8, 1, 2, -1, -1, -1, 5, 6, 7, 8, 9};
  TensorDesc positions = int32_tensor(values, {2, 2, 5});
  const ForwardParams p =
      make_forward_params(q.desc(), k.desc(), v.desc(), out.desc(), lse.desc(), nullptr,
                          nullptr, AttentionOptions{}, GatheredKeys{&positions, 10});
  EXPECT_EQ(p.key_positions, values.data());
  EXPECT_EQ(p.key_positions_stride_b, 10);
  EXPECT_EQ(p.key_positions_stride_h, 5);
  EXPECT_EQ(p.key_positions_head_div, 2);  // Hkv-sized: one set per GQA group
  EXPECT_EQ(p.seqlen_k_original, 10);
  EXPECT_EQ(p.window_seqlen_k(), 10);
  const ForwardParams dense = make_forward_params(q.desc(), k.desc(), v.desc(), out.desc(),
                                                  lse.desc(), nullptr, nullptr, AttentionOptions{});
  EXPECT_EQ(dense.key_positions, nullptr);
  EXPECT_EQ(dense.window_seqlen_k(), 5);
}

}  // namespace
}  // namespace dmattn::test
