// Plain parameter structs for the forward and backward passes.
//
// Filled in exactly one place (make_forward_params / make_backward_params in api.h),
// after validation; every backend reads only these. Pointers are raw device (or host)
// pointers, strides are in elements (int64), a broadcast dimension has stride 0, and a
// null pointer switches a feature off (no mask, no bias, no dbias).
//
// Packed variable-length batches (FlashAttention's "varlen" layout) use the same structs: a
// non-null cu_seqlens_q switches ForwardParams to varlen mode; see the comment there.
#pragma once

#include <cstdint>

#include "dmattn/types.h"

namespace dmattn {

// A mask or bias viewed as (B, H, Sq, Sk) through its strides.
//   element (b, h, i, j) lives at ptr[b*stride_b + (h / head_div)*stride_h + i*stride_q + j*stride_k]
// A dimension of size 1 has stride 0 and is "broadcast"; the head dimension may hold H heads
// (head_div = 1), Hkv heads (head_div = H / Hkv, one entry per GQA group) or 1 (stride 0).
// The sizes are the operand's own (1 or full), so that dbias reductions know which
// dimensions to sum over even if a caller passed a stride-0 expanded view of full size.
struct BroadcastOperand {
  const void* ptr = nullptr;  // null = absent
  DType dtype = DType::kOther;
  int64_t stride_b = 0, stride_h = 0, stride_q = 0, stride_k = 0;
  int64_t size_b = 1, size_h = 1, size_q = 1, size_k = 1;
  int64_t head_div = 1;

  bool present() const { return ptr != nullptr; }
  int64_t offset(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return b * stride_b + (h / head_div) * stride_h + i * stride_q + j * stride_k;
  }
};

// Strides of a (B, S, H, D) tensor with a contiguous last dimension.
struct SeqTensor {
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
  int64_t offset(int64_t b, int64_t s, int64_t h) const {
    return b * batch_stride + s * row_stride + h * head_stride;
  }
};

// The gate of gated attention (docs/semantics.md, "Gated attention"): a per-query alpha and a
// per-key delta whose product, through gate_fn, joins the scores:
//   s_ij += scale * g(alpha[b, i, h] * delta[b, j, h / (H / Hkv)])
// g = logsigmoid (log(sigmoid(x)), always <= 0: a soft key gate) or the identity.
enum class GateFn : int32_t { kLogSigmoid = 0, kLinear = 1 };

struct GateOperand {
  // alpha (B, Sq, H), delta (B, Sk, Hkv): any strides (offset(b, row, head) of SeqTensor);
  // dtype q's or float32. Varlen: (total_q, H) and (total_k, Hkv), batch stride 0, the rows of
  // sequence b at cu_seqlens offsets like q's and k's. alpha == null = no gate.
  const void* alpha = nullptr;
  DType alpha_dtype = DType::kOther;
  SeqTensor alpha_strides;
  const void* delta = nullptr;
  DType delta_dtype = DType::kOther;
  SeqTensor delta_strides;
  GateFn fn = GateFn::kLogSigmoid;
  // Gate skipping (docs/semantics.md, "Gate skipping"): one byte per cell of kKeepCell queries x
  // kKeepCell keys of a (batch, head), in the sequence's own positions, 0 where the cell is
  // skipped (its pairs count as masked). uint8 (B, H, ceil(Sq / cell), ceil(Sk / cell)), varlen
  // (B, H, ceil(max_seqlen_q / cell), ceil(max_seqlen_k / cell)); contiguous, so the key cells
  // of a query cell are consecutive. null = exact.
  static constexpr int64_t kKeepCell = 128;
  const uint8_t* keep = nullptr;
  int64_t keep_bs = 0, keep_hs = 0, keep_ms = 0;  // the strides of batch, head and query cell

