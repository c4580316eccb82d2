// The per-query causal top-k glue on CUDA (semantics in dmattn/api.h):
//   * prefix_thresholds: the threshold x = the keep-th smallest rank seen so far, for every
//     prefix of a row (cpu/per_query_glue.cpp is the sequential form). The keys are cut into
//     chunks of 256, one CTA each: the state before a chunk follows from `order` alone (a count
//     in rank order), then one warp streams the chunk's keys. A 32-key group costs one ballot
//     when no key of it enters the kept set; each entering key evicts x, and the new x (the
//     largest rank below x already seen) is found 32 ranks per ballot. One CTA per row would
//     leave most of the GPU idle (B * H rows) and run its events one after the other.
//   * segment_candidates: one CTA per (batch row, segment, head row) lists the keys a segment's
//     queries may keep: those before the segment by end bucket (api/segment_order.h), then its
//     own keys in index order.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cuda/common/check.h"
#include "api/segment_order.h"
#include "cuda/indexed/per_query_glue.h"

namespace dmattn::cuda {

namespace {

constexpr unsigned kFull = 0xffffffffu;

constexpr int kChunk = 256;          // keys per CTA of prefix_thresholds
constexpr int kThresholdThreads = 128;

// One CTA per (row, chunk of kChunk keys). Phase 1 (whole CTA): the state before the chunk's
// first key v0 from `order` alone -- the selectable keys before v0 are the ranks r with
// order[r] < v0 (order holds num_keys for keys that are not selectable), so the threshold is the
// keep-th such r, counted in rank order (or, when fewer than keep, their count and largest rank).
// Phase 2 (warp 0): the chunk's keys one 32-key ballot at a time, events (a key filling the set
// or entering below x) in order; the lanes between two events write the threshold in force.
__global__ void __launch_bounds__(kThresholdThreads) prefix_thresholds_kernel(PrefixThresholdsArgs a) {
  __shared__ int s_warp[kThresholdThreads / 32];
  __shared__ int s_state[3];  // count, x, fill_max
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n = int(a.num_keys), keep = int(a.keep);
  const int32_t* rank = a.ranks + blockIdx.x * a.num_keys;
  const int32_t* order = a.order + blockIdx.x * a.num_keys;
  int32_t* out = a.thresholds + blockIdx.x * a.num_keys;
  const int v0 = blockIdx.y * kChunk;

  // Phase 1: scan ranks upward, counting those already seen, until the keep-th.
  int count = 0, x = n, fill_max = -1;  // (uniform after each round)
  for (int r0 = 0; r0 < n && v0 > 0; r0 += kThresholdThreads) {
    const int r = r0 + tid;
    const bool seen = r < n && order[r] < v0;
    const unsigned ballot = __ballot_sync(kFull, seen);
    if (lane == 0) s_warp[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kThresholdThreads / 32; ++w) {
      before += w < warp ? s_warp[w] : 0;
      total += s_warp[w];
    }
    const int my_index = count + before + __popc(ballot & ((1u << lane) - 1u));  // 0-based, if seen
    if (seen && my_index == keep - 1) s_state[1] = r;  // the keep-th seen rank: the threshold
    // The largest seen rank of this round (for a set still filling).
    if (seen && my_index == count + total - 1) s_state[2] = r;
    __syncthreads();
    const bool reached = count + total >= keep;
    if (total > 0 && !reached) fill_max = s_state[2];
    count = min(count + total, keep);
    if (reached) {
      x = s_state[1];
      break;
    }
    __syncthreads();  // (s_warp / s_state reused)
  }
  if (warp != 0) return;

  // Phase 2: the chunk's keys, as the sequential form does.
  const int v_end = min(n, v0 + kChunk);
  for (int c0 = v0; c0 < v_end; c0 += 32) {
    const int v = c0 + lane;
    const int k = v < v_end ? rank[v] : n;
    const bool selectable = k < n;
    const unsigned sel = __ballot_sync(kFull, selectable);
    if (count + __popc(sel) < keep) {  // the whole 32 keys only fill the set
      int m = selectable ? k : -1;
      for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(kFull, m, o));
      fill_max = max(fill_max, m);
      count += __popc(sel);
      if (v < v_end) out[v] = n;
      continue;
    }
    int done = 0;
    while (true) {
      const bool event = lane >= done && selectable && (count < keep || k < x);
      const unsigned ev = __ballot_sync(kFull, event);
      const int first = ev ? __ffs(ev) - 1 : 32;
      if (lane >= done && lane < first && v < v_end) out[v] = count < keep ? n : x;
      if (first == 32) break;
      const int kf = __shfl_sync(kFull, k, first);
      const int vf = c0 + first;
      if (count < keep) {
        fill_max = max(fill_max, kf);
        if (++count == keep) x = fill_max;
      } else {
        int top = x;  // the largest rank below x already seen (kf at the latest)
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
constexpr int kCandWarps = kCandThreads / 32;
constexpr int kBuckets = segment_order::kMaxBuckets;
static_assert(kBuckets == kCandThreads, "one end bucket per thread in the bucket bookkeeping");

// One CTA per (batch row, segment, head row). The keys before the segment (kept by its first
// query) are placed by end bucket (api/segment_order.h): a histogram, the buckets' first rows
// (smallest bucket first), then a stable placement 256 keys at a time -- a key's row is its
// bucket's next row plus the keys of its bucket before it in the round (earlier warps, then
// lower lanes: __match_any_sync). The segment's own keys follow in index order (a block scan per
// 256 keys).
__global__ void __launch_bounds__(kCandThreads) segment_candidates_kernel(SegmentCandidatesArgs a) {
  using BlockScan = cub::BlockScan<int, kCandThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int s_total;
  __shared__ int s_next[kBuckets];                   // the next row of each bucket
  __shared__ int s_warp_count[kCandWarps][kBuckets];  // this round's keys per (warp, bucket)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int32_t* e = a.ends + (b * a.rows_h + h) * a.num_keys;
  const int64_t out_row = ((b * a.num_segments + s) * a.rows_h + h) * a.width;
  int32_t* slot_row = a.slots + ((b * a.num_segments + s) * a.rows_h + h) * a.num_keys;
  const int64_t first = s * a.seg_len + a.offset;
  const int64_t original = a.num_segments * a.seg_len + a.offset;
  const int64_t stop = min(a.num_keys, first + a.seg_len);
  const int64_t before_stop = min(first, stop);
  const int64_t span = segment_order::bucket_span(a.seg_len);
  // Row n holds key j at position pos (the own keys': j - first + original - seg_len).
  auto write_row = [&](int64_t n, int64_t j, int64_t pos) {
    const int64_t o = out_row + n;
    a.positions[o] = int32_t(pos);
    a.key_ends[o] = int32_t(e[j] - first);
    a.index[o] = int32_t(j);
  };

  // The keys before the segment.
  s_next[tid] = 0;
  for (int w = 0; w < kCandWarps; ++w) s_warp_count[w][tid] = 0;
  __syncthreads();
  for (int64_t j = tid; j < before_stop; j += kCandThreads)
    if (e[j] > first) atomicAdd(&s_next[segment_order::bucket(e[j] - first, a.seg_len, span)], 1);
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int k = 1; k < kBuckets; ++k) {
      const int c = s_next[k];
      s_next[k] = run;
      run += c;
    }
    s_total = run;
  }
  __syncthreads();
  int64_t n = min(int64_t(s_total), a.width);  // candidates written (uniform)
  // The keys before the segment are visible to all its queries: rows 0..n-1 take the positions
  // just below the segment's first one, increasing as the positions contract asks.
  const int64_t before_pos0 = original - a.seg_len - n;
  for (int64_t j0 = 0; j0 < before_stop; j0 += kCandThreads) {
    const int64_t j = j0 + tid;
    const bool take = j < before_stop && e[j] > first;
    const int bk = take ? segment_order::bucket(e[j] - first, a.seg_len, span) : 0;
    const unsigned peers = __match_any_sync(kFull, bk);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    if (take && rank == 0) s_warp_count[warp][bk] = __popc(peers);
    __syncthreads();
    if (take) {
      int row = s_next[bk] + rank;
      for (int w = 0; w < warp; ++w) row += s_warp_count[w][bk];
      if (row < a.width) write_row(row, j, before_pos0 + row);
      slot_row[j] = row < a.width ? row : -1;
    } else if (j < before_stop) {
      slot_row[j] = -1;
    }
    __syncthreads();
    int round = 0;
    for (int w = 0; w < kCandWarps; ++w) {
      round += s_warp_count[w][tid];
      s_warp_count[w][tid] = 0;
    }
    s_next[tid] += round;
    __syncthreads();
  }
  __syncthreads();  // (s_total is rewritten below)

  // The segment's own keys, in index order.
  int64_t j0 = before_stop;
  for (; j0 < stop && n < a.width; j0 += kCandThreads) {
    const int64_t j = j0 + tid;
    const bool take = j < stop && e[j] > j;
    int slot = 0;
    BlockScan(scan_storage).ExclusiveSum(int(take), slot);
    if (take && n + slot < a.width) write_row(n + slot, j, j - first + original - a.seg_len);
    if (j < stop) slot_row[j] = take && n + slot < a.width ? int32_t(n + slot) : -1;
    if (tid == kCandThreads - 1) s_total = slot + int(take);
    __syncthreads();
    n += s_total;
    __syncthreads();  // (s_total and the scan storage are reused)
  }
  // Keys the scan did not reach (it stops once the width is full) and keys past the segment (the
  // scan's last round wrote the slots of its keys below `stop` only).
  for (int64_t j = min(j0, stop) + tid; j < a.num_keys; j += kCandThreads) slot_row[j] = -1;
  for (int64_t w = min(n, a.width) + tid; w < a.width; w += kCandThreads) {
    a.positions[out_row + w] = -1;
    a.key_ends[out_row + w] = 0;
    a.index[out_row + w] = -1;
  }
}

// interval_ends, before the thresholds: the rank of every key and the key at every rank, S for
// the keys `allowed` excludes (and at their ranks, which come after every allowed key's).
__global__ void ranks_of_order_kernel(IntervalEndsArgs a) {
  const int64_t total = a.rows * a.num_keys;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = e / a.num_keys, p = e % a.num_keys;
    const int64_t j = a.sorted[e];
    const bool ok = a.allowed == nullptr || a.allowed[row * a.num_keys + j];
    a.ranks[row * a.num_keys + j] = ok ? int32_t(p) : int32_t(a.num_keys);
    a.order[e] = ok ? int32_t(j) : int32_t(a.num_keys);
  }
}

// interval_ends, after the thresholds (non-increasing along a row): key j's end is the first
// prefix whose threshold falls below its rank (a binary search), at least j; j itself for a key
// that is never selectable.
__global__ void ends_of_thresholds_kernel(IntervalEndsArgs a) {
  const int64_t total = a.rows * a.num_keys;
  const int n = int(a.num_keys);
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int32_t* t = a.thresholds + (e / n) * n;
    const int j = int(e % n), rank = a.ranks[e];
    int lo = 0, hi = n;  // the first v with t[v] < rank
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (__ldg(t + mid) < rank) hi = mid;
      else lo = mid + 1;
    }
    a.ends[e] = rank < n ? max(lo, j) : j;
  }
}

