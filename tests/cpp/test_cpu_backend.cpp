// GoogleTest suite of the CPU backend against the float64 reference (naive_reference.h).
// Every case poisons its outputs with NaN first, so anything left unwritten fails.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention_case.h"
#include "cpu/cpu_backend.h"

namespace dmattn::test {
namespace {

template <typename T>
T pick(std::mt19937_64& rng, const std::vector<T>& choices) {
  return choices[rng() % choices.size()];
}

bool chance(std::mt19937_64& rng, double probability) {
  return std::uniform_real_distribution<double>(0, 1)(rng) < probability;
}

// A broadcastable operand shape: each dim full or 1 (head: 1, H or Hkv), leading 1s sometimes
// dropped (right-aligned broadcasting).
std::vector<int64_t> random_operand_shape(std::mt19937_64& rng, const CaseConfig& c) {
  std::vector<int64_t> shape = {
      chance(rng, 0.5) ? c.batch : 1,
      pick<int64_t>(rng, {1, c.heads, c.heads_kv}),
      chance(rng, 0.6) ? c.seqlen_q : 1,
      chance(rng, 0.85) ? c.seqlen_k : 1,
  };
  while (!shape.empty() && shape.front() == 1 && chance(rng, 0.5)) shape.erase(shape.begin());
  return shape;
}

CaseConfig random_config(std::mt19937_64& rng, DType dtype) {
  CaseConfig c;
  c.dtype = dtype;
  c.seed = rng();
  auto length = [&] { return chance(rng, 0.08) ? 0 : pick<int64_t>(rng, {1, 17, 64, 100, 130}); };
  c.dim = pick<int64_t>(rng, {1, 8, 40, 64, 72, 128});
  c.seqlen_q = length();
  c.seqlen_k = length();
  c.batch = pick<int64_t>(rng, {1, 2});
  c.heads_kv = pick<int64_t>(rng, {1, 2});
  int64_t group = pick<int64_t>(rng, {1, 2, 3});
  // Keep the float64 reference cheap: shrink batch and heads of large problems.
  while (c.batch * c.heads_kv * group * c.seqlen_q * c.seqlen_k * c.dim > 2500000) {
    if (c.batch > 1) --c.batch;
    else if (group > 1) --group;
    else if (c.heads_kv > 1) --c.heads_kv;
    else break;
  }
  c.heads = c.heads_kv * group;

  c.causal = chance(rng, 0.3);
  if (chance(rng, 0.3)) {
    c.window_left = chance(rng, 0.8) ? pick<int64_t>(rng, {0, 3, 20, 70}) : -1;
    c.window_right = chance(rng, 0.7) ? pick<int64_t>(rng, {0, 5, 40}) : -1;
  }
  if (chance(rng, 0.3)) c.scale = pick<double>(rng, {0.05, 0.3, 1.0});
  if (chance(rng, 0.25)) c.softcap = pick<double>(rng, {1.5, 5.0, 30.0});
  if (chance(rng, 0.55)) {
    c.mask_shape = random_operand_shape(rng, c);
    c.mask_keep = pick<double>(rng, {0.2, 0.7, 0.95});
    if (chance(rng, 0.35)) c.empty_mask_rows = 0.25;
  }
  if (chance(rng, 0.7)) {
    c.bias_shape = random_operand_shape(rng, c);
    c.bias_dtype = chance(rng, 0.5) ? dtype : DType::kFloat32;
    c.bias_grad = chance(rng, 0.85);
    if (chance(rng, 0.35)) {
      c.bias_neg_inf = 0.08;
      c.bias_lowest = 0.05;
    }
  }
  c.strided = chance(rng, 0.4);
  return c;
}

void run_random_configs(DType dtype, int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int n = 0; n < count; ++n) {
    const CaseConfig c = random_config(rng, dtype);
    SCOPED_TRACE(describe(c));
    check_case_against_reference(c);
    if (::testing::Test::HasFailure()) return;  // one failing config is enough to read
  }
}

TEST(CpuBackendRandom, Float32) { run_random_configs(DType::kFloat32, 200, 101); }
TEST(CpuBackendRandom, BFloat16) { run_random_configs(DType::kBFloat16, 120, 202); }
TEST(CpuBackendRandom, Float16) { run_random_configs(DType::kFloat16, 120, 303); }
TEST(CpuBackendRandom, Float64) { run_random_configs(DType::kFloat64, 60, 404); }

// The backward's other memory levels (score_cache.h): the per-thread row tiles only, and no
// cache at all (the three-pass recomputation); the default keeps every tile.
class CacheLimits {
 public:
  CacheLimits(int64_t store_bytes, int64_t row_bytes) {
    cpu::set_backward_cache_limits(store_bytes, row_bytes);
  }
  ~CacheLimits() { cpu::set_backward_cache_limits(int64_t{256} << 20, int64_t{16} << 20); }
};

TEST(CpuBackendRandom, Float32RowTilesOnly) {
  CacheLimits limits(0, int64_t{16} << 20);
  run_random_configs(DType::kFloat32, 60, 505);
}
TEST(CpuBackendRandom, BFloat16WithoutCache) {
  CacheLimits limits(0, 0);
  run_random_configs(DType::kBFloat16, 60, 606);
}

// Every bias shape the spec allows (with dbias) and every mask shape, over two key blocks, a
// GQA group of 2 and a tail query block.
TEST(CpuBackend, EveryBroadcastShape) {
  CaseConfig base;
  base.batch = 2, base.heads = 4, base.heads_kv = 2, base.seqlen_q = 70, base.seqlen_k = 100;
  base.dim = 8;
  uint64_t seed = 7;
  for (int64_t b : {int64_t{1}, base.batch}) {
    for (int64_t h : {int64_t{1}, base.heads_kv, base.heads}) {
      for (int64_t i : {int64_t{1}, base.seqlen_q}) {
        for (int64_t j : {int64_t{1}, base.seqlen_k}) {
          for (bool as_mask : {false, true}) {
            CaseConfig c = base;
            c.seed = ++seed;
            c.causal = seed % 3 == 0;
            c.strided = seed % 2 == 0;
            if (as_mask) {
              c.mask_shape = std::vector<int64_t>{b, h, i, j};
              c.empty_mask_rows = 0.2;
            } else {
              c.bias_shape = std::vector<int64_t>{b, h, i, j};
              c.bias_dtype = seed % 4 == 0 ? DType::kFloat32 : c.dtype;
            }
            SCOPED_TRACE(describe(c));
            check_case_against_reference(c);
          }
        }
      }
    }
  }
}

// B = 0, Sq = 0, Sk = 0: outputs still fully written; a broadcast dbias is all zeros.
TEST(CpuBackend, ZeroSizes) {
  struct Sizes { int64_t b, sq, sk; };
  for (Sizes s : {Sizes{0, 5, 7}, Sizes{2, 0, 7}, Sizes{2, 5, 0}, Sizes{2, 0, 0}}) {
    using Shape = std::vector<int64_t>;
    for (const Shape& bias_shape : {Shape{1, 1, 1, 1}, Shape{1, 3, 1, 1}, Shape{1, 3, s.sq, 1},
                                    Shape{1, 1, 1, s.sk}, Shape{s.b, 3, s.sq, s.sk}}) {
      CaseConfig c;
      c.batch = s.b, c.seqlen_q = s.sq, c.seqlen_k = s.sk, c.heads = 3, c.heads_kv = 1;
      c.dim = 8, c.bias_shape = bias_shape, c.mask_shape = std::vector<int64_t>{1, s.sk};
      SCOPED_TRACE(describe(c));
      check_case_against_reference(c);
    }
  }
}

// Bottom-right causal alignment with Sq > Sk: the first Sq - Sk query rows see no key.
TEST(CpuBackend, CausalWithMoreQueriesThanKeysHasEmptyLeadingRows) {
  CaseConfig c;
  c.seqlen_q = 100, c.seqlen_k = 17, c.causal = true, c.dim = 40;
  CaseTensors t = make_case_tensors(c);
  run_case(c, t);
  for (int64_t i = 0; i < c.seqlen_q; ++i) {
    const double lse = t.lse.get(i);
    if (i < c.seqlen_q - c.seqlen_k) EXPECT_EQ(lse, -INFINITY) << "row " << i;
    else EXPECT_TRUE(std::isfinite(lse)) << "row " << i;
  }
  check_case_against_reference(c);
}

// Rows with no allowed key contribute exactly nothing: changing their q and dout leaves dk,
// dv and dbias bitwise unchanged, and their out/dq are exactly 0 (the reference check is exact
// where the reference is 0).
TEST(CpuBackend, EmptyRowsContributeExactlyZero) {
  CaseConfig c;
  c.batch = 2, c.heads = 4, c.heads_kv = 2, c.seqlen_q = 100, c.seqlen_k = 130, c.dim = 64;
  c.mask_shape = std::vector<int64_t>{2, 1, 100, 130};
  c.empty_mask_rows = 0.3;
  c.bias_shape = std::vector<int64_t>{1, 4, 100, 1};  // folds batches and keys in dbias
  c.softcap = 5;
  SCOPED_TRACE(describe(c));
  check_case_against_reference(c);

  CaseTensors t = make_case_tensors(c);
  run_case(c, t);
  const std::vector<uint8_t> dk = t.dk.raw_bytes(), dv = t.dv.raw_bytes(),
                             dbias = t.dbias.raw_bytes();
  std::mt19937_64 rng(99);
  std::normal_distribution<double> normal(0, 5);
  int64_t empty_rows = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.heads; ++h) {
      for (int64_t i = 0; i < c.seqlen_q; ++i) {
        if (t.lse.get((b * c.heads + h) * c.seqlen_q + i) != -INFINITY) continue;
        ++empty_rows;
        for (int64_t d = 0; d < c.dim; ++d) {
          const int64_t e = ((b * c.seqlen_q + i) * c.heads + h) * c.dim + d;
          t.q.set(e, normal(rng));
          t.dout.set(e, normal(rng));
        }
      }
    }
  }
  ASSERT_GT(empty_rows, 10);
  run_case(c, t);
  EXPECT_EQ(t.dk.raw_bytes(), dk);
  EXPECT_EQ(t.dv.raw_bytes(), dv);
  EXPECT_EQ(t.dbias.raw_bytes(), dbias);
}

