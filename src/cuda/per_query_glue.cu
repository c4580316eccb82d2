// The per-query causal top-k glue on CUDA (semantics in dmattn/api.h):
//   * prefix_thresholds: one warp per row streams the keys in index order and keeps the
//     threshold x = the keep-th smallest rank seen so far (cpu/per_query_glue.cpp is the
//     sequential form). A 32-key chunk costs one ballot when no key of it enters the kept set;
//     each entering key evicts x, and the new x (the largest rank below x already seen) is found
//     32 ranks per ballot in the row's `order`, held in shared memory when it fits. x only
//     decreases, so the searches of a row cost O(num_keys / 32) ballots together.
//   * segment_candidates: one CTA per (batch row, segment, head row) compacts, in index order,
//     the keys a segment's queries may keep (a block-wide scan per 256 keys).
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "cuda/check.h"
#include "cuda/per_query_glue.h"

namespace dmattn::cuda {

namespace {

constexpr unsigned kFull = 0xffffffffu;

__global__ void __launch_bounds__(32) prefix_thresholds_kernel(PrefixThresholdsArgs a, bool order_in_smem) {
  extern __shared__ int32_t s_order[];
  const int lane = threadIdx.x;
  const int n = int(a.num_keys);
  const int32_t* rank = a.ranks + blockIdx.x * a.num_keys;
  const int32_t* order = a.order + blockIdx.x * a.num_keys;
  int32_t* out = a.thresholds + blockIdx.x * a.num_keys;
  if (order_in_smem) {
    for (int i = lane; i < n; i += 32) s_order[i] = order[i];
    __syncwarp();
    order = s_order;
  }
  const int keep = int(a.keep);
  int count = 0, x = n, fill_max = -1;  // warp-uniform
  int next = lane < n ? rank[lane] : n;
  for (int v0 = 0; v0 < n; v0 += 32) {
    const int v = v0 + lane;
    const int k = next;
    next = v + 32 < n ? rank[v + 32] : n;  // the next chunk's load, in flight during this one
    const bool selectable = k < n;
    const unsigned sel = __ballot_sync(kFull, selectable);
    if (count + __popc(sel) < keep) {  // the whole chunk only fills the kept set
      int m = selectable ? k : -1;
      for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(kFull, m, o));
      fill_max = max(fill_max, m);
      count += __popc(sel);
      if (v < n) out[v] = n;
      continue;
    }
    // Events (a key filling the set or entering below x), one at a time; the lanes between two
    // events write the threshold in force.
    int done = 0;
    while (true) {
      const bool event = lane >= done && selectable && (count < keep || k < x);
      const unsigned ev = __ballot_sync(kFull, event);
      const int first = ev ? __ffs(ev) - 1 : 32;
      if (lane >= done && lane < first && v < n) out[v] = count < keep ? n : x;
      if (first == 32) break;
      const int kf = __shfl_sync(kFull, k, first);
      const int vf = v0 + first;
      if (count < keep) {
        fill_max = max(fill_max, kf);
        if (++count == keep) x = fill_max;
      } else {
        int top = x;  // search ranks [top - 32, top) for the largest one already seen
        while (true) {
          const int cand = top - 1 - lane;
          const bool seen = cand >= 0 && order[cand] <= vf;
          const unsigned s = __ballot_sync(kFull, seen);
          if (s) {
            x = top - 1 - (__ffs(s) - 1);
            break;
          }
          top -= 32;
        }
      }
      if (lane == first) out[vf] = count < keep ? n : x;
      done = first + 1;
    }
  }
}

constexpr int kCandThreads = 256;

__global__ void __launch_bounds__(kCandThreads) segment_candidates_kernel(SegmentCandidatesArgs a) {
  using BlockScan = cub::BlockScan<int, kCandThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int s_total;
  const int tid = threadIdx.x;
  const int64_t s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int32_t* e = a.ends + (b * a.rows_h + h) * a.num_keys;
  const int64_t out_row = ((b * a.num_segments + s) * a.rows_h + h) * a.width;
  const int64_t first = s * a.seg_len + a.offset;
  const int64_t original = a.num_segments * a.seg_len + a.offset;
  const int64_t stop = min(a.num_keys, first + a.seg_len);
  int64_t n = 0;  // candidates written (uniform)
  for (int64_t j0 = 0; j0 < stop && n < a.width; j0 += kCandThreads) {
    const int64_t j = j0 + tid;
    const bool take = j < stop && e[j] > max(j, first);
    int slot = 0;
    BlockScan(scan_storage).ExclusiveSum(int(take), slot);
    if (take && n + slot < a.width) {
      const int64_t o = out_row + n + slot;
      a.positions[o] = int32_t(j - first + original - a.seg_len);
      a.key_ends[o] = int32_t(e[j] - first);
      a.index[o] = int32_t(j);
    }
    if (tid == kCandThreads - 1) s_total = slot + int(take);
    __syncthreads();
    n += s_total;
    __syncthreads();  // (s_total and the scan storage are reused)
  }
  for (int64_t w = min(n, a.width) + tid; w < a.width; w += kCandThreads) {
    a.positions[out_row + w] = -1;
    a.key_ends[out_row + w] = 0;
    a.index[out_row + w] = -1;
  }
}

}  // namespace

void prefix_thresholds(const PrefixThresholdsArgs& a, void* stream) {
  if (a.rows == 0 || a.num_keys == 0) return;
  int dev = 0, max_smem = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
             "cudaDeviceGetAttribute(smem per block)");
  const int64_t bytes = a.num_keys * 4;
  const bool in_smem = bytes <= max_smem;
  const int smem = in_smem ? int(bytes) : 0;
  check_cuda(cudaFuncSetAttribute(prefix_thresholds_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "cudaFuncSetAttribute(prefix_thresholds)");
  prefix_thresholds_kernel<<<dim3(unsigned(a.rows)), 32, smem, static_cast<cudaStream_t>(stream)>>>(a, in_smem);
  check_cuda(cudaGetLastError(), "prefix_thresholds kernel");
}

void segment_candidates(const SegmentCandidatesArgs& a, void* stream) {
  if (a.rows_b == 0 || a.rows_h == 0 || a.num_segments == 0 || a.width == 0) return;
  const dim3 grid(unsigned(a.num_segments), unsigned(a.rows_h), unsigned(a.rows_b));
  segment_candidates_kernel<<<grid, kCandThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  check_cuda(cudaGetLastError(), "segment_candidates kernel");
}

}  // namespace dmattn::cuda
