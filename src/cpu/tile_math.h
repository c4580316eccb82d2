// Tile sizes, tile loads/stores and the small matrix products of the blockwise algorithm.
//
// Every tile is a contiguous row-major buffer of the accumulator type. The products are
// written so that the innermost loop is an axpy over contiguous memory (no reduction), which
// gcc vectorizes at -O3 without -ffast-math; the summation order is fixed at compile time, so
// results do not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/element_types.h"

namespace dmattn::cpu {

// Query rows and key columns per tile. They need not divide the sequence lengths.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// tile[r * dim + d] = src[r * row_stride + d], for r < rows, d < dim.
template <typename T, typename Acc>
inline void load_rows(const T* src, int64_t row_stride, int64_t rows, int64_t dim,
                      Acc* __restrict tile) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = src + r * row_stride;
    Acc* out = tile + r * dim;
    for (int64_t d = 0; d < dim; ++d) out[d] = load_as<Acc>(row[d]);
  }
}

// Transposed load: tile_t[d * kBlockK + r] = src[r * row_stride + d], for r < rows <= kBlockK.
template <typename T, typename Acc>
inline void load_rows_transposed(const T* src, int64_t row_stride, int64_t rows, int64_t dim,
                                 Acc* __restrict tile_t) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = src + r * row_stride;
    for (int64_t d = 0; d < dim; ++d) tile_t[d * kBlockK + r] = load_as<Acc>(row[d]);
  }
}

// dst[r * row_stride + d] = factor * tile[r * dim + d], saturating to T.
template <typename T, typename Acc>
inline void store_rows(const Acc* tile, int64_t rows, int64_t dim, Acc factor, T* dst,
                       int64_t row_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    T* row = dst + r * row_stride;
    const Acc* in = tile + r * dim;
    for (int64_t d = 0; d < dim; ++d) store_saturating(row + d, in[d] * factor);
  }
}

// c (rows x cols, leading dim kBlockK) = a (rows x dim) * b_t (dim x cols, leading dim kBlockK).
// Used for scores S = Q K^T and dP = dO V^T, with K^T / V^T loaded transposed.
template <typename Acc>
inline void matmul_into_scores(const Acc* __restrict a, const Acc* __restrict b_t, int64_t rows,
                               int64_t cols, int64_t dim, Acc* __restrict c) {
  for (int64_t r = 0; r < rows; ++r) {
    Acc* c_row = c + r * kBlockK;
    for (int64_t j = 0; j < cols; ++j) c_row[j] = Acc(0);
    const Acc* a_row = a + r * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const Acc a_rd = a_row[d];
      const Acc* b_row = b_t + d * kBlockK;
      for (int64_t j = 0; j < cols; ++j) c_row[j] += a_rd * b_row[j];
    }
  }
}

// acc (rows x dim) += p (rows x cols, leading dim kBlockK) * b (cols x dim).
// Used for O += P V and dQ += dS K.
template <typename Acc>
inline void accumulate_product(const Acc* __restrict p, const Acc* __restrict b, int64_t rows,
                               int64_t cols, int64_t dim, Acc* __restrict acc) {
  for (int64_t r = 0; r < rows; ++r) {
    Acc* acc_row = acc + r * dim;
    const Acc* p_row = p + r * kBlockK;
    for (int64_t j = 0; j < cols; ++j) {
      const Acc weight = p_row[j];
      if (weight == Acc(0)) continue;  // masked positions: adding zero changes nothing
      const Acc* b_row = b + j * dim;
      for (int64_t d = 0; d < dim; ++d) acc_row[d] += weight * b_row[d];
    }
  }
}

// acc (cols x dim) += p^T (p: rows x cols, leading dim kBlockK) * a (rows x dim).
// Used for dV += P^T dO and dK += dS^T Q.
template <typename Acc>
inline void accumulate_transposed_product(const Acc* __restrict p, const Acc* __restrict a,
                                          int64_t rows, int64_t cols, int64_t dim,
                                          Acc* __restrict acc) {
  for (int64_t r = 0; r < rows; ++r) {
    const Acc* p_row = p + r * kBlockK;
    const Acc* a_row = a + r * dim;
    for (int64_t j = 0; j < cols; ++j) {
      const Acc weight = p_row[j];
      if (weight == Acc(0)) continue;
      Acc* acc_row = acc + j * dim;
      for (int64_t d = 0; d < dim; ++d) acc_row[d] += weight * a_row[d];
    }
  }
}

}  // namespace dmattn::cpu
