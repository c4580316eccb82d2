// Launchers of the gather path's glue kernels (key_glue.cu): the top-k selection of key positions,
// the gathers of K / V / bias rows, and the scatter of their gradients back to full size. Plain
// argument structs (pointers, int64 strides in elements, sizes); validation is the caller's
// (src/api/key_glue.cpp).
#pragma once

#include <cstdint>
#include <climits>

namespace dmattn::cuda {

// Rows (b, h) of a key-side bias, bias[b * stride_b + h * stride_h + i * stride_k] for key i <
// num_keys (16- or 32-bit floats, elem_bytes 2 or 4); positions: int32 (rows_b, rows_h, keep),
// contiguous; 1 <= keep <= num_keys. values, when given: the bias at each selected position, same
// layout as positions in the bias's element type.
struct TopkPositionsArgs {
  const void* bias = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_k = 0;
  int64_t rows_b = 0, rows_h = 0, num_keys = 0, keep = 0;
  int elem_bytes = 2;
  // The bit pattern of +inf in the bias's format (0x7C00 float16, 0x7F80 bfloat16, 0x7F800000
  // float32): a larger magnitude is a NaN, which the selection ranks as +inf.
  uint32_t inf_bits = 0x7F800000u;
  int32_t* positions = nullptr;
  void* values = nullptr;
};

// dst[b, j, g, :] = src[b, positions[b', g', j], g, :] for operand 0 (k) and 1 (v): dst
// contiguous (batch, width, heads, row), src strides in elements (batch, key row, head), rows of
// row_bytes contiguous bytes; positions int32 (pos_batch, pos_heads, width) with pos_batch in
// {1, batch}, pos_heads in {1, heads}, pos_sb / pos_sh its strides; a negative position gives a
// zero row.
struct GatherRowsArgs {
  struct Operand {
    const void* src = nullptr;
    int64_t sb = 0, sr = 0, sh = 0;
    void* dst = nullptr;
  } operand[2];
  const int32_t* positions = nullptr;
  int64_t pos_batch = 1, pos_heads = 1, pos_sb = 0, pos_sh = 0;
  int64_t batch = 0, width = 0, heads = 0, row_bytes = 0;
  int elem_bytes = 2;
  // dst batch b reads source batch b / src_batch_div, dst head g source head g / src_head_div
  // (the per-query path: one dst batch per (batch, segment), one dst head per query head).
  int64_t src_batch_div = 1, src_head_div = 1;
  int64_t src_rows = INT64_MAX;  // a position at or past it also gives a zero row
};

// out[b, j, kvh, :] = sum over segments s and the gathered heads g of kv head kvh (g / group ==
// kvh, group = heads / heads_kv) with slot = slots[b, s, g' (0 when slot_heads == 1), j] >= 0 of
// rows[b * num_segments + s, slot, g, :], summed in float32 and rounded once; operands 0 and 1
// (dk, dv). rows contiguous (batch * num_segments, width, heads, head_dim); out contiguous
// (batch, num_keys, heads_kv, head_dim); slots int32 contiguous (batch, num_segments,
// slot_heads, num_keys).
struct SumSegmentRowsArgs {
  struct Operand {
    const void* rows = nullptr;
    void* out = nullptr;
  } operand[2];
  const int32_t* slots = nullptr;
  int64_t batch = 0, num_segments = 0, slot_heads = 1, num_keys = 0, width = 0;
  int64_t heads = 0, heads_kv = 0, head_dim = 0;
  int elem_bytes = 2;
  bool bf16 = true;  // 2-byte elements: bfloat16 (else float16)
};

// out[b, h, j] = bias[b * stride_b + h * stride_h + positions[b, h, j] * stride_k] (0 for a
// negative position); positions and out contiguous (rows_b, rows_h, width).
struct GatherBiasArgs {
  const void* bias = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_k = 0;
  int64_t rows_b = 0, rows_h = 0, width = 0;
  int elem_bytes = 2;
  const int32_t* positions = nullptr;
  void* out = nullptr;
};

// The inverse of a gather at distinct positions: dst[b, s, g, :] = rows[b, j, g, :] where
// positions[b', g', j] == s, else zeros, for operand 0 (dk) and 1 (dv); rows contiguous (batch,
// width, heads, row), dst contiguous (batch, num_keys, heads, row), rows of row_bytes contiguous
// bytes; positions int32 contiguous (pos_batch, pos_heads, width), pos_batch in {1, batch},
// pos_heads in {1, heads}, per row strictly increasing with negative padding last. Given bias_dst:
// bias_dst[b', g', s] = bias_rows[b', g', j] likewise, both contiguous (pos_batch, pos_heads, ...)
// with bias_bytes-byte elements.
struct ScatterRowsArgs {
  struct Operand {
    const void* rows = nullptr;
    void* dst = nullptr;
  } operand[2];
  const int32_t* positions = nullptr;
  int64_t pos_batch = 1, pos_heads = 1;
  int64_t batch = 0, num_keys = 0, width = 0, heads = 0, row_bytes = 0;
  int elem_bytes = 2;
  const void* bias_rows = nullptr;
  void* bias_dst = nullptr;
  int bias_bytes = 2;
};

void topk_positions(const TopkPositionsArgs& a, void* stream);
// vec16: every row and source offset 16-byte aligned (16-byte chunks), else element-wise.
void gather_rows(const GatherRowsArgs& a, bool vec16, void* stream);
void gather_bias(const GatherBiasArgs& a, void* stream);
// vec16: every row 16-byte aligned (16-byte chunks), else element-wise.
void scatter_rows(const ScatterRowsArgs& a, bool vec16, void* stream);
void sum_segment_rows(const SumSegmentRowsArgs& a, void* stream);

}  // namespace dmattn::cuda
