// The CPU backend: a blockwise online-softmax implementation of the contract in
// shared/spec/semantics.md, parallel with OpenMP. It reads everything through the params
// structs, which make_forward_params / make_backward_params have validated.
#pragma once

#include "dmattn/params.h"

namespace dmattn::cpu {

// Writes out (B, Sq, H, D) and lse (B, H, Sq).
void forward(const ForwardParams& p);

// Writes dq, dk, dv and, when p.dbias is set, dbias. Always deterministic: every output
// element is produced by exactly one task in a fixed summation order, so results are bitwise
// identical for any thread count (p.deterministic is therefore not needed here).
void backward(const BackwardParams& p);

// Packed variable-length batches (p.fwd.is_varlen()): the same, sequence by sequence
// (cpu_varlen.cpp).
void forward_varlen(const ForwardParams& p);
void backward_varlen(const BackwardParams& p);

}  // namespace dmattn::cpu
