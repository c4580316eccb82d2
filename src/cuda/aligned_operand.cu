// The padded copy of a mask or bias (aligned_operand.h): each thread writes one 16-byte chunk of
// a padded row (one vector store) from the 16 / esize source elements it loads first, all in
// flight together. (One element a thread, a load then a store, ran each thread's loads one after
// another: the store may alias the next load. H200: 1.6 ms for a 537 MB mask.)
#include "cuda/aligned_operand.h"

namespace dmattn::cuda {

namespace {

template <typename T>
__global__ void __launch_bounds__(256) copy_padded_rows_kernel(PaddedRowsArgs a, int64_t chunks) {
  constexpr int kPer = 16 / int(sizeof(T));  // elements a chunk
  const int64_t chunk = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (chunk >= chunks) return;
  const int64_t per_row = a.pitch / kPer;
  const int64_t row = chunk / per_row;  // (b, h, q) flattened, q fastest
  const int64_t k0 = (chunk - row * per_row) * kPer;
  const int64_t q = row % a.rows, bh = row / a.rows;
  const int64_t h = bh % a.nh, b = bh / a.nh;
  const T* __restrict__ src = static_cast<const T*>(a.src) + b * a.sb + h * a.sh + q * a.sq;
  union {
    T e[kPer];
    uint4 v;
  } out;
#pragma unroll
  for (int i = 0; i < kPer; ++i) out.e[i] = k0 + i < a.cols ? __ldg(src + (k0 + i) * a.sk) : T(0);
  reinterpret_cast<uint4*>(a.dst)[chunk] = out.v;
}

}  // namespace

void copy_padded_rows(const PaddedRowsArgs& a, cudaStream_t stream) {
  // (pitch * esize is a multiple of 16: the rows are whole chunks)
  const int64_t chunks = a.nb * a.nh * a.rows * (a.pitch * a.esize / 16);
  if (chunks == 0) return;
  const int64_t blocks = (chunks + 255) / 256;
  check(blocks < (int64_t(1) << 31), ErrorKind::kValue, "mask/bias: too large for the CUDA backend's padded copy");
  const dim3 grid(static_cast<unsigned>(blocks));
  if (a.esize == 1) copy_padded_rows_kernel<uint8_t><<<grid, 256, 0, stream>>>(a, chunks);
  else if (a.esize == 2) copy_padded_rows_kernel<uint16_t><<<grid, 256, 0, stream>>>(a, chunks);
  else copy_padded_rows_kernel<uint32_t><<<grid, 256, 0, stream>>>(a, chunks);
  check_cuda(cudaGetLastError(), "padded mask/bias copy launch");
}

}  // namespace dmattn::cuda
