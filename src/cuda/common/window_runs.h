// Windows with sinks on the warp-specialized kernels (docs/semantics.md, "Windows with sinks"):
// one head's row [sink, near, gap, far], the key blocks a query block sees and the query blocks a
// key block meets -- up to three runs each (the sinks, the near band, the far band) -- and a walk
// that visits those runs as one range, so that the kernels' loops, pipeline stages and schedules
// stay those of a contiguous range and only addresses and tests go through BlockWalk::at.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/common/fwd_args.h"

namespace dmattn::cuda {

// A range of blocks as one run of virtual indices: virtual blocks [v_min, v_max) are the runs'
// blocks in order, the top run's at their own index, each run below shifted up by the gaps above
// it. at(v) gives the block. The identity (no gaps) when split1 = split2 = INT_MIN.
struct BlockWalk {
  int split1 = INT_MIN, gap1 = 0, split2 = INT_MIN, gap2 = 0;

  // (volatile: the kernels read a walk where it lies in shared memory, at each use)
  __device__ __forceinline__ int at(int v) const volatile {
    return v - (v < split1 ? gap1 : 0) - (v < split2 ? gap2 : 0);
  }

  // The walk over the union of three block ranges [l0, h0), [l1, h1), [l2, h2) (any order;
  // empty ones, h <= l, ignored; overlapping or touching ones merged) and its virtual range.
  // (Scalars throughout: arrays indexed at run time would live in local memory.)
  __device__ __forceinline__ static BlockWalk of_runs(int l0, int h0, int l1, int h1, int l2, int h2, int& v_min,
                                                      int& v_max) {
    auto mark_empty = [](int& l, int& h) {
      if (h <= l) l = h = INT_MIN;
    };
    mark_empty(l0, h0);
    mark_empty(l1, h1);
    mark_empty(l2, h2);
    auto order = [](int& la, int& ha, int& lb, int& hb) {  // (la, ha) the lower start
      if (lb < la) {
        const int l = la, h = ha;
        la = lb, ha = hb, lb = l, hb = h;
      }
    };
    order(l0, h0, l1, h1);  // (a sorting network by start: empty runs first)
    order(l1, h1, l2, h2);
    order(l0, h0, l1, h1);
    auto merge_up = [](int& la, int& ha, int& lb, int& hb) {  // (la, ha) into (lb, hb) where they meet
      if (la != INT_MIN && ha >= lb) {
        lb = la, hb = max(ha, hb);
        la = ha = INT_MIN;
      }
    };
    merge_up(l0, h0, l1, h1);  // (then run 0, if any, ends below run 1's start, so below run 2's)
    merge_up(l1, h1, l2, h2);
    if (l1 == INT_MIN) {  // (the runs left at the top)
      l1 = l0, h1 = h0;
      l0 = h0 = INT_MIN;
    }
    BlockWalk w;
    if (l2 == INT_MIN) {
      v_min = v_max = 0;
      return w;
    }
    v_max = h2;
    v_min = v_max - (h2 - l2) - (h1 - l1) - (h0 - l0);
    if (l1 != INT_MIN) {
      w.split1 = l2;
      w.gap1 = l2 - h1;
    }
    if (l0 != INT_MIN) {
      w.split2 = l2 - (h1 - l1);
      w.gap2 = l1 - h0;
    }
    return w;
  }
};

// A query tile's key blocks that the window shows whole: n with n < c[0] and (n < c[1] or
// n >= c[2] or (n < c[3] and n >= c[4])) (SinkWindow::clear_key_blocks). Read from shared memory
// (volatile) by the key-row loader, one block at a time.
struct ClearKeyBlocks {
  int32_t c[5];

  __device__ __forceinline__ bool has(int n) const volatile {
    return n < c[0] && (n < c[1] || n >= c[2] || (n < c[3] && n >= c[4]));
  }
};

// A key block's query blocks that the window shows whole: m in [c[0], c[1]) or [c[2], c[3])
// (SinkWindow::clear_query_blocks), read by the row-statistics loader one block at a time.
struct ClearQueryBlocks {
  int32_t c[4];