  bool present() const { return alpha != nullptr; }
  // Whether query i and key j's cell is computed (any i, j inside the sequence).
  bool keeps(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return keep == nullptr || keep[b * keep_bs + h * keep_hs + i / kKeepCell * keep_ms + j / kKeepCell] != 0;
  }
};

// Windows with sinks, per head (docs/semantics.md, "Windows with sinks"): int32 (Hw, 4),
// Hw in {1, Hkv, H}, rows [sink, near, gap, far], the row of query head h at
//   ptr + (h / head_div) * stride_h   (stride_h = 0 when Hw = 1).
// With d = i + offset - j (offset = Sk - Sq, bottom-right aligned like causal), key j is
// visible to query i iff d >= 0 and (j < sink or d < near or near + gap <= d < near + gap + far).
// Same device as q. ptr == null = off.
struct LocalWindows {
  const int32_t* ptr = nullptr;
  int64_t stride_h = 0, head_div = 1;

  bool present() const { return ptr != nullptr; }
  const int32_t* row(int64_t h) const { return ptr + (h / head_div) * stride_h; }
};

struct ForwardParams {
  DType dtype = DType::kOther;  // element type of q, k, v and out
  DeviceKind device = DeviceKind::kCPU;
  int32_t device_id = 0;
  void* stream = nullptr;       // cudaStream_t for CUDA, unused on CPU

  int64_t batch = 0, seqlen_q = 0, seqlen_k = 0;
  int64_t num_heads = 0, num_heads_kv = 0, head_dim = 0;

  const void* q = nullptr;  SeqTensor q_strides;
  const void* k = nullptr;  SeqTensor k_strides;
  const void* v = nullptr;  SeqTensor v_strides;
  void* out = nullptr;      SeqTensor out_strides;
  // (B, H, Sq), contiguous. float32, or float64 when dtype is float64. Empty rows get -inf.
  // Varlen: (H, total_q), contiguous. Row i of sequence b, head h lives at
  //   lse[b * lse_batch_stride + h * lse_head_stride + (varlen ? cu_seqlens_q[b] : 0) + i]
  // dense: lse_batch_stride = H * Sq, lse_head_stride = Sq; varlen: 0 and total_q.
  void* lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  BroadcastOperand mask;  // dtype kBool: true = may attend
  BroadcastOperand bias;  // dtype == dtype or kFloat32: added to the (scaled, capped) scores
  GateOperand gate;       // gated attention: scale * g(alpha_i delta_j) added like the bias
  LocalWindows windows;   // windows with sinks, on top of mask / causal / window

  double scale = 1.0;
  double softcap = 0.0;  // 0 = off
  bool causal = false;
  // After normalization: causal folded in (window_right = 0 when causal), -1 = unbounded.
  // Key j is allowed for query i iff
  //   (window_left  < 0 || j >= i + seqlen_k - seqlen_q - window_left) &&
  //   (window_right < 0 || j <= i + seqlen_k - seqlen_q + window_right)
  // (with key_positions: j is the row's original position, seqlen_k is seqlen_k_original).
  int64_t window_left = -1, window_right = -1;

  // ---- Packed variable-length batch (FlashAttention varlen); cu_seqlens_q == null = dense.
  // q, out (total_q, H, D) and k, v (total_k, Hkv, D) are SeqTensors with batch_stride 0:
  // sequence b holds query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows
  // [cu_seqlens_k[b], cu_seqlens_k[b + 1]), so its row i is at offset(0, cu_seqlens_q[b] + i, h).
  // `batch` is the number of sequences, seqlen_q / seqlen_k are max_seqlen_q / max_seqlen_k
  // (upper bounds of every sequence's length, for sizing grids). Causal and window are
  // bottom-right aligned per sequence (offset = its own len_k - len_q).
  // mask / bias are key-side, (Hb, total_k) with Hb in {1, Hkv, H}: size_b = size_q = 1,
  // stride_b = stride_q = 0, size_k = total_k, and element (b, h, i, j) lives at
  // ptr[(h / head_div) * stride_h + (cu_seqlens_k[b] + j) * stride_k] (shared by all queries).
  // The cu_seqlens arrays are int32, (batch + 1,), contiguous, on `device` (host pointers on
  // CPU, device pointers on CUDA); make_varlen_*_params checked their values when on the host.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0, total_k = 0;

