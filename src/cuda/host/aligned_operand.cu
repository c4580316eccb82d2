// The padded copy of a mask or bias (aligned_operand.h): one CTA a row (its source offset
// computed once, not per chunk), each thread writing 16-byte chunks of it by vector stores.
// Rows with contiguous keys are read as aligned 32-bit words shifted into place (five loads a
// chunk); other rows, and the chunk that reaches past the keys, element by element, all of a
// chunk's loads in flight together.
#include "cuda/host/aligned_operand.h"

namespace dmattn::cuda {

namespace {

template <typename T>
__global__ void __launch_bounds__(256) copy_padded_rows_kernel(PaddedRowsArgs a) {
  constexpr int kPer = 16 / int(sizeof(T));  // elements a chunk
  const int64_t row = blockIdx.x;             // (b, h, q) flattened, q fastest
  const int64_t q = row % a.rows, bh = row / a.rows;
  const int64_t h = bh % a.nh, b = bh / a.nh;
  const T* __restrict__ src = static_cast<const T*>(a.src) + b * a.sb + h * a.sh + q * a.sq;
  uint4* __restrict__ dst = reinterpret_cast<uint4*>(static_cast<T*>(a.dst) + row * a.pitch);
  const int chunks = int(a.pitch / kPer);
  const int full = int(a.cols / kPer);  // chunks with no element past the keys
  // Contiguous keys: the words that hold the chunk's 16 bytes (a fifth where they straddle one).
  const uintptr_t addr0 = reinterpret_cast<uintptr_t>(src);
  const uint32_t shift = uint32_t(addr0 & 3) * 8;
  const uint32_t* __restrict__ words = reinterpret_cast<const uint32_t*>(addr0 & ~uintptr_t(3));
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    if (a.sk == 1 && c < full) {
      const uint32_t* w = words + c * 4;
      uint32_t x[5];
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = __ldg(w + i);
      x[4] = shift != 0 ? __ldg(w + 4) : 0u;  // (holds chunk bytes only when shifted)
      dst[c] = make_uint4(__funnelshift_r(x[0], x[1], shift), __funnelshift_r(x[1], x[2], shift),
                          __funnelshift_r(x[2], x[3], shift), __funnelshift_r(x[3], x[4], shift));
      continue;
    }
    union {
      T e[kPer];
      uint4 v;
    } out;
    const int64_t k0 = int64_t(c) * kPer;
#pragma unroll
    for (int i = 0; i < kPer; ++i) out.e[i] = k0 + i < a.cols ? __ldg(src + (k0 + i) * a.sk) : T(0);
    dst[c] = out.v;
  }
}

}  // namespace

void copy_padded_rows(const PaddedRowsArgs& a, cudaStream_t stream) {
  const int64_t rows = a.nb * a.nh * a.rows;
  if (rows == 0) return;
  check(rows < (int64_t(1) << 31), ErrorKind::kValue, "mask/bias: too many rows for the CUDA backend's padded copy");
  const dim3 grid(static_cast<unsigned>(rows));
  if (a.esize == 1) copy_padded_rows_kernel<uint8_t><<<grid, 256, 0, stream>>>(a);
  else if (a.esize == 2) copy_padded_rows_kernel<uint16_t><<<grid, 256, 0, stream>>>(a);
  else copy_padded_rows_kernel<uint32_t><<<grid, 256, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "padded mask/bias copy launch");
}

}  // namespace dmattn::cuda
