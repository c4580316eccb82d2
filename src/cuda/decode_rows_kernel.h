// Split-KV decode for more packed query rows than one 16-row tile (speculative decoding: a few
// queries times the query heads of a kv head; docs/decode.md). One CTA per (64-row chunk, key
// split, kv head, batch): each warp owns one 16-row tile, and every warp reads every key of the
// split from one CTA-wide cp.async ring, so that a K / V row crosses from memory to the SM once
// for the 64 rows (decode_kernel.h, one tile per CTA, would read it once per 16-row chunk).
// The per-tile work (scores, softmax, values) is decode_kernel.h's attend_tile, on tiles of 64
// keys (32 with a mask or bias): four times the keys of decode_kernel.h's steps, so the
// tensor-core products of a tile are independent and the softmax bookkeeping is paid once.
#pragma once

#include "cuda/decode_kernel.h"

namespace dmattn::cuda {

namespace decode_detail {

// Geometry per head-dim bucket kD (64 / 128; at 256 the accumulators of a 16-row tile and the
// ring's addressing spill, so those rows take decode_kernel.h's 16-row chunks): four warps, 64
// rows, q in registers; three stages of 64 keys of K and V: 48 / 96 KB, two CTAs an SM.
template <int kD>
struct DecodeRowsTile {
  static_assert(kD <= kDecodeRowsMaxHeadDim, "decode_rows_kernel: head dims up to 128");
  static constexpr int kWarps = 4;
  static constexpr int kRows = kWarps * kDecodeRows;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStageKeys = 64;
  static constexpr int kStages = 3;
  static constexpr int kChunks = kD / 8;  // 16-byte chunks of a K / V row
  static constexpr int kStageBytes = 2 * kStageKeys * kD * 2;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static_assert(kStageKeys * kChunks % kThreads == 0, "whole chunks per thread");
};

}  // namespace decode_detail

// Grid (row_chunks * num_splits, heads_kv, batch) with 64-row chunks,
// DecodeRowsTile<kD>::kThreads threads and kSmemBytes of dynamic shared memory. kOperands: mask
// / bias entries read from global memory at each 32-key tile (any layout).
template <typename Element, int kD, bool kOperands>
__global__ void __launch_bounds__(decode_detail::DecodeRowsTile<kD>::kThreads, 2)
    decode_rows_kernel(const DecodeArgs a) {
  using namespace decode_detail;
  using Tile = DecodeRowsTile<kD>;
  constexpr int kStageKeys = Tile::kStageKeys, kStages = Tile::kStages, kChunks = Tile::kChunks;
  constexpr int kNd = kD / 8;

  const int chunk = blockIdx.x % a.row_chunks, split = blockIdx.x / a.row_chunks;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int total_rows = a.seqlen_q * a.group;
  const int c0 = chunk * Tile::kRows;
  const int cta_rows = min(Tile::kRows, total_rows - c0);
  // The warp's tile; a warp past the chunk's rows only helps with the copies.
  const int r0 = c0 + warp * kDecodeRows;
  const int nrows = min(kDecodeRows, total_rows - r0);
  const bool computes = nrows > 0;

  // Splits on whole stages, so that a stage never straddles two.
  const SplitKeys keys = split_keys(a, b, c0, cta_rows, split, kStageKeys);
  const int kb = keys.begin, ke = keys.end;

  int row_i[2], row_h[2];
  accumulator_rows(a, kvh, computes ? r0 : c0, computes ? nrows : 1, lane, row_i, row_h);

  // q's A fragments of the warp's tile in registers (decode_kernel.h's layout; 0 past its rows).
  extern __shared__ __align__(16) char decode_smem[];
  uint32_t qa[kD / 16][4];
  load_q_fragments<Element>(a, b, kvh, r0, nrows, lane, qa);
  const auto q_fragment = [&](int ks, uint32_t (&f)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) f[e] = qa[ks][e];
  };

