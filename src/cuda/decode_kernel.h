// Split-KV decode kernels (docs/decode.md): one CTA per (query-row chunk, key split, kv head,
// batch) computes the rows of every query head of its kv head (GQA packing) against its share
// of the keys; with several splits a second kernel merges the partial rows by their lse.
//
// Decode reads each key once and does a few multiply-adds per key and query row, so it is
// bound by memory bandwidth: the kernel runs on CUDA cores, kLanes threads share one key row
// (8 elements, one 16-byte load each), and every thread keeps several keys' K and V loads in
// flight before it uses them. Scores are reduced across the key's lanes with shuffles; the
// online softmax runs per group of kT keys.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/decode_args.h"
#include "cuda/utils.h"

namespace dmattn::cuda {

namespace decode_detail {

// Keys per lane group and loop step: two keys' K and V loads in flight per thread; more
// raise the registers (query rows, accumulators, scores) past four resident CTAs per SM.
inline constexpr int kKeysPerStep = 2;

template <typename Element>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&f)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) ElemInfo<Element>::to_float2(&w[e], f[2 * e], f[2 * e + 1]);
}

// Where key j of batch b starts (paged or contiguous), in elements from the K / V base.
struct KeyRow {
  int64_t k, v;
};
__device__ __forceinline__ KeyRow key_row(const DecodeArgs& a, int b, int kvh, int j) {
  int64_t page = b, row = j;
  if (a.block_table != nullptr) {
    const int p = j / a.page_size;
    page = a.block_table[b * a.bt_stride + p];
    row = j - p * a.page_size;
  }
  return {page * a.k_st.batch_stride + row * a.k_st.row_stride + kvh * a.k_st.head_stride,
          page * a.v_st.batch_stride + row * a.v_st.row_stride + kvh * a.v_st.head_stride};
}

// The allowed test and transform of one score (docs/semantics.md): softcap, bias, mask,
// window; a disallowed key gives -inf (replaced, never offset). Returned in log2 units.
template <typename Element, bool kOperands>
__device__ __forceinline__ float transform_score(const DecodeArgs& a, float s, int b, int h, int i, int j,
                                                 int64_t off, bool in_range) {
  if (a.softcap > 0.f) s = a.softcap * tanhf(s);
  bool ok = in_range;
  if (a.window_left >= 0) ok = ok && j >= i + off - a.window_left;
  if (a.window_right >= 0) ok = ok && j <= i + off + a.window_right;
  const DecodeOperand& m = a.mask;
  if (kOperands && ok && m.ptr != nullptr) ok = m.ptr[b * m.sb + (h / m.head_div) * m.sh + i * m.sq + j * m.sk] != 0;
  const DecodeOperand& bo = a.bias;
  if (kOperands && ok && bo.ptr != nullptr) {
    const int64_t e = b * bo.sb + (h / bo.head_div) * bo.sh + i * bo.sq + j * bo.sk;
    s += a.bias_fp32 ? reinterpret_cast<const float*>(bo.ptr)[e]
                     : ElemInfo<Element>::to_float(reinterpret_cast<const Element*>(bo.ptr) + e);
  }
  return ok ? s * 1.4426950408889634f : -INFINITY;
}

}  // namespace decode_detail

