// Public C++ entry points: validate + fill params, then run on the params' device.
#pragma once

#include "dmattn/error.h"
#include "dmattn/params.h"
#include "dmattn/types.h"

namespace dmattn {

struct AttentionOptions {
  bool causal = false;
  int64_t window_left = -1;   // -1 = unbounded; other negatives are an error
  int64_t window_right = -1;
  // Softmax scale; NaN means "default" = 1/sqrt(head_dim).
  double scale = __builtin_nan("");
  double softcap = 0.0;
  bool deterministic = false;
};

// Keys gathered out of a longer key sequence (ForwardParams::key_positions; docs/semantics.md,
// "Gather path"): key_positions int32 (1 or B, 1 / Hkv / H, K) with K = k.shape[1] and a
// contiguous last dimension; seqlen_k_original >= 0 the length the positions index into.
// key_positions == null: k, v hold every key (seqlen_k_original is ignored).
// key_ends (optional, only with key_positions): int32 of key_positions' shape, strides and
// device; row j is allowed only for queries i < key_ends[b, h', j] (ForwardParams::key_ends).
// key_rows (optional, only with key_positions; CUDA): int32 of key_positions' shape, strides
// and device: k, v are then the source (B / r, S, Hkv, D) for some r dividing B, and gathered
// row j of (b, h) is their row key_rows[b, h', j] of batch b / r (ForwardParams::key_rows);
// the gathered count K is key_positions.shape[2].
struct GatheredKeys {
  const TensorDesc* key_positions = nullptr;
  int64_t seqlen_k_original = 0;
  const TensorDesc* key_ends = nullptr;
  const TensorDesc* key_rows = nullptr;
};

// Validates every argument (rank, shape, dtype, device, strides, head ratio, head dim,
// options) and fills ForwardParams. Throws dmattn::Error naming the offending argument.
//   q (B, Sq, H, D); k, v (B, Sk, Hkv, D); out like q; lse (B, H, Sq) float32 (float64 for
//   float64 inputs); mask/bias may be null, rank <= 4, right-aligned broadcast to (B, H, Sq, Sk).
ForwardParams make_forward_params(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                  const TensorDesc& out, const TensorDesc& lse,
                                  const TensorDesc* mask, const TensorDesc* bias,
                                  const AttentionOptions& options,
                                  const GatheredKeys& gathered = {});

// Same, plus dout (like q), dq (like q), dk/dv (like k), dbias (null, or bias's exact shape and
// dtype), optional CUDA scratch (softmax_delta (B, H, Sq) float32, dq_accum (B, Sq, H, D)
// float32, dbias_accum float32 with the bias's sizes); the CPU backend ignores the scratch.
BackwardParams make_backward_params(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                    const TensorDesc& out, const TensorDesc& lse,
                                    const TensorDesc* mask, const TensorDesc* bias,
                                    const TensorDesc& dout, const TensorDesc& dq,
                                    const TensorDesc& dk, const TensorDesc& dv,
                                    const TensorDesc* dbias, const TensorDesc* softmax_delta,
                                    const TensorDesc* dq_accum, const TensorDesc* dbias_accum,
                                    const AttentionOptions& options,
                                    const GatheredKeys& gathered = {});

// ---- Packed variable-length batches (docs/semantics.md, "Packed variable-length batches").

// How a varlen batch is packed: int32 cu_seqlens of length B + 1 (0, then running totals) and
// upper bounds of the per-sequence lengths.
struct VarlenPacking {
  TensorDesc cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
};

// Checks the *values* of host-resident cu_seqlens: first entry 0, non-decreasing, last entry
// total_q / total_k, every length <= its max_seqlen. make_varlen_forward_params calls it for
// CPU tensors; for CUDA tensors the caller copies cu_seqlens to the host and calls it itself
// (the Python ops do), because the core never synchronizes with the device.
void check_cu_seqlens_values(const VarlenPacking& packing, int64_t total_q, int64_t total_k);

// Varlen counterpart of make_forward_params: q (total_q, H, D); k, v (total_k, Hkv, D); out
// like q; lse (H, total_q) float32 (float64 for float64 inputs); mask/bias null or key-side
// (Hb, total_k) with Hb in {1, Hkv, H}. Every dtype/device/stride/option rule of the dense
// path applies unchanged.
ForwardParams make_varlen_forward_params(const TensorDesc& q, const TensorDesc& k,
                                         const TensorDesc& v, const VarlenPacking& packing,
                                         const TensorDesc& out, const TensorDesc& lse,
                                         const TensorDesc* mask, const TensorDesc* bias,
                                         const AttentionOptions& options);

// Varlen counterpart of make_backward_params: dout/dq like q, dk/dv like k, dbias like bias;
// optional CUDA scratch softmax_delta (H, total_q), dq_accum (total_q, H, D), dbias_accum with
// the bias's Hb * total_k elements, all float32.
BackwardParams make_varlen_backward_params(
    const TensorDesc& q, const TensorDesc& k, const TensorDesc& v, const VarlenPacking& packing,
    const TensorDesc& out, const TensorDesc& lse, const TensorDesc* mask, const TensorDesc* bias,
    const TensorDesc& dout, const TensorDesc& dq, const TensorDesc& dk, const TensorDesc& dv,
    const TensorDesc* dbias, const TensorDesc* softmax_delta, const TensorDesc* dq_accum,
    const TensorDesc* dbias_accum, const AttentionOptions& options);

// ---- Gated attention and windows with sinks (docs/semantics.md, "Gated attention" and
// "Windows with sinks"), on top of params made by the functions above (dense or varlen).
struct ScoreTerms {
  // alpha (B, Sq, H) and delta (B, Sk, Hkv) -- varlen: (total_q, H), (total_k, Hkv) --, any
  // strides, dtype q's or float32, both or neither.
  const TensorDesc* alpha = nullptr;
  const TensorDesc* delta = nullptr;
  GateFn gate_fn = GateFn::kLogSigmoid;
  // int32 (Hw, 4), Hw in {1, Hkv, H}, rows [sink, near, gap, far], entries >= 0 (checked when
  // on the host), contiguous rows.
  const TensorDesc* windows = nullptr;
  // Gate skipping's cells (GateOperand::keep): uint8, contiguous, with a gate, on q's device;
  // null = exact. Built by dmattn.gate_skip from alpha and delta.
  const TensorDesc* gate_keep = nullptr;
};

// Validates `terms` against the problem `params` describes (q's device, sizes, varlen or not)
// and fills params.gate / params.windows. Throws dmattn::Error naming the argument.
void set_score_terms(const ScoreTerms& terms, ForwardParams& params);

// The backward's counterpart: set_score_terms on params.fwd, then the gradients dalpha / ddelta
// (each optional, only with a gate: exactly alpha's / delta's shape and dtype, any strides) and
// dalpha's CUDA scratch dalpha_accum (BackwardParams::dalpha_accum: float32, contiguous, a
// multiple of H * total query rows elements; the CPU backend ignores it).
void set_score_terms(const ScoreTerms& terms, const TensorDesc* dalpha, const TensorDesc* ddelta,
                     const TensorDesc* dalpha_accum, BackwardParams& params);

// ---- Decode (docs/decode.md): the split-KV kernel for short query lengths, CUDA only.

// The key-side inputs of a decode call: per-batch key lengths, paged keys, the split-KV
// workspace. k / v are (B, Sk, Hkv, D) when block_table is null, else pages
// (num_blocks, page_size, Hkv, D) with block_table int32 (B, max_blocks) (unit stride along the
// blocks) and the key axis Sk = max_blocks * page_size (what mask / bias broadcast against).
// seqused_k: int32 (B,) contiguous, or null (every batch holds Sk keys). workspace: float32,
// contiguous, at least num_splits * B * H * Sq * (D + 1) elements when num_splits > 1.
// k_name / v_name: how errors name k and v (the cache call's "k_cache" / "v_cache"; a paged
// cache is always named so).
// gathered: indexed keys (attention_topk's decoding step), contiguous keys only: key_positions
// and key_rows the same int32 (1 or B, 1 or Hkv, K) tensor, no key_ends; k, v are the source
// (B, S, Hkv, D) and the K rows of (b, kv head) are read in place. The rules then see the
// gathered index, not the position, so only calls where positions cannot matter are taken: no
// left window, and one query or no right window / causal (a last query sees every earlier
// key). Every row must lie in [0, S) (the selection's positions do): one outside reads zeros
// (never memory outside k, v) but is not masked.
struct DecodeInputs {
  const TensorDesc* seqused_k = nullptr;
  const TensorDesc* block_table = nullptr;
  const TensorDesc* workspace = nullptr;
  GatheredKeys gathered;
  int64_t num_splits = 1;
  // The call may run in the balanced form (docs/decode.md, "Balanced shares": the batch's key
  // stages in equal shares over the GPU's CTA places, rows cut anywhere), where its shapes and
  // the kernel allow and the workspace holds decode_balanced_splits' answer of splits:
  // attention_with_kvcache's calls. Others keep their splits (a packed batch's sequences must
  // equal their own calls bit for bit).
  bool balanced = false;
  const char* k_name = "k";
  const char* v_name = "v";
};

// The number of key splits the decode path uses for this problem on `device` (a property of
// the shapes and the GPU, never of tensor values), or 0 where it does not apply: another
// device, no CUDA build, seqlen_q * (num_heads / num_heads_kv) > max_rows, or a head dim or
// head ratio the decode kernel does not take (the general kernels then report the error).
int64_t decode_splits(DeviceKind device, int32_t device_id, int64_t batch, int64_t seqlen_q,
                      int64_t num_heads, int64_t num_heads_kv, int64_t head_dim, int64_t seqlen_k,
                      int64_t max_rows);

// Packed batches on the decode kernels (docs/decode.md, "Packed batches"): the split count
// the workspace of make_varlen_decode_forward_params needs (its launches' largest), 1 where one
// split serves every sequence, or 0 where the decode kernels take none of the sequences
// (another device, no CUDA build, every sequence above kDecodePackedMaxRows query rows, or a
// head dim or head ratio they do not take). A shape property, like decode_splits.
int64_t decode_packed_splits(DeviceKind device, int32_t device_id, int64_t num_heads, int64_t num_heads_kv,
                             int64_t head_dim, int64_t max_seqlen_q, int64_t max_seqlen_k);

// The workspace, in splits as decode_splits counts them, that the balanced form of a call of
// these shapes needs (DecodeInputs::balanced), or 0 where its shapes do not take that form. A
// shape property, like decode_splits.
int64_t decode_balanced_splits(DeviceKind device, int32_t device_id, int64_t batch, int64_t seqlen_q,
                               int64_t num_heads, int64_t num_heads_kv, int64_t head_dim, int64_t seqlen_k);

// make_varlen_forward_params for the decode kernels, which then compute the sequences of at
// most 64 query rows (len_q * num_heads / num_heads_kv) and leave the other rows of out and lse
// as they are (the general kernels' call computes them). num_splits: decode_packed_splits'
// answer (>= 1); workspace: float32, contiguous, num_splits * H * total_q * (D + 1) elements when
// num_splits > 1. Each sequence's rows equal those of the dense decode call of that sequence
// alone, bit for bit.
ForwardParams make_varlen_decode_forward_params(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                                const VarlenPacking& packing, const TensorDesc& out,
                                                const TensorDesc& lse, const TensorDesc* mask, const TensorDesc* bias,
                                                const AttentionOptions& options, const TensorDesc* workspace,
                                                int64_t num_splits);

// make_forward_params for the decode path: every rule of the dense call (q, out, lse, mask,
// bias, options) with the key side of `inputs`; sets decode_splits = inputs.num_splits (>= 1).
ForwardParams make_decode_forward_params(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                         const TensorDesc& out, const TensorDesc& lse, const TensorDesc* mask,
                                         const TensorDesc* bias, const AttentionOptions& options,
                                         const DecodeInputs& inputs);

// Run on params.device. CPU always available; CUDA when built with it (otherwise an Error).
// Varlen params (params.is_varlen()) and gathered keys (params.has_key_positions()) run on the
// CPU; on CUDA they raise kNotImplemented until the kernels read them.
void run_forward(const ForwardParams& params);
void run_backward(const BackwardParams& params);

// The gather path's glue on CUDA (dmattn.attention_topk without a mask), in destination-passing
// style on the current stream `stream` (a cudaStream_t):
//   select_topk_positions: per row (b, h) of bias (rows_b, rows_h, Sk) -- 16/32-bit floats, any
//     strides -- the `keep` keys with the largest bias (ties: the lower key index; -0.0 == 0.0;
//     bit-pattern order, as dmattn.dynamic_mask) in increasing order, into positions, int32
//     (rows_b, rows_h, keep) contiguous; bias may also be the key-side bias itself, (rows_b,
//     rows_h, 1, Sk); given, values (bias's dtype, (rows_b, rows_h, keep) or (rows_b, rows_h, 1,
//     keep), contiguous) receives the bias at each selected position;
//   gather_key_rows: k_rows[b, j, g] = k[b, positions[b', g', j], g] (v likewise; k, v (B, Sk, Hkv,
//     D), positions (1 or B, 1 or Hkv, K) contiguous, k_rows / v_rows (B, K, Hkv, D) contiguous),
//     and, given, bias_rows[b', g', j] = bias[b', g', positions[b', g', j]] (bias (rows of the
//     positions..., Sk), bias_rows contiguous). A negative position gives zeros;
//   scatter_key_rows: the inverse for the gradients of a gather at distinct positions (each row
//     strictly increasing, negative padding last): dk[b, s, g] = dk_rows[b, j, g] where
//     positions[b', g', j] == s, zeros at the keys no position names (dv likewise; shapes as in
//     gather_key_rows, every tensor contiguous), and, given, dbias (rows of the positions..., 1,
//     Sk) from dbias_rows (..., 1, K) the same way. Every element of the outputs is written.
void select_topk_positions(const TensorDesc& bias, int64_t keep, const TensorDesc& positions, const TensorDesc* values,
                           void* stream);
void gather_key_rows(const TensorDesc& k, const TensorDesc& v, const TensorDesc& positions, const TensorDesc& k_rows,
                     const TensorDesc& v_rows, const TensorDesc* bias, const TensorDesc* bias_rows, void* stream);
void scatter_key_rows(const TensorDesc& dk_rows, const TensorDesc& dv_rows, const TensorDesc& positions,
                      const TensorDesc& dk, const TensorDesc& dv, const TensorDesc* dbias_rows, const TensorDesc* dbias,
                      void* stream);

// Gate skipping's cells on CUDA (docs/semantics.md, "Gate skipping"; python/dmattn/gate_skip.py
// computes them with framework ops elsewhere), on `stream`: from alpha (B, Sq, H) and delta (B,
// Sk, Hkv) -- packed: (total_q, H) / (total_k, Hkv) with int32 cu_seqlens_q / cu_seqlens_k (B + 1)
// and the max lengths -- in float32, float16 or bfloat16, any strides, into keep, bool (B, H,
// ceil(max_q / 128), ceil(max_k / 128)) contiguous. threshold > 0; gate_fn as in ScoreTerms;
// window_left / window_right: -1 unbounded; adaptive: flash-sparse-attn's is_adapt_gate (with
// causal). Every element of keep is written. Returns false (writing nothing) where the cells of
// one (b, h) exceed the kernel's shared memory; the caller then takes the framework path.
struct GateKeepOptions {
  double scale = 1.0, threshold = 0.0;
  GateFn gate_fn = GateFn::kLogSigmoid;
  bool causal = false, adaptive = false;
  int64_t window_left = -1, window_right = -1;
};
bool gate_keep_cells(const TensorDesc& alpha, const TensorDesc& delta, const TensorDesc* cu_seqlens_q,
                     const TensorDesc* cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                     const GateKeepOptions& options, const TensorDesc& keep, void* stream);

// Per-query causal top-k glue (docs/semantics.md, "Per-query causal top-k"), CPU or CUDA tensors
// (CUDA: on `stream`), destination-passing, every tensor int32 and contiguous:
//   prefix_thresholds: per row r of ranks (R, S) -- the rank of key j in the selection order
//     (0 = selected first; S for a key that may not be selected) -- and order (R, S), the key at
//     each rank of a selectable key (order[r, ranks[r, j]] == j), S at the ranks after them:
//     thresholds[r, v] = the keep-th smallest rank among the selectable keys 0..v, or S while
//     fewer than keep of them are. Key j <= v is kept by prefix v iff ranks[r, j] <= thresholds.
//   segment_candidates: from interval ends (Rb, Rh, S) -- key j is kept by the queries whose
//     visible prefix v = i + offset lies in [j, ends[j]) -- the candidate keys of each segment of
//     seg_len queries (segment s: queries [s * seg_len, (s + 1) * seg_len), first prefix P = s *
//     seg_len + offset): keys j < P + seg_len with ends[j] > max(j, P) -- first
//     those before the segment (j < P) by increasing end bucket ceil(min(ends[j] - P, seg_len) /
//     span), span = 64 while seg_len <= 16320 (src/api/segment_order.h), index order inside a
//     bucket; then the others in increasing order -- into row (b * num_segments + s, h) of positions / key_ends / index (Rb * num_segments, Rh,
//     W): positions j - P + num_segments * seg_len + offset - seg_len (causal on them, with
//     seqlen_k_original = num_segments * seg_len + offset and seg_len queries, is j <= i +
//     offset) for the segment's own keys, and for the n keys before it, visible to all its
//     queries, the n positions just below the segment's first (increasing), key_ends ends[j] - P, index j; padding -1, 0, -1 after them; and slots (Rb,
//     num_segments, Rh, S): the row of key j in segment s's list, -1 where it is none. W must hold
//     every segment's candidates (min(keep, S) + seg_len does); offset >= 0.
void prefix_thresholds(const TensorDesc& ranks, const TensorDesc& order, int64_t keep, const TensorDesc& thresholds,
                       void* stream);
// interval_ends (CUDA): the whole selection after the sort, three kernels. From sorted (R, S)
// int64 -- per row the keys in selection order (the argsort of the selection key, keys that
// `allowed` (bool (R, S) or null) excludes last) -- it writes ranks and order as
// prefix_thresholds takes them (S for excluded keys, S at their ranks), the thresholds, and
// ends (R, S): for a selectable key j the first prefix v >= j whose threshold falls below j's
// rank (S: kept to the end), for an excluded key j itself (never kept). ranks, order,
// thresholds and ends int32 (R, S) contiguous.
// selection_key (CUDA): the integer key of dmattn.masks.selection_key for (R, S) contiguous
// scores (float16, bfloat16 or float32) and allowed (bool (R, S) or null), in one kernel: key
// (R, S) int32 (16-bit scores and S <= 2^16) or int64 = ordered bits * 2^16 (2^32) - index, NaN
// as +inf, excluded keys at the key dtype's minimum.
void selection_key(const TensorDesc& scores, const TensorDesc* allowed, const TensorDesc& key, void* stream);
void interval_ends(const TensorDesc& sorted, const TensorDesc* allowed, int64_t keep, const TensorDesc& ranks,
                   const TensorDesc& order, const TensorDesc& thresholds, const TensorDesc& ends, void* stream);
void segment_candidates(const TensorDesc& ends, int64_t offset, int64_t seg_len, const TensorDesc& positions,
                        const TensorDesc& key_ends, const TensorDesc& index, const TensorDesc& slots, void* stream);
// The per-query path's K / V row copies on CUDA (the CPU composes torch ops), current stream:
//   gather_segment_rows: k_rows[b', w, g] = k[b' / (B' / B), index[b', g', w], g / (G / Hkv)] (v
//     likewise; zeros where index < 0): k, v (B, S, Hkv, D) with a contiguous last dim, 16- or
//     32-bit floats; index int32 (B', 1 or G, W) contiguous with B' a multiple of B; rows (B', W,
//     G, D) contiguous, G a multiple of Hkv;
//   sum_segment_rows: dk[b, j, kvh] = the float32 sum, rounded once, of dk_rows[b * nseg + s,
//     slots[b, s, g', j], g] over the segments s and the heads g of kv head kvh where the slot is
//     >= 0 (dv likewise); rows (B * nseg, W, G, D), slots int32 (B, nseg, 1 or G, S), dk / dv (B,
//     S, Hkv, D), all contiguous.
void gather_segment_rows(const TensorDesc& k, const TensorDesc& v, const TensorDesc& index, const TensorDesc& k_rows,
                         const TensorDesc& v_rows, void* stream);
void sum_segment_rows(const TensorDesc& dk_rows, const TensorDesc& dv_rows, const TensorDesc& slots,
                      const TensorDesc& dk, const TensorDesc& dv, void* stream);

// Is the CUDA backend compiled in?
bool cuda_available();

// The device code of this build that CUDA device `device_id` runs: binary_arch, the
// architecture of the machine code the driver loaded (90 on an H100), and ptx_arch, the virtual
// architecture it was compiled from: the same number for the build's own machine code (sm_80,
// sm_90a), 80 where the driver JIT-compiled the compute_80 PTX (a GPU with no machine code in
// the build, or CUDA_FORCE_PTX_JIT=1). Both 0 when none runs there, and without CUDA.
struct CudaKernelCode {
  int binary_arch = 0;
  int ptx_arch = 0;
};
CudaKernelCode cuda_kernel_code(int32_t device_id);

// Whether `stream` (a cudaStream_t of the current CUDA device) is capturing a CUDA graph: work
// queued on it then runs at each replay, not now, so a buffer reused across calls (the decode
// calls' scratch) must not be baked into it. True where the runtime cannot tell (the legacy
// stream while another thread captures), false without CUDA.
bool stream_capturing(void* stream);

// Whether the calls of this thread may launch persistent kernels (the Hopper forward's grid of one
// CTA per multiprocessor, each taking tiles in turn; the default), or must launch one CTA per tile
// instead: then multiprocessors free up as tiles finish, and kernels of other streams (NCCL's
// transfers while a ring step computes) start during the call rather than after it. Returns the
// previous setting. DMATTN_FWD_PERSISTENT in the environment, where set, decides instead.
bool set_persistent_kernels(bool allowed);
bool persistent_kernels_allowed();

// Does the backend of `device` read ForwardParams::key_positions? run_forward / run_backward
// refuse key_positions (kNotImplemented) where it does not; the Python layer then falls back
// to the dense masked path.
bool key_positions_supported(DeviceKind device);

}  // namespace dmattn