// Bitwise identical results for 1, 2 and 3 threads, including folded dbias reductions.
TEST(CpuBackend, DeterministicAcrossThreadCounts) {
  const int saved_threads = omp_get_max_threads();
  for (auto bias_shape : {std::vector<int64_t>{2, 4, 100, 130}, std::vector<int64_t>{1, 1, 100, 1},
                          std::vector<int64_t>{1, 2, 1, 130}}) {
    CaseConfig c;
    c.dtype = DType::kBFloat16;
    c.batch = 2, c.heads = 4, c.heads_kv = 2, c.seqlen_q = 100, c.seqlen_k = 130, c.dim = 72;
    c.bias_shape = bias_shape;
    c.bias_dtype = DType::kFloat32;
    c.window_left = 50;
    c.mask_shape = std::vector<int64_t>{100, 130};
    SCOPED_TRACE(describe(c));
    std::vector<std::vector<uint8_t>> first;
    for (int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      CaseTensors t = make_case_tensors(c);
      run_case(c, t);
      std::vector<std::vector<uint8_t>> results = {t.out.raw_bytes(), t.lse.raw_bytes(),
                                                   t.dq.raw_bytes(), t.dk.raw_bytes(),
                                                   t.dv.raw_bytes(), t.dbias.raw_bytes()};
      if (first.empty()) first = results;
      else EXPECT_TRUE(results == first) << threads << " threads differ from 1 thread";
    }
  }
  omp_set_num_threads(saved_threads);
}

