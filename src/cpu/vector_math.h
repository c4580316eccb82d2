// Row-wise softmax arithmetic of the CPU backend, vectorized: e^x, row max, row sum and dot
// product over one tile row.
//
// std::exp is a scalar library call, and gcc only substitutes glibc's vector variants under
// -ffast-math, which would also drop the -inf / NaN handling the softmax depends on; a plain
// `sum += x` loop is not reordered (so not vectorized) without it either. So the float versions
// (vector_math.cpp) are written with explicit vectors of kLanes floats and compiled for AVX-512,
// AVX2 and baseline x86-64, the best one picked at load time. The lane count fixes the
// summation order, so results do not depend on the thread count. fp64 (the gradcheck dtype)
// keeps plain loops.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace dmattn::cpu {

constexpr int kLanes = 16;

// x[c] = e^(x[c] - shift) for c < n, shift finite. Exactly 0 where x[c] = -inf or
// x[c] - shift < -87.3 (where e^x would be subnormal), exactly 1 where x[c] = shift, NaN for
// NaN, within 2 ulp of e^(x - shift) elsewhere. Arguments are <= 0 in the softmax (shift is the
// row max); positive ones are taken as 0.
void exp_shifted(float* x, int64_t n, float shift);
// max_c x[c] (-inf for n = 0); NaN if any x[c] is NaN (a NaN score must reach the row's
// statistics instead of being skipped, see max_keep_nan).
float row_max(const float* x, int64_t n);
// sum_c a[c] * b[c], or sum_c a[c] when b is null.
float row_dot(const float* a, const float* b, int64_t n);

// max(a, b), NaN if either is NaN. std::max and plain comparisons drop a NaN in one of the
// two argument positions, which would let a NaN score vanish from a row's softmax statistics.
template <typename Acc>
inline Acc max_keep_nan(Acc a, Acc b) {
  return (a < b || b != b) ? b : a;
}

inline void exp_shifted(double* x, int64_t n, double shift) {
  for (int64_t c = 0; c < n; ++c) x[c] = std::exp(x[c] - shift);
}
inline double row_max(const double* x, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < n; ++c) m = max_keep_nan(m, x[c]);
  return m;
}
inline double row_dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t c = 0; c < n; ++c) s += b ? a[c] * b[c] : a[c];
  return s;
}

}  // namespace dmattn::cpu
