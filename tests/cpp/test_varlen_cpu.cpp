// GoogleTest suite of packed variable-length batches on the CPU: make_varlen_*_params +
// run_forward/run_backward against the dense CPU path run sequence by sequence on copies of
// each sequence's slices. Both run the same dense kernels, so every output element must be
// identical; every packed output is NaN-poisoned first (and, in strided layouts, nothing
// outside its elements may be written). Also: the validation errors and the CUDA refusal.
#include <gtest/gtest.h>

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

struct VarlenConfig {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> lens_q, lens_k;
  int64_t heads = 2, heads_kv = 1, dim = 8;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  int64_t mask_heads = 0, bias_heads = 0;  // Hb of the key-side mask / bias; 0 = absent
  DType bias_dtype = DType::kFloat32;
  bool strided = false;  // head-major, padded q/k/v/out/grads; key-strided mask/bias
  uint64_t seed = 1;
};

std::string describe(const VarlenConfig& c) {
  std::ostringstream os;
  os << short_name(c.dtype) << " lens_q" << shape_string(c.lens_q) << " lens_k"
     << shape_string(c.lens_k) << " H=" << c.heads << " Hkv=" << c.heads_kv << " D=" << c.dim
     << " causal=" << c.causal << " window=(" << c.window_left << "," << c.window_right
     << ") softcap=" << c.softcap << " mask_Hb=" << c.mask_heads << " bias_Hb=" << c.bias_heads
     << ":" << short_name(c.bias_dtype) << (c.strided ? " strided" : "") << " seed=" << c.seed;
  return os.str();
}

std::vector<int32_t> offsets_of(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> offsets = {0};
  for (int64_t n : lengths) offsets.push_back(static_cast<int32_t>(offsets.back() + n));
  return offsets;
}

int64_t longest(const std::vector<int64_t>& lengths) {
  int64_t m = 0;
  for (int64_t n : lengths) m = std::max(m, n);
  return m;
}

TensorDesc int32_desc(std::vector<int32_t>& values) {
  TensorDesc d;
  d.data = values.data();
  d.dtype = DType::kInt32;
  d.shape = {static_cast<int64_t>(values.size())};
  d.strides = {1};
  return d;
}

// The packed batch: q (total_q, H, D), k/v (total_k, Hkv, D), lse (H, total_q), key-side
// mask/bias/dbias (Hb, total_k).
struct PackedTensors {
  TestTensor q, k, v, out, lse, dout, dq, dk, dv, mask, bias, dbias;
  std::vector<int32_t> cu_q, cu_k;
  int64_t max_q = 0, max_k = 0;
};

PackedTensors make_packed(const VarlenConfig& c) {
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  PackedTensors t;
  t.cu_q = offsets_of(c.lens_q), t.cu_k = offsets_of(c.lens_k);
  t.max_q = longest(c.lens_q), t.max_k = longest(c.lens_k);
  const int64_t tq = t.cu_q.back(), tk = t.cu_k.back(), D = c.dim;
  const Layout rows = c.strided ? Layout{{1, 0, 2}, 3} : Layout{};  // last dim stays unit-stride
  const Layout keys = c.strided ? Layout{{1, 0}, 2} : Layout{};
  for (TestTensor* x : {&t.q, &t.out, &t.dout, &t.dq}) *x = TestTensor(c.dtype, {tq, c.heads, D}, rows);
  for (TestTensor* x : {&t.k, &t.v, &t.dk, &t.dv}) *x = TestTensor(c.dtype, {tk, c.heads_kv, D}, rows);
  t.lse = TestTensor(c.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32, {c.heads, tq});
  for (TestTensor* x : {&t.q, &t.k, &t.v, &t.dout}) {
    for (int64_t e = 0; e < x->numel(); ++e) x->set(e, normal(rng));
  }
  if (c.mask_heads > 0) {
    t.mask = TestTensor(DType::kBool, {c.mask_heads, tk}, keys);
    for (int64_t e = 0; e < t.mask.numel(); ++e) t.mask.set(e, uniform(rng) < 0.8);
  }
  if (c.bias_heads > 0) {
    t.bias = TestTensor(c.bias_dtype, {c.bias_heads, tk}, keys);
    t.dbias = TestTensor(c.bias_dtype, {c.bias_heads, tk}, keys);
    for (int64_t e = 0; e < t.bias.numel(); ++e) t.bias.set(e, 1.5 * normal(rng));
  }
  return t;
}

AttentionOptions options_of(const VarlenConfig& c) {
  AttentionOptions o;
  o.causal = c.causal;
  o.window_left = c.window_left, o.window_right = c.window_right;
  o.softcap = c.softcap;
  return o;
}

