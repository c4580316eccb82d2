// The parts of the key-block-major backward kernel that do not depend on how its products are
// computed, shared by the sm80-class kernel (bwd_kernel.h, mma.sync) and the Hopper kernel
// (sm90/bwd_kernel_sm90.h, wgmma): dQ atomics, dbias from the dS registers or from the dS tile
// in shared memory, column sums of a query-broadcast dbias, the dbias rows no query block
// reached, and the dK / dV stores. Both kernels' accumulators have mma.sync's per-quad
// ownership (rows r and r + 8, column pairs), which is all these parts rely on.
#pragma once

#include <cute/tensor.hpp>

#include "cuda/common/bwd_args.h"
#include "cuda/common/bwd_common.h"
#include "cuda/common/seq_bounds.h"

namespace dmattn::cuda {

// Fire-and-forget fp32 reduction of 4 consecutive floats (16-byte aligned).
__device__ __forceinline__ void red_add4(float* p, float x, float y, float z, float w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
#else
  atomicAdd(p, x);
  atomicAdd(p + 1, y);
  atomicAdd(p + 2, z);
  atomicAdd(p + 3, w);
#endif
}

// Row statistics of one query block (m, log2 l when present, Delta: kBlockM floats each) into
// shared memory, issued with the block's Q / dO loads (cp.async, 4 bytes per row), so that the
// products do not wait on their global loads: read back by bwd_load_row_stats, which ignores rows
// past rows_valid (left unwritten here). Layout: [m | log2 l | Delta], kBlockM floats each.
template <int kBlockM, int kThreads>
__device__ __forceinline__ void bwd_row_stats_async(float* s_stats, const float* g_m, const float* g_log2l,
                                                    const float* g_delta, int rows_valid, int tid) {
  for (int i = tid; i < 3 * kBlockM; i += kThreads) {
    const int which = i / kBlockM, row = i % kBlockM;
    const float* src = which == 0 ? g_m : which == 1 ? g_log2l : g_delta;
    if (src != nullptr && row < rows_valid) {
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(s_stats + i));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src + row));
    }
  }
}

// dq_accum rows [0, rows_valid) of one query block += acc_dq (coord: its (row, col) in the
// block). Each accumulator quad holds (r, c..c+1) and (r+8, c..c+1); lanes 2k and 2k+1 trade
// halves so that each issues one 16-byte reduction: the even lane (r, c..c+3), the odd lane
// (r+8, c-2..c+1).
template <class Acc, class C>
__device__ __forceinline__ void bwd_dq_atomic_add(Acc const& acc_dq, C const& coord, float* gdq, int64_t dq_rs,
                                                  int rows_valid, int head_dim, int tid) {
  using namespace cute;
  const bool odd = tid & 1;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += 4) {
    const float s0 = odd ? acc_dq(i) : acc_dq(i + 2);
    const float s1 = odd ? acc_dq(i + 1) : acc_dq(i + 3);
    const float r0 = __shfl_xor_sync(0xffffffff, s0, 1);
    const float r1 = __shfl_xor_sync(0xffffffff, s1, 1);
    const int row = get<0>(coord(i)) + (odd ? 8 : 0);
    const int col = get<1>(coord(i)) - (odd ? 2 : 0);
    if (row < rows_valid && col < head_dim) {
      if (odd) red_add4(gdq + row * dq_rs + col, r0, r1, acc_dq(i + 2), acc_dq(i + 3));
      else red_add4(gdq + row * dq_rs + col, acc_dq(i), acc_dq(i + 1), r0, r1);
    }
  }
}

// Zeroes dbias rows [r0, r0 + rows) x key columns [n0, n0 + cols) of one (batch, bias head).
template <typename BiasT, int kThreads>
__device__ __forceinline__ void bwd_dbias_zero_rows(const BwdArgs& a, int b, int hb, int r0, int rows, int n0, int cols,
                                                    int tid) {
  BiasT* base = static_cast<BiasT*>(a.dbias) + int64_t(b) * a.db_sb + int64_t(hb) * a.db_sh;
  constexpr int kVec = 16 / int(sizeof(BiasT));
  if (a.db_vec) {
    const int chunks = (cols + kVec - 1) / kVec;
    for (int idx = tid; idx < rows * chunks; idx += kThreads) {
      const int r = idx / chunks, c = (idx % chunks) * kVec;
      BiasT* p = base + int64_t(r0 + r) * a.db_sq + n0 + c;
      if (c + kVec <= cols) {
        *reinterpret_cast<uint4*>(p) = make_uint4(0, 0, 0, 0);
      } else {
        for (int e = 0; e < cols - c; ++e) p[e] = BiasT(0.f);
      }
    }
  } else {
    for (int idx = tid; idx < rows * cols; idx += kThreads) {
      const int r = idx / cols, c = idx % cols;
      base[int64_t(r0 + r) * a.db_sq + int64_t(n0 + c) * a.db_sk] = BiasT(0.f);
    }
  }
}

