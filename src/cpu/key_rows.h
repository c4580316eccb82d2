// Which rows of k/v causal and the sliding window let a query reach, and back.
//
// Without gathered keys row j *is* key position j. With ForwardParams::key_positions, row j of
// (b, h) stands for the original position key_positions[b, h, j]; the window rule is applied
// to those positions, and since valid positions are strictly increasing and come before the
// padding rows, the rows a query range reaches are still one contiguous range, found by binary
// search. Padding rows are outside every range, so nothing ever attends to them.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dmattn/params.h"

namespace dmattn::cpu {

// Half-open index range.
struct IndexRange {
  int64_t begin = 0, end = 0;
  bool empty() const { return begin >= end; }
};

// One head's window with sinks (ForwardParams::windows): with d = i + offset - j, key j is
// visible to query i iff d >= 0 and (j < sink or d < near or near + gap <= d < reach), where
// reach = near + gap + far (or near when far = 0).
struct SinkWindow {
  int64_t sink = 0, near = 0, gap = 0, far = 0;

  static SinkWindow of(const LocalWindows& w, int64_t h) {
    const int32_t* row = w.row(h);
    return {row[0], row[1], row[2], row[3]};
  }
  // One past the largest visible distance d (sinks aside).
  int64_t reach() const { return far > 0 ? near + gap + far : near; }
  bool allows(int64_t d, int64_t j) const {
    return d >= 0 && (j < sink || d < near || (d >= near + gap && d < near + gap + far));
  }
};

// The causal/sliding-window rule on key positions, bottom-right aligned (see ForwardParams):
// key position j is allowed for query i iff  i + offset - left <= j <= i + offset + right,
// offset = Sk - Sq (Sk = the original key length with gathered keys), and a negative
// left/right means unbounded on that side. With windows (sinks), each head's SinkWindow
// applies on top: the ranges below are then the hull of what it lets through, and
// SinkWindow::allows decides per element.
struct WindowRule {
  int64_t seqlen_q = 0, seqlen_k = 0, offset = 0, left = -1, right = -1;
  LocalWindows windows;

  explicit WindowRule(const ForwardParams& p)
      : seqlen_q(p.seqlen_q), seqlen_k(p.window_seqlen_k()), offset(seqlen_k - p.seqlen_q),
        left(p.window_left), right(p.window_right), windows(p.windows) {}

  // Key positions that at least one query in [rows.begin, rows.end) of head h may attend to
  // ({0, 0} if none).
  IndexRange keys_for_queries(IndexRange rows, int64_t h) const {
    if (rows.empty()) return {0, 0};
    IndexRange keys{0, seqlen_k};
    if (left >= 0) keys.begin = std::max<int64_t>(0, rows.begin + offset - left);
    if (right >= 0) keys.end = std::min<int64_t>(seqlen_k, rows.end - 1 + offset + right + 1);
    if (windows.present()) {
      const SinkWindow w = SinkWindow::of(windows, h);
      keys.end = std::min<int64_t>(keys.end, rows.end + offset);  // d >= 0
      if (w.sink == 0) keys.begin = std::max<int64_t>(keys.begin, rows.begin + offset - w.reach() + 1);
    }
    return keys.empty() ? IndexRange{0, 0} : keys;
  }

  // Queries of head h that may attend to at least one key position in [keys.begin, keys.end)
  // ({0, 0} if none).
  IndexRange queries_for_keys(IndexRange keys, int64_t h) const {
    if (keys.empty()) return {0, 0};
    IndexRange rows{0, seqlen_q};
    if (right >= 0) rows.begin = std::max<int64_t>(0, keys.begin - offset - right);
    if (left >= 0) rows.end = std::min<int64_t>(seqlen_q, keys.end - 1 - offset + left + 1);
    if (windows.present()) {
      const SinkWindow w = SinkWindow::of(windows, h);
      rows.begin = std::max<int64_t>(rows.begin, keys.begin - offset);  // d >= 0
      if (keys.begin >= w.sink) rows.end = std::min<int64_t>(rows.end, keys.end - 1 - offset + w.reach());
    }
    return rows.empty() ? IndexRange{0, 0} : rows;
  }
};

// The window rule expressed on rows of k/v, for one (batch, query head).
class KeyRows {
 public:
  explicit KeyRows(const ForwardParams& p)
      : window_(p), positions_(p.key_positions), ends_(p.key_ends), stride_b_(p.key_positions_stride_b),
        stride_h_(p.key_positions_stride_h), head_div_(p.key_positions_head_div),
        rows_(p.seqlen_k), seqlen_k_original_(p.seqlen_k_original) {}

  // Rows of k/v that at least one query in `queries` of (b, h) may attend to.
  IndexRange for_queries(int64_t b, int64_t h, IndexRange queries) const {
    const IndexRange positions = window_.keys_for_queries(queries, h);
    if (positions_ == nullptr) return positions;
    const int32_t* row = positions_row(b, h);
    const int32_t* valid_end = row + valid_count(row);
    // The rows whose position lies in [positions.begin, positions.end): contiguous (sorted).
    const int32_t* first = std::lower_bound(row, valid_end, positions.begin);
    const int32_t* last = std::lower_bound(first, valid_end, positions.end);
    return {first - row, last - row};
  }

  // The windows with sinks of head h, or null without them (SinkWindow::allows then decides
  // per element inside for_queries' hull).
  const LocalWindows* windows() const { return window_.windows.present() ? &window_.windows : nullptr; }
  int64_t offset() const { return window_.offset; }

  // key_ends[b, h', :] (ForwardParams::key_ends): row j is allowed only for queries i < the
  // entry j; null without key ends.
  const int32_t* ends_row(int64_t b, int64_t h) const {
    return ends_ == nullptr ? nullptr : ends_ + b * stride_b_ + (h / head_div_) * stride_h_;
  }

  // Queries of (b, h) that may attend to at least one of the rows `keys`.
  IndexRange queries_for(int64_t b, int64_t h, IndexRange keys) const {
    if (positions_ == nullptr) return window_.queries_for_keys(keys, h);
    const int32_t* row = positions_row(b, h);
    const int64_t end = std::min(keys.end, valid_count(row));
    if (keys.begin >= end) return {0, 0};  // padding rows only
    return window_.queries_for_keys({row[keys.begin], int64_t{row[end - 1]} + 1}, h);
  }

 private:
  const int32_t* positions_row(int64_t b, int64_t h) const {
    return positions_ + b * stride_b_ + (h / head_div_) * stride_h_;
  }

  // Number of leading valid rows (positions in [0, seqlen_k_original)); the rest is padding.
  int64_t valid_count(const int32_t* row) const {
    const int32_t* end = std::partition_point(row, row + rows_, [&](int32_t pos) {
      return pos >= 0 && pos < seqlen_k_original_;
    });
    return end - row;
  }

  WindowRule window_;
  const int32_t* positions_;  // null: row j is position j
  const int32_t* ends_;       // null: no per-row query bound
  int64_t stride_b_, stride_h_, head_div_, rows_, seqlen_k_original_;
};

}  // namespace dmattn::cpu