VarlenPacking packing_of(PackedTensors& t) {
  VarlenPacking packing;
  packing.cu_seqlens_q = int32_desc(t.cu_q);
  packing.cu_seqlens_k = int32_desc(t.cu_k);
  packing.max_seqlen_q = t.max_q, packing.max_seqlen_k = t.max_k;
  return packing;
}

void run_varlen(const VarlenConfig& c, PackedTensors& t) {
  for (TestTensor* x : {&t.out, &t.lse, &t.dq, &t.dk, &t.dv, &t.dbias}) x->poison();
  TensorDesc mask = t.mask.desc(), bias = t.bias.desc(), dbias = t.dbias.desc();
  const TensorDesc* mask_ptr = c.mask_heads > 0 ? &mask : nullptr;
  const TensorDesc* bias_ptr = c.bias_heads > 0 ? &bias : nullptr;
  const VarlenPacking packing = packing_of(t);
  run_forward(make_varlen_forward_params(t.q.desc(), t.k.desc(), t.v.desc(), packing,
                                         t.out.desc(), t.lse.desc(), mask_ptr, bias_ptr,
                                         options_of(c)));
  run_backward(make_varlen_backward_params(
      t.q.desc(), t.k.desc(), t.v.desc(), packing, t.out.desc(), t.lse.desc(), mask_ptr,
      bias_ptr, t.dout.desc(), t.dq.desc(), t.dk.desc(), t.dv.desc(),
      c.bias_heads > 0 ? &dbias : nullptr, nullptr, nullptr, nullptr, options_of(c)));
}

// dst[dst_first + e] = src[src_first + e] for e < count (row-major logical indices).
void copy_elements(const TestTensor& src, int64_t src_first, TestTensor& dst, int64_t dst_first,
                   int64_t count) {
  for (int64_t e = 0; e < count; ++e) dst.set(dst_first + e, src.get(src_first + e));
}

// A (rows, ...) slice of a packed tensor as a dense (1, rows, ...) tensor.
TestTensor row_slice(const TestTensor& packed, int64_t first, int64_t rows) {
  std::vector<int64_t> shape = packed.shape();
  const int64_t row_size = packed.numel() / std::max<int64_t>(1, shape[0]);
  shape[0] = rows;
  shape.insert(shape.begin(), 1);
  TestTensor slice(packed.dtype(), shape);
  copy_elements(packed, first * row_size, slice, 0, rows * row_size);
  return slice;
}

// Keys [first, first + keys) of a (Hb, total_k) operand as the dense (1, Hb, 1, keys).
TestTensor key_slice(const TestTensor& packed, int64_t first, int64_t keys) {
  const int64_t heads = packed.shape()[0], total = packed.shape()[1];
  TestTensor slice(packed.dtype(), {1, heads, 1, keys});
  for (int64_t h = 0; h < heads; ++h) copy_elements(packed, h * total + first, slice, h * keys, keys);
  return slice;
}

// Expects packed[packed_first + e] == dense[dense_first + e], bit for bit (as values).
void expect_identical(const char* name, const TestTensor& packed, int64_t packed_first,
                      const TestTensor& dense, int64_t dense_first, int64_t count,
                      const std::string& where) {
  int64_t failures = 0;
  for (int64_t e = 0; e < count; ++e) {
    const double got = packed.get(packed_first + e), want = dense.get(dense_first + e);
    const bool finite_or_empty_row = std::isfinite(got) || got == -INFINITY;
    if ((got != want || !finite_or_empty_row) && ++failures <= 3) {
      ADD_FAILURE() << name << "[" << packed_first + e << "] = " << got << ", dense per sequence "
                    << want << "; " << where;
    }
  }
  EXPECT_EQ(failures, 0) << name << ": " << failures << " of " << count << " differ; " << where;
}

