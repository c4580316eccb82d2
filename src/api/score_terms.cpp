// Validation of the gate (gated attention) and of windows with sinks (ScoreTerms, dmattn/api.h),
// on top of params that make_forward_params / make_varlen_forward_params have filled: the
// problem's sizes, device and layout come from there, so the rules stay those of the one
// validation routine.
#include "api/tensor_checks.h"
#include "dmattn/api.h"

namespace dmattn {
namespace {

using namespace checks;  // NOLINT: the shared argument checks

void check_on_device(const ForwardParams& p, const TensorDesc& t, const char* name) {
  check_same_device(p.device, p.device_id, t, name);
}

// The strides of a (B, S, heads) tensor, or of a packed batch's (total, heads) (batch stride 0).
SeqTensor row_strides(const TensorDesc& t) {
  if (t.rank() == 2) return {0, t.strides[0], t.strides[1]};
  return {t.strides[0], t.strides[1], t.strides[2]};
}

// alpha / delta: (B, S, heads), or (total, heads) in a packed batch (the layouts as error text).
SeqTensor gate_rows(const ForwardParams& p, const TensorDesc& t, int64_t rows, int64_t heads, const char* name,
                    const char* dense_layout, const char* packed_layout) {
  check_on_device(p, t, name);
  check(t.dtype == p.dtype || t.dtype == DType::kFloat32, ErrorKind::kType, name, ": expected dtype ",
        QDtypeOrFloat32Text{p.dtype}, ", got ", dtype_name(t.dtype));
  if (p.is_varlen()) {
    check_rank(t, 2, name, packed_layout);
    check_shape(t, {rows, heads}, name);
  } else {
    check_rank(t, 3, name, dense_layout);
    check_shape(t, {p.batch, rows, heads}, name);
  }
  return row_strides(t);
}

// Gate skipping's cells: bool (B, H, query cells, key cells) over the sequences' (max) lengths.
void set_gate_keep(const TensorDesc& keep, ForwardParams& p) {
  constexpr int64_t kCell = GateOperand::kKeepCell;
  check_on_device(p, keep, "gate_keep");
  check_dtype(keep, DType::kBool, "gate_keep");
  check_rank(keep, 4, "gate_keep", "(batch, num_heads, query cells, key cells)");
  check_shape(keep, {p.batch, p.num_heads, (p.seqlen_q + kCell - 1) / kCell, (p.seqlen_k + kCell - 1) / kCell},
              "gate_keep");
  check_contiguous(keep, "gate_keep");
  check(keep.numel() < (int64_t(1) << 31), ErrorKind::kValue, "gate_keep: expected fewer than 2^31 cells, got ",
        keep.numel(), " (the kernels index the cells with 32 bits)");
  p.gate.keep = static_cast<const uint8_t*>(keep.data);
  p.gate.keep_bs = keep.strides[0], p.gate.keep_hs = keep.strides[1], p.gate.keep_ms = keep.strides[2];
}

void set_gate(const ScoreTerms& terms, ForwardParams& p) {
  check(terms.delta != nullptr, ErrorKind::kValue, "gate: alpha given without delta");
  check(!p.has_key_positions(), ErrorKind::kNotImplemented,
        "gate: gated attention does not take gathered keys (attention_topk) yet");
  const int64_t rows_q = p.is_varlen() ? p.total_q : p.seqlen_q;
  const int64_t rows_k = p.is_varlen() ? p.total_k : p.seqlen_k;
  p.gate.alpha_strides = gate_rows(p, *terms.alpha, rows_q, p.num_heads, "alpha", "(batch, seqlen_q, num_heads)",
                                   "(total_q, num_heads)");
  p.gate.delta_strides = gate_rows(p, *terms.delta, rows_k, p.num_heads_kv, "delta",
                                   "(batch, seqlen_k, num_heads_kv)", "(total_k, num_heads_kv)");
  p.gate.alpha = terms.alpha->data, p.gate.alpha_dtype = terms.alpha->dtype;
  p.gate.delta = terms.delta->data, p.gate.delta_dtype = terms.delta->dtype;
  check(terms.gate_fn == GateFn::kLogSigmoid || terms.gate_fn == GateFn::kLinear, ErrorKind::kValue,
        "gate_fn: expected logsigmoid (0) or linear (1), got ", static_cast<int>(terms.gate_fn));
  p.gate.fn = terms.gate_fn;
  if (terms.gate_keep != nullptr) set_gate_keep(*terms.gate_keep, p);
}

void set_windows(const TensorDesc& w, ForwardParams& p) {
  check_on_device(p, w, "windows");
  check_dtype(w, DType::kInt32, "windows");
  check_rank(w, 2, "windows", "(heads, 4) with rows [sink, near, gap, far]");
  const int64_t heads = w.shape[0];
  check(w.shape[1] == 4 && (heads == 1 || heads == p.num_heads || heads == p.num_heads_kv), ErrorKind::kValue,
        "windows: expected shape (1, 4), (num_heads_kv, 4) = (", p.num_heads_kv, ", 4) or (num_heads, 4) = (",
        p.num_heads, ", 4), got ", w.shape_text());
  check(w.strides[1] == 1, ErrorKind::kValue,
        "windows: expected contiguous rows (stride 1 along the last dimension), got stride ", w.strides[1]);
  check(!p.has_key_positions(), ErrorKind::kNotImplemented,
        "windows: windows with sinks do not take gathered keys (attention_topk) yet");
  const auto* rows = static_cast<const int32_t*>(w.data);
  const int64_t stride_h = heads == 1 ? 0 : w.strides[0];  // (0 for an expanded row, too)
  if (w.device == DeviceKind::kCPU) {  // values are read on the host only where they live there
    for (int64_t h = 0; h < heads; ++h) {
      for (int c = 0; c < 4; ++c) {
        const char* names[4] = {"sink", "near", "gap", "far"};
        check(rows[h * stride_h + c] >= 0, ErrorKind::kValue, "windows: expected entries >= 0, got ",
              names[c], " = ", rows[h * stride_h + c], " in row ", h);
      }
    }
  }
  p.windows.ptr = rows;
  p.windows.stride_h = stride_h;
  p.windows.head_div = (heads == p.num_heads_kv && heads != p.num_heads) ? p.num_heads / p.num_heads_kv : 1;
}

// A gradient with exactly its input's shape and dtype (any strides) as a SeqTensor.
SeqTensor gate_grad_rows(const ForwardParams& p, const TensorDesc& grad, const TensorDesc& input,
                         DType dtype, const char* name) {
  check_on_device(p, grad, name);
  check_dtype(grad, dtype, name);
  check_shape(grad, input.shape, name);
  return row_strides(grad);
}

}  // namespace

void set_score_terms(const ScoreTerms& terms, ForwardParams& params) {
  if (terms.alpha != nullptr) {
    set_gate(terms, params);
  } else {
    check(terms.delta == nullptr, ErrorKind::kValue, "gate: delta given without alpha");
    check(terms.gate_keep == nullptr, ErrorKind::kValue, "gate_keep: given without a gate");
  }
  if (terms.windows != nullptr) set_windows(*terms.windows, params);
  check(terms.gate_keep == nullptr || terms.windows == nullptr, ErrorKind::kNotImplemented,
        "gate_threshold: gate skipping does not take windows with sinks yet");
}

void set_score_terms(const ScoreTerms& terms, const TensorDesc* dalpha, const TensorDesc* ddelta,
                     const TensorDesc* dalpha_accum, BackwardParams& params) {
  set_score_terms(terms, params.fwd);
  const ForwardParams& f = params.fwd;
  // (whether a gate came is the arguments' question: an empty alpha -- no query -- has no data,
  // and f.gate holds none)
  if (dalpha != nullptr) {
    check(terms.alpha != nullptr, ErrorKind::kValue, "dalpha: given without a gate");
    params.dalpha_strides = gate_grad_rows(f, *dalpha, *terms.alpha, f.gate.alpha_dtype, "dalpha");
    params.dalpha = dalpha->data;
  }
  if (ddelta != nullptr) {
    check(terms.alpha != nullptr, ErrorKind::kValue, "ddelta: given without a gate");
    params.ddelta_strides = gate_grad_rows(f, *ddelta, *terms.delta, f.gate.delta_dtype, "ddelta");
    params.ddelta = ddelta->data;
  }
  if (dalpha_accum != nullptr) {
    check(dalpha != nullptr, ErrorKind::kValue, "dalpha_accum: given without dalpha");
    check_on_device(f, *dalpha_accum, "dalpha_accum");
    check_dtype(*dalpha_accum, DType::kFloat32, "dalpha_accum");
    check_contiguous(*dalpha_accum, "dalpha_accum");
    const int64_t rows = f.num_heads * (f.is_varlen() ? f.total_q : f.batch * f.seqlen_q);
    check(rows == 0 || (dalpha_accum->numel() >= rows && dalpha_accum->numel() % rows == 0), ErrorKind::kValue,
          "dalpha_accum: expected a positive multiple of H * query rows = ", rows, " float32 elements, got ",
          dalpha_accum->numel());
    params.dalpha_accum = dalpha_accum->data;
    params.dalpha_accum_slices = rows == 0 ? 1 : dalpha_accum->numel() / rows;
  }
}

}  // namespace dmattn