// selection_key: a float's bit pattern as a signed integer is sign and magnitude; `ordered`
// is its two's complement (-magnitude for negative floats: -0.0 and 0.0 both 0), NaN first
// made +inf; key = ordered * 2^shift - index (shift 16 for int32 keys of 16-bit scores, else
// 32), the key type's minimum where `allowed` is false.
template <typename Bits, typename Signed, typename Key>
__global__ void selection_key_kernel(SelectionKeyArgs a, Bits abs_mask, Bits inf_bits, int shift) {
  const int64_t total = a.rows * a.num_keys;
  const Bits* bits = static_cast<const Bits*>(a.scores);
  Key* key = static_cast<Key*>(a.key);
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    Bits b = bits[e];
    if (Bits(b & abs_mask) > inf_bits) b = inf_bits;  // NaN (either sign) -> +inf
    const Signed sb = static_cast<Signed>(b);
    const int64_t ordered = sb < 0 ? int64_t(std::numeric_limits<Signed>::min()) - int64_t(sb) : int64_t(sb);
    const int64_t index = e % a.num_keys;
    const bool ok = a.allowed == nullptr || a.allowed[e];
    key[e] = ok ? Key(ordered * (int64_t(1) << shift) - index) : std::numeric_limits<Key>::min();
  }
}