// Grid (row_chunks * num_splits, heads_kv, batch), kDecodeThreads threads. kMaxD: head dims up
// to it (kMaxD / 8 lanes per key, lanes past head_dim idle); kRows: query rows per CTA;
// kOperands: a mask or bias is read (compiled out otherwise). Two CTAs per SM: the cp.async ring
// keeps enough bytes in flight with them, and the register budget stays free of spills.
template <typename Element, int kMaxD, int kRows, bool kOperands>
__global__ void __launch_bounds__(kDecodeThreads, 2) decode_kernel(const DecodeArgs a) {
  using namespace decode_detail;
  constexpr int kLanes = kMaxD / 8;
  constexpr int kSlots = kDecodeThreads / kLanes;  // keys in flight per CTA step and key
  constexpr int kT = kKeysPerStep;
  static_assert(kLanes <= 32 && 32 % kLanes == 0);

  const int chunk = blockIdx.x % a.row_chunks, split = blockIdx.x / a.row_chunks;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int slot = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const int d0 = lane * 8;
  const bool d_ok = d0 < a.head_dim;
  const int r0 = chunk * kRows;
  const int nrows = min(kRows, a.seqlen_q * a.group - r0);

  // This batch's keys, and the part of them the chunk's queries may see (window / causal).
  int len = a.seqused_k != nullptr ? a.seqused_k[b] : a.seqlen_k;
  len = max(0, min(len, a.seqlen_k));
  const int64_t off = int64_t(len) - a.seqlen_q;
  const int i_first = r0 / a.group, i_last = (r0 + nrows - 1) / a.group;
  int64_t lo = 0, hi = len;
  if (a.window_left >= 0) lo = max(lo, i_first + off - a.window_left);
  if (a.window_right >= 0) hi = min(hi, i_last + off + a.window_right + 1);
  const int64_t n = hi > lo ? hi - lo : 0;
  const int64_t per_split = (n + a.num_splits - 1) / a.num_splits;
  const int kb = static_cast<int>(lo + split * per_split);
  const int ke = static_cast<int>(min(hi, lo + (split + 1) * per_split));

  int row_i[kRows], row_h[kRows];
  float q[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = r0 + min(r, nrows - 1);
    row_i[r] = row / a.group;
    row_h[r] = kvh * a.group + row % a.group;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (r < nrows && d_ok) {
      raw = *reinterpret_cast<const uint4*>(static_cast<const Element*>(a.q) + b * a.q_st.batch_stride +
                                            row_i[r] * a.q_st.row_stride + row_h[r] * a.q_st.head_stride + d0);
    }
    unpack8<Element>(raw, q[r]);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[r][e] *= a.q_scale;
  }

  float m[kRows], l[kRows], acc[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
  }

  // K / V rows stream through a per-thread cp.async ring of kStages steps: each thread reads back
  // only the 16-byte chunks it copied itself (no CTA barrier), and the loads in flight do not
  // hold registers. Keys past the split's end are never read (zero-filled): their rows may lie
  // behind the batch's length.
  constexpr int kStages = kDecodeStages;
  constexpr int kStepKeys = kSlots * kT;
  constexpr int kRingBytes = kStages * kT * 2 * kDecodeThreads * 16;
  constexpr int kMergeBytes = kSlots * kRows * kMaxD * 4;
  __shared__ __align__(16) char smem[kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes];
  uint4* ring = reinterpret_cast<uint4*>(smem);  // [stage][t][k or v][thread]
  const Element* kbase = static_cast<const Element*>(a.k) + d0;
  const Element* vbase = static_cast<const Element*>(a.v) + d0;
  const int nsteps = ke > kb ? (ke - kb + kStepKeys - 1) / kStepKeys : 0;
  const auto issue = [&](int step) {
    if (step < nsteps) {
      uint4* dst = ring + (step % kStages) * kT * 2 * kDecodeThreads + threadIdx.x;
#pragma unroll
      for (int t = 0; t < kT; ++t) {
        const int j = kb + step * kStepKeys + t * kSlots + slot;
        const bool ok = j < ke && d_ok;
        const KeyRow at = ok ? key_row(a, b, kvh, j) : KeyRow{0, 0};
        cp_async_16(dst + (2 * t) * kDecodeThreads, kbase + at.k, ok ? 16 : 0);
        cp_async_16(dst + (2 * t + 1) * kDecodeThreads, vbase + at.v, ok ? 16 : 0);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) issue(st);

  for (int step = 0; step < nsteps; ++step) {
    cp_async_wait<kStages - 2>();  // this step's group has landed
    const int j0 = kb + step * kStepKeys + slot;
    uint4 kr[kT], vr[kT];
    const uint4* src = ring + (step % kStages) * kT * 2 * kDecodeThreads + threadIdx.x;
#pragma unroll
    for (int t = 0; t < kT; ++t) {
      kr[t] = src[(2 * t) * kDecodeThreads];
      vr[t] = src[(2 * t + 1) * kDecodeThreads];
    }
    // The ring slot refilled next is the one read a step ago; the copies must not move above
    // those reads.
    asm volatile("" ::: "memory");
    issue(step + kStages - 1);
    float s[kRows][kT];
#pragma unroll
    for (int t = 0; t < kT; ++t) {
      float kf[8];
      unpack8<Element>(kr[t], kf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(q[r][e], kf[e], dot);
        s[r][t] = dot;
      }
    }
#pragma unroll
    for (int o = kLanes / 2; o > 0; o /= 2) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int t = 0; t < kT; ++t) s[r][t] += __shfl_xor_sync(0xffffffffu, s[r][t], o);
      }
    }
    // Online softmax over the step's keys, per row (log2 units). A row whose maximum is -inf so
    // far subtracts 0 instead: its p are then 0 for masked keys and NaN for NaN scores.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float mx = m[r];
#pragma unroll
      for (int t = 0; t < kT; ++t) {
        const int j = j0 + t * kSlots;
        s[r][t] = transform_score<Element, kOperands>(a, s[r][t], b, row_h[r], row_i[r], j, off, j < ke);
        mx = fmaxf(mx, s[r][t]);
      }
      const float mu = mx == -INFINITY ? 0.f : mx;
      const float alpha = fast_exp2(m[r] - mu);
      m[r] = mx;
      l[r] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
#pragma unroll
      for (int t = 0; t < kT; ++t) {
        s[r][t] = fast_exp2(s[r][t] - mu);
        l[r] += s[r][t];
      }
    }
