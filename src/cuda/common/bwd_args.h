// The backward kernels' argument block, filled once on the host from BackwardParams
// (make_bwd_args in cuda_backend.cu). Plain data; device code reads nothing else.
#pragma once

#include <cstdint>

#include "cuda/common/fwd_args.h"

namespace dmattn::cuda {

// How the main (key-block-major) kernel produces dbias. The bias is (size_b, size_h, size_q,
// size_k) with each size 1 or full (head: H, Hkv or 1).
enum BwdDbiasMode : int {
  kDbNone = 0,    // no dbias, or a key-broadcast bias (size_k == 1): exactly zero, filled apart
  kDbDirect = 1,  // every dS element has its own dbias element: tiles written directly
  kDbAccum = 2,   // full query dim, reduced over heads and/or batch: fp32 adds into dbias_accum
  kDbColSum = 3,  // query-broadcast (size_q == 1): column sums in the CTA, one flush per target
};

struct BwdArgs {
  FwdArgs f;  // q, k, v, out, lse, mask, bias, sizes, scale, softcap, window

  const void* dout = nullptr;
  int64_t do_bs = 0, do_rs = 0, do_hs = 0;
  void* dq = nullptr;
  int64_t dq_bs = 0, dq_rs = 0, dq_hs = 0;
  void* dk = nullptr;
  int64_t dk_bs = 0, dk_rs = 0, dk_hs = 0;
  void* dv = nullptr;
  int64_t dv_bs = 0, dv_rs = 0, dv_hs = 0;

  float* delta = nullptr;     // (B, H, Sq): rowsum(dO * O), or sum_j P_ij dP_ij (exact path)
  // Row statistics read by the main and dQ kernels (B, H, Sq): m (lse on the lse path) and
  // log2 of the row sum (null on the lse path). The exact path's bwd_stats writes them.
  const float* row_m = nullptr;
  const float* row_log2l = nullptr;
  float* stats_m = nullptr;      // bwd_stats outputs (exact path)
  float* stats_log2l = nullptr;
  float* dq_accum = nullptr;  // (B, Sq, H, D) contiguous; null: the main kernel skips dQ
  // Deterministic mode on the warp-specialized Hopper kernel: per (batch, head, query block of
  // its kBlockM rows), 1 + the last key block that added its dQ into dq_accum (0: none yet);
  // each key block adds after its predecessor (sm90/bwd_ws_kernel_sm90.h). Null: unordered adds.
  int* dq_order = nullptr;
  int num_heads_kv = 1;

  // dbias (same dtype as the bias: Element or fp32), strides 0 along broadcast dims.
  void* dbias = nullptr;
  int64_t db_sb = 0, db_sh = 0, db_sq = 0, db_sk = 0;
  float* dbias_accum = nullptr;  // contiguous (size_b, size_h, size_q, size_k)
  int64_t bsize_b = 1, bsize_h = 1, bsize_q = 1, bsize_k = 1;
  int bias_head_div = 1;
  int dbias_mode = kDbNone;
  bool db_atomic = false;         // adds into dbias_accum are atomic (several CTAs share targets)
  bool db_colsum_to_accum = false;  // kDbColSum: flush into dbias_accum instead of dbias
  bool db_vec = false;            // dbias rows 16-byte aligned with unit key stride

  // The gate's gradients (score_terms.h). dalpha_accum: fp32, laid out like lse, dalpha_slices
  // slices of H * q_rows floats: one per key block (each key block's CTA stores its rows' sums
  // in its own slice: deterministic) or one (atomic adds); zeroed before the kernel, summed and
  // converted into dalpha (alpha's layout, dtype Element or fp32) after it. ddelta: written by
  // the key block's CTA (it owns its keys across the GQA group), delta's layout and dtype.
  float* dalpha_accum = nullptr;
  int64_t dalpha_slices = 0;
  void* dalpha = nullptr;
  int64_t dalpha_bs = 0, dalpha_rs = 0, dalpha_hs = 0;
  void* ddelta = nullptr;
  int64_t ddelta_bs = 0, ddelta_rs = 0, ddelta_hs = 0;

  // Deterministic mode with a dbias reduced over batch / kv heads: one CTA per key block
  // walks these dimensions itself (so that it owns its dbias elements).
  bool fold_batch = false, fold_heads = false;
  int exp_flags = 0;  // profiling experiments only (DMATTN_BWD_EXP): skip parts of the main kernel
};

}  // namespace dmattn::cuda
