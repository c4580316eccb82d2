// Launcher of the backward pass for one (element type, instantiated head dim); explicitly
// instantiated once per pair in src/cuda/inst/bwd_<dtype>_hd<D>.cu; the warp-specialized
// kernel's launcher in src/cuda/inst/bwd_ws_<dtype>_hd<D>.cu, the query-major kernel's in
// bwd_dq_<dtype>_hd<D>.cu (bwd_dq_launch.h), the general Hopper kernel's in bwd_sm90_<dtype>.cu
// (bwd_sm90_launch.h). Sequence on the stream:
//   1. zero the fp32 accumulators (dq_accum unless dQ comes from the query-major kernel -- in a
//      dense batch by bwd_preprocess instead --, dbias_accum when used);
//   2. bwd_preprocess: Delta = rowsum(dO * O) for every row (0 for empty rows), or (exact path)
//      bwd_stats: m, log2 l and Delta = sum_j P_ij dP_ij recomputed for every row;
//   3. a key-broadcast dbias is exactly zero (see kDbNone): filled here;
//   4. bwd_kernel (dK, dV, dQ atomics, dbias), or the warp-specialized Hopper kernel (dQ by TMA
//      reduce-adds, in key block order in deterministic mode);
//   5. dQ: bwd_convert_dq (dq_accum -> dq), or bwd_dq_kernel (deterministic mode on the general
//      kernels, exact path);
//   6. dbias_accum -> dbias when the reduction went through it.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/bwd_args.h"
#include "cuda/common/check.h"
#include "dmattn/error.h"

namespace dmattn::cuda {

// exact: the three-pass scheme of the CPU backend (bwd_stats -> main kernel without atomics ->
// query-major dQ), with the row statistics kept in dq_accum; otherwise FlashAttention-2's
// Delta = rowsum(dO * O) and P = exp(s - lse).
template <typename Element, int kHeadDim>
void run_bwd(const BwdArgs& a, bool deterministic, bool exact, cudaStream_t stream);

}  // namespace dmattn::cuda

#ifdef DMATTN_BWD_LAUNCH_IMPL
#include <cstdlib>

#include "cuda/sm80/bwd_kernel.h"
#include "cuda/common/device_info.h"
#include "cuda/common/launch.h"
#include "cuda/host/bwd_dq_launch.h"
#include "cuda/host/bwd_sm90_launch.h"
#include "cuda/indexed/indexed_rows.h"
#include "cuda/common/seq_bounds.h"
#include "cuda/sm90/bwd_tile_sm90.h"
#include "cuda/sm90/bwd_ws_launch_sm90.h"
#include "cuda/sm90/enabled.h"

namespace dmattn::cuda::sm90 {
// The warp-specialized backward's variants are compiled in translation units of their own
// (inst/bwd_ws_<dtype>_hd<D>.cu, DMATTN_INSTANTIATE_BWD_WS), beside the other backward kernels'
// rather than after them in one: the longest units of the build, split in two.
extern template void launch_bwd_ws<cutlass::half_t, 64>(const BwdArgs&, dim3, bool, cudaStream_t);
extern template void launch_bwd_ws<cutlass::half_t, 128>(const BwdArgs&, dim3, bool, cudaStream_t);
extern template void launch_bwd_ws<cutlass::half_t, 256>(const BwdArgs&, dim3, bool, cudaStream_t);
extern template void launch_bwd_ws<cutlass::bfloat16_t, 64>(const BwdArgs&, dim3, bool, cudaStream_t);
extern template void launch_bwd_ws<cutlass::bfloat16_t, 128>(const BwdArgs&, dim3, bool, cudaStream_t);
extern template void launch_bwd_ws<cutlass::bfloat16_t, 256>(const BwdArgs&, dim3, bool, cudaStream_t);
}  // namespace dmattn::cuda::sm90
// The gate's variants (head dims 64 and 128, dense and packed batches) likewise in units of
// their own: beside key rows (inst/bwd_ws_gate_<dtype>.cu, DMATTN_INSTANTIATE_BWD_WS_GATE) and
// the gate alone on plain scores (inst/bwd_ws_plain_gate_<dtype>.cu,
// DMATTN_INSTANTIATE_BWD_WS_PLAIN_GATE): the part of the Hopper backward that changes most,
// rebuilt alone. (kSkip: with gate skipping's cells.)
#define DMATTN_BWD_WS_GATE_LAUNCH(Element, HD, kPacked, kSkip)                                                      \
  void dmattn::cuda::sm90::launch_bwd_ws_tile<                                                                    \
      dmattn::cuda::sm90::BwdWsTile<Element, HD, dmattn::cuda::sm90::BwdWsScores::kKeyRows, false, true, kSkip>, \
      kPacked>(const dmattn::cuda::BwdArgs&, dim3, cudaStream_t)