// dbias from the dS registers of one (query block, column slice) before the softcap chain (the
// bias is added after the softcap): column sums (kDbColSum), fp32 adds (kDbAccum) or direct
// stores (kDbDirect, unless the caller writes them from the dS tile, bwd_dbias_from_tile).
// dp: dS on the accumulator's row/col view, coord the same view of (row, col) in the slice,
// c_off the slice's first column in the key block. colsum holds kSlices slices of the
// thread's columns; slice picks one (a runtime value: the indexing stays static).
template <typename Element, int kSlices, int kN, class DP, class C>
__device__ __forceinline__ void bwd_dbias_from_scores(const BwdArgs& a, bool direct_from_smem, int b, int h, int m0,
                                                      int n0, int c_off, int slice, int rows_valid, int cols,
                                                      DP const& dp, C const& coord, float (&colsum)[kN]) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(dp))::value;
  constexpr int kCols = decltype(size<1>(dp))::value;
  static_assert(kN == kSlices * kCols);
  const FwdArgs& f = a.f;
  const int mode = a.dbias_mode;
  if (mode == kDbColSum) {
    CUTE_UNROLL
    for (int s = 0; s < kSlices; ++s) {
      if (slice != s) continue;
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) colsum[s * kCols + c] += dp(r, c);
      }
    }
  } else if (mode == kDbAccum) {
    const int bb = a.bsize_b == 1 ? 0 : b;
    const int hb = a.bsize_h == 1 ? 0 : h / a.bias_head_div;
    float* base = a.dbias_accum + (int64_t(bb) * a.bsize_h + hb) * a.bsize_q * a.bsize_k;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(coord(r, 0));
      if (row >= rows_valid) continue;
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const int col = c_off + get<1>(coord(r, c));
        if (col < cols) {
          float* p = base + int64_t(m0 + row) * a.bsize_k + n0 + col;
          if (a.db_atomic) atomicAdd(p, dp(r, c));
          else *p += dp(r, c);
        }
      }
    }
  } else if (mode == kDbDirect && !direct_from_smem) {
    const int64_t off0 = int64_t(b) * a.db_sb + int64_t(h) * a.db_sh;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(coord(r, 0));
      if (row >= rows_valid) continue;
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const int col = c_off + get<1>(coord(r, c));
        if (col < cols) {
          const int64_t off = off0 + int64_t(m0 + row) * a.db_sq + int64_t(n0 + col) * a.db_sk;
          if (f.bias_fp32) store_sat(static_cast<float*>(a.dbias) + off, dp(r, c));
          else store_sat(static_cast<Element*>(a.dbias) + off, dp(r, c));
        }
      }
    }
  }
}

// kDbDirect with a 16-bit bias and no softcap: the (kBlockM, kBlockN) dS tile, already converted
// in shared memory, is the dbias tile (coalesced stores). sdS: any layout whose rows hold
// 8-element contiguous chunks.
template <typename Element, int kBlockM, int kBlockN, int kThreads, class SdS>
__device__ __forceinline__ void bwd_dbias_from_tile(const BwdArgs& a, SdS const& sdS, int b, int h, int m0, int n0,
                                                    int rows_valid, int cols, int tid) {
  Element* gdb = static_cast<Element*>(a.dbias) + int64_t(b) * a.db_sb + int64_t(h) * a.db_sh + int64_t(m0) * a.db_sq +
                 int64_t(n0) * a.db_sk;
  if (a.db_vec) {
    constexpr int kChunksPerRow = kBlockN / 8;
    CUTE_UNROLL
    for (int it = 0; it < kBlockM * kChunksPerRow / kThreads; ++it) {
      const int idx = it * kThreads + tid;
      const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
      if (r < rows_valid && c < cols) {
        Element* p = gdb + int64_t(r) * a.db_sq + c;
        if (c + 8 <= cols) {
          *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&sdS(r, c));
        } else {
          for (int e = 0; e < cols - c; ++e) p[e] = sdS(r, c + e);
        }
      }
    }
  } else {
    for (int idx = tid; idx < kBlockM * kBlockN; idx += kThreads) {
      const int r = idx / kBlockN, c = idx % kBlockN;
      if (r < rows_valid && c < cols) gdb[int64_t(r) * a.db_sq + int64_t(c) * a.db_sk] = sdS(r, c);
    }
  }
}

