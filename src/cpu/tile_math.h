// Tile sizes, tile loads/stores and the matrix products of the blockwise algorithm.
//
// Every tile is a contiguous row-major buffer of the accumulator type, kBlockQ or kBlockK rows
// whatever the sequence lengths: rows past the end of a sequence are zero, and every product
// is a BLAS call (blas_gemm.h) on whole tiles. The fixed shapes matter for more than
// simplicity: a BLAS may pick a different kernel (and summation order) for a different shape,
// and with whole tiles a score, an output or a gradient element is the same function of its
// inputs wherever its tile lies, so gathering the kept keys (attention_topk) gives the bitwise
// result of masking the others. Zero rows make zero scores, probabilities and products, so the
// padding contributes exactly nothing.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/blas_gemm.h"
#include "cpu/element_types.h"

namespace dmattn::cpu {

// Query rows and key columns per tile. They need not divide the sequence lengths.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// tile[r * dim + d] = src[r * row_stride + d] for r < rows, d < dim; 0 for rows <= r < tile_rows.
template <typename T, typename Acc>
inline void load_rows(const T* src, int64_t row_stride, int64_t rows, int64_t dim,
                      Acc* __restrict tile, int64_t tile_rows) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = src + r * row_stride;
    Acc* out = tile + r * dim;
    for (int64_t d = 0; d < dim; ++d) out[d] = load_as<Acc>(row[d]);
  }
  std::fill(tile + rows * dim, tile + tile_rows * dim, Acc(0));
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

// c (kBlockQ x kBlockK, leading dim kBlockK) = a (kBlockQ x dim) * b^T, b (kBlockK x dim).
// Used for scores S = Q K^T and dP = dO V^T.
template <typename Acc>
inline void matmul_into_scores(const Acc* a, const Acc* b, int64_t dim, Acc* c) {
  gemm(false, true, kBlockQ, kBlockK, dim, Acc(1), a, dim, b, dim, Acc(0), c, kBlockK);
}

// acc (kBlockQ x dim) += p (kBlockQ x kBlockK, leading dim kBlockK) * b (kBlockK x dim).
// Used for O += P V and dQ += dS K.
template <typename Acc>
inline void accumulate_product(const Acc* p, const Acc* b, int64_t dim, Acc* acc) {
  gemm(false, false, kBlockQ, dim, kBlockK, Acc(1), p, kBlockK, b, dim, Acc(1), acc, dim);
}

// acc (kBlockK x dim) += p^T (p: kBlockQ x kBlockK, leading dim kBlockK) * a (kBlockQ x dim).
// Used for dV += P^T dO and dK += dS^T Q.
template <typename Acc>
inline void accumulate_transposed_product(const Acc* p, const Acc* a, int64_t dim, Acc* acc) {
  gemm(true, false, kBlockK, dim, kBlockQ, Acc(1), p, kBlockK, a, dim, Acc(1), acc, dim);
}

}  // namespace dmattn::cpu