#pragma unroll
    for (int t = 0; t < kT; ++t) {
      float vf[8];
      unpack8<Element>(vr[t], vf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(s[r][t], vf[e], acc[r][e]);
      }
    }
  }

  // Merge the kSlots partial rows of the CTA (each slot saw every kSlots-th key), in the ring's
  // memory once every copy has landed.
  cp_async_wait<0>();
  __syncthreads();
  __shared__ float sm_m[kSlots][kRows], sm_l[kSlots][kRows], sm_w[kSlots][kRows];
  __shared__ float sm_row_l[kRows], sm_row_m[kRows];
  auto& sm_acc = *reinterpret_cast<float(*)[kSlots][kRows][kMaxD]>(smem);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (lane == 0) sm_m[slot][r] = m[r], sm_l[slot][r] = l[r];
#pragma unroll
    for (int e = 0; e < 8; ++e) sm_acc[slot][r][d0 + e] = acc[r][e];
  }
  __syncthreads();
  if (threadIdx.x < kRows) {
    const int r = threadIdx.x;
    float mx = -INFINITY;
    for (int sl = 0; sl < kSlots; ++sl) mx = fmaxf(mx, sm_m[sl][r]);
    const float mu = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
    for (int sl = 0; sl < kSlots; ++sl) {
      const float w = fast_exp2(sm_m[sl][r] - mu);
      sm_w[sl][r] = w;
      sum += sm_l[sl][r] * w;
    }
    sm_row_m[r] = mu;
    sm_row_l[r] = sum;
  }
  __syncthreads();

  const bool direct = a.num_splits == 1;
  for (int idx = threadIdx.x; idx < kRows * kMaxD; idx += kDecodeThreads) {
    const int r = idx / kMaxD, d = idx % kMaxD;
    if (r >= nrows || d >= a.head_dim) continue;
    const float sum = sm_row_l[r];
    float o = 0.f;
    for (int sl = 0; sl < kSlots; ++sl) o = fmaf(sm_acc[sl][r][d], sm_w[sl][r], o);
    // An empty row (no allowed key in this split) is 0 with lse -inf; a NaN sum stays NaN.
    const bool empty = sum == 0.f;
    o = empty ? 0.f : o / sum;
    const int row = r0 + r, qi = row / a.group, h = kvh * a.group + row % a.group;
    const float lse = empty ? -INFINITY : (sm_row_m[r] + __log2f(sum)) * 0.6931471805599453f;
    if (direct) {
      Element* out = static_cast<Element*>(a.out) + b * a.o_st.batch_stride + qi * a.o_st.row_stride +
                     h * a.o_st.head_stride;
      out[d] = Element(saturate_keep_nan<Element>(o));
      if (d == 0) a.lse[b * a.lse_bs + h * a.lse_hs + qi] = lse;
    } else {
      const int64_t prow = ((int64_t(split) * a.batch + b) * a.num_heads + h) * a.seqlen_q + qi;
      a.part_out[prow * a.head_dim + d] = o;
      if (d == 0) a.part_lse[prow] = lse;
    }
  }
}

// Merges the splits' partial rows: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse)
// out_s. One warp per (b, h, i) row; grid ceil(B * H * Sq / 4), 128 threads.
template <typename Element>
__global__ void __launch_bounds__(128) decode_combine_kernel(const DecodeArgs a) {
  const int64_t rows = int64_t(a.batch) * a.num_heads * a.seqlen_q;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t split_rows = rows;
  float mx = -INFINITY;
  for (int s = lane; s < a.num_splits; s += 32) mx = fmaxf(mx, a.part_lse[s * split_rows + row]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float mu = mx == -INFINITY ? 0.f : mx;
  float sum = 0.f;
  for (int s = lane; s < a.num_splits; s += 32) sum += __expf(a.part_lse[s * split_rows + row] - mu);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const bool empty = sum == 0.f;
  const float lse = empty ? -INFINITY : mu + __logf(sum);
  const int i = static_cast<int>(row % a.seqlen_q);
  const int h = static_cast<int>((row / a.seqlen_q) % a.num_heads);
  const int b = static_cast<int>(row / (int64_t(a.seqlen_q) * a.num_heads));
  Element* out =
      static_cast<Element*>(a.out) + b * a.o_st.batch_stride + i * a.o_st.row_stride + h * a.o_st.head_stride;
  for (int d = lane; d < a.head_dim; d += 32) {
    float o = 0.f;
    if (!empty) {
      for (int s = 0; s < a.num_splits; ++s) {
        const float w = __expf(a.part_lse[s * split_rows + row] - lse);
        o = fmaf(w, a.part_out[(s * split_rows + row) * a.head_dim + d], o);
      }
    }
    out[d] = Element(saturate_keep_nan<Element>(o));
  }
  if (lane == 0) a.lse[b * a.lse_bs + h * a.lse_hs + i] = lse;
}

}  // namespace dmattn::cuda