// Column sums of one (batch, bias head), reduced over the CTA, then stored or added. The
// kWarpsPerCol warps that share a set of columns (warp % kWarpsPerCol tells them apart) each
// write their own row of s_col ([kWarpsPerCol][kBlockN] floats), summed in a fixed order:
// deterministic. coord: the (row, col) view of one slice of kHalfN columns; colsum holds
// kN / kCols slices. Clears colsum.
// The first half of a column-sum flush: each thread's column sums reduced over its warp's rows
// (lanes 4 apart share columns), one row of s_col per warp of the kWarpsPerCol that share the
// columns; visible after the barrier.
template <int kBlockN, int kHalfN, int kWarpsPerCol, int kN, class C>
__device__ __forceinline__ void bwd_colsum_to_smem(float (&colsum)[kN], C const& coord, float* s_col, int tid) {
  using namespace cute;
  constexpr int kCols = decltype(size<1>(coord))::value;
  CUTE_UNROLL
  for (int c = 0; c < kN; ++c) {
    float v = colsum[c];
    v += __shfl_xor_sync(0xffffffff, v, 4);
    v += __shfl_xor_sync(0xffffffff, v, 8);
    v += __shfl_xor_sync(0xffffffff, v, 16);
    colsum[c] = v;
  }
  if ((tid & 31) < 4) {
    float* row = s_col + ((tid / 32) % kWarpsPerCol) * kBlockN;
    CUTE_UNROLL
    for (int c = 0; c < kN; ++c) row[(c / kCols) * kHalfN + get<1>(coord(0, c % kCols))] = colsum[c];
  }
  __syncthreads();
}

// One key's column sum of a query-broadcast dbias (key: its row from the batch slice's first; bb,
// hb: the bias's batch and head), stored into dbias (its dtype) or added into its fp32
// accumulator (atomically where several CTAs add into it).
template <typename Element>
__device__ __forceinline__ void store_dbias_colsum(const BwdArgs& a, int bb, int hb, int key, float v) {
  if (a.db_colsum_to_accum) {
    float* p = a.dbias_accum + (int64_t(bb) * a.bsize_h + hb) * a.bsize_k + key;
    if (a.db_atomic) atomicAdd(p, v);
    else *p += v;
  } else {
    const int64_t off = int64_t(bb) * a.db_sb + int64_t(hb) * a.db_sh + int64_t(key) * a.db_sk;
    if (a.f.bias_fp32) store_sat(static_cast<float*>(a.dbias) + off, v);
    else store_sat(static_cast<Element*>(a.dbias) + off, v);
  }
}

template <typename Element, int kBlockN, int kHalfN, int kWarpsPerCol, int kThreads, int kN, class C>
__device__ __forceinline__ void bwd_colsum_flush(const BwdArgs& a, float (&colsum)[kN], C const& coord, float* s_col,
                                                 int b, int h, int n0, int cols, int tid) {
  const FwdArgs& f = a.f;
  bwd_colsum_to_smem<kBlockN, kHalfN, kWarpsPerCol>(colsum, coord, s_col, tid);
  const int bb = a.bsize_b == 1 ? 0 : b;
  const int hb = a.bsize_h == 1 ? 0 : h / a.bias_head_div;
  const int k0 = SeqBounds(f, b).k0();
  for (int c = tid; c < cols; c += kThreads) {
    float v = s_col[c];
    CUTE_UNROLL
    for (int w = 1; w < kWarpsPerCol; ++w) v += s_col[w * kBlockN + c];
    store_dbias_colsum<Element>(a, bb, hb, k0 + n0 + c, v);
  }
  CUTE_UNROLL
  for (int c = 0; c < kN; ++c) colsum[c] = 0.f;
  __syncthreads();
}

// The gate's ddelta of key block n0 of kv head kvh, batch b (score_terms.h): the CTA's column
// sums of G alpha, reduced as bwd_colsum_flush's, stored into ddelta (every key of the block: the
// CTA walked every query head of the group and every query block that reaches it; 0 where none
// did). Clears gcol.
// ddelta of keys [n0, n0 + cols) of batch b's sequence, kv head kvh, from column sums staged in
// shared memory (s_col: kWarpsPerCol rows of kBlockN floats, summed in a fixed order), in
// delta's layout and dtype; thread tid of kThreads.
template <typename Element, int kBlockN, int kWarpsPerCol, int kThreads>
__device__ __forceinline__ void store_ddelta_sums(const BwdArgs& a, const float* s_col, int b, int kvh, int n0,
                                                  int cols, int tid) {
  const int k0 = SeqBounds(a.f, b).k0();
  for (int c = tid; c < cols; c += kThreads) {
    float v = s_col[c];
    CUTE_UNROLL
    for (int w = 1; w < kWarpsPerCol; ++w) v += s_col[w * kBlockN + c];
    const int64_t off = int64_t(b) * a.ddelta_bs + int64_t(k0 + n0 + c) * a.ddelta_rs + int64_t(kvh) * a.ddelta_hs;
    if (a.f.gate.delta_fp32) static_cast<float*>(a.ddelta)[off] = v;
    else store_sat(static_cast<Element*>(a.ddelta) + off, v);
  }
}

