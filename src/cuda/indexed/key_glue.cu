// The gather path's glue on CUDA, as two kernels instead of a dozen framework ops (host time:
// every op launched costs the host more than these kernels cost the GPU):
//   * topk_positions: per row of a key-side bias, the indices of the `keep` largest values in
//     increasing order -- dynamic_mask's selection (larger bias first, equal values, -0.0 ==
//     0.0 included, by the lower key index; a NaN ranks as +inf) as the sorted key_positions
//     operand -- and optionally the bias at them (the gathered bias operand);
//   * gather_key_rows: the K, V (and bias) rows at those positions, laid out as the kernels'
//     gathered operands;
//   * scatter_key_rows: the inverse for the gradients, dK, dV (and dbias) of the gathered rows
//     written back at full size with zeros elsewhere, in one pass over the output.
// One CTA per row selects by a radix select on an order-preserving 32-bit key of the bias's
// bits (8 bits per pass, most significant first), then writes the selected indices in index
// order with one block-wide scan.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/indexed/key_glue.h"

namespace dmattn::cuda {

namespace {

constexpr int kSelectThreads = 512;

// Order-preserving unsigned keys of float bit patterns: sign-magnitude -> two's complement
// (-0.0 and 0.0 both 0, as masks.selection_key), shifted to unsigned. A NaN of either sign
// (magnitude above inf_bits, the format's +inf) becomes +inf first, as in masks.selection_key.
__device__ __forceinline__ uint16_t nan_as_inf(uint16_t bits, uint32_t inf_bits) {
  return (bits & 0x7FFFu) > inf_bits ? uint16_t(inf_bits) : bits;
}
__device__ __forceinline__ uint32_t nan_as_inf(uint32_t bits, uint32_t inf_bits) {
  return (bits & 0x7FFFFFFFu) > inf_bits ? inf_bits : bits;
}
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

// The radix select's digit of one pass: given the 256 bins' counts of the candidates (the keys
// whose higher digits are the prefix so far), the digit d whose bin holds the left-th largest
// candidate and how many candidates of larger digits come before it. By warp 0: lane l sums bins
// 255 - 8l down to 248 - 8l, an inclusive scan over the lanes orders those sums from the largest
// digits, and the first lane whose scan reaches `left` walks its own eight bins (a serial walk
// over 256 bins by one thread took a few microseconds a pass: shared loads one after another).
__device__ __forceinline__ void pick_digit(const unsigned* hist, int left, int lane, int& digit, int& above_out) {
  unsigned bins[8];
  unsigned sum = 0;
  #pragma unroll
  for (int e = 0; e < 8; ++e) {
    bins[e] = hist[255 - 8 * lane - e];
    sum += bins[e];
  }
  unsigned incl = sum;
  #pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  const unsigned reach = __ballot_sync(0xffffffffu, int(incl) >= left);
  const int first = reach != 0 ? __ffs(reach) - 1 : 31;  // (a candidate count below `left` cannot happen)
  int above = int(__shfl_sync(0xffffffffu, incl - sum, first));
  int d = 255 - 8 * first;
  if (lane == first) {
    int e = 0;
    for (; e < 7 && above + int(bins[e]) < left; ++e) above += int(bins[e]);
    d -= e;
  }
  digit = __shfl_sync(0xffffffffu, d, first);
  above_out = __shfl_sync(0xffffffffu, above, first);
}

// The end of a radix pass, once its histogram is complete and visible (a barrier behind): warp 0
// picks the digit (pick_digit) and publishes the longer prefix and the count still to take
// through shared memory (s_prefix, s_left); every thread of the block calls it and reads them.
__device__ __forceinline__ void finish_pass(const unsigned* hist, int shift, uint32_t& prefix, uint32_t& prefix_mask,
                                            int& left, uint32_t& s_prefix, int& s_left) {
  if (threadIdx.x < 32) {
    int digit, above;
    pick_digit(hist, left, threadIdx.x, digit, above);
    if (threadIdx.x == 0) {
      s_prefix = prefix | (uint32_t(digit) << shift);
      s_left = left - above;
    }
  }
  __syncthreads();
  prefix = s_prefix;
  left = s_left;
  prefix_mask |= 255u << shift;
}

// The write phase of a selection, the same for both kernels: each thread walks its contiguous
// chunk of keys in index order and hands each key to take(); a key above the threshold T goes to
// the slot after those above it and the T-equal keys taken before it, a key equal to T to its slot
// among the first `left` of them. The block-wide scan of the chunks' counts (above << 32 | equal)
// gives each thread its starting counts.
template <typename Bits>
struct SelectionWriter {
  int32_t* out;
  Bits* out_values;  // null: positions only
  const Bits* src;
  int64_t stride_k;
  uint32_t threshold;
  int left;
  int64_t above, equal;

