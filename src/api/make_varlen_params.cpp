// Validation of packed variable-length batches (make_varlen_forward_params and friends).
//
// Only what is specific to varlen is checked here: the ranks and shapes of the packed tensors,
// the key-side mask/bias, and cu_seqlens / max_seqlen. Everything shared with the dense path
// (dtypes, devices, strides, head dim, options) is then checked by make_forward_params /
// make_backward_params themselves, on a batch-1 view of the packed problem -- one sequence of
// total_q queries and total_k keys -- whose params are finally switched to varlen mode.
// The shape checks come first so that no error message ever shows the batch-1 view's shapes.
#include <string>

#include "api/tensor_checks.h"
#include "dmattn/api.h"

namespace dmattn {
namespace {

using namespace checks;  // NOLINT: the shared argument checks

struct PackedSizes {
  int64_t total_q = 0, total_k = 0, heads = 0, heads_kv = 0, dim = 0;
};

void check_packed_shape(const TensorDesc& t, const std::vector<int64_t>& shape, const char* name,
                        const char* layout) {
  check_rank(t, static_cast<int64_t>(shape.size()), name, layout);
  check_shape(t, shape, name);
}

// Rank 1, int32, contiguous, at least the leading 0. Device is checked against q separately.
void check_cu_seqlens_desc(const TensorDesc& cu, const char* name) {
  check_rank(cu, 1, name, "(batch + 1,) of cumulative sequence lengths");
  check_dtype(cu, DType::kInt32, name);
  check(cu.shape[0] >= 1, ErrorKind::kValue, name,
        ": expected at least one entry (a leading 0), got an empty tensor");
  check(cu.shape[0] == 1 || cu.strides[0] == 1, ErrorKind::kValue, name,
        ": expected a contiguous tensor (stride 1), got stride ", cu.strides[0],
        "; call .contiguous() first");
}

void check_packing_desc(const VarlenPacking& packing) {
  check_cu_seqlens_desc(packing.cu_seqlens_q, "cu_seqlens_q");
  check_cu_seqlens_desc(packing.cu_seqlens_k, "cu_seqlens_k");
  check(packing.cu_seqlens_k.shape[0] == packing.cu_seqlens_q.shape[0], ErrorKind::kValue,
        "cu_seqlens_k: expected length ", packing.cu_seqlens_q.shape[0],
        " (batch + 1, like cu_seqlens_q), got ", packing.cu_seqlens_k.shape[0]);
  check(packing.max_seqlen_q >= 0, ErrorKind::kValue, "max_seqlen_q: expected >= 0, got ",
        packing.max_seqlen_q);
  check(packing.max_seqlen_k >= 0, ErrorKind::kValue, "max_seqlen_k: expected >= 0, got ",
        packing.max_seqlen_k);
}

void check_cu_seqlens_on_host(const TensorDesc& cu, const char* name, int64_t total,
                              const char* total_name, int64_t max_seqlen, const char* max_name) {
  check(cu.device == DeviceKind::kCPU, ErrorKind::kRuntime, name,
        ": its values can only be checked on the host, got a tensor on ",
        device_name(cu.device));
  const auto* values = static_cast<const int32_t*>(cu.data);
  const int64_t entries = cu.shape[0];
  check(values[0] == 0, ErrorKind::kValue, name, ": expected first entry 0, got ", values[0]);
  for (int64_t b = 0; b + 1 < entries; ++b) {
    const int64_t length = int64_t{values[b + 1]} - values[b];
    check(length >= 0, ErrorKind::kValue, name, ": expected non-decreasing values, got ", name,
          "[", b + 1, "] = ", values[b + 1], " < ", name, "[", b, "] = ", values[b]);
    check(length <= max_seqlen, ErrorKind::kValue, name, ": sequence ", b, " has length ",
          length, ", more than ", max_name, " = ", max_seqlen);
  }
  check(values[entries - 1] == total, ErrorKind::kValue, name, ": expected last entry ",
        total_name, " = ", total, ", got ", values[entries - 1]);
}

// A key-side mask or bias: (Hb, total_k), Hb in {1, Hkv, H}.
void check_key_side(const TensorDesc& t, const PackedSizes& n, const char* name) {
  const char* layout = "(Hb, total_k) with Hb in {1, num_heads_kv, num_heads}";
  check_rank(t, 2, name, layout);
  const int64_t hb = t.shape[0];
  check(t.shape[1] == n.total_k && (hb == 1 || hb == n.heads_kv || hb == n.heads),
        ErrorKind::kValue, name, ": expected shape (Hb, total_k) = (1, ", n.total_k, "), (",
        n.heads_kv, ", ", n.total_k, ") or (", n.heads, ", ", n.total_k, "), got ",
        t.shape_text());
}

// The varlen-specific shape checks of the forward's arguments.
PackedSizes check_packed_forward(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                 const VarlenPacking& packing, const TensorDesc& out,
                                 const TensorDesc& lse, const TensorDesc* mask,
                                 const TensorDesc* bias) {
  check_rank(q, 3, "q", "(total_q, num_heads, head_dim)");
  PackedSizes n;
  n.total_q = q.shape[0], n.heads = q.shape[1], n.dim = q.shape[2];
  check(n.heads >= 1, ErrorKind::kValue, "q: expected at least 1 head (dim 1), got shape ",
        q.shape_text());
  check_rank(k, 3, "k", "(total_k, num_heads_kv, head_dim)");
  n.total_k = k.shape[0], n.heads_kv = k.shape[1];
  check(k.shape[2] == n.dim, ErrorKind::kValue, "k: expected head_dim ", n.dim,
        " like q, got shape ", k.shape_text());
  check(n.heads_kv >= 1 && n.heads % n.heads_kv == 0, ErrorKind::kValue,
        "k: num_heads_kv (k.shape[1] = ", n.heads_kv, ") must be >= 1 and divide num_heads ",
        "(q.shape[1] = ", n.heads, ")");
  check_packed_shape(v, k.shape, "v", "(total_k, num_heads_kv, head_dim)");
  check_packed_shape(out, q.shape, "out", "like q (total_q, num_heads, head_dim)");
  check_packed_shape(lse, {n.heads, n.total_q}, "lse", "(num_heads, total_q)");
  check_contiguous(lse, "lse");

  check_packing_desc(packing);
  check_same_device(q, packing.cu_seqlens_q, "cu_seqlens_q");
  check_same_device(q, packing.cu_seqlens_k, "cu_seqlens_k");
  if (mask != nullptr) check_key_side(*mask, n, "mask");
  if (bias != nullptr) check_key_side(*bias, n, "bias");
  return n;
}

// (S, H, D) -> (1, S, H, D): one sequence holding every packed row.
TensorDesc as_one_sequence(const TensorDesc& t) {
  TensorDesc view = t;
  view.shape.insert(view.shape.begin(), 1);
  view.strides.insert(view.strides.begin(), 0);
  return view;
}

// lse (H, total_q) -> (1, H, total_q), contiguous like the dense lse.
TensorDesc lse_as_one_sequence(const TensorDesc& lse) {
  TensorDesc view = lse;
  view.shape.insert(view.shape.begin(), 1);
  view.strides.insert(view.strides.begin(), lse.numel());
  return view;
}

// (Hb, total_k) -> (1, Hb, 1, total_k): shared by every query.
TensorDesc key_side_as_dense(const TensorDesc& t) {
  TensorDesc view = t;
  view.shape = {1, t.shape[0], 1, t.shape[1]};
  view.strides = {0, t.strides[0], 0, t.strides[1]};
  return view;
}

// Owns the optional views so that their pointers stay valid for the dense call.
struct OptionalView {
  TensorDesc view;
  bool present = false;
  OptionalView(const TensorDesc* t, TensorDesc (*make)(const TensorDesc&)) {
    if (t != nullptr) view = make(*t), present = true;
  }
  const TensorDesc* get() const { return present ? &view : nullptr; }
};

TensorDesc unchanged(const TensorDesc& t) { return t; }

// Turns the params of the batch-1 view into varlen params (see ForwardParams).
void switch_to_varlen(ForwardParams& p, const VarlenPacking& packing, const PackedSizes& n) {
  p.batch = packing.cu_seqlens_q.shape[0] - 1;
  p.seqlen_q = packing.max_seqlen_q;
  p.seqlen_k = packing.max_seqlen_k;
  p.total_q = n.total_q;
  p.total_k = n.total_k;
  p.cu_seqlens_q = static_cast<const int32_t*>(packing.cu_seqlens_q.data);
  p.cu_seqlens_k = static_cast<const int32_t*>(packing.cu_seqlens_k.data);
  p.lse_batch_stride = 0;  // sequence b's rows start at column cu_seqlens_q[b]
  p.lse_head_stride = n.total_q;
}

}  // namespace

void check_cu_seqlens_values(const VarlenPacking& packing, int64_t total_q, int64_t total_k) {
  check_packing_desc(packing);
  check_cu_seqlens_on_host(packing.cu_seqlens_q, "cu_seqlens_q", total_q, "total_q (q.shape[0])",
                           packing.max_seqlen_q, "max_seqlen_q");
  check_cu_seqlens_on_host(packing.cu_seqlens_k, "cu_seqlens_k", total_k, "total_k (k.shape[0])",
                           packing.max_seqlen_k, "max_seqlen_k");
}

ForwardParams make_varlen_forward_params(const TensorDesc& q, const TensorDesc& k,
                                         const TensorDesc& v, const VarlenPacking& packing,
                                         const TensorDesc& out, const TensorDesc& lse,
                                         const TensorDesc* mask, const TensorDesc* bias,
                                         const AttentionOptions& options) {
  const PackedSizes n = check_packed_forward(q, k, v, packing, out, lse, mask, bias);
  const OptionalView mask_view(mask, key_side_as_dense), bias_view(bias, key_side_as_dense);
  ForwardParams p = make_forward_params(as_one_sequence(q), as_one_sequence(k),
                                        as_one_sequence(v), as_one_sequence(out),
                                        lse_as_one_sequence(lse), mask_view.get(),
                                        bias_view.get(), options);
  if (q.device == DeviceKind::kCPU) check_cu_seqlens_values(packing, n.total_q, n.total_k);
  switch_to_varlen(p, packing, n);
  return p;
}

BackwardParams make_varlen_backward_params(
    const TensorDesc& q, const TensorDesc& k, const TensorDesc& v, const VarlenPacking& packing,
    const TensorDesc& out, const TensorDesc& lse, const TensorDesc* mask, const TensorDesc* bias,
    const TensorDesc& dout, const TensorDesc& dq, const TensorDesc& dk, const TensorDesc& dv,
    const TensorDesc* dbias, const TensorDesc* softmax_delta, const TensorDesc* dq_accum,
    const TensorDesc* dbias_accum, const AttentionOptions& options) {
  const PackedSizes n = check_packed_forward(q, k, v, packing, out, lse, mask, bias);
  check_packed_shape(dout, q.shape, "dout", "like q (total_q, num_heads, head_dim)");
  check_packed_shape(dq, q.shape, "dq", "like q (total_q, num_heads, head_dim)");
  check_packed_shape(dk, k.shape, "dk", "like k (total_k, num_heads_kv, head_dim)");
  check_packed_shape(dv, k.shape, "dv", "like k (total_k, num_heads_kv, head_dim)");
  if (dbias != nullptr) {
    check(bias != nullptr, ErrorKind::kValue, "dbias: given without a bias");
    check_packed_shape(*dbias, bias->shape, "dbias", "like bias (Hb, total_k)");
  }
  if (softmax_delta != nullptr) {
    check_packed_shape(*softmax_delta, {n.heads, n.total_q}, "softmax_delta",
                       "(num_heads, total_q)");
  }
  if (dq_accum != nullptr) {
    check_packed_shape(*dq_accum, q.shape, "dq_accum", "like q (total_q, num_heads, head_dim)");
  }

  const OptionalView mask_view(mask, key_side_as_dense), bias_view(bias, key_side_as_dense),
      dbias_view(dbias, key_side_as_dense), delta_view(softmax_delta, lse_as_one_sequence),
      dq_accum_view(dq_accum, as_one_sequence), dbias_accum_view(dbias_accum, unchanged);
  BackwardParams p = make_backward_params(
      as_one_sequence(q), as_one_sequence(k), as_one_sequence(v), as_one_sequence(out),
      lse_as_one_sequence(lse), mask_view.get(), bias_view.get(), as_one_sequence(dout),
      as_one_sequence(dq), as_one_sequence(dk), as_one_sequence(dv), dbias_view.get(),
      delta_view.get(), dq_accum_view.get(), dbias_accum_view.get(), options);
  if (q.device == DeviceKind::kCPU) check_cu_seqlens_values(packing, n.total_q, n.total_k);
  switch_to_varlen(p.fwd, packing, n);
  return p;
}

}  // namespace dmattn
