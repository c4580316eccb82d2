// Keeps the system BLAS single-threaded (see blas_gemm.h). OpenBLAS and BLIS expose a
// set-threads call; other BLAS builds are taken as single-threaded or governed by their own
// environment variable, so the symbols are weak and the calls optional.
#include <mutex>

#include "cpu/blas_gemm.h"

extern "C" {
void openblas_set_num_threads(int) __attribute__((weak));
void bli_thread_set_num_threads(long) __attribute__((weak));  // NOLINT(runtime/int)
}

namespace dmattn::cpu {

void use_single_threaded_blas() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (openblas_set_num_threads) openblas_set_num_threads(1);
    if (bli_thread_set_num_threads) bli_thread_set_num_threads(1);
  });
}

}  // namespace dmattn::cpu
