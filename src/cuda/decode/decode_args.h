// The decode kernels' argument block (docs/decode.md), filled once on the host from
// ForwardParams (decode_backend.cu). Plain data; device code reads nothing else.
#pragma once

#include <cstdint>

#include "dmattn/params.h"

namespace dmattn::cuda {

// Query rows per CTA: the M of the tensor-core tile (mma.sync m16n8k16). Rows are
// (query i, head g of the group) = i * group + g: the 4 query heads of the usual GQA ratio with
// up to 4 queries (speculative decoding) fill one tile; more rows take chunks of 64 rows.
inline constexpr int kDecodeRows = 16;
// More rows than one tile run in chunks of this many (decode_rows_kernel.h: four tiles a CTA,
// one K / V ring) ...
inline constexpr int kDecodeChunkRows = 64;
// ... for head dims up to this; larger ones take chunks of kDecodeRows rows.
inline constexpr int kDecodeRowsMaxHeadDim = 128;
// Packed query rows the narrow kernel holds (sm90/decode_narrow_sm90.h: wgmma's smallest N, the
// rows transposed onto it); on Hopper a call of that many rows or fewer takes it.
inline constexpr int kDecodeNarrowRows = 8;
// Key splits at most (the combine kernel keeps one weight per split in shared memory).
inline constexpr int kDecodeMaxSplits = 128;
// A split reads at least this many keys: below it the partial rows' write and the combine
// kernel cost more than the parallelism gains.
inline constexpr int kDecodeMinKeysPerSplit = 256;
// Packed batches take the decode kernels for sequences of up to this many query rows
// (len_q * group), in at most this many row chunks of kDecodeRows (head dims above 128).
inline constexpr int kDecodePackedMaxRows = 64;
inline constexpr int kDecodePackedMaxChunks = kDecodePackedMaxRows / kDecodeRows;

// How the decode kernel reads mask / bias entries: not at all; by loads into registers a step
// ahead (any layout); or copied with each step's K / V tiles into its cp.async ring (16-bit bias
// and bool mask running along the keys with stride 1, every row 16-byte aligned:
// DecodeArgs::operands_in_ring).
enum class DecodeOperands { kNone, kRegisters, kRing };

// A mask or bias element (b, h, i, j) at ptr[b * sb + (h / head_div) * sh + i * sq + j * sk]
// (stride 0 = broadcast); the decode kernel reads single elements, so every layout is legal.
struct DecodeOperand {
  const char* ptr = nullptr;  // null = absent
  int64_t sb = 0, sh = 0, sq = 0, sk = 0;
  int head_div = 1;
};

struct DecodeArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // (b, h, i) at b * lse_bs + h * lse_hs + i
  int64_t lse_bs = 0, lse_hs = 0;
  SeqTensor q_st, k_st, v_st, o_st;  // k / v: batch_stride is the page stride when paged
  int batch = 0, seqlen_q = 0, seqlen_k = 0, num_heads = 0, heads_kv = 0, group = 1, head_dim = 0;
  const int32_t* seqused_k = nullptr;    // null: every batch holds seqlen_k keys
  const int32_t* block_table = nullptr;  // null: contiguous keys
  int64_t bt_stride = 0;
  int page_size = 1;
  // Indexed keys, or null: key j of (b, kv head) is row key_rows[b * kr_sb + kvh * kr_sh + j] of
  // batch b; a row outside [0, kr_rows) is read as zeros.
  const int32_t* key_rows = nullptr;
  int64_t kr_sb = 0, kr_sh = 0;
  int kr_rows = 0;
  float q_scale = 1.f;  // folded into q: scale, or scale / softcap with a softcap
  float softcap = 0.f;  // 0 = off
  int64_t window_left = -1, window_right = -1;  // -1 = unbounded, causal folded in
  DecodeOperand mask, bias;
  bool bias_fp32 = false;
  bool operands_in_ring = false;  // DecodeOperands::kRing applies (decode_backend.cu)
  // Query-row chunks (of kDecodeRows rows, or kDecodeChunkRows above one tile; row i * group + g
  // = query i, head g of the group), and the CTAs that share one (batch, kv head):
  // row_chunks * num_splits, the chunk index varying fastest so that the chunks reading the
  // same keys run side by side (their second read hits L2).
  int row_chunks = 1, num_splits = 1;
  float* part_out = nullptr;  // (num_splits, B, H, Sq, D) float32, with num_splits > 1
  float* part_lse = nullptr;  // (num_splits, B, H, Sq) float32, natural log

  // Packed variable-length batches (attention_varlen), or null: sequence b holds query rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q / out / lse and key rows [cu_seqlens_k[b],
  // cu_seqlens_k[b + 1]) of k / v and the key-side mask / bias, all seen as one batch (batch
  // strides 0; the partial rows (num_splits, 1, H, total_q)); seqlen_q / seqlen_k are the
  // longest sequence's lengths and `batch` the number of sequences (the grid).
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int total_q = 0;
  // Packed: a launch computes only the sequences whose query rows (len_q * group) lie in
  // (rows_lo, rows_hi], the rows its kernel takes in a call of that one sequence, and gives
  // each the key splits that call would use: split_table[c - 1][m - 1] for c row chunks and
  // m = clamp(len_k / kDecodeMinKeysPerSplit, 1, kDecodeMaxSplits) (decode_num_splits with
  // one sequence). So a packed batch's rows equal its sequences' run one by one, bit for bit;
  // num_splits is then the largest count, and a sequence's splits past its own are empty.
  int rows_lo = 0, rows_hi = 0;
  uint8_t split_table[kDecodePackedMaxChunks][kDecodeMaxSplits] = {};

  // (Last, so that the fields above keep their offsets in every kernel's parameters.)
  int64_t workspace_floats = 0;  // what part_out points to (the call's whole workspace)
  // The balanced form (decode_balanced.h; attention_with_kvcache's calls): balanced_ctas CTAs
  // (0: the call does not allow it) take equal shares of the batch's key stages, a share free to
  // end one (batch, kv head) row and start the next; `balanced` where the launch runs it (the
  // grid then holds balanced_ctas CTAs, and partial rows lie in slots: balanced_slot_row).
  int balanced_ctas = 0;
  bool balanced = false;
};

}  // namespace dmattn::cuda
