// Gate skipping's cells (gate_keep.h): one CTA per (batch, head). Each warp reduces the 128 rows
// of a query cell of alpha (or a key cell of delta) to their largest and smallest value (a NaN
// anywhere gives NaN, which keeps its cells), then each warp takes query cells: the largest
// bound R over the key cells its rows see, and the rule per key cell.
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/common/check.h"
#include "cuda/common/fwd_args.h"
#include "cuda/common/gate_keep.h"

namespace dmattn::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load_value(const void* base, int type, int64_t off) {
  if (type == 1) return __half2float(static_cast<const __half*>(base)[off]);
  if (type == 2) return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[off]);
  return static_cast<const float*>(base)[off];
}

__device__ __forceinline__ const void* element_at(const void* base, int type, int64_t off) {
  return static_cast<const char*>(base) + off * (type == 0 ? 4 : 2);
}

// max / min that keep a NaN (fmaxf / fminf drop it)
__device__ __forceinline__ float max_nan(float x, float y) { return (x != x || y != y) ? NAN : fmaxf(x, y); }
__device__ __forceinline__ float min_nan(float x, float y) { return (x != x || y != y) ? NAN : fminf(x, y); }

__device__ __forceinline__ float gate_value(float x, bool logsigmoid) {
  return logsigmoid ? fminf(x, 0.f) - log1pf(expf(-fabsf(x))) : x;
}

// floor(x / kGateCell) for either sign
__device__ __forceinline__ int64_t floor_cell(int64_t x) { return x >= 0 ? x / kGateCell : -((-x + kGateCell - 1) / kGateCell); }

// The extremes of rows [0, len) of one (b, head) column in cells of kGateCell rows, one cell per
// warp at a time, into hi[c] / lo[c] (an empty cell: -inf / +inf).
__device__ void cell_extremes(const void* base, int type, int64_t row_stride, int len, int cells, float* hi,
                              float* lo) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int c = warp; c < cells; c += kThreads / 32) {
    float h = -INFINITY, l = INFINITY;
    for (int r = c * kGateCell + lane; r < min(len, (c + 1) * kGateCell); r += 32) {
      const float x = load_value(base, type, int64_t(r) * row_stride);
      h = max_nan(h, x);
      l = min_nan(l, x);
    }
    for (int o = 16; o > 0; o /= 2) {
      h = max_nan(h, __shfl_xor_sync(0xffffffffu, h, o));
      l = min_nan(l, __shfl_xor_sync(0xffffffffu, l, o));
    }
    if (lane == 0) hi[c] = h, lo[c] = l;
  }
}

__global__ void __launch_bounds__(kThreads) gate_keep_kernel(GateKeepArgs a) {
  extern __shared__ float smem[];
  const int h = blockIdx.x, b = blockIdx.y;
  int q0 = 0, k0 = 0, len_q = a.seqlen_q, len_k = a.seqlen_k;
  if (a.cu_seqlens_q != nullptr) {
    q0 = a.cu_seqlens_q[b], len_q = a.cu_seqlens_q[b + 1] - q0;
    k0 = a.cu_seqlens_k[b], len_k = a.cu_seqlens_k[b + 1] - k0;
  }
  const int mc = (len_q + kGateCell - 1) / kGateCell, nc = (len_k + kGateCell - 1) / kGateCell;
  float* a_hi = smem;
  float* a_lo = a_hi + a.m_cells;
  float* d_hi = a_lo + a.m_cells;
  float* d_lo = d_hi + a.n_cells;
  const int64_t a_off = int64_t(b) * a.a_bs + int64_t(q0) * a.a_rs + int64_t(h) * a.a_hs;
  const int64_t d_off = int64_t(b) * a.d_bs + int64_t(k0) * a.d_rs + int64_t(h / a.group) * a.d_hs;
  cell_extremes(element_at(a.alpha, a.alpha_type, a_off), a.alpha_type, a.a_rs, len_q, mc, a_hi, a_lo);
  cell_extremes(element_at(a.delta, a.delta_type, d_off), a.delta_type, a.d_rs, len_k, nc, d_hi, d_lo);
  __syncthreads();
  uint8_t* keep = a.keep + (int64_t(b) * a.heads + h) * a.m_cells * a.n_cells;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t offset = int64_t(len_k) - len_q;
  const int right = a.causal ? (a.window_right < 0 ? 0 : min(a.window_right, 0)) : a.window_right;
  const int left = a.window_left;
  for (int m = warp; m < a.m_cells; m += kThreads / 32) {
    uint8_t* row = keep + int64_t(m) * a.n_cells;
    // the key cells some row of the block sees: [n_lo, n_hi)
    int64_t n_lo = 0, n_hi = 0;
    if (m < mc) {
      const int64_t i0 = int64_t(m) * kGateCell, i1 = min(i0 + kGateCell, int64_t(len_q));
      n_hi = nc;
      if (right >= 0) n_hi = min(n_hi, floor_cell(i1 - 1 + offset + right) + 1);
      if (left >= 0) n_lo = max(n_lo, floor_cell(i0 + offset - left));
    }
    const float ah = a_hi[m < mc ? m : 0], al = a_lo[m < mc ? m : 0];
    auto bound = [&](int n) {  // the largest product the cell's pairs can reach
      return max_nan(max_nan(ah * d_hi[n], ah * d_lo[n]), max_nan(al * d_hi[n], al * d_lo[n]));
    };
    float r = -INFINITY;
    for (int64_t n = n_lo + lane; n < n_hi; n += 32) r = max_nan(r, bound(int(n)));
    for (int o = 16; o > 0; o /= 2) r = max_nan(r, __shfl_xor_sync(0xffffffffu, r, o));
    float log_thr = a.log_threshold;
    if (a.adaptive && a.causal && m < mc) {  // threshold * (keys the block's first row sees) / Sk
      const int64_t seen = min(max(int64_t(m) * kGateCell + offset + 1, int64_t(0)), int64_t(len_k));
      log_thr = logf(a.threshold * float(seen) / float(max(len_k, 1)));
    }
    const float g_r = gate_value(r, a.logsigmoid);
    for (int n = lane; n < a.n_cells; n += 32) {
      bool skip = false;
      if (n >= n_lo && n < n_hi) {
        const float ub = bound(n);
        skip = ub < r && a.scale * (gate_value(ub, a.logsigmoid) - g_r) < log_thr;
      }
      row[n] = skip ? 0 : 1;
    }
  }
}

}  // namespace

int64_t gate_keep_smem_bytes(int m_cells, int n_cells) { return int64_t(2 * (m_cells + n_cells)) * sizeof(float); }

void launch_gate_keep(const GateKeepArgs& a, void* stream) {
  if (a.batch == 0 || a.heads == 0 || a.m_cells == 0 || a.n_cells == 0) return;
  const int64_t smem = gate_keep_smem_bytes(a.m_cells, a.n_cells);
  if (smem > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(gate_keep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
               "cudaFuncSetAttribute(gate_keep_kernel)");
  gate_keep_kernel<<<dim3(a.heads, a.batch), kThreads, smem, static_cast<cudaStream_t>(stream)>>>(a);
  check_cuda(cudaGetLastError(), "gate_keep_kernel launch");
}

}  // namespace dmattn::cuda