// Runs the packed batch, then each sequence through the dense CPU path, and compares.
void check_against_dense_per_sequence(const VarlenConfig& c) {
  PackedTensors t = make_packed(c);
  run_varlen(c, t);
  const std::string where = describe(c);
  for (TestTensor* x : {&t.out, &t.dq, &t.dk, &t.dv}) {
    EXPECT_TRUE(x->padding_untouched()) << "wrote outside its elements; " << where;
  }
  if (c.bias_heads > 0) EXPECT_TRUE(t.dbias.padding_untouched()) << "dbias; " << where;
  const int64_t HD = c.heads * c.dim, HkvD = c.heads_kv * c.dim;
  const int64_t total_q = t.cu_q.back(), total_k = t.cu_k.back();
  for (size_t b = 0; b < c.lens_q.size(); ++b) {
    const int64_t q0 = t.cu_q[b], lq = c.lens_q[b], k0 = t.cu_k[b], lk = c.lens_k[b];
    CaseConfig dense;
    dense.dtype = c.dtype;
    dense.batch = 1, dense.seqlen_q = lq, dense.seqlen_k = lk;
    dense.heads = c.heads, dense.heads_kv = c.heads_kv, dense.dim = c.dim;
    dense.causal = c.causal, dense.window_left = c.window_left;
    dense.window_right = c.window_right, dense.softcap = c.softcap;
    CaseTensors s;
    s.q = row_slice(t.q, q0, lq), s.dout = row_slice(t.dout, q0, lq);
    s.k = row_slice(t.k, k0, lk), s.v = row_slice(t.v, k0, lk);
    s.out = TestTensor(c.dtype, s.q.shape()), s.dq = TestTensor(c.dtype, s.q.shape());
    s.dk = TestTensor(c.dtype, s.k.shape()), s.dv = TestTensor(c.dtype, s.k.shape());
    s.lse = TestTensor(t.lse.dtype(), {1, c.heads, lq});
    if (c.mask_heads > 0) s.has_mask = true, s.mask = key_slice(t.mask, k0, lk);
    if (c.bias_heads > 0) {
      s.has_bias = s.has_dbias = true;
      s.bias = key_slice(t.bias, k0, lk);
      s.dbias = TestTensor(c.bias_dtype, s.bias.shape());
    }
    run_case(dense, s);  // poisons its outputs, then forward + backward

    const std::string seq = "sequence " + std::to_string(b) + " of " + where;
    expect_identical("out", t.out, q0 * HD, s.out, 0, lq * HD, seq);
    expect_identical("dq", t.dq, q0 * HD, s.dq, 0, lq * HD, seq);
    expect_identical("dk", t.dk, k0 * HkvD, s.dk, 0, lk * HkvD, seq);
    expect_identical("dv", t.dv, k0 * HkvD, s.dv, 0, lk * HkvD, seq);
    for (int64_t h = 0; h < c.heads; ++h) {
      expect_identical("lse", t.lse, h * total_q + q0, s.lse, h * lq, lq, seq);
    }
    for (int64_t hb = 0; hb < c.bias_heads; ++hb) {
      expect_identical("dbias", t.dbias, hb * total_k + k0, s.dbias, hb * lk, lk, seq);
    }
  }
}

VarlenConfig random_config(std::mt19937_64& rng) {
  auto pick = [&](std::vector<int64_t> choices) { return choices[rng() % choices.size()]; };
  VarlenConfig c;
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};
  c.dtype = dtypes[rng() % 4];
  const int64_t batch = pick({1, 2, 3, 5});
  auto length = [&] { return rng() % 8 == 0 ? pick({63, 64, 65, 130}) : pick({0, 1, 2, 5, 17, 33}); };
  for (int64_t b = 0; b < batch; ++b) c.lens_q.push_back(length()), c.lens_k.push_back(length());
  if (rng() % 3 == 0) c.lens_k = c.lens_q;
  c.heads_kv = pick({1, 2});
  c.heads = c.heads_kv * pick({1, 2, 3});
  c.dim = pick({1, 8, 24, 64});
  c.causal = rng() % 3 == 0;
  if (rng() % 4 == 0) c.window_left = pick({0, 3, 40}), c.window_right = pick({-1, 0, 5});
  if (rng() % 6 == 0) c.softcap = 10;
  if (rng() % 2) c.mask_heads = pick({1, c.heads_kv, c.heads});
  if (rng() % 3) {
    c.bias_heads = pick({1, c.heads_kv, c.heads});
    c.bias_dtype = rng() % 2 ? c.dtype : DType::kFloat32;
  }
  c.strided = rng() % 2;
  c.seed = rng();
  return c;
}

TEST(CpuVarlen, RandomBatchesMatchDensePerSequence) {
  std::mt19937_64 rng(2024);
  for (int i = 0; i < 40; ++i) {
    check_against_dense_per_sequence(random_config(rng));
    if (HasFailure()) return;
  }
}

TEST(CpuVarlen, LengthsZeroAndOne) {
  VarlenConfig c;
  c.lens_q = {0, 1, 0, 3, 1};
  c.lens_k = {2, 0, 0, 1, 1};
  c.heads = 4, c.heads_kv = 2, c.causal = true, c.mask_heads = 2, c.bias_heads = 4;
  check_against_dense_per_sequence(c);
}

