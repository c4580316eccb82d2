// The forward kernel's own argument block, filled once on the host from ForwardParams
// (make_fwd_args in fwd_launch.h). Plain data; device code reads nothing else.
#pragma once

#include <cstdint>

#include "cuda/common/key_positions.h"

namespace dmattn::cuda {

// A mask or bias seen as (B, H, Sq, Sk) through element strides (0 = broadcast).
struct OperandArgs {
  const char* ptr = nullptr;  // null = absent
  int64_t stride_b = 0, stride_h = 0, stride_q = 0, stride_k = 0;
  int head_div = 1;
  int esize = 1;           // bytes per element (1 bool, 2 fp16/bf16, 4 fp32)
  bool vec = false;        // stride_k == 1 and 16-byte aligned rows: cp.async path
  bool row_bcast = false;  // stride_q == 0: one row serves the whole query block
};

// The gate of gated attention (docs/semantics.md): alpha (B, Sq, H) per query, delta (B, Sk,
// Hkv) per key, element strides (batch stride 0 in a packed batch, whose rows are offset by the
// sequence's first row like q's and k's), q's element type or fp32. alpha null = no gate.
// Gate skipping's cell: kGateCell queries x kGateCell keys (GateOperand::kKeepCell).
constexpr int kGateCell = 128;

struct GateArgs {
  const char* alpha = nullptr;
  const char* delta = nullptr;
  int64_t alpha_bs = 0, alpha_rs = 0, alpha_hs = 0;
  int64_t delta_bs = 0, delta_rs = 0, delta_hs = 0;
  bool alpha_fp32 = false, delta_fp32 = false;
  bool linear = false;  // g = identity, else logsigmoid
  // Gate skipping's cells (GateOperand::keep: 0 = the 128 x 128 cell is skipped), null = exact.
  const uint8_t* keep = nullptr;
  int64_t keep_bs = 0, keep_hs = 0, keep_ms = 0;
};

struct FwdArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // element (b, h, i) at b * lse_bs + h * lse_hs + q0 + i (seq_bounds.h)
  int64_t lse_bs = 0, lse_hs = 0;  // dense (B, H, Sq): H * Sq, Sq; packed (H, total_q): 0, total_q
  int64_t q_bs = 0, q_rs = 0, q_hs = 0;
  int64_t k_bs = 0, k_rs = 0, k_hs = 0;
  int64_t v_bs = 0, v_rs = 0, v_hs = 0;
  int64_t o_bs = 0, o_rs = 0, o_hs = 0;
  int batch = 0, seqlen_q = 0, seqlen_k = 0, num_heads = 0, group = 1, head_dim = 0;
  // Packed variable-length batch (null = dense): int32 (batch + 1,) device arrays of cumulative
  // lengths; seqlen_q / seqlen_k are then the max lengths (grid sizes) and every batch stride
  // is 0. Read once per CTA by seq_bounds() (seq_bounds.h).
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  int64_t q_rows = 0;  // query rows of the whole batch: B * seqlen_q, or total_q when packed
  int64_t k_rows = 0;  // key rows of the whole batch: B * seqlen_k, or total_k when packed
  float scale = 1.f;
  float softcap = 0.f;          // 0 = off
  float scale_div_softcap = 0.f;
  int64_t window_left = -1, window_right = -1;  // -1 = unbounded, causal folded in
  OperandArgs mask, bias;
  bool bias_fp32 = false;  // else bias has the element type of q
  KeyPositionsArgs kpos;   // gathered keys (key_positions.h); kpos.ptr null = off
  GateArgs gate;           // gated attention (score_terms.h); gate.alpha null = off
  // Windows with sinks (score_terms.h): int32 rows [sink, near, gap, far] of query head h at
  // windows + (h / windows_head_div) * windows_hs; null = off (causal is then folded in).
  const int32_t* windows = nullptr;
  int64_t windows_hs = 0;
  int windows_head_div = 1;
  // Shared-memory placement of the mask / bias tiles (bytes from the start of dynamic smem),
  // filled by run_fwd for its tile: two mask buffers (the next key block's tile is read one
  // block ahead, for block skipping; three in the init and sm90 mask / bias kernels, which
  // decide the next block a block earlier), one or two bias buffers (bias_db: the next block's
  // bias streams in during this block).
  int smem_mask_off = 0, smem_mask_stride = 0;
  int smem_bias_off = 0, smem_bias_stride = 0;
  bool bias_db = false;
  int smem_kpos_off = 0;  // the key block's positions tile (kBlockN int32), with kpos only
};

}  // namespace dmattn::cuda
