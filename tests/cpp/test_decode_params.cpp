// GoogleTest suite of the decode path's host side (make_decode_forward_params, decode_splits):
// every key-side input is validated with an error naming it, paged caches get the page stride
// and the key axis max_blocks * page_size, and CPU tensors are refused (the kernel is CUDA
// only; the CPU runs the cache call composed in Python).
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "dmattn/api.h"
#include "test_tensor.h"

namespace dmattn::test {
namespace {

struct DecodeCase {
  TestTensor q{DType::kFloat16, {2, 1, 8, 64}};
  TestTensor out{DType::kFloat16, {2, 1, 8, 64}};
  TestTensor lse{DType::kFloat32, {2, 8, 1}};
  TestTensor k{DType::kFloat16, {6, 16, 2, 64}};  // 6 pages of 16 keys
  TestTensor v{DType::kFloat16, {6, 16, 2, 64}};
  TestTensor seqlens{DType::kInt32, {2}};
  TestTensor table{DType::kInt32, {2, 3}};
  TestTensor workspace{DType::kFloat32, {4 * 2 * 8 * 1 * 65}};
};

// The error of make_decode_forward_params after `change` alters the descriptors.
Error decode_error(const std::function<void(TensorDesc& q, TensorDesc& k, TensorDesc& seqlens, TensorDesc& table,
                                            DecodeInputs& inputs)>& change) {
  DecodeCase c;
  TensorDesc q = c.q.desc(), k = c.k.desc(), v = c.v.desc(), seqlens = c.seqlens.desc(), table = c.table.desc(),
             workspace = c.workspace.desc();
  DecodeInputs inputs;
  inputs.seqused_k = &seqlens;
  inputs.block_table = &table;
  inputs.workspace = &workspace;
  inputs.num_splits = 4;
  change(q, k, seqlens, table, inputs);
  try {
    make_decode_forward_params(q, k, v, c.out.desc(), c.lse.desc(), nullptr, nullptr, AttentionOptions{}, inputs);
  } catch (const Error& e) {
    return e;
  }
  return Error(ErrorKind::kRuntime, "no error");
}

void expect_error(const Error& e, ErrorKind kind, const std::string& message_part) {
  EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
  EXPECT_NE(std::string(e.what()).find(message_part), std::string::npos) << e.what();
}

TEST(DecodeParams, KeySideInputsAreNamed) {
  expect_error(decode_error([](auto&, auto&, auto&, TensorDesc& t, auto&) { t.dtype = DType::kFloat32; }),
               ErrorKind::kType, "block_table: expected dtype int32");
  expect_error(decode_error([](auto&, auto&, auto&, TensorDesc& t, auto&) { t.shape = {3, 2}; }), ErrorKind::kValue,
               "block_table: expected 2 rows");
  expect_error(decode_error([](auto&, auto&, TensorDesc& s, auto&, auto&) { s.dtype = DType::kFloat32; }),
               ErrorKind::kType, "cache_seqlens: expected dtype int32");
  expect_error(decode_error([](auto&, auto&, TensorDesc& s, auto&, auto&) { s.shape = {3}; }), ErrorKind::kValue,
               "cache_seqlens: expected shape (2,)");
  expect_error(decode_error([](auto&, TensorDesc& k, auto&, auto&, auto&) { k.shape = {6, 16, 2}; }),
               ErrorKind::kValue, "k_cache: expected a 4-D tensor");
  expect_error(decode_error([](auto&, TensorDesc& k, auto&, auto&, auto&) { k.shape = {6, 8, 2, 64}; }),
               ErrorKind::kValue, "v_cache: expected the shape of k_cache");
  expect_error(decode_error([](auto&, auto&, auto&, auto&, DecodeInputs& in) { in.workspace = nullptr; }),
               ErrorKind::kValue, "workspace: 4 key splits need a float32 workspace");
  expect_error(decode_error([](auto&, auto&, auto&, auto&, DecodeInputs& in) { in.num_splits = 200; }),
               ErrorKind::kValue, "workspace: expected at least");
  expect_error(decode_error([](auto&, auto&, auto&, auto&, DecodeInputs& in) { in.num_splits = 0; }),
               ErrorKind::kValue, "num_splits: expected >= 1");
}

// The error of make_decode_forward_params for a contiguous cache k, v (B, Sk, Hkv, D) under
// the given names (q (2, 1, 8, 64) float16, no lengths, one split).
Error contiguous_error(TestTensor k, TestTensor v, const char* k_name, const char* v_name) {
  DecodeCase c;
  DecodeInputs inputs;
  inputs.k_name = k_name, inputs.v_name = v_name;
  try {
    make_decode_forward_params(c.q.desc(), k.desc(), v.desc(), c.out.desc(), c.lse.desc(), nullptr, nullptr,
                               AttentionOptions{}, inputs);
  } catch (const Error& e) {
    return e;
  }
  return Error(ErrorKind::kRuntime, "no error");
}

TEST(DecodeParams, ContiguousKeysTakeTheCallersNames) {
  const auto cache = [](DType dtype, std::vector<int64_t> shape) { return TestTensor{dtype, std::move(shape)}; };
  TestTensor good = cache(DType::kFloat16, {2, 48, 2, 64});
  expect_error(contiguous_error(good, cache(DType::kFloat16, {2, 40, 2, 64}), "k", "v"), ErrorKind::kValue,
               "v: expected the shape of k (2, 48, 2, 64)");
  expect_error(contiguous_error(good, cache(DType::kFloat16, {2, 40, 2, 64}), "k_cache", "v_cache"),
               ErrorKind::kValue, "v_cache: expected the shape of k_cache (2, 48, 2, 64)");
  expect_error(contiguous_error(good, cache(DType::kBFloat16, {2, 48, 2, 64}), "k_cache", "v_cache"),
               ErrorKind::kType, "v_cache: expected dtype float16, got bfloat16");
  TestTensor bf16 = cache(DType::kBFloat16, {2, 48, 2, 64});
  expect_error(contiguous_error(bf16, bf16, "k_cache", "v_cache"), ErrorKind::kType, "k_cache: expected dtype");
  TestTensor batch3 = cache(DType::kFloat16, {3, 48, 2, 64});
  expect_error(contiguous_error(batch3, batch3, "k_cache", "v_cache"), ErrorKind::kValue,
               "k_cache: expected batch 2 like q");
  TestTensor heads3 = cache(DType::kFloat16, {2, 48, 3, 64});
  expect_error(contiguous_error(heads3, heads3, "k_cache", "v_cache"), ErrorKind::kValue,
               "k_cache: num_heads_kv (3) must be >= 1 and divide num_heads (8)");
  TestTensor dim32 = cache(DType::kFloat16, {2, 48, 2, 32});
  expect_error(contiguous_error(dim32, dim32, "k_cache", "v_cache"), ErrorKind::kValue,
               "k_cache: expected head_dim 64 like q");
  // Valid keys pass the names' checks and reach the device rule.
  expect_error(contiguous_error(good, good, "k_cache", "v_cache"), ErrorKind::kNotImplemented,
               "q: the decode kernel runs on CUDA tensors");
}

TEST(DecodeParams, CpuTensorsAreRefusedAfterValidation) {
  expect_error(decode_error([](auto&, auto&, auto&, auto&, auto&) {}), ErrorKind::kNotImplemented,
               "q: the decode kernel runs on CUDA tensors");
  EXPECT_EQ(decode_splits(DeviceKind::kCPU, 0, 8, 1, 32, 8, 128, 32768, 64), 0);
}

TEST(DecodeParams, NoSplitsForShapesTheKernelDoesNotTake) {
  // Rows beyond max_rows, a head dim that is no multiple of 8, heads that do not divide.
  EXPECT_EQ(decode_splits(DeviceKind::kCUDA, 0, 8, 16, 32, 8, 128, 32768, 16), 0);
  EXPECT_EQ(decode_splits(DeviceKind::kCUDA, 0, 8, 1, 32, 8, 100, 32768, 64), 0);
  EXPECT_EQ(decode_splits(DeviceKind::kCUDA, 0, 8, 1, 32, 6, 128, 32768, 64), 0);
}

// Gathered keys (DecodeInputs::gathered): the rules of the decode kernel's indexed keys, checked
// on descriptors marked as CUDA tensors (validation only: nothing runs).
struct GatheredCase {
  TestTensor q{DType::kBFloat16, {2, 1, 8, 64}};
  TestTensor out{DType::kBFloat16, {2, 1, 8, 64}};
  TestTensor lse{DType::kFloat32, {2, 8, 1}};
  TestTensor k{DType::kBFloat16, {2, 100, 2, 64}};
  TestTensor v{DType::kBFloat16, {2, 100, 2, 64}};
  TestTensor positions{DType::kInt32, {2, 2, 30}};
};

TensorDesc on_cuda(TestTensor& t) {
  TensorDesc d = t.desc();
  d.device = DeviceKind::kCUDA;
  return d;
}

// make_decode_forward_params' error (or "no error" and the params) for gathered keys, after
// `change` alters the inputs and options.
Error gathered_error(const std::function<void(GatheredCase& c, DecodeInputs& inputs, AttentionOptions& o)>& change,
                     ForwardParams* params = nullptr) {
  GatheredCase c;
  const TensorDesc positions = on_cuda(c.positions);
  DecodeInputs inputs;
  inputs.gathered = GatheredKeys{&positions, 100, nullptr, &positions};
  AttentionOptions options;
  change(c, inputs, options);
  try {
    const ForwardParams p = make_decode_forward_params(on_cuda(c.q), on_cuda(c.k), on_cuda(c.v), on_cuda(c.out),
                                                       on_cuda(c.lse), nullptr, nullptr, options, inputs);
    if (params != nullptr) *params = p;
  } catch (const Error& e) {
    return e;
  }
  return Error(ErrorKind::kRuntime, "no error");
}

TEST(DecodeParams, GatheredKeysRules) {
  ForwardParams p;
  EXPECT_STREQ(gathered_error([](auto&, auto&, AttentionOptions& o) { o.causal = true; }, &p).what(), "no error");
  EXPECT_NE(p.key_rows, nullptr);
  EXPECT_EQ(p.key_rows, p.key_positions);
  EXPECT_EQ(p.seqlen_k, 30);  // the kept keys
  EXPECT_EQ(p.key_rows_source_len, 100);

  TestTensor table{DType::kInt32, {2, 3}};
  const TensorDesc table_d = on_cuda(table);
  expect_error(gathered_error([&](auto&, DecodeInputs& in, auto&) { in.block_table = &table_d; }),
               ErrorKind::kValue, "key_positions: the decode kernel reads gathered keys from a contiguous k, v");
  expect_error(gathered_error([](auto&, DecodeInputs& in, auto&) { in.gathered.key_rows = nullptr; }),
               ErrorKind::kValue, "key_rows: the decode kernel reads gathered keys in place");
  expect_error(gathered_error([](auto&, DecodeInputs& in, auto&) { in.gathered.key_ends = in.gathered.key_rows; }),
               ErrorKind::kNotImplemented, "key_ends: per-query key bounds are not read by the decode kernel");
  TestTensor per_query_head{DType::kInt32, {2, 8, 30}};
  const TensorDesc per_head = on_cuda(per_query_head);
  expect_error(gathered_error([&](auto&, DecodeInputs& in, auto&) {
                 in.gathered.key_positions = in.gathered.key_rows = &per_head;
               }),
               ErrorKind::kValue, "key_positions: the decode kernel takes one key set per kv head");
  expect_error(gathered_error([](auto&, auto&, AttentionOptions& o) { o.window_left = 10; }),
               ErrorKind::kNotImplemented, "window: with gathered keys the decode kernel takes no left window");
  // Causal with several queries: the positions would matter.
  expect_error(gathered_error([](GatheredCase& c, auto&, AttentionOptions& o) {
                 c.q = TestTensor{DType::kBFloat16, {2, 2, 8, 64}};
                 c.out = TestTensor{DType::kBFloat16, {2, 2, 8, 64}};
                 c.lse = TestTensor{DType::kFloat32, {2, 8, 2}};
                 o.causal = true;
               }),
               ErrorKind::kNotImplemented, "with seqlen_q 2");
}

}  // namespace
}  // namespace dmattn::test