unsigned elementwise_grid(int64_t total) {
  return unsigned(std::min<int64_t>((total + 255) / 256, 132 * 16));
}

}  // namespace

void selection_key(const SelectionKeyArgs& a, void* stream) {
  if (a.rows == 0 || a.num_keys == 0) return;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned grid = elementwise_grid(a.rows * a.num_keys);
  if (a.fmt == 2)
    selection_key_kernel<uint32_t, int32_t, int64_t><<<grid, 256, 0, s>>>(a, 0x7FFFFFFFu, 0x7F800000u, 32);
  else if (a.key32)
    selection_key_kernel<uint16_t, int16_t, int32_t><<<grid, 256, 0, s>>>(a, 0x7FFF, a.fmt == 1 ? 0x7F80 : 0x7C00, 16);
  else
    selection_key_kernel<uint16_t, int16_t, int64_t><<<grid, 256, 0, s>>>(a, 0x7FFF, a.fmt == 1 ? 0x7F80 : 0x7C00, 32);
  check_cuda(cudaGetLastError(), "selection_key kernel");
}

void interval_ends(const IntervalEndsArgs& a, void* stream) {
  if (a.rows == 0 || a.num_keys == 0) return;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned grid = elementwise_grid(a.rows * a.num_keys);
  ranks_of_order_kernel<<<grid, 256, 0, s>>>(a);
  check_cuda(cudaGetLastError(), "interval_ends: ranks kernel");
  prefix_thresholds({a.ranks, a.order, a.thresholds, a.rows, a.num_keys, a.keep}, stream);
  ends_of_thresholds_kernel<<<grid, 256, 0, s>>>(a);
  check_cuda(cudaGetLastError(), "interval_ends: ends kernel");
}

void prefix_thresholds(const PrefixThresholdsArgs& a, void* stream) {
  if (a.rows == 0 || a.num_keys == 0) return;
  const dim3 grid(unsigned(a.rows), unsigned((a.num_keys + kChunk - 1) / kChunk));
  prefix_thresholds_kernel<<<grid, kThresholdThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  check_cuda(cudaGetLastError(), "prefix_thresholds kernel");
}

void segment_candidates(const SegmentCandidatesArgs& a, void* stream) {
  if (a.rows_b == 0 || a.rows_h == 0 || a.num_segments == 0 || a.width == 0) return;
  const dim3 grid(unsigned(a.num_segments), unsigned(a.rows_h), unsigned(a.rows_b));
  segment_candidates_kernel<<<grid, kCandThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  check_cuda(cudaGetLastError(), "segment_candidates kernel");
}

}  // namespace dmattn::cuda
