// The per-query causal top-k glue on the CPU: one row at a time, the sequential form of what the
// CUDA kernels do warp- or block-wide (src/cuda/indexed/per_query_glue.cu).
#include "cpu/per_query_glue.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "api/segment_order.h"

namespace dmattn::cpu {

// Streams the keys of a row in index order keeping the threshold x = the keep-th smallest rank
// seen: a key entering below x evicts x, and the new threshold is the largest rank below x whose
// key has already been seen (order[rank] <= v), found by walking down the ranks. x only
// decreases, so the walks of a row cost O(num_keys) together.
void prefix_thresholds(const int32_t* ranks, const int32_t* order, int32_t* thresholds, int64_t rows,
                       int64_t num_keys, int64_t keep) {
#pragma omp parallel for schedule(dynamic)
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* rank = ranks + r * num_keys;
    const int32_t* ord = order + r * num_keys;
    int32_t* out = thresholds + r * num_keys;
    const int32_t none = static_cast<int32_t>(num_keys);
    int64_t count = 0;
    int32_t x = none, fill_max = -1;
    for (int64_t v = 0; v < num_keys; ++v) {
      const int32_t k = rank[v];
      if (k < none) {  // selectable
        if (count < keep) {
          fill_max = std::max(fill_max, k);
          if (++count == keep) x = fill_max;
        } else if (k < x) {
          int32_t y = x - 1;
          while (ord[y] > v) --y;  // stops at k at the latest (ord[k] == v)
          x = y;
        }
      }
      out[v] = count < keep ? none : x;
    }
  }
}

void segment_candidates(const int32_t* ends, int32_t* positions, int32_t* key_ends, int32_t* index, int32_t* slots,
                        int64_t rows_b,
                        int64_t rows_h, int64_t num_keys, int64_t num_segments, int64_t width, int64_t offset,
                        int64_t seg_len) {
  const int64_t original = num_segments * seg_len + offset;
  const int64_t span = segment_order::bucket_span(seg_len);
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t b = 0; b < rows_b; ++b) {
    for (int64_t s = 0; s < num_segments; ++s) {
      for (int64_t h = 0; h < rows_h; ++h) {
        const int32_t* e = ends + (b * rows_h + h) * num_keys;
        const int64_t out_row = ((b * num_segments + s) * rows_h + h) * width;
        const int64_t first = s * seg_len + offset;  // the segment's first visible-prefix index
        const int64_t stop = std::min(num_keys, first + seg_len);
        int32_t* slot = slots + ((b * num_segments + s) * rows_h + h) * num_keys;
        std::fill(slot, slot + num_keys, -1);
        int64_t n = 0;
        auto put = [&](int64_t j, int64_t pos) {
          positions[out_row + n] = static_cast<int32_t>(pos);
          key_ends[out_row + n] = static_cast<int32_t>(e[j] - first);
          index[out_row + n] = static_cast<int32_t>(j);
          slot[j] = static_cast<int32_t>(n);
          ++n;
        };
        // The keys before the segment by end bucket, smallest first (api/segment_order.h), then
        // the segment's own keys in index order.
        std::vector<std::pair<int, int64_t>> before;  // (bucket, j): sorts as listed
        for (int64_t j = 0; j < std::min(stop, first); ++j)
          if (e[j] > first) before.emplace_back(segment_order::bucket(e[j] - first, seg_len, span), j);
        std::sort(before.begin(), before.end());
        // They are visible to every query of the segment: the positions just below its first
        // one, increasing (the positions contract).
        const int64_t n_before = std::min(static_cast<int64_t>(before.size()), width);
        for (int64_t r = 0; r < n_before; ++r) put(before[r].second, original - seg_len - n_before + r);
        for (int64_t j = first; j < stop && n < width; ++j)
          if (e[j] > j) put(j, j - first + original - seg_len);
        for (; n < width; ++n) {
          positions[out_row + n] = -1;
          key_ends[out_row + n] = 0;
          index[out_row + n] = -1;
        }
      }
    }
  }
}

}  // namespace dmattn::cpu