TEST(CpuVarlen, LengthsAroundTheTileSize) {
  VarlenConfig c;
  c.dtype = DType::kBFloat16;
  c.lens_q = {63, 64, 65, 129};
  c.lens_k = {65, 64, 63, 130};
  c.heads = 2, c.heads_kv = 1, c.window_left = 30, c.causal = true, c.bias_heads = 1;
  c.strided = true;
  check_against_dense_per_sequence(c);
}

TEST(CpuVarlen, NoSequences) {
  VarlenConfig c;
  c.bias_heads = 1;
  check_against_dense_per_sequence(c);
}

// The layout a varlen kernel reads (params.h): pins every field make_varlen_forward_params
// fills differently from the dense path.
TEST(CpuVarlen, ParamsFollowTheDocumentedLayout) {
  VarlenConfig c;
  c.lens_q = {3, 0, 4}, c.lens_k = {4, 1, 4}, c.heads = 4, c.heads_kv = 2;
  c.mask_heads = 2, c.bias_heads = 4, c.strided = true;
  PackedTensors t = make_packed(c);
  TensorDesc mask = t.mask.desc(), bias = t.bias.desc();
  const VarlenPacking packing = packing_of(t);
  const ForwardParams p = make_varlen_forward_params(t.q.desc(), t.k.desc(), t.v.desc(), packing,
                                                     t.out.desc(), t.lse.desc(), &mask, &bias,
                                                     AttentionOptions{});
  EXPECT_TRUE(p.is_varlen());
  EXPECT_EQ(p.cu_seqlens_q, t.cu_q.data());
  EXPECT_EQ(p.cu_seqlens_k, t.cu_k.data());
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.seqlen_q, 4);  // max_seqlen_q
  EXPECT_EQ(p.seqlen_k, 4);
  EXPECT_EQ(p.total_q, 7);
  EXPECT_EQ(p.total_k, 9);
  EXPECT_EQ(p.q_strides.batch_stride, 0);
  EXPECT_EQ(p.q_strides.row_stride, t.q.desc().strides[0]);
  EXPECT_EQ(p.q_strides.head_stride, t.q.desc().strides[1]);
  EXPECT_EQ(p.k_strides.row_stride, t.k.desc().strides[0]);
  EXPECT_EQ(p.lse_batch_stride, 0);
  EXPECT_EQ(p.lse_head_stride, 7);
  EXPECT_EQ(p.mask.size_b, 1);
  EXPECT_EQ(p.mask.size_h, 2);
  EXPECT_EQ(p.mask.head_div, 2);  // Hb = Hkv: one row per GQA group
  EXPECT_EQ(p.mask.size_q, 1);
  EXPECT_EQ(p.mask.size_k, 9);
  EXPECT_EQ(p.mask.stride_q, 0);
  EXPECT_EQ(p.mask.stride_k, mask.strides[1]);
  EXPECT_EQ(p.bias.size_h, 4);
  EXPECT_EQ(p.bias.head_div, 1);
  EXPECT_EQ(p.bias.stride_h, bias.strides[0]);
}

// ---- Errors ----------------------------------------------------------------------------

// Runs make_varlen_forward_params on a valid batch (q (7, 4, 8), k/v (9, 2, 8), sequences of
// (3, 4), (0, 1), (4, 4) rows) after `edit`, and returns the error it raised.
template <typename Edit>
Error varlen_error(Edit edit) {
  VarlenConfig c;
  c.lens_q = {3, 0, 4}, c.lens_k = {4, 1, 4}, c.heads = 4, c.heads_kv = 2;
  c.mask_heads = 2, c.bias_heads = 4;
  PackedTensors t = make_packed(c);
  VarlenPacking packing = packing_of(t);
  TensorDesc q = t.q.desc(), k = t.k.desc(), mask = t.mask.desc(), bias = t.bias.desc();
  edit(packing, q, k, mask, bias);
  try {
    make_varlen_forward_params(q, k, t.v.desc(), packing, t.out.desc(), t.lse.desc(), &mask,
                               &bias, AttentionOptions{});
  } catch (const Error& e) {
    return e;
  }
  return Error(ErrorKind::kRuntime, "no error");
}

void expect_error(const Error& e, ErrorKind kind, const std::string& message_part) {
  EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
  EXPECT_NE(std::string(e.what()).find(message_part), std::string::npos)
      << "message \"" << e.what() << "\" lacks \"" << message_part << "\"";
}

