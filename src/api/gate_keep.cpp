// Validation and dispatch of gate skipping's cells on CUDA (gate_keep_cells, dmattn/api.h); the
// CPU composes framework ops (python/dmattn/gate_skip.py).
#include <cmath>
#include <cstdint>
#include <utility>

#include "api/tensor_checks.h"
#include "dmattn/api.h"
#ifdef DMATTN_WITH_CUDA
#include "cuda/common/gate_keep.h"
#endif

namespace dmattn {

namespace {

using namespace checks;  // NOLINT: the shared argument checks

int gate_type(const TensorDesc& t, const char* name) {
  check(t.dtype == DType::kFloat32 || t.dtype == DType::kFloat16 || t.dtype == DType::kBFloat16, ErrorKind::kType,
        name, ": expected dtype float32, float16 or bfloat16, got ", dtype_name(t.dtype));
  return t.dtype == DType::kFloat32 ? 0 : t.dtype == DType::kFloat16 ? 1 : 2;
}

}  // namespace

bool gate_keep_cells(const TensorDesc& alpha, const TensorDesc& delta, const TensorDesc* cu_seqlens_q,
                     const TensorDesc* cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                     const GateKeepOptions& options, const TensorDesc& keep, void* stream) {
  constexpr int64_t kCell = GateOperand::kKeepCell;
  check(alpha.device == DeviceKind::kCUDA, ErrorKind::kValue, "alpha: expected a CUDA tensor, got ",
        device_name(alpha.device), " (the CPU composes framework ops)");
  for (const auto& [t, name] : {std::pair{&delta, "delta"}, std::pair{&keep, "keep"}}) check_same_device(alpha, *t, name);
  const bool packed = cu_seqlens_q != nullptr;
  check(packed == (cu_seqlens_k != nullptr), ErrorKind::kValue, "cu_seqlens_q / cu_seqlens_k: both or neither");
  check(options.threshold > 0 && std::isfinite(options.threshold), ErrorKind::kValue,
        "gate_threshold: expected a finite value > 0, got ", options.threshold);
  const int64_t rank = packed ? 2 : 3;
  check_rank(alpha, rank, "alpha", packed ? "(total_q, num_heads)" : "(batch, seqlen_q, num_heads)");
  check_rank(delta, rank, "delta", packed ? "(total_k, num_heads_kv)" : "(batch, seqlen_k, num_heads_kv)");
  const int64_t heads = alpha.shape[rank - 1], heads_kv = delta.shape[rank - 1];
  check(heads_kv > 0 && heads % heads_kv == 0, ErrorKind::kValue, "delta: expected num_heads_kv dividing num_heads = ",
        heads, ", got ", heads_kv);
  int64_t batch = 0;
  if (packed) {
    for (const auto& [t, name] : {std::pair{cu_seqlens_q, "cu_seqlens_q"}, std::pair{cu_seqlens_k, "cu_seqlens_k"}}) {
      check_same_device(alpha, *t, name);
      check_dtype(*t, DType::kInt32, name);
      check_rank(*t, 1, name, "(batch + 1,)");
      check_contiguous(*t, name);
    }
    batch = cu_seqlens_q->shape[0] - 1;
    check(cu_seqlens_k->shape[0] == batch + 1, ErrorKind::kValue, "cu_seqlens_k: expected length ", batch + 1);
  } else {
    batch = alpha.shape[0];
    check(delta.shape[0] == batch, ErrorKind::kValue, "delta: expected batch ", batch, ", got ", delta.shape[0]);
    max_seqlen_q = alpha.shape[1], max_seqlen_k = delta.shape[1];
  }
  const int64_t m_cells = (max_seqlen_q + kCell - 1) / kCell, n_cells = (max_seqlen_k + kCell - 1) / kCell;
  check_dtype(keep, DType::kBool, "keep");
  check_shape(keep, {batch, heads, m_cells, n_cells}, "keep");
  check_contiguous(keep, "keep");
  const int alpha_type = gate_type(alpha, "alpha"), delta_type = gate_type(delta, "delta");
#ifndef DMATTN_WITH_CUDA
  (void)stream, (void)alpha_type, (void)delta_type;
  fail(ErrorKind::kRuntime, "alpha: this build of dmattn has no CUDA backend");
#else
  if (cuda::gate_keep_smem_bytes(int(m_cells), int(n_cells)) > 200 * 1024) return false;
  cuda::GateKeepArgs a;
  a.alpha = alpha.data, a.delta = delta.data;
  a.alpha_type = alpha_type, a.delta_type = delta_type;
  if (packed) {
    a.a_rs = alpha.strides[0], a.a_hs = alpha.strides[1], a.d_rs = delta.strides[0], a.d_hs = delta.strides[1];
    a.cu_seqlens_q = static_cast<const int32_t*>(cu_seqlens_q->data);
    a.cu_seqlens_k = static_cast<const int32_t*>(cu_seqlens_k->data);
  } else {
    a.a_bs = alpha.strides[0], a.a_rs = alpha.strides[1], a.a_hs = alpha.strides[2];
    a.d_bs = delta.strides[0], a.d_rs = delta.strides[1], a.d_hs = delta.strides[2];
  }
  a.batch = int(batch), a.heads = int(heads), a.group = int(heads / heads_kv);
  a.seqlen_q = int(max_seqlen_q), a.seqlen_k = int(max_seqlen_k);
  a.m_cells = int(m_cells), a.n_cells = int(n_cells);
  a.scale = float(options.scale), a.threshold = float(options.threshold);
  a.log_threshold = float(std::log(options.threshold));
  a.logsigmoid = options.gate_fn == GateFn::kLogSigmoid;
  a.causal = options.causal, a.adaptive = options.adaptive;
  a.window_left = int(window_bound(options.window_left, max_seqlen_k, "window[0] (left)"));
  a.window_right = int(window_bound(options.window_right, max_seqlen_q, "window[1] (right)"));
  a.keep = static_cast<uint8_t*>(keep.data);
  cuda::launch_gate_keep(a, stream);
  return true;
#endif
}

}  // namespace dmattn