  float o[kNd][4];
#pragma unroll
  for (int dn = 0; dn < kNd; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  // The CTA's threads copy stage it (keys kb + it * kStageKeys onwards) together; keys past the
  // split's end are zero-filled, never read (their rows may lie behind the batch's length).
  const auto stage_k = [&](int it) {
    return reinterpret_cast<Element*>(decode_smem + (it % kStages) * Tile::kStageBytes);
  };
  const int stages = ke > kb ? (ke - kb + kStageKeys - 1) / kStageKeys : 0;
  const Element* kbase = static_cast<const Element*>(a.k);
  const Element* vbase = static_cast<const Element*>(a.v);
  const auto issue = [&](int it) {
    if (it < stages) {
      const int jt = kb + it * kStageKeys;
      Element* sk = stage_k(it);
      Element* sv = sk + kStageKeys * kD;
#pragma unroll 2
      for (int u = 0; u < kStageKeys * kChunks / Tile::kThreads; ++u) {
        const int idx = u * Tile::kThreads + threadIdx.x, r = idx / kChunks, c = idx % kChunks;
        const int j = jt + r;
        const bool ok = j < ke && c * 8 < a.head_dim;
        KeyRow at{0, 0};
        if (ok) at = key_row(a, b, kvh, j);
        const int so = tile_offset<kD>(r, c);
        cp_async_16(sk + so, kbase + at.k + c * 8, ok ? 16 : 0);
        cp_async_16(sv + so, vbase + at.v + c * 8, ok ? 16 : 0);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) issue(st);

  // The stage's keys in tiles of kTileKeys (the whole stage; 32 keys with operands, whose 16 + 16
  // entries a thread holds in registers).
  constexpr int kTileKeys = kOperands ? 32 : kStageKeys;
  const OperandRows op_rows = operand_rows(a, b, row_h, row_i);
  StepOperandsOf<kTileKeys> op;
  for (int it = 0; it < stages; ++it) {
    cp_async_wait<kStages - 2>();  // the thread's copies of stage it have landed
    __syncthreads();               // ... and everyone's; every warp is done with the slot refilled next
    issue(it + kStages - 1);
    if (!computes) continue;
    const Element* sk = stage_k(it);
    const Element* sv = sk + kStageKeys * kD;
#pragma unroll 1
    for (int sub = 0; sub < kStageKeys / kTileKeys; ++sub) {
      const int jt = kb + it * kStageKeys + sub * kTileKeys;
      if (jt >= ke) break;
      if constexpr (kOperands) load_step_operands(a, op_rows, jt, ke, lane, op);
      attend_tile<Element, kD, kOperands, kTileKeys>(a, sk + sub * kTileKeys * kD, sv + sub * kTileKeys * kD, jt, ke,
                                                     keys.off, row_i, op, q_fragment, m, l, o, lane);
    }
  }
  cp_async_wait<0>();
  if (!computes) return;

  // The warp's rows are complete over the split: normalized here (no merge across warps).
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = lane / 4 + 8 * hf;
    const float sum = quad_sum(l[hf]);
    if (r >= nrows) continue;
    // An empty row (no allowed key in this split) is 0 with lse -inf; a NaN sum stays NaN.
    const bool empty = sum == 0.f;
    const float mu = m[hf] == -INFINITY ? 0.f : m[hf];
    const float lse = empty ? -INFINITY : (mu + __log2f(sum)) * 0.6931471805599453f;
    const int row = r0 + r, qi = row / a.group, h = kvh * a.group + row % a.group;
    const int64_t prow = ((int64_t(split) * a.batch + b) * a.num_heads + h) * a.seqlen_q + qi;
    Element* dst =
        static_cast<Element*>(a.out) + b * a.o_st.batch_stride + qi * a.o_st.row_stride + h * a.o_st.head_stride;
#pragma unroll
    for (int dn = 0; dn < kNd; ++dn) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int d = dn * 8 + (lane % 4) * 2 + e;
        if (d >= a.head_dim) continue;
        const float out = empty ? 0.f : o[dn][2 * hf + e] / sum;
        if (a.num_splits == 1) dst[d] = Element(saturate_keep_nan<Element>(out));
        else a.part_out[prow * a.head_dim + d] = out;
      }
    }
    if (lane % 4 == 0) {
      if (a.num_splits == 1) a.lse[b * a.lse_bs + h * a.lse_hs + qi] = lse;
      else a.part_lse[prow] = lse;
    }
  }
}

}  // namespace dmattn::cuda
