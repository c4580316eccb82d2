// Causal / sliding-window masking (bottom-right aligned, causal already folded into
// window_right = 0): which key blocks a query block can see, which of them need element-wise
// masking, and the per-element test. The bool mask tile itself lives in operand_tile.h.
#pragma once

#include <cstdint>

namespace dmattn::cuda {

struct WindowMask {
  int64_t seqlen_q, seqlen_k, left, right;  // left/right < 0: unbounded

  // Key j allowed for query i (also checks j < seqlen_k).
  __device__ __forceinline__ bool allowed(int64_t i, int64_t j) const {
    const int64_t d = i + seqlen_k - seqlen_q;
    return j < seqlen_k && (left < 0 || j >= d - left) && (right < 0 || j <= d + right);
  }

  // Allowed keys of query i as a column range [lo, hi) relative to key `base`, clamped to
  // [-1, width + 1] so that it fits an int.
  __device__ __forceinline__ void column_range(int64_t i, int64_t base, int width, int& lo, int& hi) const {
    const int64_t d = i + seqlen_k - seqlen_q;
    int64_t l = left < 0 ? 0 : d - left;
    int64_t h = right < 0 ? seqlen_k : min(seqlen_k, d + right + 1);
    l -= base;
    h -= base;
    lo = int(max(int64_t(-1), min(l, int64_t(width) + 1)));
    hi = int(max(int64_t(-1), min(h, int64_t(width) + 1)));
  }

  // Key blocks [n_min, n_max) that may hold an allowed key for queries [m0, m0 + block_m);
  // every other key block is skipped without loading anything. Empty when n_max <= n_min.
  __device__ __forceinline__ void key_block_range(int m0, int block_m, int block_n, int& n_min,
                                                  int& n_max) const {
    const int64_t m_last = (m0 + block_m < seqlen_q ? m0 + block_m : seqlen_q) - 1;
    const int64_t off = seqlen_k - seqlen_q;
    int64_t lo = 0, hi = seqlen_k;  // allowed keys lie in [lo, hi)
    if (left >= 0) lo = max(lo, int64_t(m0) + off - left);
    if (right >= 0) hi = min(hi, m_last + off + right + 1);
    if (hi <= lo) { n_min = n_max = 0; return; }
    n_min = int(lo / block_n);
    n_max = int((hi + block_n - 1) / block_n);
  }

  // Does key block n need the element-wise test (sequence tail or a window edge inside it)?
  __device__ __forceinline__ bool block_needs_mask(int m0, int block_m, int block_n, int n) const {
    const int64_t n0 = int64_t(n) * block_n, n_end = n0 + block_n;  // [n0, n_end)
    const int64_t m_last = (m0 + block_m < seqlen_q ? m0 + block_m : seqlen_q) - 1;
    const int64_t off = seqlen_k - seqlen_q;
    if (n_end > seqlen_k) return true;
    if (right >= 0 && n_end - 1 > int64_t(m0) + off + right) return true;
    if (left >= 0 && n0 < m_last + off - left) return true;
    return false;
  }
};

}  // namespace dmattn::cuda
