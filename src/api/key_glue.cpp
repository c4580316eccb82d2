// Validation and dispatch of the gather path's glue (select_topk_positions, gather_key_rows,
// scatter_key_rows) and the per-query path's row copies: CUDA only; the CPU path composes
// framework ops (python/dmattn/gather.py).
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "api/tensor_checks.h"
#include "dmattn/api.h"
#ifdef DMATTN_WITH_CUDA
#include "cuda/indexed/key_glue.h"
#endif

namespace dmattn {

namespace {

// The glue kernels move 16- or 32-bit float elements (bias keys, K / V rows).
void check_float_16_or_32(const TensorDesc& t, const char* name) {
  check(t.dtype == DType::kFloat16 || t.dtype == DType::kBFloat16 || t.dtype == DType::kFloat32, ErrorKind::kType,
        name, ": expected dtype float16, bfloat16 or float32, got ", dtype_name(t.dtype));
}

void check_cuda_tensor(const TensorDesc& t, const TensorDesc& ref, const char* name) {
  check(t.device == DeviceKind::kCUDA, ErrorKind::kValue, name, ": expected a CUDA tensor, got ",
        device_name(t.device), " (the gather path's glue runs on CUDA; the CPU composes torch ops)");
  checks::check_same_device(ref, t, name);
}

// The sources of a row gather (k, v (B, Sk, Hkv, D): 16- or 32-bit floats, rows of unit stride)
// and the call's other tensors, every one on k's GPU (checked in that order: k, v, others).
void check_gather_sources(const TensorDesc& k, const TensorDesc& v,
                          std::initializer_list<std::pair<const TensorDesc*, const char*>> others) {
  check_cuda_tensor(k, k, "k");
  check_cuda_tensor(v, k, "v");
  for (const auto& [t, name] : others) check_cuda_tensor(*t, k, name);
  checks::check_rank(k, 4, "k", "(B, Sk, Hkv, D)");
  checks::check_shape(v, k.shape, "v");
  check_float_16_or_32(k, "k");
  checks::check_dtype(v, k.dtype, "v");
  checks::check_last_dim_contiguous(k, "k");
  checks::check_last_dim_contiguous(v, "v");
}

// The key_positions operand of a (B, Sk, heads, D) k or dk: int32 (1 or B, 1 or heads, K),
// contiguous. Returns its shape.
struct PositionsShape {
  int64_t batch, heads, width;
};
PositionsShape check_key_positions(const TensorDesc& positions, int64_t batch, int64_t heads) {
  checks::check_dtype(positions, DType::kInt32, "positions");
  checks::check_rank(positions, 3, "positions", "(1 or B, 1 or Hkv, K)");
  checks::check_contiguous(positions, "positions");
  const PositionsShape shape{positions.shape[0], positions.shape[1], positions.shape[2]};
  check((shape.batch == 1 || shape.batch == batch) && (shape.heads == 1 || shape.heads == heads), ErrorKind::kValue,
        "positions: expected shape (1 or ", batch, ", 1 or ", heads, ", K), got ", positions.shape_text());
  return shape;
}

#ifndef DMATTN_WITH_CUDA
[[noreturn]] void no_cuda_glue() {
  fail(ErrorKind::kRuntime, "bias: this build of dmattn has no CUDA backend");
}
#else
// The arguments of a row gather from k and v into k_rows and v_rows (the top-k and the per-query
// paths'): operands, positions (pos_batch x pos_heads rows of `width`, contiguous), the rows'
// shape, and whether every address and stride allows 16-byte copies.
cuda::GatherRowsArgs gather_rows_args(const TensorDesc& k, const TensorDesc& v, const TensorDesc& k_rows,
                                      const TensorDesc& v_rows, const void* positions, int64_t pos_batch,
                                      int64_t pos_heads, int64_t batch, int64_t width, int64_t heads,
                                      int64_t head_dim, bool& vec16) {
  cuda::GatherRowsArgs a;
  const int64_t elem = int64_t(dtype_size(k.dtype));
  vec16 = (head_dim * elem) % 16 == 0;
  const TensorDesc* srcs[2] = {&k, &v};
  const TensorDesc* dsts[2] = {&k_rows, &v_rows};
  for (int i = 0; i < 2; ++i) {
    const TensorDesc& s = *srcs[i];
    a.operand[i] = {s.data, s.strides[0], s.strides[1], s.strides[2], dsts[i]->data};
    vec16 = vec16 && reinterpret_cast<uintptr_t>(s.data) % 16 == 0 && reinterpret_cast<uintptr_t>(dsts[i]->data) % 16 == 0;
    for (int d = 0; d < 3; ++d) vec16 = vec16 && (s.strides[d] * elem) % 16 == 0;
  }
  a.positions = static_cast<const int32_t*>(positions);
  a.pos_batch = pos_batch;
  a.pos_heads = pos_heads;
  a.pos_sb = pos_heads * width;
  a.pos_sh = width;
  a.batch = batch;
  a.width = width;
  a.heads = heads;
  a.row_bytes = head_dim * elem;
  a.elem_bytes = int(elem);
  return a;
}
#endif

}  // namespace

void select_topk_positions(const TensorDesc& bias, int64_t keep, const TensorDesc& positions, const TensorDesc* values,
                           void* stream) {
  check_cuda_tensor(bias, bias, "bias");
  check_cuda_tensor(positions, bias, "positions");
  // (rows_b, rows_h, Sk), or the key-side bias itself, (rows_b, rows_h, 1, Sk).
  check(bias.rank() == 3 || (bias.rank() == 4 && bias.shape[2] == 1), ErrorKind::kValue,
        "bias: expected shape (rows_b, rows_h, Sk) or (rows_b, rows_h, 1, Sk), got ", bias.shape_text());
  const int key_dim = bias.rank() == 4 ? 3 : 2;
  check_float_16_or_32(bias, "bias");
  const int64_t num_keys = bias.shape[key_dim];
  check(keep >= 1 && keep <= num_keys && num_keys < (int64_t(1) << 31), ErrorKind::kValue,
        "keep: expected 1 <= keep <= Sk = ", num_keys, " (< 2^31), got ", keep);
  checks::check_dtype(positions, DType::kInt32, "positions");
  checks::check_shape(positions, {bias.shape[0], bias.shape[1], keep}, "positions");
  checks::check_contiguous(positions, "positions");
  if (values != nullptr) {
    check_cuda_tensor(*values, bias, "values");
    checks::check_dtype(*values, bias.dtype, "values");
    if (values->rank() == 4)
      checks::check_shape(*values, {bias.shape[0], bias.shape[1], 1, keep}, "values");
    else
      checks::check_shape(*values, {bias.shape[0], bias.shape[1], keep}, "values");
    checks::check_contiguous(*values, "values");
  }
#ifdef DMATTN_WITH_CUDA
  cuda::TopkPositionsArgs a;
  a.bias = bias.data;
  a.stride_b = bias.strides[0];
  a.stride_h = bias.strides[1];
  a.stride_k = bias.strides[key_dim];
  a.rows_b = bias.shape[0];
  a.rows_h = bias.shape[1];
  a.num_keys = num_keys;
  a.keep = keep;
  a.elem_bytes = int(dtype_size(bias.dtype));
  a.inf_bits = bias.dtype == DType::kFloat16 ? 0x7C00u : bias.dtype == DType::kBFloat16 ? 0x7F80u : 0x7F800000u;
  a.positions = static_cast<int32_t*>(positions.data);
  a.values = values != nullptr ? values->data : nullptr;
  cuda::topk_positions(a, stream);
#else
  (void)stream;
  no_cuda_glue();
#endif
}

void gather_key_rows(const TensorDesc& k, const TensorDesc& v, const TensorDesc& positions, const TensorDesc& k_rows,
                     const TensorDesc& v_rows, const TensorDesc* bias, const TensorDesc* bias_rows, void* stream) {
  check_gather_sources(k, v, {{&positions, "positions"}, {&k_rows, "k_rows"}, {&v_rows, "v_rows"}});
  const int64_t batch = k.shape[0], num_keys = k.shape[1], heads = k.shape[2], head_dim = k.shape[3];
  const auto [pos_batch, pos_heads, width] = check_key_positions(positions, batch, heads);
  for (const auto& [t, name] : {std::pair{&k_rows, "k_rows"}, {&v_rows, "v_rows"}}) {
    checks::check_dtype(*t, k.dtype, name);
    checks::check_shape(*t, {batch, width, heads, head_dim}, name);
    checks::check_contiguous(*t, name);
  }
  check((bias == nullptr) == (bias_rows == nullptr), ErrorKind::kValue, "bias_rows: expected with bias, and only then");
  if (bias != nullptr) {
    check_cuda_tensor(*bias, k, "bias");
    check_cuda_tensor(*bias_rows, k, "bias_rows");
    checks::check_rank(*bias, 3, "bias", "(rows_b, rows_h, Sk): the positions' leading dims");
    check_float_16_or_32(*bias, "bias");
    checks::check_shape(*bias, {pos_batch, pos_heads, num_keys}, "bias");
    checks::check_dtype(*bias_rows, bias->dtype, "bias_rows");
    checks::check_shape(*bias_rows, {pos_batch, pos_heads, width}, "bias_rows");
    checks::check_contiguous(*bias_rows, "bias_rows");
  }
#ifdef DMATTN_WITH_CUDA
  bool vec16 = false;
  const cuda::GatherRowsArgs a = gather_rows_args(k, v, k_rows, v_rows, positions.data, pos_batch, pos_heads, batch,
                                                  width, heads, head_dim, vec16);
  cuda::gather_rows(a, vec16, stream);
  if (bias != nullptr) {
    cuda::GatherBiasArgs g;
    g.bias = bias->data;
    g.stride_b = bias->strides[0];
    g.stride_h = bias->strides[1];
    g.stride_k = bias->strides[2];
    g.rows_b = pos_batch;
    g.rows_h = pos_heads;
    g.width = width;
    g.elem_bytes = int(dtype_size(bias->dtype));
    g.positions = a.positions;
    g.out = bias_rows->data;
    cuda::gather_bias(g, stream);
  }
#else
  (void)stream;
  no_cuda_glue();
#endif
}

void scatter_key_rows(const TensorDesc& dk_rows, const TensorDesc& dv_rows, const TensorDesc& positions,
                      const TensorDesc& dk, const TensorDesc& dv, const TensorDesc* dbias_rows, const TensorDesc* dbias,
                      void* stream) {
  check_cuda_tensor(dk_rows, dk_rows, "dk_rows");
  for (const auto& [t, name] : {std::pair{&dv_rows, "dv_rows"}, {&positions, "positions"}, {&dk, "dk"}, {&dv, "dv"}})
    check_cuda_tensor(*t, dk_rows, name);
  checks::check_rank(dk, 4, "dk", "(B, Sk, Hkv, D)");
  check_float_16_or_32(dk, "dk");
  const int64_t batch = dk.shape[0], num_keys = dk.shape[1], heads = dk.shape[2], head_dim = dk.shape[3];
  const auto [pos_batch, pos_heads, width] = check_key_positions(positions, batch, heads);
  check(num_keys < (int64_t(1) << 31) && width < (int64_t(1) << 31), ErrorKind::kValue,
        "dk, positions: expected fewer than 2^31 keys and positions, got ", num_keys, " and ", width);
  for (const auto& [t, name] : {std::pair{&dk_rows, "dk_rows"}, {&dv_rows, "dv_rows"}}) {
    checks::check_dtype(*t, dk.dtype, name);
    checks::check_shape(*t, {batch, width, heads, head_dim}, name);
    checks::check_contiguous(*t, name);
  }
  checks::check_dtype(dv, dk.dtype, "dv");
  checks::check_shape(dv, dk.shape, "dv");
  checks::check_contiguous(dk, "dk");
  checks::check_contiguous(dv, "dv");
  check((dbias == nullptr) == (dbias_rows == nullptr), ErrorKind::kValue, "dbias_rows: expected with dbias, and only then");
  if (dbias != nullptr) {
    check_cuda_tensor(*dbias, dk_rows, "dbias");
    check_cuda_tensor(*dbias_rows, dk_rows, "dbias_rows");
    check_float_16_or_32(*dbias, "dbias");
    checks::check_dtype(*dbias_rows, dbias->dtype, "dbias_rows");
    checks::check_shape(*dbias, {pos_batch, pos_heads, 1, num_keys}, "dbias");
    checks::check_shape(*dbias_rows, {pos_batch, pos_heads, 1, width}, "dbias_rows");
    checks::check_contiguous(*dbias, "dbias");
    checks::check_contiguous(*dbias_rows, "dbias_rows");
  }
#ifdef DMATTN_WITH_CUDA
  cuda::ScatterRowsArgs a;
  const int64_t elem = int64_t(dtype_size(dk.dtype));
  a.operand[0] = {dk_rows.data, dk.data};
  a.operand[1] = {dv_rows.data, dv.data};
  bool vec16 = (head_dim * elem) % 16 == 0;
  for (const void* p : {dk_rows.data, dv_rows.data, dk.data, dv.data})
    vec16 = vec16 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  a.positions = static_cast<const int32_t*>(positions.data);
  a.pos_batch = pos_batch;
  a.pos_heads = pos_heads;
  a.batch = batch;
  a.num_keys = num_keys;
  a.width = width;
  a.heads = heads;
  a.row_bytes = head_dim * elem;
  a.elem_bytes = int(elem);
  if (dbias != nullptr) {
    a.bias_rows = dbias_rows->data;
    a.bias_dst = dbias->data;
    a.bias_bytes = int(dtype_size(dbias->dtype));
  }
  cuda::scatter_rows(a, vec16, stream);
#else
  (void)stream;
  no_cuda_glue();
#endif
}

void gather_segment_rows(const TensorDesc& k, const TensorDesc& v, const TensorDesc& index, const TensorDesc& k_rows,
                         const TensorDesc& v_rows, void* stream) {
  check_gather_sources(k, v, {{&index, "index"}, {&k_rows, "k_rows"}, {&v_rows, "v_rows"}});
  const int64_t batch = k.shape[0], heads_kv = k.shape[2], head_dim = k.shape[3];
  checks::check_dtype(index, DType::kInt32, "index");
  checks::check_rank(index, 3, "index", "(B * segments, 1 or G, W)");
  checks::check_contiguous(index, "index");
  checks::check_rank(k_rows, 4, "k_rows", "(B * segments, W, G, D)");
  const int64_t rows_b = k_rows.shape[0], width = k_rows.shape[1], heads = k_rows.shape[2];
  check(batch > 0 && rows_b % batch == 0 && heads_kv > 0 && heads % heads_kv == 0 &&
            (index.shape[1] == 1 || index.shape[1] == heads) && index.shape[0] == rows_b && index.shape[2] == width,
        ErrorKind::kValue, "index, k_rows: expected index (B * segments, 1 or G, W) and rows (B * segments, W, G, D) "
        "with B = ", batch, " and G a multiple of Hkv = ", heads_kv, ", got ", index.shape_text(), " and ",
        k_rows.shape_text());
  for (const auto& [t, name] : {std::pair{&k_rows, "k_rows"}, {&v_rows, "v_rows"}}) {
    checks::check_dtype(*t, k.dtype, name);
    checks::check_shape(*t, {rows_b, width, heads, head_dim}, name);
    checks::check_contiguous(*t, name);
  }
#ifdef DMATTN_WITH_CUDA
  bool vec16 = false;
  cuda::GatherRowsArgs a = gather_rows_args(k, v, k_rows, v_rows, index.data, rows_b, index.shape[1], rows_b, width,
                                            heads, head_dim, vec16);
  a.src_batch_div = rows_b / batch;
  a.src_head_div = heads / heads_kv;
  cuda::gather_rows(a, vec16, stream);
#else
  (void)stream;
  no_cuda_glue();
#endif
}

void sum_segment_rows(const TensorDesc& dk_rows, const TensorDesc& dv_rows, const TensorDesc& slots,
                      const TensorDesc& dk, const TensorDesc& dv, void* stream) {
  check_cuda_tensor(dk_rows, dk_rows, "dk_rows");
  for (const auto& [t, name] : {std::pair{&dv_rows, "dv_rows"}, {&slots, "slots"}, {&dk, "dk"}, {&dv, "dv"}})
    check_cuda_tensor(*t, dk_rows, name);
  checks::check_rank(dk_rows, 4, "dk_rows", "(B * segments, W, G, D)");
  check_float_16_or_32(dk_rows, "dk_rows");
  checks::check_rank(dk, 4, "dk", "(B, Sk, Hkv, D)");
  checks::check_rank(slots, 4, "slots", "(B, segments, 1 or G, Sk)");
  const int64_t rows_b = dk_rows.shape[0], heads = dk_rows.shape[2], head_dim = dk_rows.shape[3];
  const int64_t batch = dk.shape[0], num_keys = dk.shape[1], heads_kv = dk.shape[2];
  const int64_t segments = slots.shape[1];
  check(batch > 0 && slots.shape[0] == batch && rows_b == batch * segments && heads_kv > 0 && heads % heads_kv == 0 &&
            (slots.shape[2] == 1 || slots.shape[2] == heads) && slots.shape[3] == num_keys && dk.shape[3] == head_dim &&
            head_dim <= 256,
        ErrorKind::kValue, "dk_rows, slots, dk: expected rows (B * segments, W, G, D), slots (B, segments, 1 or G, Sk) ",
        "and dk (B, Sk, Hkv, D) with G a multiple of Hkv and D <= 256, got ", dk_rows.shape_text(), ", ",
        slots.shape_text(), " and ", dk.shape_text());
  checks::check_dtype(slots, DType::kInt32, "slots");
  for (const auto& [t, name] : {std::pair{&dk_rows, "dk_rows"}, {&dv_rows, "dv_rows"}, {&slots, "slots"}, {&dk, "dk"},
                                {&dv, "dv"}})
    checks::check_contiguous(*t, name);
  checks::check_shape(dv_rows, dk_rows.shape, "dv_rows");
  checks::check_shape(dv, dk.shape, "dv");
  for (const auto& [t, name] : {std::pair{&dv_rows, "dv_rows"}, {&dk, "dk"}, {&dv, "dv"}})
    checks::check_dtype(*t, dk_rows.dtype, name);
#ifdef DMATTN_WITH_CUDA
  cuda::SumSegmentRowsArgs a;
  a.operand[0] = {dk_rows.data, dk.data};
  a.operand[1] = {dv_rows.data, dv.data};
  a.slots = static_cast<const int32_t*>(slots.data);
  a.batch = batch;
  a.num_segments = segments;
  a.slot_heads = slots.shape[2];
  a.num_keys = num_keys;
  a.width = dk_rows.shape[1];  // (read here: a CPU build never uses it, and gcc warns of unused variables)
  a.heads = heads;
  a.heads_kv = heads_kv;
  a.head_dim = head_dim;
  a.elem_bytes = int(dtype_size(dk_rows.dtype));
  a.bf16 = dk_rows.dtype == DType::kBFloat16;
  cuda::sum_segment_rows(a, stream);
#else
  (void)stream;
  no_cuda_glue();
#endif
}

}  // namespace dmattn
