// Gathered keys (ForwardParams::key_positions) in the CUDA kernels.
//
// With gathered keys, row j of k/v for (b, h) stands for the original key position
// pos = key_positions[b, h', j]; causal / window test pos (bottom-right aligned with
// seqlen_k_original) instead of j, and a pos outside [0, seqlen_k_original) is a padding row
// that nothing attends to. The valid positions of a row are strictly increasing and come
// before the padding (the contract), so:
//   * the rows a query range may reach are one contiguous range, found by binary search over
//     the row in global memory (KeyPositionRow::key_block_range, forward and dQ kernels);
//   * the queries a key block may reach follow from the block's first and last valid
//     positions (KeyPositionRow::query_block_range, the key-block-major backward kernel);
//   * the per-element test reads the key block's positions from a kBlockN int32 tile in shared
//     memory loaded beside K (load_positions_tile); rows past the gathered count read -1.
// Key blocks made only of padding rows fall outside every range: never loaded or computed.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/common/mask.h"

namespace dmattn::cuda {

// The positions operand as the kernels see it (plain data, part of FwdArgs).
struct KeyPositionsArgs {
  const int32_t* ptr = nullptr;  // null: row j is key position j (no gather)
  int64_t stride_b = 0, stride_h = 0;
  int head_div = 1;
  int seqlen_k_original = 0;
  // Per-row query bound (ForwardParams::key_ends; null = none): row j of (b, h) is allowed only
  // for queries i < ends[b, h', j]; same strides as ptr. The mask / bias kernels keep a
  // kBlockN-entry tile of it right after their positions tile in shared memory (end_delta =
  // kBlockN, a compile-time constant), INT_MAX without key ends, so that their test needs no
  // branch and no register.
  const int32_t* ends = nullptr;
  // Indexed keys (ForwardParams::key_rows; null = off): row j of (b, h) is row rows[b, h', j]
  // (same strides as ptr) of batch b / rows_batch_div of the source k, v, whose key rows number
  // rows_source_len; an index outside [0, rows_source_len) reads a zero row. Only the
  // warp-specialized Hopper kernels read it (in place, by cp.async); for the others the host
  // gathers the rows into a copy first (indexed_rows.h).
  const int32_t* rows = nullptr;
  int rows_batch_div = 1, rows_source_len = 0;
};

// The window rule on original positions for query i: the allowed positions are [lo, hi) with
// 0 <= lo and hi <= seqlen_k_original, so that a padding position (< 0 or >= the original
// length) never passes `lo <= pos < hi`. `win` has seqlen_k = seqlen_k_original.
__device__ __forceinline__ void position_range(const WindowMask& win, int64_t i, int& lo, int& hi) {
  const int64_t d = i + win.seqlen_k - win.seqlen_q;
  int64_t l = win.left < 0 ? 0 : max(int64_t(0), d - win.left);
  int64_t h = win.right < 0 ? win.seqlen_k : min(win.seqlen_k, d + win.right + 1);
  l = min(l, win.seqlen_k);
  h = max(h, int64_t(0));
  lo = int(l);
  hi = int(h);
}

// The window on positions of a kernel's arguments (FwdArgs). Built where it is used, from the
// kernel's constant parameters, rather than kept in registers across the key loop.
template <class Args>
__device__ __forceinline__ WindowMask position_window(const Args& a) {
  return WindowMask{a.seqlen_q, a.kpos.seqlen_k_original, a.window_left, a.window_right};
}

// The offset of row (b, h') of the operands that share key_positions' strides (positions, key
// ends, key rows) for query head h.
__device__ __forceinline__ int64_t kpos_row_offset(const KeyPositionsArgs& kp, int b, int h) {
  return int64_t(b) * kp.stride_b + int64_t(h / kp.head_div) * kp.stride_h;
}

// key_positions[b, h', :] for query head h.
__device__ __forceinline__ const int32_t* positions_row(const KeyPositionsArgs& kp, int b, int h) {
  return kp.ptr + kpos_row_offset(kp, b, h);
}

// key_ends[b, h', :] for query head h, or null without key ends.
__device__ __forceinline__ const int32_t* ends_row(const KeyPositionsArgs& kp, int b, int h) {
  return kp.ends == nullptr ? nullptr : kp.ends + kpos_row_offset(kp, b, h);
}

// key_rows[b, h', :] for query head h, or null without indexed keys.
__device__ __forceinline__ const int32_t* rows_row(const KeyPositionsArgs& kp, int b, int h) {
  return kp.rows == nullptr ? nullptr : kp.rows + kpos_row_offset(kp, b, h);
}

// Per-element test of the score transform (score_mask.h): the positions of the columns it
// is handed (shared memory, column c at s_pos[c]), the window on positions, and in the mask /
// bias kernels the query bound of column c at s_pos[c + end_delta].
struct PositionTest {
  const int32_t* s_pos;  // the tile, already offset to the first column handed over
  WindowMask win;        // seqlen_k = seqlen_k_original
  int end_delta;
};

// One (batch, head) row of positions in global memory.
struct KeyPositionRow {
  const int32_t* row = nullptr;  // key_positions[b, h', :]
  int count = 0;                 // gathered rows K (= FwdArgs::seqlen_k)
  WindowMask win;                // on positions: seqlen_k = seqlen_k_original