  // ---- Gathered keys (the "gather path" of dynamic top-k); key_positions == null = off.
  // k, v (and a key-indexed mask/bias, whose key dimension is then seqlen_k or 1) hold only the
  // gathered rows: seqlen_k is the gathered count K. Row j of (b, h) stands for the original
  // key position
  //   pos = key_positions[b * key_positions_stride_b + (h / key_positions_head_div)
  //                       * key_positions_stride_h + j]
  // (int32, (1 or B, 1 / Hkv / H, K), unit stride along j; a head dim of 1 has stride 0 and
  // head_div 1, of Hkv head_div H / Hkv, like a bias). Causal and window test pos instead of j,
  // bottom-right aligned with the original length: offset = seqlen_k_original - seqlen_q.
  // A pos < 0 or >= seqlen_k_original is a padding row: never allowed, dk = dv = dbias = 0.
  // Contract (checked on the CPU, not on CUDA): within each (b, h) the valid positions are
  // strictly increasing and come first, padding rows only after them, so the keys a query
  // block may reach form one contiguous range of rows, found by binary search.
  // Not combined with varlen.
  const int32_t* key_positions = nullptr;
  int64_t key_positions_stride_b = 0, key_positions_stride_h = 0;
  int64_t key_positions_head_div = 1;
  int64_t seqlen_k_original = 0;  // meaningful only with key_positions
  // Optional, only with key_positions: int32 with key_positions' shape and strides. Row j of
  // (b, h) is allowed only for queries i < key_ends[same index] (i: this call's query index),
  // on top of every other rule; rows whose end is <= a query block's first query are masked
  // for the whole block. Per-query top-k runs on it: the queries that keep a key form one
  // interval, whose start is the causal rule and whose end is this bound.
  const int32_t* key_ends = nullptr;
  // Optional, only with key_positions: indexed keys. int32 with key_positions' shape and
  // strides: gathered row j of (b, h) is row key_rows[same index] of the source k, v, which are
  // then (batch / key_rows_batch_div, key_rows_source_len, Hkv, D) (batch b reads source batch
  // b / key_rows_batch_div); an index < 0 or >= key_rows_source_len reads a zero row. The
  // kernels read the rows in place instead of a gathered copy; dk, dv stay (B, seqlen_k, Hkv,
  // D), one row per gathered row. CUDA only.
  const int32_t* key_rows = nullptr;
  int64_t key_rows_batch_div = 1, key_rows_source_len = 0;

  // ---- Decode (docs/decode.md): the split-KV kernel for short query lengths; decode_splits == 0
  // = off (the general kernels). Only make_decode_forward_params sets these, CUDA only.
  // seqused_k: int32 (B,) on the device, or null: batch b reads keys [0, seqused_k[b]) only
  // (clamped to seqlen_k), and causal / window are aligned with that length (off = len - Sq);
  // the keys behind it are never loaded. block_table: int32, paged keys: key j of batch b is
  // row j % page_size of page block_table[b * block_table_stride + j / page_size], a page
  // being k + page * k_strides.batch_stride (v likewise); seqlen_k = max_blocks * page_size.
  // key_rows (indexed keys, key_positions the same rows; DecodeInputs::gathered): key j of
  // (b, kv head) is row key_rows[..., j] of batch b, read in place.
  // split_workspace: float32, decode_splits * B * H * Sq * (D + 1) elements when
  // decode_splits > 1 (the partial outputs and their lse, combined by a second kernel).
  // split_workspace_floats: its size (any workspace the call passed, also with one split);
  // decode_balanced: the call allows the balanced form (DecodeInputs::balanced).
  int64_t decode_splits = 0;
  int64_t split_workspace_floats = 0;
  bool decode_balanced = false;
  const int32_t* seqused_k = nullptr;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0, page_size = 0;
  float* split_workspace = nullptr;
  // allocate_out (optional, decode only): out's storage, allocated by the call once its first
  // decode kernel is launched where that kernel writes partial rows only (key splits, the merge
  // writing out), so that the GPU starts without waiting for the allocation; at once otherwise.
  // out's data is then a placeholder (never read or written) and its shape and strides are
  // checked as given; allocate_out(allocate_out_context) returns storage of that layout. A call
  // that launches nothing (an empty batch, query or head axis) never calls it. Null: out holds
  // its storage already.
  void* (*allocate_out)(void* context) = nullptr;
  void* allocate_out_context = nullptr;