TEST(CpuVarlen, ValidBatchIsAccepted) {
  const Error e = varlen_error([](auto&...) {});
  EXPECT_STREQ(e.what(), "no error");
}

TEST(CpuVarlen, MalformedCuSeqlensAreErrors) {
  std::vector<int32_t> values;
  auto set = [&](TensorDesc& cu, std::vector<int32_t> v) {
    values = std::move(v);
    cu.data = values.data(), cu.shape = {static_cast<int64_t>(values.size())};
  };
  expect_error(varlen_error([&](VarlenPacking& p, auto&...) { p.cu_seqlens_q.dtype = DType::kFloat32; }),
               ErrorKind::kType, "cu_seqlens_q: expected dtype int32, got float32");
  expect_error(varlen_error([&](VarlenPacking& p, auto&...) { set(p.cu_seqlens_q, {0, 4, 3, 7}); }),
               ErrorKind::kValue, "cu_seqlens_q: expected non-decreasing values, got cu_seqlens_q[2] = 3");
  expect_error(varlen_error([&](VarlenPacking& p, auto&...) { set(p.cu_seqlens_k, {1, 4, 5, 9}); }),
               ErrorKind::kValue, "cu_seqlens_k: expected first entry 0, got 1");
  expect_error(varlen_error([&](VarlenPacking& p, auto&...) { set(p.cu_seqlens_k, {0, 4, 9}); }),
               ErrorKind::kValue, "cu_seqlens_k: expected length 4");
  expect_error(varlen_error([&](VarlenPacking& p, auto&...) { set(p.cu_seqlens_q, {0, 3, 3, 6}); }),
               ErrorKind::kValue, "cu_seqlens_q: expected last entry total_q (q.shape[0]) = 7, got 6");
  expect_error(varlen_error([&](VarlenPacking& p, auto&...) { p.max_seqlen_k = 3; }),
               ErrorKind::kValue, "cu_seqlens_k: sequence 0 has length 4, more than max_seqlen_k = 3");
  expect_error(varlen_error([&](VarlenPacking& p, auto&...) { p.max_seqlen_q = -1; }),
               ErrorKind::kValue, "max_seqlen_q: expected >= 0");
  expect_error(varlen_error([&](VarlenPacking& p, auto&...) { p.cu_seqlens_q.strides = {2}; }),
               ErrorKind::kValue, "cu_seqlens_q: expected a contiguous tensor");
  expect_error(varlen_error([&](VarlenPacking& p, auto&...) { set(p.cu_seqlens_q, {}); }),
               ErrorKind::kValue, "cu_seqlens_q: expected at least one entry");
}

TEST(CpuVarlen, MalformedPackedTensorsAreErrors) {
  expect_error(varlen_error([](auto&, TensorDesc& q, auto&...) { q.shape = {1, 7, 4, 8}, q.strides = {0, 32, 8, 1}; }),
               ErrorKind::kValue, "q: expected a 3-D tensor (total_q, num_heads, head_dim)");
  expect_error(varlen_error([](auto&, auto&, TensorDesc& k, auto&...) { k.shape = {9, 3, 8}; }),
               ErrorKind::kValue, "k: num_heads_kv (k.shape[1] = 3) must be >= 1 and divide");
  expect_error(varlen_error([](auto&, auto&, auto&, TensorDesc& mask, auto&) { mask.shape = {3, 9}; }),
               ErrorKind::kValue, "mask: expected shape (Hb, total_k) = (1, 9), (2, 9) or (4, 9), got (3, 9)");
  expect_error(varlen_error([](auto&, auto&, auto&, auto&, TensorDesc& bias) { bias.dtype = DType::kFloat16; }),
               ErrorKind::kType, "bias: expected dtype float32 (like q), got float16");
}

// Varlen params on CUDA go to the CUDA backend like dense ones (dispatch refuses nothing):
// with these empty params it rejects the dtype, and a build without CUDA says it has none.
TEST(CpuVarlen, CudaVarlenParamsReachTheBackend) {
  ForwardParams p;
  const int32_t offsets[] = {0};
  p.device = DeviceKind::kCUDA;
  p.cu_seqlens_q = p.cu_seqlens_k = offsets;
  try {
    run_forward(p);
    ADD_FAILURE() << "run_forward accepted params without tensors";
  } catch (const Error& e) {
    if (cuda_available()) expect_error(e, ErrorKind::kType, "q: the CUDA backend supports float16 and bfloat16");
    else expect_error(e, ErrorKind::kRuntime, "this build of dmattn has no CUDA backend");
  }
}

}  // namespace
}  // namespace dmattn::test