  __device__ __forceinline__ bool has(int m) const volatile {
    return (m >= c[0] && m < c[1]) || (m >= c[2] && m < c[3]);
  }
};

// floor(x / d) for d > 0 and x of either sign, clamped into half the int range (so that a
// caller's + 1 does not overflow).
__device__ __forceinline__ int32_t floor_div_clamped(int64_t x, int d) {
  const int64_t q = x >= 0 ? x / d : -((-x + d - 1) / d);
  return int32_t(max(int64_t(INT_MIN / 2), min(q, int64_t(INT_MAX / 2))));
}

// Positions [first, end) clipped to [0, len), as the blocks of `block` positions that hold them:
// [lo, hi), empty (lo == hi) where nothing is left.
__device__ __forceinline__ void block_run(int64_t first, int64_t end, int64_t len, int block, int& lo, int& hi) {
  first = max(first, int64_t(0));
  end = min(end, len);
  lo = int(first / block);
  hi = end > first ? int((end + block - 1) / block) : lo;
}

// One head's window with sinks on a sequence of len_q queries and len_k keys (bottom-right
// aligned: d = i + offset - j).
struct SinkWindow {
  int64_t sink, near, gap, far, offset, len_q, len_k;

  // The row of query head h (a negative entry, which only a CUDA tensor can carry past the
  // validation, counts as 0).
  __device__ __forceinline__ static SinkWindow of(const FwdArgs& a, int h, int len_q, int len_k) {
    const int32_t* w = a.windows + int64_t(h / a.windows_head_div) * a.windows_hs;
    return {max(__ldg(w), 0), max(__ldg(w + 1), 0), max(__ldg(w + 2), 0), max(__ldg(w + 3), 0),
            int64_t(len_k) - len_q, len_q, len_k};
  }

  // The key blocks (of block_n keys) that queries [m0, m0 + block_m) see, as a walk and its
  // virtual range [v_min, v_max).
  __device__ __forceinline__ BlockWalk key_blocks(int m0, int block_m, int block_n, int& v_min, int& v_max) const {
    const int64_t m_end = min(int64_t(m0) + block_m, len_q);
    const int64_t top = m_end + offset;  // (keys below top have d >= 0 for the block's last query)
    int l0, h0, l1, h1, l2, h2;
    block_run(near > 0 ? m0 + offset - near + 1 : top, top, len_k, block_n, l0, h0);                      // near
    block_run(far > 0 ? m0 + offset - near - gap - far + 1 : top, top - near - gap, len_k, block_n, l1, h1);  // far
    block_run(0, min(sink, top), len_k, block_n, l2, h2);                                                  // sinks
    return BlockWalk::of_runs(l0, h0, l1, h1, l2, h2, v_min, v_max);
  }

  // The key blocks (of block_n keys) whose tile with queries [m0, m0 + block_m) the window shows
  // whole (ClearKeyBlocks). The sequence's last, partial key block is never among them (its last
  // key, n0 + block_n - 1, lies past the diagonal of every query), so its rows past the keys are
  // hidden by the test.
  __device__ __forceinline__ ClearKeyBlocks clear_key_blocks(int m0, int block_m, int block_n) const {
    ClearKeyBlocks k;
    int32_t* c = k.c;
    const int64_t m_end = min(int64_t(m0) + block_m, len_q);
    auto floor_div = [&](int64_t x) { return floor_div_clamped(x, block_n); };
    // every distance d = i + offset - j of block n's pairs lies in [m0 + offset - (n + 1) bn + 1,
    // m_end - 1 + offset - n bn]: visible whole where the lower end is >= 0 and the block's keys
    // are sinks, or both ends lie in the near band, or both in the far band
    c[0] = floor_div(m0 + offset - block_n + 1) + 1;
    c[1] = floor_div(sink);
    c[2] = floor_div(m_end - 1 + offset - near) + 1;
    c[3] = floor_div(m0 + offset - near - gap - block_n + 1) + 1;
    c[4] = floor_div(m_end - 1 + offset - near - gap - far) + 1;
    return k;
  }