  bool is_varlen() const { return cu_seqlens_q != nullptr; }
  bool has_key_positions() const { return key_positions != nullptr; }
  bool has_key_ends() const { return key_ends != nullptr; }
  bool has_key_rows() const { return key_rows != nullptr; }
  int64_t group_size() const { return num_heads_kv > 0 ? num_heads / num_heads_kv : 1; }
  // The key length causal/window are aligned with.
  int64_t window_seqlen_k() const { return has_key_positions() ? seqlen_k_original : seqlen_k; }
};

struct BackwardParams {
  ForwardParams fwd;  // inputs, out and lse of the forward pass (read only here)

  const void* dout = nullptr;  SeqTensor dout_strides;
  void* dq = nullptr;          SeqTensor dq_strides;
  void* dk = nullptr;          SeqTensor dk_strides;  // (B, Sk, Hkv, D): summed over each GQA group
  void* dv = nullptr;          SeqTensor dv_strides;

  // Same dtype, sizes and broadcast structure as fwd.bias, its own strides (varlen: (Hb,
  // total_k), sequence b's keys at (cu_seqlens_k[b] + j) * dbias_stride_k). Null = bias
  // does not require grad. Every element is written (sums over broadcast dims, 0 where
  // nothing is allowed).
  void* dbias = nullptr;
  int64_t dbias_stride_b = 0, dbias_stride_h = 0, dbias_stride_q = 0, dbias_stride_k = 0;

  // Gradients of the gate's alpha and delta (their shapes, dtypes and layouts; null = not
  // wanted). Every element is written (0 where nothing is allowed).
  void* dalpha = nullptr;  SeqTensor dalpha_strides;
  void* ddelta = nullptr;  SeqTensor ddelta_strides;
  // CUDA scratch for dalpha (null on CPU): float32, dalpha_accum_slices slices laid out like lse
  // (H * total query rows each): one slice (atomic adds), or in deterministic mode one per key
  // block (at least ceil(Sk / 64)).
  void* dalpha_accum = nullptr;
  int64_t dalpha_accum_slices = 0;

  // Optional scratch provided by the caller (CUDA backend): null on CPU, which keeps its own.
  // Varlen: softmax_delta is (H, total_q) and dq_accum (total_q, H, D), laid out like lse and
  // q; they have no padding rows, so a kernel must predicate its reads and writes to the rows
  // of the sequence it works on (never touch rows of a neighbouring sequence).
  void* softmax_delta = nullptr;  // (B, H, Sq) float32: rowsum(dO * O)
  void* dq_accum = nullptr;       // (B, Sq, H, D) float32, contiguous: accumulator for dq
  // (size_b, size_h, size_q, size_k) float32, contiguous: accumulator for a dbias that is
  // reduced across CTAs (bias broadcast over batch or heads); null when not needed.
  void* dbias_accum = nullptr;

  bool deterministic = false;
  // false: the softmax statistics (row max and sum) and Delta_i = sum_j P_ij dP_ij are
  // recomputed from the keys of this call, and fwd.lse / fwd.out are not read (CPU, and the
  // CUDA exact path). true: FlashAttention's P = exp(S - lse) and Delta = rowsum(dO * out) from
  // the given lse and out, so that a call over a part of the keys of a softmax normalized over
  // more keys (context parallelism: lse and out of the whole row) gives that part's share of
  // the gradients. An empty row has lse = -inf (P = 0).
  bool forward_stats = false;

  int64_t dbias_offset(int64_t b, int64_t hb, int64_t i, int64_t j) const {
    // hb is the bias head index (already divided by head_div).
    return b * dbias_stride_b + hb * dbias_stride_h + i * dbias_stride_q + j * dbias_stride_k;
  }
};

}  // namespace dmattn
