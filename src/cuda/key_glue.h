// Launchers of the gather path's glue kernels (key_glue.cu): the top-k selection of key positions
// and the gathers of K / V / bias rows. Plain argument structs (pointers, int64 strides in
// elements, sizes); validation is the caller's (src/api/key_glue.cpp).
#pragma once

#include <cstdint>

namespace dmattn::cuda {

// Rows (b, h) of a key-side bias, bias[b * stride_b + h * stride_h + i * stride_k] for key i <
// num_keys (16- or 32-bit floats, elem_bytes 2 or 4); positions: int32 (rows_b, rows_h, keep),
// contiguous; 1 <= keep <= num_keys.
struct TopkPositionsArgs {
  const void* bias = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_k = 0;
  int64_t rows_b = 0, rows_h = 0, num_keys = 0, keep = 0;
  int elem_bytes = 2;
  int32_t* positions = nullptr;
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

void topk_positions(const TopkPositionsArgs& a, void* stream);
// vec16: every row and source offset 16-byte aligned (16-byte chunks), else element-wise.
void gather_rows(const GatherRowsArgs& a, bool vec16, void* stream);
void gather_bias(const GatherBiasArgs& a, void* stream);

}  // namespace dmattn::cuda