  template <class Args>
  __device__ __forceinline__ KeyPositionRow(const Args& a, int b, int h)
      : row(positions_row(a.kpos, b, h)), count(a.seqlen_k), win(position_window(a)) {}

  // Number of rows with 0 <= pos < x (x <= seqlen_k_original): by the contract a prefix of the
  // row, so this is a lower bound. Warp-cooperative: each round the 32 lanes probe 32 evenly
  // spaced rows and one ballot narrows the range 32-fold (3 dependent loads for K = 2048
  // instead of 11). Every lane of the warp must call it with the same arguments; every warp
  // of a block gets the same answer (no barrier needed).
  __device__ __forceinline__ int rows_below(int64_t x) const {
    const int lane = threadIdx.x & 31;
    int lo = 0, hi = count;  // rows < lo are below x, rows >= hi are not
    while (lo < hi) {
      const int step = (hi - lo + 31) / 32;
      const int j = lo + lane * step;
      bool below = false;
      if (j < hi) {
        const int pos = __ldg(row + j);
        below = pos >= 0 && pos < x;
      }
      const unsigned ballot = __ballot_sync(0xffffffffu, below);
      const int probes_below = __popc(ballot);  // a prefix of the lanes
      const int new_lo = probes_below > 0 ? lo + (probes_below - 1) * step + 1 : lo;
      hi = min(hi, lo + probes_below * step);
      lo = new_lo;
    }
    return lo;
  }

  // Key blocks [n_min, n_max) holding a row that a query of [m0, m0 + block_m) may attend
  // (empty when n_max <= n_min), as WindowMask::key_block_range does for plain rows.
  __device__ __forceinline__ void key_block_range(int m0, int block_m, int block_n, int& n_min, int& n_max) const {
    const int64_t m_last = (m0 + block_m < win.seqlen_q ? m0 + block_m : win.seqlen_q) - 1;
    const int64_t off = win.seqlen_k - win.seqlen_q;
    int64_t lo = 0, hi = win.seqlen_k;  // allowed positions [lo, hi)
    if (win.left >= 0) lo = max(lo, int64_t(m0) + off - win.left);
    if (win.right >= 0) hi = min(hi, m_last + off + win.right + 1);
    n_min = n_max = 0;
    if (hi <= lo) return;
    const int first = rows_below(lo), last = rows_below(hi);
    if (last <= first) return;
    n_min = first / block_n;
    n_max = (last + block_n - 1) / block_n;
  }

