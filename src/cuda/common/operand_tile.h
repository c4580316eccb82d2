// Mask and bias tiles: a (kBlockM, kBlockN) window of a broadcast (B, H, Sq, Sk) operand,
// copied to shared memory through the operand's own strides (never expanded in memory) and
// read back in the accumulator layout.
//   vec path:  stride_k == 1 and 16-byte aligned rows -> cp.async, zero-filled tails.
//   else:      element-wise loads (key-broadcast, unaligned or transposed operands).
// A query-broadcast operand (stride_q == 0) loads a single row and reads it for every query.
// Out-of-range elements are zero: mask false, bias 0 (positions are masked separately).
#pragma once

#include "cuda/common/fwd_args.h"
#include "cuda/common/utils.h"

namespace dmattn::cuda {

template <int kBlockM, int kBlockN, int kThreads>
struct OperandTile {
  static constexpr int log2_of(int x) { return x > 1 ? 1 + log2_of(x >> 1) : 0; }
  static constexpr int kLog2BlockN = log2_of(kBlockN);
  const char* base = nullptr;  // element (b, h, m0, 0)
  int64_t stride_q = 0, stride_k = 0;
  int esize = 1, pitch = 0;  // pitch: elements per shared row; 0 for a query-broadcast tile
  bool vec = false;
  int rows_valid = 0;        // query rows of this block inside Sq (1 for a broadcast row)

  // k0: the sequence's first key (packed varlen batches, seq_bounds.h; 0 when dense). Its
  // rows start wherever the previous sequence ended, so the 16-byte cp.async path is kept
  // only when that start is aligned too.
  __device__ __forceinline__ void init(const OperandArgs& a, int b, int h, int m0, int seqlen_q,
                                       int smem_pitch, int k0) {
    esize = a.esize;
    const int64_t key_off = int64_t(k0) * a.stride_k * esize;
    vec = a.vec && (key_off & 15) == 0;
    stride_q = a.stride_q;
    stride_k = a.stride_k;
    base = a.ptr + (int64_t(b) * a.stride_b + int64_t(h / a.head_div) * a.stride_h +
                    int64_t(m0) * a.stride_q) * esize + key_off;
    pitch = a.row_bcast ? 0 : smem_pitch;
    rows_valid = a.row_bcast ? 1 : min(kBlockM, seqlen_q - m0);
  }

  // Issues the copy of key block [n0, n0 + kBlockN) into smem (row pitch `smem_pitch` elements).
  // vec path: cp.async (caller commits); else synchronous stores (visible after a barrier).
  __device__ __forceinline__ void load(char* smem, int smem_pitch, int n0, int seqlen_k, int tid) const {
    const int rows = pitch == 0 ? 1 : kBlockM;
    const int cols_valid = min(kBlockN, seqlen_k - n0);
    if (vec) {
      // esize 1, 2 or 4 and kBlockN a power of two: shifts, not run-time divisions.
      static_assert((kBlockN & (kBlockN - 1)) == 0 && kBlockN >= 16);
      const int log2_esize = esize == 1 ? 0 : esize == 2 ? 1 : 2;
      const int log2_chunk_elems = 4 - log2_esize;
      const int log2_chunks_per_row = kLog2BlockN - log2_chunk_elems;
      const int chunks_per_row = 1 << log2_chunks_per_row;
      const char* g0 = base + int64_t(n0) * esize;
      for (int idx = tid; idx < rows * chunks_per_row; idx += kThreads) {
        const int r = idx >> log2_chunks_per_row, c = (idx & (chunks_per_row - 1)) << log2_chunk_elems;
        int bytes = r < rows_valid ? (cols_valid - c) * esize : 0;
        bytes = bytes < 0 ? 0 : (bytes > 16 ? 16 : bytes);
        const char* src = bytes > 0 ? g0 + (int64_t(r) * stride_q + c) * esize : g0;
        cp_async_16(smem + (r * smem_pitch + c) * esize, src, bytes);
      }
    } else {
      for (int idx = tid; idx < rows * kBlockN; idx += kThreads) {
        const int r = idx / kBlockN, c = idx % kBlockN;
        const bool ok = r < rows_valid && c < cols_valid;
        const char* src = base + (int64_t(r) * stride_q + int64_t(n0 + c) * stride_k) * esize;
        char* dst = smem + (r * smem_pitch + c) * esize;
        if (esize == 1) *reinterpret_cast<uint8_t*>(dst) = ok ? *reinterpret_cast<const uint8_t*>(src) : 0;
        else if (esize == 2) *reinterpret_cast<uint16_t*>(dst) = ok ? __ldg(reinterpret_cast<const uint16_t*>(src)) : 0;
        else *reinterpret_cast<uint32_t*>(dst) = ok ? __ldg(reinterpret_cast<const uint32_t*>(src)) : 0u;
      }
    }
  }