template <typename Element, int kBlockN, int kHalfN, int kWarpsPerCol, int kThreads, int kN, class C>
__device__ __forceinline__ void bwd_ddelta_flush(const BwdArgs& a, float (&gcol)[kN], C const& coord, float* s_col,
                                                 int b, int kvh, int n0, int cols, int tid) {
  bwd_colsum_to_smem<kBlockN, kHalfN, kWarpsPerCol>(gcol, coord, s_col, tid);
  store_ddelta_sums<Element, kBlockN, kWarpsPerCol, kThreads>(a, s_col, b, kvh, n0, cols, tid);
  CUTE_UNROLL
  for (int c = 0; c < kN; ++c) gcol[c] = 0.f;
  __syncthreads();
}

// The gate's dalpha of one (query block, key block) tile, in two halves around a barrier of the
// CTA. Stage: each thread's row sums of G delta reduced over its quad (lanes 1 and 2 apart share
// rows), one row of s_rows ([warps along the columns][kBlockM] floats) per warp sharing the rows.
template <int kBlockM, int kWarpsPerCol, int kRows, class C>
__device__ __forceinline__ void bwd_dalpha_stage(float (&grow)[kRows], C const& coord, float* s_rows, int tid) {
  using namespace cute;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    float v = grow[r];
    v += __shfl_xor_sync(0xffffffff, v, 1);
    v += __shfl_xor_sync(0xffffffff, v, 2);
    if ((tid & 3) == 0) s_rows[((tid / 32) / kWarpsPerCol) * kBlockM + get<0>(coord(r, 0))] = v;
  }
}

// Add: the staged sums of the kWarpsAlongN warps summed in a fixed order per row, then into
// dalpha_accum (laid out like lse): stored into the key block's own slice (deterministic; the
// slices are zeroed before the kernel), or added atomically into the one slice.
template <int kBlockM, int kWarpsAlongN, int kThreads>
__device__ __forceinline__ void bwd_dalpha_add(const BwdArgs& a, const float* s_rows, const SeqBounds& seq, int h,
                                               int m0, int rows_valid, int n_block, int tid) {
  for (int row = tid; row < rows_valid; row += kThreads) {
    float v = s_rows[row];
    CUTE_UNROLL
    for (int w = 1; w < kWarpsAlongN; ++w) v += s_rows[w * kBlockM + row];
    const int64_t n = int64_t(a.f.num_heads) * a.f.q_rows;
    float* p = a.dalpha_accum + seq.stat_offset(h) + m0 + row;
    if (a.dalpha_slices > 1) p[n * n_block] = v;
    else atomicAdd(p, v);
  }
}

// dalpha from its fp32 accumulator (laid out like lse: `slices` slices of H * q_rows, summed in
// order), converted into alpha's layout and dtype (Element or fp32), one thread per element.
template <typename Element>
__global__ void store_dalpha(const float* accum, int64_t slices, int64_t n, int64_t lse_bs, int64_t lse_hs,
                             void* dalpha, int64_t bs, int64_t rs, int64_t hs, bool fp32) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    float v = 0.f;
    for (int64_t s = 0; s < slices; ++s) v += accum[s * n + e];
    const int64_t b = lse_bs > 0 ? e / lse_bs : 0, rem = lse_bs > 0 ? e % lse_bs : e;
    const int64_t h = rem / lse_hs, i = rem % lse_hs;
    const int64_t off = b * bs + i * rs + h * hs;
    if (fp32) static_cast<float*>(dalpha)[off] = v;
    else store_sat(static_cast<Element*>(dalpha) + off, v);
  }
}