  // Query blocks [m_lo, m_hi) holding a query that may attend a valid row of the key block
  // whose first position is p_first and last valid position p_last (n_valid rows valid, 0:
  // padding only, empty range), as bwd_query_block_range does for plain rows.
  __device__ __forceinline__ void query_block_range(int p_first, int p_last, int n_valid, int block_m, int& m_lo,
                                                    int& m_hi) const {
    m_lo = m_hi = 0;
    if (n_valid <= 0) return;
    const int64_t off = win.seqlen_k - win.seqlen_q;
    int64_t lo = 0, hi = win.seqlen_q;  // queries [lo, hi)
    if (win.right >= 0) lo = max(lo, int64_t(p_first) - off - win.right);
    if (win.left >= 0) hi = min(hi, int64_t(p_last) - off + win.left + 1);
    if (hi <= lo) return;
    m_lo = int(lo / block_m);
    m_hi = int((hi + block_m - 1) / block_m);
  }
};

// The positions every query of [m0, m0 + block_m) may see, [lo, hi) (the window of the last
// query begins at lo, that of the first ends at hi: positions grow along a row; 0 <= lo and hi
// <= seqlen_k, so that padding, -1, and positions past the keys fall outside), and the end of
// those queries, m_end. The one rule for "does a key block need the per-element test": not when
// each of its rows lies inside [lo, hi) and no query bound of the block falls below m_end.
// Kernels that test many key blocks against one query block (the Hopper forward's key-row
// loader) build it once and keep it; the others call the *_block_needs_mask forms below.
struct QueryBlockWindow {
  int lo, hi, m_end;

  // (as position_range of the first and last query, without the clamps the test does not need:
  // lean, for the kernels that call it per block)
  __device__ __forceinline__ static QueryBlockWindow of(const WindowMask& pwin, int m0, int block_m) {
    const int64_t off = pwin.seqlen_k - pwin.seqlen_q;
    const int64_t m_end = min(int64_t(m0) + block_m, pwin.seqlen_q);
    QueryBlockWindow w{0, int(pwin.seqlen_k), int(m_end)};
    if (pwin.left >= 0) w.lo = int(max(int64_t(0), m_end - 1 + off - pwin.left));
    if (pwin.right >= 0) w.hi = int(min(pwin.seqlen_k, int64_t(m0) + off + pwin.right + 1));
    return w;
  }

  // A key block of sorted positions first .. last (-1: padding rows, which come last; a position
  // past the keys, >= hi) whose smallest query bound is end_min (INT_MAX: none).
  __device__ __forceinline__ bool block_needs_test(int first, int last, int end_min) const {
    return needs_test(*this, first, last, end_min);
  }
  // The same on a window kept in shared memory as volatile (read field by field as the test
  // needs them: a loader that keeps it there has no registers to hold it through its loop).
  __device__ __forceinline__ bool block_needs_test(int first, int last, int end_min) const volatile {
    return needs_test(*this, first, last, end_min);
  }

 private:
  template <class Window>
  __device__ __forceinline__ static bool needs_test(Window& w, int first, int last, int end_min) {
    return end_min < w.m_end || first < w.lo || last < w.lo || last >= w.hi;
  }
};

// Does the key block whose positions tile is s_pos (kBlockN entries, -1 past the gathered
// rows) need the per-element test for queries [m0, m0 + block_m)? Not when every row is valid
// and inside the window of every query of the block. Reads two shared entries (broadcast).
template <int kBlockN>
__device__ __forceinline__ bool positions_block_needs_mask(const WindowMask& pwin, const int32_t* s_pos, int m0,
                                                           int block_m, bool has_ends) {
  if (has_ends) return true;  // (the per-row query bounds are not summarized per block)
  return QueryBlockWindow::of(pwin, m0, block_m).block_needs_test(s_pos[0], s_pos[kBlockN - 1], INT_MAX);
}

// As positions_block_needs_mask, for a block whose query bounds (key ends, a query-broadcast
// mask as bound 0) are summarized by their smallest, end_min (INT_MAX without bounds): no test
// when every query of the block is below every bound.
template <int kBlockN>
__device__ __forceinline__ bool bounded_block_needs_mask(const WindowMask& pwin, const int32_t* s_pos, int m0,
                                                         int block_m, int end_min) {
  return QueryBlockWindow::of(pwin, m0, block_m).block_needs_test(s_pos[0], s_pos[kBlockN - 1], end_min);
}

// Stores the positions of rows [n0, n0 + kBlockN) into s_pos, -1 past the `count` gathered
// rows. Plain loads and shared stores (512 bytes at most): visible after the caller's next
// barrier, which must also separate it from the previous block's reads.
// kEnds (the mask / bias kernels): the key ends' tile goes to s_pos + end_delta the same way
// (INT_MAX when end_row is null: no bound; 0 past the gathered rows).
template <int kBlockN, int kThreads, bool kEnds>
__device__ __forceinline__ void load_positions_tile(int32_t* s_pos, const int32_t* row, int count, int n0, int tid,
                                                    const int32_t* end_row, int end_delta) {
  for (int c = tid; c < kBlockN; c += kThreads) s_pos[c] = n0 + c < count ? __ldg(row + n0 + c) : -1;
  if constexpr (kEnds) {
    for (int c = tid; c < kBlockN; c += kThreads)
      s_pos[end_delta + c] = n0 + c >= count ? 0 : end_row != nullptr ? __ldg(end_row + n0 + c) : INT_MAX;
  }
}

// As load_positions_tile, but the rows inside the gathered count go through 4-byte cp.async
// (the row need not be 16-byte aligned): it lands with the caller's next
// cp_async_commit / cp_async_wait, so the load latency hides behind the caller's MMAs.
template <int kBlockN, int kThreads>
__device__ __forceinline__ void load_int_tile_async(int32_t* s_tile, const int32_t* row, int count, int n0, int tid,
                                                    int past_end) {
  for (int c = tid; c < kBlockN; c += kThreads) {
    if (n0 + c < count) {
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(s_tile + c));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(row + n0 + c));
    } else {
      s_tile[c] = past_end;
    }
  }
}

