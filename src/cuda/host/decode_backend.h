// Host side of the decode path (docs/decode.md): the split heuristic and the launch from
// validated ForwardParams (decode_splits > 0).
#pragma once

#include <cstdint>

#include "dmattn/params.h"

namespace dmattn::cuda {

// How many key splits the decode kernel uses for a problem of `ctas` CTAs per split (batch x
// kv heads x query-row chunks) over seqlen_k keys on GPU `device_id`.
int64_t decode_num_splits(int64_t ctas, int64_t seqlen_k, int device_id);

// Query-row chunks of the decode kernels for seqlen_q queries of `group` heads each: one tile of
// kDecodeRows rows, or above it chunks of kDecodeChunkRows (kDecodeRows at head dims above
// kDecodeRowsMaxHeadDim).
int64_t decode_row_chunks(int64_t seqlen_q, int64_t group, int64_t head_dim);

// Packed batches (decode_packed_splits in dmattn/api.h): the workspace's split count for
// sequences of at most kDecodePackedMaxRows query rows, 1 if one split serves them all, or 0
// where none can have that few.
int64_t decode_packed_splits(int64_t heads_kv, int64_t group, int64_t head_dim, int64_t max_seqlen_q,
                             int64_t max_seqlen_k, int device_id);

// The balanced form (DecodeInputs::balanced; decode_balanced.h) for a dense call of these
// shapes on GPU device_id: the workspace's split count it needs, or 0 where its shapes do not
// take it (decode_balanced_ctas CTAs are then not worth their slots, or the kernel that runs it
// does not take the call).
int64_t decode_balanced_splits(int64_t batch, int64_t seqlen_q, int64_t group, int64_t heads_kv, int64_t head_dim,
                               int64_t seqlen_k, int device_id);

// The decode kernels on validated params: dense (decode_splits splits), or packed
// (p.is_varlen(): the short sequences only, each with its own splits).
void decode_forward(const ForwardParams& p);

}  // namespace dmattn::cuda
