// Launchers of the per-query causal top-k glue (per_query_glue.cu): the prefix thresholds of the
// selection and the per-segment candidate keys. Plain argument structs; validation is the
// caller's (src/api/per_query_glue.cpp). The semantics are documented in dmattn/api.h.
#pragma once

#include <cstdint>

namespace dmattn::cuda {

// rows x num_keys int32, contiguous: ranks (in), order (in), thresholds (out).
struct PrefixThresholdsArgs {
  const int32_t* ranks = nullptr;
  const int32_t* order = nullptr;
  int32_t* thresholds = nullptr;
  int64_t rows = 0, num_keys = 0, keep = 0;
};

// ends (rows_b, rows_h, num_keys) in; positions / key_ends / index (rows_b * num_segments,
// rows_h, width) and slots (rows_b, num_segments, rows_h, num_keys) out; all int32, contiguous.
struct SegmentCandidatesArgs {
  const int32_t* ends = nullptr;
  int32_t* positions = nullptr;
  int32_t* key_ends = nullptr;
  int32_t* index = nullptr;
  int32_t* slots = nullptr;
  int64_t rows_b = 0, rows_h = 0, num_keys = 0, num_segments = 0, width = 0;
  int64_t offset = 0, seg_len = 0;
};

// sorted int64 (rows, num_keys) in, allowed bool (null: every key) in; ranks, order, thresholds,
// ends int32 out (dmattn/api.h, interval_ends); all contiguous.
struct IntervalEndsArgs {
  const int64_t* sorted = nullptr;
  const bool* allowed = nullptr;
  int32_t* ranks = nullptr;
  int32_t* order = nullptr;
  int32_t* thresholds = nullptr;
  int32_t* ends = nullptr;
  int64_t rows = 0, num_keys = 0, keep = 0;
};

// scores (rows, num_keys) in, fmt 0 float16, 1 bfloat16, 2 float32; allowed bool or null; key
// int32 (key32) or int64 out (dmattn/api.h, selection_key); all contiguous.
struct SelectionKeyArgs {
  const void* scores = nullptr;
  const bool* allowed = nullptr;
  void* key = nullptr;
  int64_t rows = 0, num_keys = 0;
  int fmt = 0;
  bool key32 = true;
};

void prefix_thresholds(const PrefixThresholdsArgs& a, void* stream);
void interval_ends(const IntervalEndsArgs& a, void* stream);
void selection_key(const SelectionKeyArgs& a, void* stream);
void segment_candidates(const SegmentCandidatesArgs& a, void* stream);

}  // namespace dmattn::cuda
