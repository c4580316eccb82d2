// The gather path's glue on CUDA, as two kernels instead of a dozen framework ops (host time:
// every op launched costs the host more than these kernels cost the GPU):
//   * topk_positions: per row of a key-side bias, the indices of the `keep` largest values in
//     increasing order -- dynamic_mask's selection (larger bias first, equal values, -0.0 ==
//     0.0 included, by the lower key index) as the sorted key_positions operand;
//   * gather_key_rows: the K, V (and bias) rows at those positions, laid out as the kernels'
//     gathered operands.
// One CTA per row selects by a radix select on an order-preserving 32-bit key of the bias's
// bits (8 bits per pass, most significant first), then writes the selected indices in index
// order with one block-wide scan.
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "cuda/check.h"
#include "cuda/key_glue.h"

namespace dmattn::cuda {

namespace {

constexpr int kSelectThreads = 512;

// Order-preserving unsigned keys of float bit patterns: sign-magnitude -> two's complement
// (-0.0 and 0.0 both 0, as masks.selection_key), shifted to unsigned.
__device__ __forceinline__ uint32_t ordered_key(uint16_t bits) {
  const int32_t b = int16_t(bits);
  const int32_t o = b >= 0 ? b : (-32768 - b);
  return uint32_t(o + 32768);
}
__device__ __forceinline__ uint32_t ordered_key(uint32_t bits) {
  const int64_t b = int32_t(bits);
  const int64_t o = b >= 0 ? b : (int64_t(INT32_MIN) - b);
  return uint32_t(o + 2147483648LL);
}

template <typename Bits>
__global__ void __launch_bounds__(kSelectThreads) topk_positions_kernel(TopkPositionsArgs a) {
  using BlockScan = cub::BlockScan<long long, kSelectThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ unsigned hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_left;
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const Bits* src = static_cast<const Bits*>(a.bias) + (row / a.rows_h) * a.stride_b + (row % a.rows_h) * a.stride_h;
  auto key = [&](int64_t i) { return ordered_key(src[i * a.stride_k]); };

  // Radix select: the keep-th largest key T, and `left` = how many keys equal to T are taken.
  uint32_t prefix = 0, prefix_mask = 0;
  int left = a.keep;
  for (int shift = sizeof(Bits) == 2 ? 8 : 24; shift >= 0; shift -= 8) {
    for (int d = tid; d < 256; d += kSelectThreads) hist[d] = 0;
    __syncthreads();
    for (int64_t i = tid; i < a.num_keys; i += kSelectThreads) {
      const uint32_t u = key(i);
      if ((u & prefix_mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid == 0) {  // the digit whose bucket holds the left-th largest of the candidates
      int above = 0, d = 255;
      for (; d > 0 && above + int(hist[d]) < left; --d) above += int(hist[d]);
      s_prefix = prefix | (uint32_t(d) << shift);
      s_left = left - above;
    }
    __syncthreads();
    prefix = s_prefix;
    left = s_left;
    prefix_mask |= 255u << shift;
    __syncthreads();  // (hist is cleared again at the next pass)
  }
  const uint32_t threshold = prefix;

  // Each thread takes a contiguous chunk: counts above / equal, one scan, then the writes.
  const int64_t chunk = (a.num_keys + kSelectThreads - 1) / kSelectThreads;
  const int64_t begin = min(int64_t(tid) * chunk, a.num_keys), end = min(begin + chunk, a.num_keys);
  long long counts = 0;  // (above << 32) | equal
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t u = key(i);
    counts += u > threshold ? (1LL << 32) : (u == threshold ? 1LL : 0LL);
  }
  long long before;
  BlockScan(scan_storage).ExclusiveSum(counts, before);
  int64_t above = before >> 32, equal = before & 0xffffffffLL;
  int32_t* out = a.positions + row * a.keep;
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t u = key(i);
    if (u > threshold) {
      out[above + min(equal, int64_t(left))] = int32_t(i);
      ++above;
    } else if (u == threshold) {
      if (equal < left) out[above + equal] = int32_t(i);
      ++equal;
    }
  }
}

template <typename Chunk>
__global__ void gather_rows_kernel(GatherRowsArgs a) {
  const GatherRowsArgs::Operand& op = a.operand[blockIdx.y];
  const int64_t chunks_per_row = a.row_bytes / int64_t(sizeof(Chunk));
  const int64_t total = a.batch * a.width * a.heads * chunks_per_row;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < total; c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = c / chunks_per_row, ch = c % chunks_per_row;
    const int64_t g = r % a.heads, t = r / a.heads, j = t % a.width, b = t / a.width;
    const int32_t pos = a.positions[(a.pos_batch > 1 ? b : 0) * a.pos_sb + (a.pos_heads > 1 ? g : 0) * a.pos_sh + j];
    Chunk v{};
    if (pos >= 0)
      v = *reinterpret_cast<const Chunk*>(static_cast<const char*>(op.src) +
                                          (b * op.sb + int64_t(pos) * op.sr + g * op.sh) * a.elem_bytes +
                                          ch * int64_t(sizeof(Chunk)));
    reinterpret_cast<Chunk*>(op.dst)[c] = v;
  }
}

template <typename Bits>
__global__ void gather_bias_kernel(GatherBiasArgs a) {
  const int64_t total = a.rows_b * a.rows_h * a.width;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = e % a.width, bh = e / a.width;
    const int32_t pos = a.positions[bh * a.width + j];
    const Bits* src = static_cast<const Bits*>(a.bias) + (bh / a.rows_h) * a.stride_b + (bh % a.rows_h) * a.stride_h;
    static_cast<Bits*>(a.out)[e] = pos >= 0 ? src[int64_t(pos) * a.stride_k] : Bits(0);
  }
}

int grid_for(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return int(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
}

}  // namespace

void topk_positions(const TopkPositionsArgs& a, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (a.rows_b * a.rows_h == 0 || a.keep == 0) return;
  const dim3 grid(unsigned(a.rows_b * a.rows_h));
  if (a.elem_bytes == 2) topk_positions_kernel<uint16_t><<<grid, kSelectThreads, 0, stream>>>(a);
  else topk_positions_kernel<uint32_t><<<grid, kSelectThreads, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "top-k positions launch");
}

void gather_rows(const GatherRowsArgs& a, bool vec16, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t rows = a.batch * a.width * a.heads;
  if (rows == 0) return;
  const int64_t chunk = vec16 ? 16 : a.elem_bytes;
  const dim3 grid(unsigned(grid_for(rows * (a.row_bytes / chunk), 256)), 2);
  if (vec16) gather_rows_kernel<uint4><<<grid, 256, 0, stream>>>(a);
  else if (a.elem_bytes == 2) gather_rows_kernel<uint16_t><<<grid, 256, 0, stream>>>(a);
  else gather_rows_kernel<uint32_t><<<grid, 256, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "gather of key rows launch");
}

void gather_bias(const GatherBiasArgs& a, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t total = a.rows_b * a.rows_h * a.width;
  if (total == 0) return;
  if (a.elem_bytes == 2) gather_bias_kernel<uint16_t><<<grid_for(total, 256), 256, 0, stream>>>(a);
  else gather_bias_kernel<uint32_t><<<grid_for(total, 256), 256, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "gather of bias keys launch");
}

}  // namespace dmattn::cuda
