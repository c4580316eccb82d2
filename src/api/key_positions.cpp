// Validation of gathered keys: the shape rules of ForwardParams::key_positions and, for host
// tensors, the ordering contract kernels rely on for their binary searches.
#include "api/key_positions.h"

#include "api/tensor_checks.h"

namespace dmattn {
namespace {

using namespace checks;  // NOLINT: the shared argument checks

// Within one (b, h) row: valid positions (in [0, seqlen_k_original)) strictly increasing and
// first, padding rows (anything else) only after them. O(K), far below the attention's cost.
void check_row_order(const int32_t* row, int64_t count, int64_t seqlen_k_original, int64_t b,
                     int64_t h) {
  auto valid = [&](int64_t pos) { return pos >= 0 && pos < seqlen_k_original; };
  int64_t j = 0;
  for (; j < count && valid(row[j]); ++j) {
    check(j == 0 || row[j] > row[j - 1], ErrorKind::kValue,
          "key_positions: expected strictly increasing positions within each (batch, head), got ",
          row[j - 1], " then ", row[j], " at [", b, ", ", h, ", ", j, "]");
  }
  for (int64_t first_padding = j; j < count; ++j) {
    check(!valid(row[j]), ErrorKind::kValue, "key_positions: a valid position (", row[j],
          ") at [", b, ", ", h, ", ", j, "] follows a padding entry (", row[first_padding],
          " at index ", first_padding, "); padding (< 0 or >= seqlen_k_original = ",
          seqlen_k_original, ") must come last");
  }
}

// The shape of `t` and its strides along every dimension of more than one element.
bool same_layout_as(const TensorDesc& e, const TensorDesc& t) {
  bool same = e.shape == t.shape;
  for (size_t d = 0; same && d < e.shape.size(); ++d) same = e.shape[d] == 1 || e.strides[d] == t.strides[d];
  return same;
}

}  // namespace

void set_key_positions(const TensorDesc& q, const GatheredKeys& gathered, ForwardParams& p) {
  check(gathered.key_positions != nullptr || gathered.key_ends == nullptr, ErrorKind::kValue,
        "key_ends: given without key_positions (it bounds the queries of gathered rows)");
  if (gathered.key_positions == nullptr) return;
  const TensorDesc& t = *gathered.key_positions;
  check_same_device(q, t, "key_positions");
  check_dtype(t, DType::kInt32, "key_positions");
  check_rank(t, 3, "key_positions", "(1 or batch, 1 / num_heads_kv / num_heads, seqlen_k)");
  const int64_t batch = t.shape[0], heads = t.shape[1], count = t.shape[2];
  const bool heads_ok = heads == 1 || heads == p.num_heads || heads == p.num_heads_kv;
  check((batch == 1 || batch == p.batch) && heads_ok && count == p.seqlen_k, ErrorKind::kValue,
        "key_positions: expected shape (1 or ", p.batch, ", 1, ", p.num_heads_kv, " or ",
        p.num_heads, ", ", p.seqlen_k, " = k.shape[1]), got ", t.shape_text());
  check_last_dim_contiguous(t, "key_positions");
  check(gathered.seqlen_k_original >= 0, ErrorKind::kValue,
        "seqlen_k_original: expected >= 0 (the key length key_positions index into), got ",
        gathered.seqlen_k_original);

  p.key_positions = static_cast<const int32_t*>(t.data);
  p.key_positions_stride_b = batch == 1 ? 0 : t.strides[0];
  p.key_positions_stride_h = heads == 1 ? 0 : t.strides[1];
  // One row per GQA group when sized Hkv (and Hkv != H), as for a bias.
  p.key_positions_head_div = (heads == p.num_heads_kv && heads != p.num_heads) ? p.group_size() : 1;
  p.seqlen_k_original = gathered.seqlen_k_original;

  if (gathered.key_ends != nullptr) {
    const TensorDesc& e = *gathered.key_ends;
    check_same_device(q, e, "key_ends");
    check_dtype(e, DType::kInt32, "key_ends");
    check(same_layout_as(e, t), ErrorKind::kValue,
          "key_ends: expected the shape and strides of key_positions ", t.shape_text(), ", got ",
          e.shape_text());
    p.key_ends = static_cast<const int32_t*>(e.data);
  }
  if (gathered.key_rows != nullptr) {
    const TensorDesc& r = *gathered.key_rows;
    check(t.device == DeviceKind::kCUDA, ErrorKind::kNotImplemented,
          "key_rows: indexed keys are read by the CUDA kernels only; gather k and v on ", device_name(t.device));
    check_same_device(q, r, "key_rows");
    check_dtype(r, DType::kInt32, "key_rows");
    check(same_layout_as(r, t), ErrorKind::kValue, "key_rows: expected the shape and strides of key_positions ",
          t.shape_text(), ", got ", r.shape_text());
    p.key_rows = static_cast<const int32_t*>(r.data);
  }

  if (t.device != DeviceKind::kCPU) return;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int32_t* row = p.key_positions + b * p.key_positions_stride_b +
                           h * p.key_positions_stride_h;
      check_row_order(row, count, p.seqlen_k_original, b, h);
    }
  }
}

}  // namespace dmattn