// kDbDirect: the dbias rows of query blocks outside [m_lo, m_hi) (no query there reaches this
// key block) are zero; written here for every query head of the kv head's group.
template <typename Element, int kBlockM, int kThreads>
__device__ __forceinline__ void bwd_dbias_zero_unreached(const BwdArgs& a, const SeqBounds& seq, int b, int kvh,
                                                         int m_lo, int m_hi, int n0, int cols, int tid) {
  const int m_blocks = (seq.len_q() + kBlockM - 1) / kBlockM;
  for (int h = kvh * a.f.group; h < (kvh + 1) * a.f.group; ++h) {
    for (int m = 0; m < m_blocks; ++m) {
      if (m >= m_lo && m < m_hi) continue;
      const int m0 = m * kBlockM;
      const int rows = seq.rows_valid(m0, kBlockM);
      if (a.f.bias_fp32) bwd_dbias_zero_rows<float, kThreads>(a, b, h, m0, rows, n0, cols, tid);
      else bwd_dbias_zero_rows<Element, kThreads>(a, b, h, m0, rows, n0, cols, tid);
    }
  }
}

// kDbDirect, by one warp of a dense batch whose dbias rows take 16-byte stores (db_vec, a 16-bit
// bias): the dbias rows of query blocks outside [m_lo, m_hi) are zero, for every query head of
// the kv head's group. Rows [0, lo_end) then [hi_begin, len_q) as one list (hi_begin >= lo_end),
// two rows a pass, a lane per 16-byte chunk of the 128 columns (the warp-specialized Hopper
// backward's zeroing warp, which has 40 registers: one loop, the row found per pass).
template <typename Element, int kBlockM>
__device__ __forceinline__ void bwd_dbias_zero_unreached_warp(const BwdArgs& a, int b, int kvh, int m_lo, int m_hi,
                                                              int n0, int cols, int lane) {
  static_assert(sizeof(Element) == 2, "16-byte chunks of 8 elements, 16 per 128 keys");
  const int len_q = a.f.seqlen_q;
  const int lo_end = min(m_lo * kBlockM, len_q), hi_begin = max(lo_end, min(m_hi * kBlockM, len_q));
  const int rows = lo_end + (len_q - hi_begin);
  const int c = (lane % 16) * 8;
  if (c >= cols) return;
  for (int h = kvh * a.f.group; h < (kvh + 1) * a.f.group; ++h) {
    Element* col = static_cast<Element*>(a.dbias) + int64_t(b) * a.db_sb + int64_t(h) * a.db_sh + n0 + c;
    for (int i = lane / 16; i < rows; i += 2) {
      Element* p = col + int64_t(i < lo_end ? i : hi_begin + (i - lo_end)) * a.db_sq;
      if (c + 8 <= cols) {
        *reinterpret_cast<uint4*>(p) = make_uint4(0, 0, 0, 0);
      } else {
        for (int k = 0; k < cols - c; ++k) p[k] = Element(0.f);
      }
    }
  }
}

// dK / dV of one key block: staged (already converted) in shared memory (sdK, sdV: any layout
// whose rows hold 8-element contiguous chunks), written with 16-byte stores, rows [0, cols).
template <typename Element, int kBlockN, int kHeadDim, int kThreads, class SK, class SV>
__device__ __forceinline__ void bwd_store_dkdv(SK const& sdK, SV const& sdV, Element* gdK, int64_t dk_rs, Element* gdV,
                                               int64_t dv_rs, int cols, int head_dim, int tid) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  CUTE_UNROLL
  for (int it = 0; it < kBlockN * kChunksPerRow / kThreads; ++it) {
    const int idx = it * kThreads + tid;
    const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
    if (r < cols && c < head_dim) {
      *reinterpret_cast<uint4*>(gdK + int64_t(r) * dk_rs + c) = *reinterpret_cast<const uint4*>(&sdK(r, c));
      *reinterpret_cast<uint4*>(gdV + int64_t(r) * dv_rs + c) = *reinterpret_cast<const uint4*>(&sdV(r, c));
    }
  }
}

// An fp32 accumulator of a (rows, head_dim) tile times `scale`, saturated to Element
// (pack_saturated), written to global rows [0, rows) (row stride `rs`) as the pairs of
// adjacent columns each thread holds.
template <typename Element, class Acc, class C>
__device__ __forceinline__ void bwd_store_acc_pairs(Acc const& acc, C const& coord, Element* g, int64_t rs, int rows,
                                                    int head_dim, float scale) {
  using namespace cute;
  using Info = ElemInfo<Element>;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int r = get<0>(coord(i)), c = get<1>(coord(i));
    if (r < rows && c < head_dim) {
      *reinterpret_cast<typename Info::Native2*>(g + int64_t(r) * rs + c) =
          pack_saturated<Element>(acc(i) * scale, acc(i + 1) * scale);
    }
  }
}

}  // namespace dmattn::cuda
