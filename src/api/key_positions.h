// Validation of gathered keys (GatheredKeys -> ForwardParams::key_positions), called by
// make_forward_params once the problem sizes are known.
#pragma once

#include "dmattn/api.h"

namespace dmattn {

// Checks key_positions (dtype int32, rank 3 (1 or B, 1 / Hkv / H, K = seqlen_k), q's device,
// unit stride along K) and seqlen_k_original >= 0, then fills the key_positions fields of p,
// whose sizes (batch, heads, seqlen_k) are already set. On the CPU it also checks the values
// against the ordering contract (see ForwardParams); CUDA values are not read (no sync).
void set_key_positions(const TensorDesc& q, const GatheredKeys& gathered, ForwardParams& p);

}  // namespace dmattn