  // The query blocks (of block_m queries) whose tile with keys [n0, n0 + block_n) the window shows
  // whole (ClearQueryBlocks). The sequence's last, partial key block is shown whole to no query
  // block: its rows past the keys (zeros, or in a packed batch the next sequence's keys) are
  // hidden by the test alone.
  __device__ __forceinline__ ClearQueryBlocks clear_query_blocks(int n0, int block_n, int block_m) const {
    ClearQueryBlocks k;
    int32_t &c0 = k.c[0], &c1 = k.c[1], &c2 = k.c[2], &c3 = k.c[3];
    const int64_t n_end = int64_t(n0) + block_n;  // (not clipped: see above)
    auto ceil_div = [&](int64_t x) { return -floor_div_clamped(-x, block_m); };
    // every distance d = i + offset - j of tile m's pairs lies in [m bm + offset - (n_end - 1),
    // m bm + bm - 1 + offset - n0]: visible whole where the lower end is >= 0 and the tile's keys
    // are sinks, or both ends lie in the near band, or both in the far band
    const int32_t first = ceil_div(n_end - 1 - offset);  // (lower end >= 0)
    if (n_end <= sink) {
      c0 = first, c1 = INT_MAX, c2 = c3 = 0;
      return k;
    }
    c0 = first, c1 = ceil_div(near - block_m + 1 - offset + n0);
    c2 = max(first, ceil_div(near + gap + n_end - 1 - offset));
    c3 = ceil_div(near + gap + far - block_m + 1 - offset + n0);
    return k;
  }

  // The query blocks (of block_m queries) that keys [n0, n0 + block_n) meet, likewise: two runs
  // at most (the sinks' and the near band's both start at the block's first key's query, and the
  // far band's lies inside the sinks' where those exist), so split2 stays unused.
  __device__ __forceinline__ BlockWalk query_blocks(int n0, int block_n, int block_m, int& v_min, int& v_max) const {
    const int64_t n_end = min(int64_t(n0) + block_n, len_k);
    const int64_t base = n0 - offset;  // (the block's first key's query at d = 0)
    int l0, h0, l1, h1, l2, h2;
    block_run(base, near > 0 ? n_end - offset + near - 1 : base, len_q, block_m, l0, h0);
    block_run(base + near + gap, far > 0 ? n_end - offset + near + gap + far - 1 : base, len_q, block_m, l1, h1);
    block_run(base, n0 < sink && n0 < n_end ? len_q : base, len_q, block_m, l2, h2);
    return BlockWalk::of_runs(l0, h0, l1, h1, l2, h2, v_min, v_max);
  }
};

// One head's window as the element test takes it: int32, each entry capped at len_q + len_k + 1
// (past every distance: the same rule, and no sum below overflows). The scheduler (forward: in
// the tile's FwdWsTileWindows) or the CTA (backward: in shared memory) keeps it; the key-row or
// statistics loader marks each tile that needs the test (SinkWindow::clear_key_blocks,
// clear_query_blocks), and the consumers read it only there.
struct SinkWindowTest {
  int32_t sink, near, near_gap, far, offset;

  __device__ __forceinline__ static SinkWindowTest of(const SinkWindow& w) {
    const int64_t cap = w.len_q + w.len_k + 1;
    return {int32_t(min(w.sink, cap)), int32_t(min(w.near, cap)), int32_t(min(w.near + w.gap, cap)),
            int32_t(min(w.far, cap)), int32_t(w.offset)};
  }
  __device__ __forceinline__ static SinkWindowTest load(const volatile SinkWindowTest& v) {
    return {v.sink, v.near, v.near_gap, v.far, v.offset};
  }
  // (without branches -- a branch per score kept the accumulators out of registers -- and
  // d - near_gap unsigned: d >= near_gap and d - near_gap < far)
  __device__ __forceinline__ bool visible(int i, int j) const {
    const int d = i + offset - j;
    return (d >= 0) & ((j < sink) | (d < near) | (unsigned(d - near_gap) < unsigned(far)));
  }
};

// -inf on the scores (row/col view, coord: (row, col) in the tile) whose key the window hides
// from the query: row r is query i0 + r, column c key j0 + c. (w by value: its fields in
// registers, not reloaded from the stage around each score's store; a select per score.)
template <class S, class C>
__device__ __forceinline__ void apply_sink_window(S& s, C const& coord, const SinkWindowTest w, int i0, int j0) {
  using namespace cute;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    const int i = i0 + get<0>(coord(r, 0));
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) s(r, c) = w.visible(i, j0 + get<1>(coord(0, c))) ? s(r, c) : -INFINITY;
  }
}

}  // namespace dmattn::cuda
