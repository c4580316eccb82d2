// The float kernels of vector_math.h, on gcc/clang vector extensions (one Vec = kLanes floats;
// the compiler splits it into the registers the target has).
#include "cpu/vector_math.h"

#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define DMATTN_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DMATTN_VECTOR_CLONES
#endif

// The helpers below pass whole vectors by value; they are always inlined into the clones, so the
// ABI note gcc gives for 64-byte vector arguments never applies.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace dmattn::cpu {
namespace {

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IVec = int32_t __attribute__((vector_size(kLanes * sizeof(float))));

__attribute__((always_inline)) inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline void store(float* p, const Vec& v) {
  std::memcpy(p, &v, sizeof(v));
}
__attribute__((always_inline)) inline Vec splat(float x) { return Vec{} + x; }

// Lanes [0, n) of p, `fill` in the others.
__attribute__((always_inline)) inline Vec load_partial(const float* p, int64_t n, float fill) {
  float tmp[kLanes];
  for (int l = 0; l < kLanes; ++l) tmp[l] = l < n ? p[l] : fill;
  return load(tmp);
}

// e^x for x <= 0 (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r).
__attribute__((always_inline)) inline Vec exp_nonpositive(const Vec& x) {
  const float kMin = -87.33654f;         // ln(FLT_MIN): below it the result is flushed to 0
  const float kRound = 12582912.0f;      // 1.5 * 2^23: adding it rounds to an integer
  Vec xc = x < kMin ? splat(kMin) : x;   // NaN stays NaN (the comparisons are false)
  xc = xc > 0.0f ? splat(0.0f) : xc;
  const Vec t = xc * 1.44269504088896341f + kRound;
  const Vec n = t - kRound;
  const IVec n_int = (IVec)t - 0x4B400000;  // n, from t's mantissa
  const Vec r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;       // ln2 in two parts
  Vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Vec y = p * r * r + r + 1.0f;
  const IVec scale_bits = (n_int + 127) << 23;  // 2^n, n in [-126, 0]
  const Vec result = y * (Vec)scale_bits;
  return x < kMin ? splat(0.0f) : result;
}

}  // namespace

DMATTN_VECTOR_CLONES void exp_shifted(float* x, int64_t n, float shift) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) store(x + c, exp_nonpositive(load(x + c) - shift));
  if (c < n) {
    float tmp[kLanes];
    store(tmp, exp_nonpositive(load_partial(x + c, n - c, shift) - shift));
    std::memcpy(x + c, tmp, (n - c) * sizeof(float));
  }
}

DMATTN_VECTOR_CLONES float row_max(const float* x, int64_t n) {
  const float kNegInf = -std::numeric_limits<float>::infinity();
  // Per lane the max of the non-NaN values, and apart from it whether a NaN came (a NaN makes
  // the result NaN). The two plain selects vectorize; a select on (m < v) | (v != v) in one went
  // lane by lane through scalar compares (gcc 12: 40 % of a CPU forward's time in this loop).
  Vec m = splat(kNegInf);
  IVec nan = IVec{};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    const Vec v = load(x + c);
    m = m < v ? v : m;
    nan |= v != v;
  }
  if (c < n) {
    const Vec v = load_partial(x + c, n - c, kNegInf);
    m = m < v ? v : m;
    nan |= v != v;
  }
  float result = kNegInf;
  int any_nan = 0;
  for (int l = 0; l < kLanes; ++l) {
    result = result < m[l] ? m[l] : result;
    any_nan |= nan[l];
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : result;
}

DMATTN_VECTOR_CLONES float row_dot(const float* a, const float* b, int64_t n) {
  Vec s = splat(0.0f);
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) s += b ? load(a + c) * load(b + c) : load(a + c);
  if (c < n) {
    const Vec va = load_partial(a + c, n - c, 0.0f);
    s += b ? va * load_partial(b + c, n - c, 0.0f) : va;
  }
  float result = 0.0f;
  for (int l = 0; l < kLanes; ++l) result += s[l];
  return result;
}

}  // namespace dmattn::cpu