#define DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(Element, HD, kPacked, kSkip)                                              \
  void dmattn::cuda::sm90::launch_bwd_ws_tile<                                                                   \
      dmattn::cuda::sm90::BwdWsTile<Element, HD, dmattn::cuda::sm90::BwdWsScores::kPlain, false, true, kSkip>,  \
      kPacked>(const dmattn::cuda::BwdArgs&, dim3, cudaStream_t)
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::half_t, 64, false, false);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::half_t, 64, true, false);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::half_t, 128, false, false);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::half_t, 128, true, false);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::half_t, 64, false, true);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::half_t, 64, true, true);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::half_t, 128, false, true);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::half_t, 128, true, true);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 64, false, false);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 64, true, false);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 128, false, false);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 128, true, false);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 64, false, true);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 64, true, true);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 128, false, true);
extern template DMATTN_BWD_WS_GATE_LAUNCH(cutlass::bfloat16_t, 128, true, true);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::half_t, 64, false, false);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::half_t, 64, true, false);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::half_t, 128, false, false);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::half_t, 128, true, false);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::bfloat16_t, 64, false, false);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::bfloat16_t, 64, true, false);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::bfloat16_t, 128, false, false);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::bfloat16_t, 128, true, false);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::half_t, 64, false, true);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::half_t, 64, true, true);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::half_t, 128, false, true);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::half_t, 128, true, true);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::bfloat16_t, 64, false, true);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::bfloat16_t, 64, true, true);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::bfloat16_t, 128, false, true);
extern template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(cutlass::bfloat16_t, 128, true, true);

