// The order of a segment's candidate keys (segment_candidates, dmattn/api.h), shared by the CPU
// and CUDA forms so that both list the same rows.
//
// The keys before the segment (kept by its first query) come first, grouped by how long into
// the segment they stay kept: the end bucket ceil(min(end - P, seg_len) / span) (P: the segment's
// first prefix), smallest first, index order inside a bucket; then the segment's own keys in
// index order. With span a multiple of 64 (the backward's query block) a gathered key block of
// such keys holds ends of one or two buckets, so the backward can stop its query loop at the
// block's largest end (the queries after it keep none of the block's keys) instead of walking
// the whole segment.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DMATTN_HOST_DEVICE __host__ __device__
#else
#define DMATTN_HOST_DEVICE
#endif

namespace dmattn::segment_order {

constexpr int kMaxBuckets = 256;  // buckets 1..kMaxBuckets - 1 (0 is never used)

// Queries per bucket: 64, or a multiple of 64 that keeps the bucket count below kMaxBuckets.
DMATTN_HOST_DEVICE inline int64_t bucket_span(int64_t seg_len) {
  const int64_t per = 64 * (kMaxBuckets - 1);
  return 64 * (seg_len <= per ? 1 : (seg_len + per - 1) / per);
}

// The bucket of a key before the segment with end_rel = end - P >= 1 (its queries in the
// segment are [0, end_rel)): 1 .. ceil(seg_len / span).
DMATTN_HOST_DEVICE inline int bucket(int64_t end_rel, int64_t seg_len, int64_t span) {
  const int64_t e = end_rel < seg_len ? end_rel : seg_len;
  return int((e + span - 1) / span);
}

}  // namespace dmattn::segment_order

#undef DMATTN_HOST_DEVICE