// kEnds: the key ends' tile as in load_positions_tile.
template <int kBlockN, int kThreads, bool kEnds>
__device__ __forceinline__ void load_positions_tile_async(int32_t* s_pos, const int32_t* row, int count, int n0,
                                                          int tid, const int32_t* end_row, int end_delta) {
  load_int_tile_async<kBlockN, kThreads>(s_pos, row, count, n0, tid, -1);
  if constexpr (kEnds) {
    if (end_row != nullptr) {
      load_int_tile_async<kBlockN, kThreads>(s_pos + end_delta, end_row, count, n0, tid, 0);
    } else {
      for (int c = tid; c < kBlockN; c += kThreads) s_pos[end_delta + c] = n0 + c < count ? INT_MAX : 0;
    }
  }
}

// The number of valid rows (0 <= pos < seqlen_k_original) in a tile just stored by
// load_positions_tile: a prefix of the tile by the contract. A block-wide barrier (every thread
// of the block must call it); the tile is visible to all threads afterwards.
template <int kBlockN>
__device__ __forceinline__ int positions_tile_valid_count(const int32_t* s_pos, int seqlen_k_original, int tid) {
  bool valid = false;
  if (tid < kBlockN) {
    const int pos = s_pos[tid];
    valid = pos >= 0 && pos < seqlen_k_original;
  }
  return __syncthreads_count(valid);
}

// The largest key end among the gathered rows [n0, n0 + kBlockN) (below `count`) of query heads
// [h0, h0 + heads), 0 when the block has none: no query at or past it keeps a row of the block,
// so a key-block-major backward may stop its query loop there. Only with key ends. Block-wide
// (every thread calls it; one barrier); s_warp_max: kThreads / 32 ints of shared memory, free
// after the call.
template <int kBlockN, int kThreads>
__device__ __forceinline__ int key_block_end_max(const KeyPositionsArgs& kp, int b, int h0, int heads, int count,
                                                 int n0, int tid, int* s_warp_max) {
  static_assert(kBlockN <= kThreads && kThreads % 32 == 0);
  int v = 0;
  if (tid < kBlockN && n0 + tid < count)
    for (int h = h0; h < h0 + heads; ++h) v = max(v, int(__ldg(ends_row(kp, b, h) + n0 + tid)));
  v = __reduce_max_sync(0xffffffffu, v);
  if (tid % 32 == 0) s_warp_max[tid / 32] = v;
  __syncthreads();
  int m = 0;
  for (int w = 0; w < kThreads / 32; ++w) m = max(m, s_warp_max[w]);
  return m;
}

}  // namespace dmattn::cuda
