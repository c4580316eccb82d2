// Host side of the decode path (docs/decode.md): the split heuristic and the launch from
// validated ForwardParams (decode_splits > 0).
#pragma once

#include <cstdint>

#include "dmattn/params.h"

namespace dmattn::cuda {

// How many key splits the decode kernel uses for a problem of `ctas` CTAs per split (batch x
// kv heads x query-row chunks) over seqlen_k keys on GPU `device_id`.
int64_t decode_num_splits(int64_t ctas, int64_t seqlen_k, int device_id);

// Query-row chunks of the decode kernel for seqlen_q queries of `group` heads each.
int64_t decode_row_chunks(int64_t seqlen_q, int64_t group);

void decode_forward(const ForwardParams& p);

}  // namespace dmattn::cuda
