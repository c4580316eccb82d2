// The tiles' matrix products, through the CBLAS interface of the system BLAS (OpenBLAS on
// Debian: libopenblas-dev). docs/design.md says why a library rather than hand-written loops.
// A build without a BLAS (CMake warns; e.g. a GPU host without the package) uses plain loops
// with the same results up to rounding, many times slower.
//
// Every call here is single-threaded: the backend already runs one tile task per OpenMP thread,
// and a BLAS that spawned its own threads inside them would oversubscribe the cores (OpenBLAS
// threads any product of 64 x 64 x 64 or more). A product is computed in one fixed order for
// given sizes, so results do not depend on the thread count.
#pragma once

#include <cstdint>

#ifdef DMATTN_WITH_BLAS
extern "C" {
#include <cblas.h>
}
#endif

namespace dmattn::cpu {

// Makes the BLAS single-threaded; called once per backend entry (cheap after the first).
void use_single_threaded_blas();

// c (m x n, leading dim ldc) = alpha * op(a) * op(b) + beta * c, row-major; op(x) = x^T when
// the flag is set. float and double accumulators (fp64 inputs accumulate in fp64). beta = 0
// never reads c.
#ifdef DMATTN_WITH_BLAS
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
#else
template <typename Acc>
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, Acc alpha,
                 const Acc* a, int64_t lda, const Acc* b, int64_t ldb, Acc beta, Acc* c,
                 int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    Acc* c_row = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) c_row[j] = beta == Acc(0) ? Acc(0) : beta * c_row[j];
    for (int64_t p = 0; p < k; ++p) {
      const Acc a_ip = alpha * (trans_a ? a[p * lda + i] : a[i * lda + p]);
      for (int64_t j = 0; j < n; ++j) {
        c_row[j] += a_ip * (trans_b ? b[j * ldb + p] : b[p * ldb + j]);
      }
    }
  }
}
#endif

}  // namespace dmattn::cpu
