// The tiles' matrix products, through the CBLAS interface of the system BLAS (OpenBLAS on
// Debian: libopenblas-dev). docs/design.md says why a library rather than hand-written loops.
//
// Every call here is single-threaded: the backend already runs one tile task per OpenMP thread,
// and a BLAS that spawned its own threads inside them would oversubscribe the cores (OpenBLAS
// threads any product of 64 x 64 x 64 or more). A product is computed in one fixed order for
// given sizes, so results do not depend on the thread count.
#pragma once

#include <cstdint>

extern "C" {
#include <cblas.h>
}

namespace dmattn::cpu {

// Makes the BLAS single-threaded; called once per backend entry (cheap after the first).
void use_single_threaded_blas();

// c (m x n, leading dim ldc) = alpha * op(a) * op(b) + beta * c, row-major; op(x) = x^T when
// the flag is set. float and double accumulators (fp64 inputs accumulate in fp64).
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb),
              beta, c, static_cast<int>(ldc));
}

inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
                 const double* a, int64_t lda, const double* b, int64_t ldb, double beta,
                 double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb),
              beta, c, static_cast<int>(ldc));
}

}  // namespace dmattn::cpu