  // load() for the common full-tile cp.async case (vec, not query-broadcast) with the element
  // size known at compile time: constant divisors and offsets, few registers. Same thread ->
  // chunk assignment as load() (own_any() reads it back).
  // kRolled: the chunks in a loop that is not unrolled (one address live at a time, not every
  // chunk's: the sm80-class general forward at head dim 64 spilled on the unrolled one).
  template <int kEsize, bool kRolled = false>
  __device__ __forceinline__ void load_vec_rows(char* smem, int smem_pitch, int n0, int seqlen_k, int tid) const {
    constexpr int kChunkElems = 16 / kEsize;
    constexpr int kChunksPerRow = kBlockN / kChunkElems;
    constexpr int kChunks = kBlockM * kChunksPerRow;
    static_assert(kBlockN % kChunkElems == 0);
    const int t = opaque_int(tid);  // keep the addresses out of the caller's loop-carried registers
    const int cols_valid = min(kBlockN, seqlen_k - n0);
    const char* g0 = base + int64_t(n0) * kEsize;
    constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
#pragma unroll(kRolled ? 1 : kIters)
    for (int it = 0; it < kIters; ++it) {
      const int idx = it * kThreads + t;
      if (kChunks % kThreads != 0 && idx >= kChunks) break;
      const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * kChunkElems;
      int bytes = r < rows_valid ? (cols_valid - c) * kEsize : 0;
      bytes = bytes < 0 ? 0 : (bytes > 16 ? 16 : bytes);
      const char* src = bytes > 0 ? g0 + (int64_t(r) * stride_q + c) * kEsize : g0;
      cp_async_16(smem + (r * smem_pitch + c) * kEsize, src, bytes);
    }
  }

  // load() with the fast path above where it applies.
  template <bool kRolled = false>
  __device__ __forceinline__ void load_any(char* smem, int smem_pitch, int n0, int seqlen_k, int tid) const {
    if (vec && pitch != 0) {
      if (esize == 2) return load_vec_rows<2, kRolled>(smem, smem_pitch, n0, seqlen_k, tid);
      if (esize == 4) return load_vec_rows<4, kRolled>(smem, smem_pitch, n0, seqlen_k, tid);
      if (esize == 1) return load_vec_rows<1, kRolled>(smem, smem_pitch, n0, seqlen_k, tid);
    }
    load(smem, smem_pitch, n0, seqlen_k, tid);
  }

  // load_any() for an operand whose element size is known to be kEsize (a bool mask: 1; a
  // bias: 2 or 4): one fast path instead of three, less code at each call site.
  template <int kEsize>
  __device__ __forceinline__ void load_as(char* smem, int smem_pitch, int n0, int seqlen_k, int tid) const {
    if (vec && pitch != 0) return load_vec_rows<kEsize>(smem, smem_pitch, n0, seqlen_k, tid);
    load(smem, smem_pitch, n0, seqlen_k, tid);
  }

  // After this thread's part of load() completed (cp_async_wait, no barrier needed): is any
  // element this thread copied nonzero? Reads exactly what this thread wrote, so a
  // __syncthreads_or over it tells whether the whole tile has a true mask element (the zero
  // fill beyond Sq / Sk counts as false). For bool masks (esize 1) and any other operand.
  __device__ __forceinline__ bool own_any(const char* smem, int smem_pitch, int tid) const {
    const int rows = pitch == 0 ? 1 : kBlockM;
    bool any = false;
    if (vec) {
      const int chunk_elems = 16 / esize;
      const int chunks_per_row = kBlockN / chunk_elems;
      for (int idx = tid; idx < rows * chunks_per_row; idx += kThreads) {
        const int r = idx / chunks_per_row, c = (idx % chunks_per_row) * chunk_elems;
        const uint4 v = *reinterpret_cast<const uint4*>(smem + (r * smem_pitch + c) * esize);
        any |= (v.x | v.y | v.z | v.w) != 0u;
      }
    } else {
      for (int idx = tid; idx < rows * kBlockN; idx += kThreads) {
        const int r = idx / kBlockN, c = idx % kBlockN;
        const char* p = smem + (r * smem_pitch + c) * esize;
        if (esize == 1) any |= *reinterpret_cast<const uint8_t*>(p) != 0;
        else if (esize == 2) any |= *reinterpret_cast<const uint16_t*>(p) != 0;
        else any |= *reinterpret_cast<const uint32_t*>(p) != 0u;
      }
    }
    return any;
  }
};

}  // namespace dmattn::cuda