  static __device__ __forceinline__ long long counts_of(uint32_t u, uint32_t threshold) {
    return u > threshold ? (1LL << 32) : (u == threshold ? 1LL : 0LL);
  }
  __device__ __forceinline__ void put(int64_t slot, int64_t i) const {
    out[slot] = int32_t(i);
    if (out_values != nullptr) out_values[slot] = src[i * stride_k];  // the bias's own bits, NaN included
  }
  __device__ __forceinline__ void take(uint32_t u, int64_t i) {
    if (u > threshold) {
      put(above + min(equal, int64_t(left)), i);
      ++above;
    } else if (u == threshold) {
      if (equal < left) put(above + equal, i);
      ++equal;
    }
  }
};

// The writer of row `row`, from its chunk's counts (one block-wide exclusive scan).
template <typename Bits, class Scan>
__device__ __forceinline__ SelectionWriter<Bits> selection_writer(const TopkPositionsArgs& a, int64_t row,
                                                                  const Bits* src, uint32_t threshold, int left,
                                                                  long long counts, Scan& scan) {
  long long before;
  scan.ExclusiveSum(counts, before);
  return {a.positions + row * a.keep, a.values != nullptr ? static_cast<Bits*>(a.values) + row * a.keep : nullptr,
          src, a.stride_k, threshold, left, before >> 32, before & 0xffffffffLL};
}

// One row's selection where the whole row stays in registers, kCached keys a thread at most
// (rows up to kSelectThreads * kCached keys): each thread loads its contiguous chunk once (all
// its loads in flight together, 16 bytes at a time where the row allows), and every radix pass,
// the counts and the writes read the registers. Each warp counts into a histogram of its own
// (the largest digits of a bias's keys fall into a few bins, which one shared histogram made
// every warp's atomics wait on), summed before the digit's choice. Same selection, same bits as
// topk_positions_stream_kernel.
constexpr int kCached = 64;
constexpr int kSelectWarps = kSelectThreads / 32;

template <typename Bits>
__global__ void __launch_bounds__(kSelectThreads) topk_positions_kernel(TopkPositionsArgs a, int chunk, bool vec) {
  using BlockScan = cub::BlockScan<long long, kSelectThreads>;
  constexpr int kPerVec = 16 / sizeof(Bits);
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ unsigned warp_hist[kSelectWarps][256];
  __shared__ unsigned hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_left;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t row = blockIdx.x;
  const Bits* src = static_cast<const Bits*>(a.bias) + (row / a.rows_h) * a.stride_b + (row % a.rows_h) * a.stride_h;
  const int64_t begin = min(int64_t(tid) * chunk, a.num_keys);
  const int count = int(min(int64_t(chunk), a.num_keys - begin));

  uint32_t keys[kCached];
  if (vec) {  // (stride 1, 16-byte aligned row, chunk a multiple of kPerVec)
    #pragma unroll
    for (int v = 0; v < kCached / kPerVec; ++v) {
      if (v * kPerVec < count) {
        const uint4 w = *reinterpret_cast<const uint4*>(src + begin + v * kPerVec);
        const Bits* e = reinterpret_cast<const Bits*>(&w);
        #pragma unroll
        for (int i = 0; i < kPerVec; ++i) keys[v * kPerVec + i] = ordered_key(nan_as_inf(e[i], a.inf_bits));
      }
    }
  } else {
    #pragma unroll
    for (int j = 0; j < kCached; ++j)
      if (j < count) keys[j] = ordered_key(nan_as_inf(src[(begin + j) * a.stride_k], a.inf_bits));
  }

  // Radix select: the keep-th largest key T, and `left` = how many keys equal to T are taken.
  uint32_t prefix = 0, prefix_mask = 0;
  int left = int(a.keep);
  for (int shift = sizeof(Bits) == 2 ? 8 : 24; shift >= 0; shift -= 8) {
    #pragma unroll
    for (int e = 0; e < 8; ++e) warp_hist[warp][lane * 8 + e] = 0;
    __syncwarp();
    #pragma unroll
    for (int j = 0; j < kCached; ++j)
      if (j < count && (keys[j] & prefix_mask) == prefix) atomicAdd(&warp_hist[warp][(keys[j] >> shift) & 255u], 1u);
    __syncthreads();
    if (tid < 256) {
      unsigned total = 0;
      #pragma unroll
      for (int w = 0; w < kSelectWarps; ++w) total += warp_hist[w][tid];
      hist[tid] = total;
    }
    __syncthreads();
    finish_pass(hist, shift, prefix, prefix_mask, left, s_prefix, s_left);
  }
  const uint32_t threshold = prefix;

  // Counts above / equal of each chunk, one scan, then the writes in index order.
  long long counts = 0;
  #pragma unroll
  for (int j = 0; j < kCached; ++j)
    if (j < count) counts += SelectionWriter<Bits>::counts_of(keys[j], threshold);
  BlockScan scan(scan_storage);
  SelectionWriter<Bits> writer = selection_writer(a, row, src, threshold, left, counts, scan);
  #pragma unroll
  for (int j = 0; j < kCached; ++j)
    if (j < count) writer.take(keys[j], begin + j);
}

// The same selection for rows longer than the registers hold: every pass reads the row from
// memory (one shared histogram).
template <typename Bits>
__global__ void __launch_bounds__(kSelectThreads) topk_positions_stream_kernel(TopkPositionsArgs a) {
  using BlockScan = cub::BlockScan<long long, kSelectThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ unsigned hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_left;
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const Bits* src = static_cast<const Bits*>(a.bias) + (row / a.rows_h) * a.stride_b + (row % a.rows_h) * a.stride_h;
  auto key = [&](int64_t i) { return ordered_key(nan_as_inf(src[i * a.stride_k], a.inf_bits)); };

  uint32_t prefix = 0, prefix_mask = 0;
  int left = int(a.keep);
  for (int shift = sizeof(Bits) == 2 ? 8 : 24; shift >= 0; shift -= 8) {
    for (int d = tid; d < 256; d += kSelectThreads) hist[d] = 0;
    __syncthreads();
    for (int64_t i = tid; i < a.num_keys; i += kSelectThreads) {
      const uint32_t u = key(i);
      if ((u & prefix_mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1u);
    }
    __syncthreads();
    finish_pass(hist, shift, prefix, prefix_mask, left, s_prefix, s_left);
    __syncthreads();  // (hist is cleared again at the next pass)
  }
  const uint32_t threshold = prefix;

  // Each thread takes a contiguous chunk: counts above / equal, one scan, then the writes.
  const int64_t chunk = (a.num_keys + kSelectThreads - 1) / kSelectThreads;
  const int64_t begin = min(int64_t(tid) * chunk, a.num_keys), end = min(begin + chunk, a.num_keys);
  long long counts = 0;
  for (int64_t i = begin; i < end; ++i) counts += SelectionWriter<Bits>::counts_of(key(i), threshold);
  BlockScan scan(scan_storage);
  SelectionWriter<Bits> writer = selection_writer(a, row, src, threshold, left, counts, scan);
  for (int64_t i = begin; i < end; ++i) writer.take(key(i), i);
}

// The rows of a batch spread over blocks of blockDim.y rows (a row's chunks over the block's
// blockDim.x threads of that y, all of them when chunks_per_row <= 256), operand blockIdx.y,
// batches from blockIdx.z on: a row's indices are two 32-bit divisions per thread (gather_rows
// checks width * heads < 2^30), where one thread per chunk spent several 64-bit divisions on
// every 16 bytes copied and the kernel ran on its integer arithmetic rather than on memory.
template <typename Chunk>
__global__ void __launch_bounds__(256) gather_rows_kernel(GatherRowsArgs a, int chunks_per_row) {
  const GatherRowsArgs::Operand& op = a.operand[blockIdx.y];
  const int heads = int(a.heads), rows = int(a.width * a.heads);
  for (int64_t b = blockIdx.z; b < a.batch; b += gridDim.z) {
    const int32_t* positions = a.positions + (a.pos_batch > 1 ? b : 0) * a.pos_sb;
    const char* src = static_cast<const char*>(op.src) + (b / a.src_batch_div) * op.sb * a.elem_bytes;
    Chunk* dst = reinterpret_cast<Chunk*>(op.dst) + b * rows * int64_t(chunks_per_row);
    for (int r = blockIdx.x * blockDim.y + threadIdx.y; r < rows; r += gridDim.x * blockDim.y) {
      const int g = r % heads, j = r / heads;
      const int32_t pos = positions[(a.pos_heads > 1 ? g : 0) * a.pos_sh + j];
      const bool in = pos >= 0 && pos < a.src_rows;
      const Chunk* row =
          reinterpret_cast<const Chunk*>(src + (int64_t(in ? pos : 0) * op.sr + (g / a.src_head_div) * op.sh) * a.elem_bytes);
      for (int c = threadIdx.x; c < chunks_per_row; c += blockDim.x)
        dst[int64_t(r) * chunks_per_row + c] = in ? row[c] : Chunk{};
    }
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

// Keys of one (batch, head) per CTA of scatter_rows_kernel: their slice of the inverse map of the
// positions (key -> gathered row) lives in shared memory.
constexpr int kScatterKeys = 256;
constexpr int kScatterThreads = 256;

// Each CTA takes a slice of kScatterKeys keys for (batch, head) pairs in turn: it inverts the
// pair's positions into the slice's map (one pass over the row of positions, which is short
// next to the rows written), then writes every output row of the slice exactly once, the
// gathered row's bytes or zeros, both operands in the same iteration (their loads in flight
// together). No atomics and no separate zero fill: each byte of dK and dV is written once.
template <typename Chunk>
__global__ void __launch_bounds__(kScatterThreads) scatter_rows_kernel(ScatterRowsArgs a) {
  __shared__ int32_t slot[kScatterKeys];  // the gathered row of key s0 + i, -1 for none
  const int tid = threadIdx.x;
  const int64_t s0 = int64_t(blockIdx.x) * kScatterKeys;
  const int keys = int(min(int64_t(kScatterKeys), a.num_keys - s0));
  const int cpr = int(a.row_bytes / int64_t(sizeof(Chunk)));  // chunks per row
  // (the thread's (row, chunk) advances by a constant step: no division in the copy loop)
  const int step_rows = kScatterThreads / cpr, step_chunks = kScatterThreads % cpr;
  const int64_t row_step = a.heads * cpr;  // chunks between consecutive keys of one head
  for (int64_t bg = blockIdx.y; bg < a.batch * a.heads; bg += gridDim.y) {
    const int64_t b = bg / a.heads, g = bg % a.heads;
    const int64_t pos_row = (a.pos_batch > 1 ? b : 0) * a.pos_heads + (a.pos_heads > 1 ? g : 0);
    const int32_t* pos = a.positions + pos_row * a.width;
    __syncthreads();  // (the previous pair's reads of the map are done)
    for (int i = tid; i < kScatterKeys; i += kScatterThreads) slot[i] = -1;
    __syncthreads();
    for (int64_t j = tid; j < a.width; j += kScatterThreads) {
      const int64_t p = int64_t(pos[j]) - s0;  // (padding, negative, falls outside)
      if (p >= 0 && p < keys) slot[p] = int32_t(j);
    }
    __syncthreads();
    const Chunk* rows0 = static_cast<const Chunk*>(a.operand[0].rows) + (b * a.width * a.heads + g) * cpr;
    const Chunk* rows1 = static_cast<const Chunk*>(a.operand[1].rows) + (b * a.width * a.heads + g) * cpr;
    const int64_t dst_base = ((b * a.num_keys + s0) * a.heads + g) * cpr;
    Chunk* dst0 = static_cast<Chunk*>(a.operand[0].dst) + dst_base;
    Chunk* dst1 = static_cast<Chunk*>(a.operand[1].dst) + dst_base;
    int i = tid / cpr, ch = tid % cpr;
    while (i < keys) {
      const int j = slot[i];
      Chunk v0{}, v1{};
      if (j >= 0) {
        v0 = rows0[j * row_step + ch];
        v1 = rows1[j * row_step + ch];
      }
      dst0[i * row_step + ch] = v0;
      dst1[i * row_step + ch] = v1;
      i += step_rows, ch += step_chunks;
      if (ch >= cpr) ch -= cpr, ++i;
    }
    // The bias row of these positions, once: by the pair whose batch and head index it.
    if (a.bias_dst != nullptr && b < a.pos_batch && g < a.pos_heads) {
      for (int k = tid; k < keys; k += kScatterThreads) {
        const int j = slot[k];
        const int64_t out = pos_row * a.num_keys + s0 + k;
        if (a.bias_bytes == 2) {
          static_cast<uint16_t*>(a.bias_dst)[out] =
              j >= 0 ? static_cast<const uint16_t*>(a.bias_rows)[pos_row * a.width + j] : uint16_t(0);
        } else {
          static_cast<uint32_t*>(a.bias_dst)[out] =
              j >= 0 ? static_cast<const uint32_t*>(a.bias_rows)[pos_row * a.width + j] : 0u;
        }
      }
    }
  }
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// kVec consecutive elements as float: 8-byte loads of four 16-bit values, 16-byte loads of four
// floats, or single elements.
template <int kVec>
__device__ __forceinline__ void load_vec(const float* p, float (&v)[kVec]) {
  if constexpr (kVec == 4) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else {
    v[0] = *p;
  }
}
template <int kVec, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[kVec]) {  // 16-bit T
  if constexpr (kVec == 4) {
    using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    const T2 lo = *reinterpret_cast<const T2*>(&x.x), hi = *reinterpret_cast<const T2*>(&x.y);
    v[0] = to_float(lo.x), v[1] = to_float(lo.y), v[2] = to_float(hi.x), v[3] = to_float(hi.y);
  } else {
    v[0] = to_float(*p);
  }
}

// One warp per output row (b, j, kv head): it reads the row's slots 32 (segment, head) pairs at
// a time, then the copies two by two, each lane kVec consecutive elements per load (4 where the
// head dim allows aligned vectors), so that every copy's loads are in flight together. Copies
// are added in (segment, head) order.
template <typename T, int kVec>
__global__ void sum_segment_rows_kernel(SumSegmentRowsArgs a) {
  constexpr unsigned kFull = 0xffffffffu;
  constexpr int kIters = 256 / (32 * kVec);  // head_dim <= 256
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  const int64_t total = a.batch * a.num_keys * a.heads_kv;
  if (warp >= total) return;
  const int64_t kvh = warp % a.heads_kv, bj = warp / a.heads_kv, j = bj % a.num_keys, b = bj / a.num_keys;
  const int64_t group = a.heads / a.heads_kv;
  // Per segment: one slot per gathered head (slot_heads > 1), or one for all of the kv head's.
  const int64_t per_segment = a.slot_heads > 1 ? group : 1;
  const int heads_per_copy = a.slot_heads > 1 ? 1 : int(group);
  const int64_t pairs = a.num_segments * per_segment;
  const T* src[2] = {static_cast<const T*>(a.operand[0].rows), static_cast<const T*>(a.operand[1].rows)};
  float acc[2][kIters][kVec] = {};
  auto add_copy = [&](int64_t row) {  // row: the copy's first (row, head) index
    for (int g = 0; g < heads_per_copy; ++g) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t d = (it * 32 + lane) * kVec;
        if (d >= a.head_dim) continue;
        float v0[kVec], v1[kVec];
        load_vec<kVec>(src[0] + (row + g) * a.head_dim + d, v0);
        load_vec<kVec>(src[1] + (row + g) * a.head_dim + d, v1);
        for (int e = 0; e < kVec; ++e) acc[0][it][e] += v0[e], acc[1][it][e] += v1[e];
      }
    }
  };
  for (int64_t p0 = 0; p0 < pairs; p0 += 32) {
    const int64_t pp = p0 + lane;
    int64_t row = -1;
    if (pp < pairs) {
      const int64_t s = pp / per_segment, g = kvh * group + pp % per_segment;
      const int32_t slot = a.slots[((b * a.num_segments + s) * a.slot_heads + (a.slot_heads > 1 ? g : 0)) * a.num_keys + j];
      if (slot >= 0) row = ((b * a.num_segments + s) * a.width + slot) * a.heads + g;
    }
    unsigned copies = __ballot_sync(kFull, row >= 0);
    while (copies) {
      const int l0 = __ffs(copies) - 1;
      copies &= copies - 1;
      const int l1 = copies ? __ffs(copies) - 1 : -1;
      if (l1 >= 0) copies &= copies - 1;
      const int64_t r0 = __shfl_sync(kFull, row, l0), r1 = __shfl_sync(kFull, row, l1 >= 0 ? l1 : l0);
      add_copy(r0);
      if (l1 >= 0) add_copy(r1);
    }
  }
  const int64_t out_row = (bj * a.heads_kv + kvh) * a.head_dim;
  for (int o = 0; o < 2; ++o) {
    T* dst = static_cast<T*>(a.operand[o].out) + out_row;
    for (int it = 0; it < kIters; ++it) {
      const int64_t d = (it * 32 + lane) * kVec;
      if (d < a.head_dim)
        for (int e = 0; e < kVec; ++e) dst[d + e] = from_float<T>(acc[o][it][e]);
    }
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
  const bool half = a.elem_bytes == 2;
  if (a.num_keys <= int64_t(kSelectThreads) * kCached) {
    // Chunks of whole 16-byte vectors where the rows are contiguous and aligned.
    const int per_vec = half ? 8 : 4;
    const int64_t bytes = a.elem_bytes;
    const bool vec = a.stride_k == 1 && a.num_keys % per_vec == 0 && reinterpret_cast<uintptr_t>(a.bias) % 16 == 0 &&
                     (a.stride_b * bytes) % 16 == 0 && (a.stride_h * bytes) % 16 == 0;
    int chunk = int((a.num_keys + kSelectThreads - 1) / kSelectThreads);
    if (vec) chunk = (chunk + per_vec - 1) / per_vec * per_vec;
    if (half) topk_positions_kernel<uint16_t><<<grid, kSelectThreads, 0, stream>>>(a, chunk, vec);
    else topk_positions_kernel<uint32_t><<<grid, kSelectThreads, 0, stream>>>(a, chunk, vec);
  } else if (half) {
    topk_positions_stream_kernel<uint16_t><<<grid, kSelectThreads, 0, stream>>>(a);
  } else {
    topk_positions_stream_kernel<uint32_t><<<grid, kSelectThreads, 0, stream>>>(a);
  }
  check_cuda(cudaGetLastError(), "top-k positions launch");
}

void gather_rows(const GatherRowsArgs& a, bool vec16, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t rows = a.width * a.heads;  // per batch
  if (a.batch == 0 || rows == 0) return;
  check(rows < (int64_t(1) << 30), ErrorKind::kValue, "gather of key rows: at most 2^30 rows per batch, got ", rows);
  const int64_t chunk = vec16 ? 16 : a.elem_bytes;
  const int chunks_per_row = int(a.row_bytes / chunk);
  const int x = chunks_per_row < 256 ? chunks_per_row : 256;
  const dim3 block(unsigned(x), unsigned(256 / x));
  const dim3 grid(unsigned(grid_for(rows, int(block.y))), 2, unsigned(a.batch < 65535 ? a.batch : 65535));
  if (vec16) gather_rows_kernel<uint4><<<grid, block, 0, stream>>>(a, chunks_per_row);
  else if (a.elem_bytes == 2) gather_rows_kernel<uint16_t><<<grid, block, 0, stream>>>(a, chunks_per_row);
  else gather_rows_kernel<uint32_t><<<grid, block, 0, stream>>>(a, chunks_per_row);
  check_cuda(cudaGetLastError(), "gather of key rows launch");
}

void sum_segment_rows(const SumSegmentRowsArgs& a, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t warps = a.batch * a.num_keys * a.heads_kv;
  if (warps == 0) return;
  const int64_t blocks = (warps * 32 + 255) / 256;
  // Vector loads: rows of a multiple of 4 elements from 16-byte-aligned tensors.
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec4 = a.head_dim % 4 == 0 && aligned(a.operand[0].rows) && aligned(a.operand[1].rows) &&
                    aligned(a.operand[0].out) && aligned(a.operand[1].out);
  if (vec4) {
    if (a.elem_bytes == 4) sum_segment_rows_kernel<float, 4><<<unsigned(blocks), 256, 0, stream>>>(a);
    else if (a.bf16) sum_segment_rows_kernel<__nv_bfloat16, 4><<<unsigned(blocks), 256, 0, stream>>>(a);
    else sum_segment_rows_kernel<__half, 4><<<unsigned(blocks), 256, 0, stream>>>(a);
  } else {
    if (a.elem_bytes == 4) sum_segment_rows_kernel<float, 1><<<unsigned(blocks), 256, 0, stream>>>(a);
    else if (a.bf16) sum_segment_rows_kernel<__nv_bfloat16, 1><<<unsigned(blocks), 256, 0, stream>>>(a);
    else sum_segment_rows_kernel<__half, 1><<<unsigned(blocks), 256, 0, stream>>>(a);
  }
  check_cuda(cudaGetLastError(), "sum of segment rows launch");
}

void gather_bias(const GatherBiasArgs& a, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t total = a.rows_b * a.rows_h * a.width;
  if (total == 0) return;
  if (a.elem_bytes == 2) gather_bias_kernel<uint16_t><<<grid_for(total, 256), 256, 0, stream>>>(a);
  else gather_bias_kernel<uint32_t><<<grid_for(total, 256), 256, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "gather of bias keys launch");
}

void scatter_rows(const ScatterRowsArgs& a, bool vec16, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t pairs = a.batch * a.heads;
  if (pairs == 0 || a.num_keys == 0 || a.row_bytes == 0) return;
  const dim3 grid(unsigned((a.num_keys + kScatterKeys - 1) / kScatterKeys), unsigned(pairs < 65535 ? pairs : 65535));
  if (vec16) scatter_rows_kernel<uint4><<<grid, kScatterThreads, 0, stream>>>(a);
  else if (a.elem_bytes == 2) scatter_rows_kernel<uint16_t><<<grid, kScatterThreads, 0, stream>>>(a);
  else scatter_rows_kernel<uint32_t><<<grid, kScatterThreads, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "scatter of key rows launch");
}

}  // namespace dmattn::cuda