// A bf16 bias of finfo(bf16).min at allowed positions (whole rows of it, and mixed with
// ordinary values) gives finite outputs and gradients that match the reference.
TEST(CpuBackend, LowestBFloat16BiasKeepsEverythingFinite) {
  for (double lowest_fraction : {1.0, 0.5}) {
    CaseConfig c;
    c.dtype = DType::kBFloat16, c.bias_dtype = DType::kBFloat16;
    c.batch = 1, c.heads = 2, c.heads_kv = 1, c.seqlen_q = 64, c.seqlen_k = 100, c.dim = 64;
    c.bias_shape = std::vector<int64_t>{1, 2, 64, 100};
    c.bias_lowest = lowest_fraction;
    c.softcap = lowest_fraction == 1.0 ? 0.0 : 10.0;
    SCOPED_TRACE(describe(c));
    CaseTensors t = make_case_tensors(c);
    check_tensors_against_reference(c, t, ErrorScale::kTensorMax);
    for (const TestTensor* x : {&t.out, &t.lse, &t.dq, &t.dk, &t.dv, &t.dbias}) {
      for (int64_t e = 0; e < x->numel(); ++e) ASSERT_TRUE(std::isfinite(x->get(e))) << e;
    }
  }
}

// A row whose every allowed key has bias finfo(bf16).min (a fully padded query row in HF
// style): every score rounds to the same value, so the forward sees a uniform distribution,
// and the backward must use the same P = 1/n. (Recomputing P as exp(s - lse) would give
// P = 1: lse = s + log(n) rounds back to s.)
TEST(CpuBackend, RowOfLowestBiasIsUniformInForwardAndBackward) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat64}) {
    CaseConfig c;
    c.dtype = dtype, c.bias_dtype = DType::kFloat32;
    c.seqlen_q = 16, c.seqlen_k = 70, c.dim = 16;
    c.bias_shape = std::vector<int64_t>{1, 1, 16, 70};
    c.mask_shape = std::vector<int64_t>{16, 70};
    c.mask_keep = 0.6;
    SCOPED_TRACE(describe(c));
    CaseTensors t = make_case_tensors(c);
    const int64_t row = 4;
    for (int64_t j = 0; j < c.seqlen_k; ++j) t.bias.set(row * c.seqlen_k + j, -0x1.FEp127);
    check_tensors_against_reference(c, t, ErrorScale::kTensorMax);
    // out of that row = mean of v over the allowed keys.
    int64_t allowed = 0;
    std::vector<double> mean(c.dim, 0.0);
    for (int64_t j = 0; j < c.seqlen_k; ++j) {
      if (t.mask.get(row * c.seqlen_k + j) == 0) continue;
      ++allowed;
      for (int64_t d = 0; d < c.dim; ++d) mean[d] += t.v.get(j * c.dim + d);
    }
    ASSERT_GT(allowed, 0);
    for (int64_t d = 0; d < c.dim; ++d) {
      EXPECT_NEAR(t.out.get(row * c.dim + d), mean[d] / allowed, 1e-2) << d;
    }
  }
}