namespace dmattn::cuda {

// Delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] in fp32; 8 threads per row, each with all
// its 16-byte chunks' loads in flight together (the loop bound is the instantiated head dim).
// Given zero_dq_accum (a dense batch's dq_accum, (B, Sq, H, D)), the row's accumulator is zeroed
// by the same threads (FlashAttention-3's preprocessing does the same): one pass over the query
// rows fewer than a separate memset.
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(128) bwd_preprocess(const __grid_constant__ BwdArgs a, float* zero_dq_accum) {
  const FwdArgs& f = a.f;
  const int tid = threadIdx.x;
  const int i = blockIdx.x * 16 + tid / 8;
  const int h = blockIdx.y, b = blockIdx.z;
  const int lane8 = tid % 8;
  const SeqBounds seq(f, b);
  const int len_q = seq.len_q();
  if (int(blockIdx.x) * 16 >= len_q) return;  // packed batch: past this sequence's end
  float acc = 0.f;
  if (i < len_q) {
    const int64_t row = seq.q0() + i;
    const Element* o = static_cast<const Element*>(f.out) + int64_t(b) * f.o_bs + row * f.o_rs + int64_t(h) * f.o_hs;
    const Element* d = static_cast<const Element*>(a.dout) + int64_t(b) * a.do_bs + row * a.do_rs + int64_t(h) * a.do_hs;
    float* accum = zero_dq_accum == nullptr
                       ? nullptr
                       : zero_dq_accum + ((int64_t(b) * f.seqlen_q + row) * f.num_heads + h) * f.head_dim;
    constexpr int kChunks = (kHeadDim + 63) / 64;  // per thread
    uint4 ov[kChunks], dv[kChunks];
#pragma unroll
    for (int it = 0; it < kChunks; ++it) {
      const int c = lane8 * 8 + it * 64;
      ov[it] = dv[it] = make_uint4(0u, 0u, 0u, 0u);  // (past the head dim: adds nothing)
      if (c < f.head_dim) {
        ov[it] = *reinterpret_cast<const uint4*>(o + c);
        dv[it] = *reinterpret_cast<const uint4*>(d + c);
        if (accum != nullptr) {
          reinterpret_cast<float4*>(accum + c)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
          reinterpret_cast<float4*>(accum + c)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
    }
#pragma unroll
    for (int it = 0; it < kChunks; ++it) {
      const uint32_t* op = reinterpret_cast<const uint32_t*>(&ov[it]);
      const uint32_t* dp = reinterpret_cast<const uint32_t*>(&dv[it]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float o0, o1, d0, d1;
        ElemInfo<Element>::to_float2(op + e, o0, o1);
        ElemInfo<Element>::to_float2(dp + e, d0, d1);
        acc = fmaf(o0, d0, acc);
        acc = fmaf(o1, d1, acc);
      }
    }
  }
  acc += __shfl_xor_sync(0xffffffff, acc, 1);
  acc += __shfl_xor_sync(0xffffffff, acc, 2);
  acc += __shfl_xor_sync(0xffffffff, acc, 4);
  if (i < len_q && lane8 == 0) a.delta[seq.stat_offset(h) + i] = acc;
}

// dq = scale * dq_accum, saturated; 8 elements per thread and step. dq_accum's rows are the
// batch's query rows one after another (b * Sq + i dense, the packed row in a varlen batch, whose
// SeqTensors have batch stride 0: there the packed row is dq's row).
template <typename Element>
__global__ void bwd_convert_dq(const __grid_constant__ BwdArgs a) {
  const FwdArgs& f = a.f;
  const int chunks = f.head_dim / 8;
  const int64_t total = f.q_rows * f.num_heads * chunks;
  const int64_t rows_per_batch = f.cu_seqlens_q ? f.q_rows : f.seqlen_q;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = idx / chunks;  // (b * Sq + i) * H + h
    const int c = int(idx % chunks) * 8;
    const int h = int(row % f.num_heads);
    const int64_t bi = row / f.num_heads;
    const int64_t i = bi % rows_per_batch;
    const int64_t b = bi / rows_per_batch;
    const float4* src = reinterpret_cast<const float4*>(a.dq_accum + row * f.head_dim + c);
    const float4 x = src[0], y = src[1];
    const float v[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
    uint4 out;
    auto* o2 = reinterpret_cast<typename ElemInfo<Element>::Native2*>(&out);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      o2[e] = pack_saturated<Element>(v[2 * e] * f.scale, v[2 * e + 1] * f.scale);
    }
    Element* dst = static_cast<Element*>(a.dq) + b * a.dq_bs + i * a.dq_rs + int64_t(h) * a.dq_hs + c;
    *reinterpret_cast<uint4*>(dst) = out;
  }
}

// Writes every dbias element: from dbias_accum (contiguous, the bias's own sizes) or zeros.
template <typename BiasT>
__global__ void bwd_write_dbias(const __grid_constant__ BwdArgs a, bool from_accum) {
  const int64_t total = a.bsize_b * a.bsize_h * a.bsize_q * a.bsize_k;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = idx % a.bsize_k;
    const int64_t q = (idx / a.bsize_k) % a.bsize_q;
    const int64_t h = (idx / (a.bsize_k * a.bsize_q)) % a.bsize_h;
    const int64_t b = idx / (a.bsize_k * a.bsize_q * a.bsize_h);
    const float v = from_accum ? a.dbias_accum[idx] : 0.f;
    store_sat(static_cast<BiasT*>(a.dbias) + b * a.db_sb + h * a.db_sh + q * a.db_sq + k * a.db_sk, v);
  }
}

inline int bwd_grid_stride_blocks(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return int(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

// The main kernel runs on wgmma on compute capability 9.0 unless DMATTN_BWD_SM90=0
// (sm90/enabled.h): at head dims 64 and 128 the warp-specialized kernel (sm90/bwd_ws_kernel_sm90.h)
// for the problems it takes, else at 128 the general Hopper kernel (sm90/bwd_kernel_sm90.h); the
// sm80-class kernel everywhere else.
inline bool bwd_sm90_enabled() {
  static const bool off = sm90::env_switched_off("DMATTN_BWD_SM90");
  return !off && sm90::device_runs_sm90_kernels();
}

// The Hopper main kernel's CTA group size (cta_order.h). Grouped (key blocks slowest inside a
// group) only where the key blocks' work differs, i.e. under a causal / sliding window: at least
// a wave of CTAs per group (G x key blocks >= SMs, G a power of two) and at most 8 (kv head,
// batch) pairs, whose Q / dO (4 MB each at S = 8192, D = 128) stay in L2. Without a window all
// key blocks weigh the same and the plain order (G = 1) keeps fewer heads' Q / dO in flight.
// H100, B=2 S=8192 H=16, fwd+bwd (benchmarks/profiling/cta_order_timing.py, docs/design.md): causal dense
// 6.86 -> 6.62 ms (G = 4), Doge top-2048 causal 4.81 -> 4.34 (G = 8); without a window G = 4 to 8
// was up to 8 % slower. Windows with sinks: 8 pairs at least -- a sink's key block meets every
// query block (3-4x a band's block at S = 8192), and in groups of 4 the last groups' sink blocks
// started too late to end with the rest (H200, B=2 S=8192 H=16, sink 128, bands of 1024 with a
// gap of 2048: fwd+bwd 2.40 ms with G = 4, 2.27 with 8, 2.25 with 32).
inline int bwd_cta_group_default(const FwdArgs& f, int n_blocks) {
  if (f.windows != nullptr) return 8;
  if (f.window_left < 0 && f.window_right < 0) return 1;
  const int sms = current_multiprocessor_count();
  int g = 1;
  while (g < 8 && g * n_blocks < sms) g *= 2;
  return g;
}

template <typename Element, int kHeadDim>
void run_bwd(const BwdArgs& args, bool deterministic, bool exact, cudaStream_t stream) {
  // Indexed keys: read in place by the warp-specialized kernel alone (its dQ path), gathered into
  // a copy for the others.
  if (args.f.kpos.rows != nullptr) {
    const bool in_place =
        !deterministic && !(exact && args.dq_accum != nullptr) && bwd_sm90_enabled() && sm90::bwd_ws_supports(args);
    if (!in_place) {
      BwdArgs gathered = args;
      const GatheredRowsCopy rows(gathered.f, int(sizeof(Element)), stream);
      run_bwd<Element, kHeadDim>(gathered, deterministic, exact, stream);
      return;
    }
  }
  using Tile = BwdTile<Element, kHeadDim>;
  using TileSm90 = sm90::BwdTileSm90<Element, 128>;  // (used at head dim 128 only)
  BwdArgs a = args;
  const FwdArgs& f = a.f;
  // Sq / Sk: the longest sequence of a packed batch (grid sizes); q_rows: the query rows of the
  // whole batch (B * Sq dense, total_q packed), which size dq_accum, Delta and the statistics.
  const int64_t B = f.batch, Sq = f.seqlen_q, Sk = f.seqlen_k, H = f.num_heads, D = f.head_dim;
  const int64_t q_rows = f.q_rows;
  exact = exact && a.dq_accum != nullptr;
  // The warp-specialized Hopper kernel (sm90/bwd_ws_launch_sm90.h) where it takes the problem. In
  // deterministic mode it adds dQ in key block order where it can order the adds
  // (bwd_ws_orders_dq_adds); where it cannot (gathered keys, windows with sinks) it runs without
  // dQ, which the query-major kernel then computes, as on the exact path (its dK, dV and dbias
  // have one writer each either way).
  // The gate and windows with sinks (score_terms.h): on the sm80-class kernels, and with key
  // rows on the warp-specialized kernel (bwd_ws_supports).
  const bool terms = f.gate.alpha != nullptr || f.windows != nullptr;
  const bool ws = bwd_sm90_enabled() && sm90::bwd_ws_supports(a);
  const bool ordered_dq = ws && deterministic && !exact && a.dq_accum != nullptr && sm90::bwd_ws_orders_dq_adds(a);
  if (ordered_dq) deterministic = false;  // dQ through dq_accum, the adds in key block order
  else if (deterministic) a.dq_accum = nullptr;
  a.row_m = f.lse;
  a.row_log2l = nullptr;
  if (exact) {
    a.stats_m = a.dq_accum;  // laid out like lse, H * q_rows each; dq_accum holds q_rows * H * D >= 8 * H * q_rows floats
    a.stats_log2l = a.dq_accum + H * q_rows;
    a.row_m = a.stats_m;
    a.row_log2l = a.stats_log2l;
    a.dq_accum = nullptr;
    deterministic = true;  // dQ from the query-major kernel
  }

  // dq_accum starts at zero: in a dense batch the preprocessing below zeroes it row by row (every
  // row has its Delta); a packed batch's rows past its last sequence have none, so the memset.
  const bool zero_in_preprocess = !deterministic && !exact && f.cu_seqlens_q == nullptr;
  if (!deterministic && q_rows * H > 0 && !zero_in_preprocess)
    check_cuda(cudaMemsetAsync(a.dq_accum, 0, size_t(q_rows * H * D) * sizeof(float), stream), "cudaMemsetAsync(dq_accum)");
  const bool accum_used = a.dbias != nullptr && B > 0 && Sk > 0 &&
                          (a.dbias_mode == kDbAccum || (a.dbias_mode == kDbColSum && a.db_colsum_to_accum));
  const int64_t dbias_numel = a.bsize_b * a.bsize_h * a.bsize_q * a.bsize_k;
  if (accum_used && dbias_numel > 0)
    check_cuda(cudaMemsetAsync(a.dbias_accum, 0, size_t(dbias_numel) * sizeof(float), stream), "cudaMemsetAsync(dbias_accum)");

  if (q_rows * H > 0 && !exact) {
    bwd_preprocess<Element, kHeadDim><<<dim3(unsigned((Sq + 15) / 16), unsigned(H), unsigned(B)), 128, 0, stream>>>(
        a, zero_in_preprocess ? a.dq_accum : nullptr);
    check_cuda(cudaGetLastError(), "backward preprocess launch");
  }
  auto write_dbias = [&](bool from_accum) {
    if (dbias_numel == 0) return;
    const int blocks = bwd_grid_stride_blocks(dbias_numel, 256);
    if (f.bias_fp32) bwd_write_dbias<float><<<blocks, 256, 0, stream>>>(a, from_accum);
    else bwd_write_dbias<Element><<<blocks, 256, 0, stream>>>(a, from_accum);
    check_cuda(cudaGetLastError(), "backward dbias write launch");
  };
  // Nothing reaches dbias when there is no batch or no key: all zeros.
  const bool dbias_all_zero = a.dbias != nullptr && (a.dbias_mode == kDbNone || B == 0 || Sk == 0);
  if (dbias_all_zero) write_dbias(false);

  // Key ends are tested only by the mask / bias kernels (score_mask.h).
  const bool mask_or_bias = f.mask.ptr != nullptr || f.bias.ptr != nullptr || f.kpos.ends != nullptr || terms;
  // (an empty problem -- no query, keys to write dK = dV = 0 for -- takes the sm80-class kernel:
  // it has nothing to compute)
  bool sm90 = false;
  if constexpr (kHeadDim == 128) sm90 = !terms && bwd_sm90_enabled() && Sq > 0;
  const bool softcap = f.softcap != 0.f;
  // The Hopper kernel's bias fast path (bwd_kernel_sm90's kBiasPath): a 16-bit bias alone, its
  // rows on the 16-byte cp.async path (unit key stride, aligned rows; a dense batch, whose key
  // offset is 0), whose dbias is written tile by tile (kDbDirect), reduced over the queries in the
  // CTA (kDbColSum) or not wanted; a reduction over heads / batch (kDbAccum) stays on the general
  // kernel. DMATTN_BWD_SM90_BIAS=0 turns it off (comparisons).
  bool bias16 = false;
  if constexpr (kHeadDim == 128) {
    static const bool bias16_off = sm90::env_switched_off("DMATTN_BWD_SM90_BIAS");
    bias16 = sm90 && !bias16_off && f.bias.ptr != nullptr && !f.bias_fp32 && f.bias.vec && f.cu_seqlens_k == nullptr &&
             f.mask.ptr == nullptr && f.kpos.ends == nullptr && !softcap && a.dbias_mode != kDbAccum;
  }
  int smem = Tile::smem_bytes(f.mask.ptr != nullptr, f.bias.ptr != nullptr, f.bias_fp32);
  int smem_main = bias16 ? TileSm90::bias16_smem_bytes()
                  : sm90 ? TileSm90::smem_bytes(f.mask.ptr != nullptr, f.bias.ptr != nullptr, f.bias_fp32, a.exp_flags)
                         : smem;
  static_assert(TileSm90::kBlockN == Tile::kBlockN || kHeadDim != 128);
  // (the grid's key blocks serve the warp-specialized kernel too)
  static_assert(sm90::BwdWsTile<Element, kHeadDim, sm90::BwdWsScores::kPlain>::kBlockN == Tile::kBlockN);
  if (f.kpos.ptr) {  // gathered keys: the key block's positions (kBlockN int32) at the end,
    // at one offset for every kernel of the pass (the launches share the argument block)
    a.f.smem_kpos_off = smem > smem_main ? smem : smem_main;
    // (and the key ends' tile right after it: key_positions.h)
    smem = smem_main = a.f.smem_kpos_off + 2 * Tile::kBlockN * 4;
  }
  auto launch = [&](auto kernel, dim3 grid, const char* what) {
    launch_kernel(kernel, grid, Tile::kNThreads, smem, stream, a, what);
  };
  const dim3 q_grid(unsigned((Sq + Tile::kBlockM - 1) / Tile::kBlockM), unsigned(H), unsigned(B));
  if (exact && q_rows * H > 0)
    launch_bwd_dq<Element, kHeadDim>(a, q_grid, smem, /*stats=*/true, mask_or_bias, terms, softcap, stream);
  const int64_t n_blocks = (Sk + Tile::kBlockN - 1) / Tile::kBlockN;
  // The gate's dalpha accumulator: zeroed (every slice; a key block that reaches no row of a
  // query block leaves it 0), then summed into dalpha after the kernels (bwd_parts.h).
  const int64_t dalpha_n = H * q_rows;
  if (a.dalpha != nullptr && dalpha_n > 0) {
    check(a.dalpha_slices == 1 || a.dalpha_slices >= n_blocks, ErrorKind::kValue,
          "dalpha_accum: deterministic mode needs a slice per key block of ", Tile::kBlockN, " (", n_blocks,
          "), got ", a.dalpha_slices);
    check_cuda(cudaMemsetAsync(a.dalpha_accum, 0, size_t(a.dalpha_slices * dalpha_n) * sizeof(float), stream),
               "cudaMemsetAsync(dalpha_accum)");
  }
  if (n_blocks > 0 && B > 0) {
    const dim3 grid(unsigned(n_blocks), a.fold_heads ? 1u : unsigned(a.num_heads_kv), a.fold_batch ? 1u : unsigned(B));
    // The Hopper kernel's CTA order (cta_order.h): (kv head, batch) pairs G at a time, key blocks
    // slowest inside a group. DMATTN_BWD_CTA_GROUP=G overrides the default (read on every call, so
    // that one process can time several orders). Ordered dQ adds (deterministic mode): a CTA
    // waits for the previous key block of its pair. Where a key block's first query block grows
    // with it (causal, a right window bound), each wait costs that many query blocks of work: every
    // pair goes in one group (the CTAs resident at once are a few key blocks of each
    // pair: short chains of waits); otherwise the waits are short and 4 pairs at a time keep
    // more of their Q / dO in L2 (docs/design.md).
    const int pairs = int(grid.y * grid.z);
    int cta_group = ordered_dq ? (f.window_right >= 0 ? pairs : 4)
                    : sm90 || ws ? bwd_cta_group_default(f, int(n_blocks))
                                 : 1;
    if (const char* env = std::getenv("DMATTN_BWD_CTA_GROUP")) cta_group = std::atoi(env);
    const dim3 grid90 = bwd_cta_grid(bwd_cta_group_size(cta_group, pairs), int(n_blocks), pairs);
    auto launch_main = [&](auto mask_bias, auto softcap_on) {
      constexpr bool kMB = decltype(mask_bias)::value, kSC = decltype(softcap_on)::value;
      if constexpr (kHeadDim == 128) {
        if (bias16 || sm90) {
          launch_bwd_sm90<Element>(a, grid90, smem_main, bias16, kMB, kSC, stream);
          return;
        }
      }
      if (terms) {  // (the variant that reads the gate and windows with sinks; score_terms.h)
        if constexpr (kMB) launch(bwd_kernel<Tile, true, kSC, true>, grid, "backward kernel (gate / windows)");
        return;
      }
      launch(bwd_kernel<Tile, kMB, kSC>, grid, "backward kernel");
    };
    using T = std::true_type;
    using F = std::false_type;
    if (ws) {
      sm90::launch_bwd_ws<Element, kHeadDim>(a, grid90, ordered_dq, stream);
    } else if (mask_or_bias) {
      if (softcap) launch_main(T{}, T{});
      else launch_main(T{}, F{});
    } else {
      if (softcap) launch_main(F{}, T{});
      else launch_main(F{}, F{});
    }
  }
  if (q_rows * H > 0) {
    if (deterministic) {
      launch_bwd_dq<Element, kHeadDim>(a, q_grid, smem, /*stats=*/false, mask_or_bias, terms, softcap, stream);
    } else {
      const int blocks = bwd_grid_stride_blocks(q_rows * H * (D / 8), 256);
      bwd_convert_dq<Element><<<blocks, 256, 0, stream>>>(a);
      check_cuda(cudaGetLastError(), "backward dq convert launch");
    }
  }
  if (accum_used && !dbias_all_zero) write_dbias(true);
  if (a.dalpha != nullptr && dalpha_n > 0) {
    store_dalpha<Element><<<bwd_grid_stride_blocks(dalpha_n, 256), 256, 0, stream>>>(
        a.dalpha_accum, a.dalpha_slices, dalpha_n, f.lse_bs, f.lse_hs, a.dalpha, a.dalpha_bs, a.dalpha_rs, a.dalpha_hs,
        f.gate.alpha_fp32);
    check_cuda(cudaGetLastError(), "backward dalpha store launch");
  }
}

}  // namespace dmattn::cuda

#define DMATTN_INSTANTIATE_BWD(Element, HD) \
  template void dmattn::cuda::run_bwd<Element, HD>(const dmattn::cuda::BwdArgs&, bool, bool, cudaStream_t);
#define DMATTN_INSTANTIATE_BWD_WS(Element, HD) \
  template void dmattn::cuda::sm90::launch_bwd_ws<Element, HD>(const dmattn::cuda::BwdArgs&, dim3, bool, cudaStream_t);
#define DMATTN_INSTANTIATE_BWD_WS_GATE(Element)               \
  template DMATTN_BWD_WS_GATE_LAUNCH(Element, 64, false, false); \
  template DMATTN_BWD_WS_GATE_LAUNCH(Element, 64, true, false); \
  template DMATTN_BWD_WS_GATE_LAUNCH(Element, 128, false, false); \
  template DMATTN_BWD_WS_GATE_LAUNCH(Element, 128, true, false); \
  template DMATTN_BWD_WS_GATE_LAUNCH(Element, 64, false, true); \
  template DMATTN_BWD_WS_GATE_LAUNCH(Element, 64, true, true); \
  template DMATTN_BWD_WS_GATE_LAUNCH(Element, 128, false, true); \
  template DMATTN_BWD_WS_GATE_LAUNCH(Element, 128, true, true);
#define DMATTN_INSTANTIATE_BWD_WS_PLAIN_GATE(Element)                     \
  template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(Element, 64, false, false);  \
  template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(Element, 64, true, false);   \
  template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(Element, 128, false, false); \
  template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(Element, 128, true, false);  \
  template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(Element, 64, false, true);   \
  template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(Element, 64, true, true);    \
  template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(Element, 128, false, true);  \
  template DMATTN_BWD_WS_PLAIN_GATE_LAUNCH(Element, 128, true, true);
#endif
