// The CPU backend: a blockwise implementation of the contract in docs/semantics.md (tile
// products through BLAS), parallel with OpenMP. It reads everything through the params
// structs, which make_forward_params / make_backward_params have validated.
#pragma once

#include <cstdint>

#include "dmattn/params.h"

namespace dmattn::cpu {

// Writes out (B, Sq, H, D) and lse (B, H, Sq).
void forward(const ForwardParams& p);

// Writes dq, dk, dv and, when p.dbias is set, dbias. Always deterministic: every output
// element is produced by exactly one task in a fixed summation order, so results are bitwise
// identical for any thread count (p.deterministic is therefore not needed here).
void backward(const BackwardParams& p);

// How much memory the backward may use to keep computed tiles instead of recomputing them
// (score_cache.h): `store_bytes` for the whole call (default 256 MiB), `row_bytes` per thread
// (default 16 MiB). Results are the same either way up to rounding; 0, 0 gives the
// bounded-memory three-pass algorithm (the tests run both).
void set_backward_cache_limits(int64_t store_bytes, int64_t row_bytes);

// Packed variable-length batches (p.fwd.is_varlen()): the same, sequence by sequence
// (cpu_varlen.cpp).
void forward_varlen(const ForwardParams& p);
void backward_varlen(const BackwardParams& p);

}  // namespace dmattn::cpu