// fp16 gradients larger than 65504 saturate to the largest finite half instead of Inf.
TEST(CpuBackend, Float16GradientsSaturate) {
  CaseConfig c;
  c.dtype = DType::kFloat16;
  c.seqlen_q = 64, c.seqlen_k = 1, c.dim = 8;
  CaseTensors t = make_case_tensors(c);
  for (int64_t e = 0; e < t.dout.numel(); ++e) t.dout.set(e, e % 2 ? 30000.0 : -30000.0);
  run_case(c, t);
  // A single key gets p = 1 from every query: dv = sum of 64 x (+-30000) per dim = +-1.92e6.
  for (int64_t d = 0; d < c.dim; ++d) EXPECT_EQ(t.dv.get(d), d % 2 ? 65504.0 : -65504.0);
}

// NaN in, NaN out: a NaN in one element of a query row makes that row's out, lse and dq NaN
// (not an empty row's 0 / -inf: its scores are all NaN, so the running max must not skip
// them), and its dbias row, in every dtype and at every memory level of the backward. Every
// other row of out, lse, dq and dbias is bitwise what the NaN-free call gives: rows are
// computed independently.
TEST(CpuBackend, NanInAQueryRowReachesThatRowOnly) {
  const std::pair<int64_t, int64_t> levels[] = {
      {int64_t{256} << 20, int64_t{16} << 20}, {0, int64_t{16} << 20}, {0, 0}};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
    for (const auto& [store_bytes, row_bytes] : levels) {
      CacheLimits limits(store_bytes, row_bytes);
      CaseConfig c;
      c.dtype = dtype;
      c.heads = 2, c.seqlen_q = 70, c.seqlen_k = 130, c.dim = 16, c.causal = true;
      c.bias_shape = std::vector<int64_t>{1, 2, 70, 130};
      SCOPED_TRACE(describe(c) + " store " + std::to_string(store_bytes) + " rows " +
                   std::to_string(row_bytes));
      CaseTensors clean = make_case_tensors(c);
      run_case(c, clean);
      CaseTensors t = make_case_tensors(c);  // the same inputs (same seed)
      const int64_t nan_row = 40, nan_head = 1;
      t.q.set((nan_row * c.heads + nan_head) * c.dim + 3, NAN);
      run_case(c, t);

      // Row r of a tensor whose last dim has `width` elements.
      auto check_rows = [&](const char* name, const TestTensor& got, const TestTensor& ref,
                            int64_t width, auto is_nan_row) {
        for (int64_t r = 0; r < got.numel() / width; ++r) {
          bool any_nan = false, same = true;
          for (int64_t e = r * width; e < (r + 1) * width; ++e) {
            any_nan |= std::isnan(got.get(e));
            same &= got.get(e) == ref.get(e);
          }
          if (is_nan_row(r)) EXPECT_TRUE(any_nan) << name << " row " << r << ": no NaN";
          else EXPECT_TRUE(same) << name << " row " << r << " differs from the NaN-free call";
        }
      };
      // out / dq rows are (i, h); lse and dbias rows (h, i).
      auto seq_row = [&](int64_t r) { return r == nan_row * c.heads + nan_head; };
      auto head_row = [&](int64_t r) { return r == nan_head * c.seqlen_q + nan_row; };
      check_rows("out", t.out, clean.out, c.dim, seq_row);
      check_rows("dq", t.dq, clean.dq, c.dim, seq_row);
      check_rows("lse", t.lse, clean.lse, 1, head_row);
      check_rows("dbias", t.dbias, clean.dbias, c.seqlen_k, head_row);
      // dk / dv of the keys the row attends (j <= nan_row + Sk - Sq) are NaN.
      for (int64_t j = 0; j <= nan_row + c.seqlen_k - c.seqlen_q; ++j) {
        EXPECT_TRUE(std::isnan(t.dk.get(j * c.dim))) << "dk row " << j;
        EXPECT_TRUE(std::isnan(t.dv.get(j * c.dim))) << "dv row " << j;
      }
    }
  }
}

}  // namespace
}  // namespace dmattn::test
