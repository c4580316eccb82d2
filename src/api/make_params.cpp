// The one host-side validation routine: checks every argument against the contract
// (docs/semantics.md) and fills ForwardParams/BackwardParams.
// Every backend trusts what comes out of here and checks nothing itself.
#include <cmath>
#include <string>

#include "api/key_positions.h"
#include "api/tensor_checks.h"
#include "dmattn/api.h"

namespace dmattn {
namespace {

using namespace checks;  // NOLINT: the shared argument checks

constexpr int64_t kMaxHeadDim = 256;

bool is_float_dtype(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16 ||
         d == DType::kFloat64;
}

SeqTensor seq_strides(const TensorDesc& t) { return {t.strides[0], t.strides[1], t.strides[2]}; }

// A (B, S, H, D) tensor like `like` but possibly with another head count.
void check_seq_tensor(const TensorDesc& t, const TensorDesc& q, int64_t seqlen, int64_t heads,
                      DType dtype, const char* name, const char* layout) {
  check_rank(t, 4, name, layout);
  check_same_device(q, t, name);
  check_dtype(t, dtype, name);
  check_shape(t, {q.shape[0], seqlen, heads, q.shape[3]}, name);
  check_last_dim_contiguous(t, name);
}

struct ProblemSize {
  int64_t batch, seqlen_q, seqlen_k, heads, heads_kv;
};

// Right-aligns a mask/bias of rank <= 4 to (B, H, Sq, Sk) and checks each dimension is 1 or
// full (the head dimension may also be Hkv; the key dimension may be 1 for both mask and bias).
BroadcastOperand make_broadcast_operand(const TensorDesc& t, const ProblemSize& n,
                                        const char* name) {
  check(t.rank() <= 4, ErrorKind::kValue, name,
        ": expected at most 4 dimensions broadcastable to (B, H, Sq, Sk), got shape ",
        t.shape_text());
  int64_t sizes[4] = {1, 1, 1, 1};
  int64_t strides[4] = {0, 0, 0, 0};
  const int64_t pad = 4 - t.rank();
  for (int64_t d = 0; d < t.rank(); ++d) {
    sizes[pad + d] = t.shape[d];
    strides[pad + d] = t.shape[d] == 1 ? 0 : t.strides[d];
  }
  const int64_t full[4] = {n.batch, n.heads, n.seqlen_q, n.seqlen_k};
  const char* dim_names[4] = {"batch (B)", "heads (H)", "query (Sq)", "key (Sk)"};
  for (int d = 0; d < 4; ++d) {
    const bool ok = sizes[d] == 1 || sizes[d] == full[d] || (d == 1 && sizes[d] == n.heads_kv);
    if (ok) continue;
    const std::vector<int64_t> full_shape(full, full + 4);
    fail(ErrorKind::kValue, name, ": shape ", t.shape_text(), " does not broadcast to (B, H, Sq, Sk) = ",
         ShapeText{full_shape}, ": its ", dim_names[d], " dimension is ", sizes[d], ", expected 1 or ", full[d],
         d == 1 ? " (or Hkv = " + std::to_string(n.heads_kv) + ")" : std::string());
  }
  BroadcastOperand op;
  op.ptr = t.data;
  op.dtype = t.dtype;
  op.size_b = sizes[0], op.size_h = sizes[1], op.size_q = sizes[2], op.size_k = sizes[3];
  op.stride_b = strides[0], op.stride_h = strides[1];
  op.stride_q = strides[2], op.stride_k = strides[3];
  // One entry per GQA group when sized Hkv (and Hkv != H); otherwise indexed by h directly.
  op.head_div = (sizes[1] == n.heads_kv && sizes[1] != n.heads) ? n.heads / n.heads_kv : 1;
  return op;
}

// (p's lengths and key positions already set: the window bounds are clipped to them)
void normalize_options(const AttentionOptions& o, int64_t head_dim, ForwardParams& p) {
  const int64_t left = window_bound(o.window_left, p.window_seqlen_k(), "window[0] (left)");
  const int64_t right = window_bound(o.window_right, p.seqlen_q, "window[1] (right)");
  if (std::isnan(o.scale)) {
    p.scale = head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
  } else {
    check(std::isfinite(o.scale) && o.scale > 0, ErrorKind::kValue,
          "scale: expected a finite positive softmax scale (or None for 1/sqrt(head_dim)), got ",
          o.scale);
    p.scale = o.scale;
  }
  check(std::isfinite(o.softcap) && o.softcap >= 0, ErrorKind::kValue,
        "softcap: expected a finite value >= 0 (0 = off), got ", o.softcap);
  p.softcap = o.softcap;
  p.causal = o.causal;
  p.window_left = left;
  // Causal is the window (.., 0): a wider right bound is tightened to the diagonal.
  p.window_right = o.causal ? 0 : right;
}

}  // namespace

ForwardParams make_forward_params(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                  const TensorDesc& out, const TensorDesc& lse,
                                  const TensorDesc* mask, const TensorDesc* bias,
                                  const AttentionOptions& options, const GatheredKeys& gathered) {
  check_rank(q, 4, "q", "(batch, seqlen_q, num_heads, head_dim)");
  check(q.device == DeviceKind::kCPU || q.device == DeviceKind::kCUDA, ErrorKind::kValue,
        "q: expected a CPU or CUDA tensor, got a tensor on ", device_name(q.device));
  if (q.device == DeviceKind::kCUDA) {
    check(q.dtype == DType::kFloat16 || q.dtype == DType::kBFloat16, ErrorKind::kType,
          "q: expected dtype float16 or bfloat16 on CUDA, got ", dtype_name(q.dtype));
  } else {
    check(is_float_dtype(q.dtype), ErrorKind::kType,
          "q: expected dtype float32, float16, bfloat16 or float64 on CPU, got ",
          dtype_name(q.dtype));
  }
  check_last_dim_contiguous(q, "q");
  const int64_t batch = q.shape[0], seqlen_q = q.shape[1], heads = q.shape[2], dim = q.shape[3];
  check(heads >= 1, ErrorKind::kValue, "q: expected at least 1 head (dim 2), got shape ",
        q.shape_text());
  if (q.device == DeviceKind::kCUDA) {
    check(dim >= 8 && dim <= kMaxHeadDim && dim % 8 == 0, ErrorKind::kValue,
          "head_dim: expected a multiple of 8 in [8, ", kMaxHeadDim, "] on CUDA, got ", dim,
          " (q.shape[-1])");
  } else {
    check(dim >= 1 && dim <= kMaxHeadDim, ErrorKind::kValue, "head_dim: expected 1 <= head_dim <= ",
          kMaxHeadDim, ", got ", dim, " (q.shape[-1])");
  }

  check_rank(k, 4, "k", "(batch, seqlen_k, num_heads_kv, head_dim)");
  check_same_device(q, k, "k");
  check_dtype(k, q.dtype, "k");
  // Indexed keys: k, v are the source rows, of a batch that divides q's; the gathered count
  // is key_positions'.
  const bool indexed = gathered.key_rows != nullptr;
  if (indexed) {
    check(gathered.key_positions != nullptr, ErrorKind::kValue,
          "key_rows: given without key_positions (it says which source row each gathered row reads)");
    check(k.shape[0] >= 1 && batch % k.shape[0] == 0 && k.shape[3] == dim, ErrorKind::kValue,
          "k: with key_rows, expected a batch dividing ", batch, " and head_dim ", dim, ", got shape ",
          k.shape_text());
  } else {
    check(k.shape[0] == batch && k.shape[3] == dim, ErrorKind::kValue,
          "k: expected batch ", batch, " and head_dim ", dim, " like q, got shape ", k.shape_text());
  }
  const int64_t heads_kv = k.shape[2];
  const int64_t seqlen_k = indexed && gathered.key_positions->rank() == 3 ? gathered.key_positions->shape[2]
                                                                          : k.shape[1];
  check(heads_kv >= 1 && heads % heads_kv == 0, ErrorKind::kValue,
        "k: num_heads_kv (k.shape[2] = ", heads_kv, ") must be >= 1 and divide num_heads ",
        "(q.shape[2] = ", heads, ")");
  check_last_dim_contiguous(k, "k");
  if (indexed) {
    check_rank(v, 4, "v", "like k");
    check_same_device(q, v, "v");
    check_dtype(v, q.dtype, "v");
    check_shape(v, k.shape, "v");
    check_last_dim_contiguous(v, "v");
  } else {
    check_seq_tensor(v, q, seqlen_k, heads_kv, q.dtype, "v", "(batch, seqlen_k, num_heads_kv, head_dim)");
  }
  check_seq_tensor(out, q, seqlen_q, heads, q.dtype, "out", "like q");

  check_same_device(q, lse, "lse");
  check_dtype(lse, stat_dtype(q.dtype), "lse");
  check_shape(lse, {batch, heads, seqlen_q}, "lse");
  check_contiguous(lse, "lse");

  ForwardParams p;
  p.dtype = q.dtype;
  p.device = q.device;
  p.device_id = q.device_id;
  p.batch = batch, p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.num_heads = heads, p.num_heads_kv = heads_kv, p.head_dim = dim;
  p.q = q.data, p.q_strides = seq_strides(q);
  p.k = k.data, p.k_strides = seq_strides(k);
  p.v = v.data, p.v_strides = seq_strides(v);
  p.out = out.data, p.out_strides = seq_strides(out);
  p.lse = lse.data;
  p.lse_batch_stride = heads * seqlen_q, p.lse_head_stride = seqlen_q;

  const ProblemSize n{batch, seqlen_q, seqlen_k, heads, heads_kv};
  if (mask != nullptr) {
    check_same_device(q, *mask, "mask");
    check_dtype(*mask, DType::kBool, "mask");
    p.mask = make_broadcast_operand(*mask, n, "mask");
  }
  if (bias != nullptr) {
    check_same_device(q, *bias, "bias");
    check(bias->dtype == q.dtype || bias->dtype == DType::kFloat32, ErrorKind::kType,
          "bias: expected dtype ", QDtypeOrFloat32Text{q.dtype}, ", got ", dtype_name(bias->dtype));
    p.bias = make_broadcast_operand(*bias, n, "bias");
  }
  set_key_positions(q, gathered, p);
  if (indexed) {
    p.k_strides.batch_stride = k.shape[0] == 1 ? 0 : k.strides[0];
    p.v_strides.batch_stride = v.shape[0] == 1 ? 0 : v.strides[0];
    p.key_rows_batch_div = batch / k.shape[0];
    p.key_rows_source_len = k.shape[1];
  }
  normalize_options(options, dim, p);
  return p;
}

BackwardParams make_backward_params(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                    const TensorDesc& out, const TensorDesc& lse,
                                    const TensorDesc* mask, const TensorDesc* bias,
                                    const TensorDesc& dout, const TensorDesc& dq,
                                    const TensorDesc& dk, const TensorDesc& dv,
                                    const TensorDesc* dbias, const TensorDesc* softmax_delta,
                                    const TensorDesc* dq_accum, const TensorDesc* dbias_accum,
                                    const AttentionOptions& options,
                                    const GatheredKeys& gathered) {
  BackwardParams p;
  p.fwd = make_forward_params(q, k, v, out, lse, mask, bias, options, gathered);
  const ForwardParams& f = p.fwd;
  const char* q_layout = "like q (batch, seqlen_q, num_heads, head_dim)";
  const char* kv_layout = "like k (batch, seqlen_k, num_heads_kv, head_dim)";
  check_seq_tensor(dout, q, f.seqlen_q, f.num_heads, q.dtype, "dout", q_layout);
  check_seq_tensor(dq, q, f.seqlen_q, f.num_heads, q.dtype, "dq", q_layout);
  check_seq_tensor(dk, q, f.seqlen_k, f.num_heads_kv, q.dtype, "dk", kv_layout);
  check_seq_tensor(dv, q, f.seqlen_k, f.num_heads_kv, q.dtype, "dv", kv_layout);
  p.dout = dout.data, p.dout_strides = seq_strides(dout);
  p.dq = dq.data, p.dq_strides = seq_strides(dq);
  p.dk = dk.data, p.dk_strides = seq_strides(dk);
  p.dv = dv.data, p.dv_strides = seq_strides(dv);

  if (dbias != nullptr) {
    check(bias != nullptr, ErrorKind::kValue, "dbias: given without a bias");
    check_same_device(q, *dbias, "dbias");
    check_dtype(*dbias, bias->dtype, "dbias");
    check_shape(*dbias, bias->shape, "dbias");
    // Right-align the strides exactly like the bias; broadcast (size-1) dims get stride 0.
    int64_t strides[4] = {0, 0, 0, 0};
    const int64_t pad = 4 - dbias->rank();
    for (int64_t d = 0; d < dbias->rank(); ++d) {
      strides[pad + d] = dbias->shape[d] == 1 ? 0 : dbias->strides[d];
    }
    p.dbias = dbias->data;
    p.dbias_stride_b = strides[0], p.dbias_stride_h = strides[1];
    p.dbias_stride_q = strides[2], p.dbias_stride_k = strides[3];
  }
  if (softmax_delta != nullptr) {
    check_same_device(q, *softmax_delta, "softmax_delta");
    check_dtype(*softmax_delta, DType::kFloat32, "softmax_delta");
    check_shape(*softmax_delta, {f.batch, f.num_heads, f.seqlen_q}, "softmax_delta");
    check_contiguous(*softmax_delta, "softmax_delta");
    p.softmax_delta = softmax_delta->data;
  }
  if (dq_accum != nullptr) {
    check_same_device(q, *dq_accum, "dq_accum");
    check_dtype(*dq_accum, DType::kFloat32, "dq_accum");
    check_shape(*dq_accum, {f.batch, f.seqlen_q, f.num_heads, f.head_dim}, "dq_accum");
    check_contiguous(*dq_accum, "dq_accum");
    p.dq_accum = dq_accum->data;
  }
  if (dbias_accum != nullptr) {
    check(dbias != nullptr, ErrorKind::kValue, "dbias_accum: given without dbias");
    check_same_device(q, *dbias_accum, "dbias_accum");
    check_dtype(*dbias_accum, DType::kFloat32, "dbias_accum");
    const BroadcastOperand& b = f.bias;
    check(dbias_accum->numel() == b.size_b * b.size_h * b.size_q * b.size_k, ErrorKind::kValue,
          "dbias_accum: expected ", b.size_b * b.size_h * b.size_q * b.size_k,
          " float32 elements (the bias's size), got ", dbias_accum->numel());
    check_contiguous(*dbias_accum, "dbias_accum");
    p.dbias_accum = dbias_accum->data;
  }
  p.deterministic = options.deterministic;
  return p;
}

}  // namespace dmattn
