// The per-query causal top-k glue on the CPU (same semantics as the CUDA kernels, dmattn/api.h).
#pragma once

#include <cstdint>

namespace dmattn::cpu {

void prefix_thresholds(const int32_t* ranks, const int32_t* order, int32_t* thresholds, int64_t rows,
                       int64_t num_keys, int64_t keep);

void segment_candidates(const int32_t* ends, int32_t* positions, int32_t* key_ends, int32_t* index, int32_t* slots,
                        int64_t rows_b,
                        int64_t rows_h, int64_t num_keys, int64_t num_segments, int64_t width, int64_t offset,
                        int64_t seg_len);

}  // namespace dmattn::cpu
