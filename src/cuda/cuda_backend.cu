// Host side of the CUDA sm80-class backend: checks what only this backend requires
// (dtype, head dim, 16-byte alignment), fills FwdArgs in one place and dispatches to the
// instantiation for (dtype, head dim).
#include "cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/check.h"
#include "cuda/fwd_args.h"
#include "cuda/fwd_launch.h"
#include "cuda/fwd_tile.h"
#include "dmattn/error.h"

namespace dmattn::cuda {
namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

void check_seq_tensor(const char* name, const void* ptr, const SeqTensor& t) {
  check(aligned16(ptr) && t.batch_stride % 8 == 0 && t.row_stride % 8 == 0 && t.head_stride % 8 == 0,
        ErrorKind::kValue, name, ": the CUDA backend needs a 16-byte aligned data pointer and strides ",
        "that are multiples of 8 elements, got strides (", t.batch_stride, ", ", t.row_stride, ", ",
        t.head_stride, ")");
}

OperandArgs make_operand(const BroadcastOperand& op, int esize) {
  OperandArgs o;
  if (!op.present()) return o;
  o.ptr = static_cast<const char*>(op.ptr);
  o.stride_b = op.size_b == 1 ? 0 : op.stride_b;
  o.stride_h = op.size_h == 1 ? 0 : op.stride_h;
  o.stride_q = op.size_q == 1 ? 0 : op.stride_q;
  o.stride_k = op.size_k == 1 ? 0 : op.stride_k;
  o.head_div = static_cast<int>(op.head_div);
  o.esize = esize;
  o.row_bcast = o.stride_q == 0;
  const auto al = [&](int64_t s) { return (s * esize) % 16 == 0; };
  o.vec = o.stride_k == 1 && aligned16(op.ptr) && al(o.stride_b) && al(o.stride_h) && al(o.stride_q);
  return o;
}

FwdArgs make_fwd_args(const ForwardParams& p) {
  FwdArgs a;
  a.q = p.q; a.k = p.k; a.v = p.v; a.out = p.out;
  a.lse = static_cast<float*>(p.lse);
  a.q_bs = p.q_strides.batch_stride; a.q_rs = p.q_strides.row_stride; a.q_hs = p.q_strides.head_stride;
  a.k_bs = p.k_strides.batch_stride; a.k_rs = p.k_strides.row_stride; a.k_hs = p.k_strides.head_stride;
  a.v_bs = p.v_strides.batch_stride; a.v_rs = p.v_strides.row_stride; a.v_hs = p.v_strides.head_stride;
  a.o_bs = p.out_strides.batch_stride; a.o_rs = p.out_strides.row_stride; a.o_hs = p.out_strides.head_stride;
  a.batch = static_cast<int>(p.batch);
  a.seqlen_q = static_cast<int>(p.seqlen_q);
  a.seqlen_k = static_cast<int>(p.seqlen_k);
  a.num_heads = static_cast<int>(p.num_heads);
  a.group = static_cast<int>(p.group_size());
  a.head_dim = static_cast<int>(p.head_dim);
  a.scale = static_cast<float>(p.scale);
  a.softcap = p.softcap > 0 ? static_cast<float>(p.softcap) : 0.f;
  a.scale_div_softcap = p.softcap > 0 ? static_cast<float>(p.scale / p.softcap) : 0.f;
  a.window_left = p.window_left;
  a.window_right = p.window_right;
  a.mask = make_operand(p.mask, 1);
  if (p.bias.present()) {
    a.bias_fp32 = p.bias.dtype == DType::kFloat32;
    a.bias = make_operand(p.bias, a.bias_fp32 ? 4 : 2);
  }
  return a;
}

// Runs on p.device_id, restoring the caller's current device.
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int dev) {
    check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
    if (prev != dev) check_cuda(cudaSetDevice(dev), "cudaSetDevice");
    else prev = -1;
  }
  ~DeviceGuard() { if (prev >= 0) cudaSetDevice(prev); }
};

}  // namespace

void forward(const ForwardParams& p) {
  check(p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16, ErrorKind::kType,
        "q: the CUDA backend supports float16 and bfloat16, got another dtype");
  const int hd = fwd_instantiated_head_dim(static_cast<int>(p.head_dim));
  check(p.head_dim > 0 && p.head_dim % 8 == 0 && hd > 0, ErrorKind::kValue, "q: head_dim ", p.head_dim,
        " is not supported by the CUDA backend (expected a multiple of 8 up to 256)");
  check(!p.mask.present() || p.mask.dtype == DType::kBool, ErrorKind::kType, "mask: expected dtype bool");
  check(!p.bias.present() || p.bias.dtype == DType::kFloat32 || p.bias.dtype == p.dtype, ErrorKind::kType,
        "bias: expected q's dtype or float32");
  check(p.seqlen_q < (int64_t(1) << 31) && p.seqlen_k < (int64_t(1) << 31), ErrorKind::kValue,
        "q/k: sequence lengths must be below 2^31 for the CUDA backend");
  check(p.num_heads <= 65535 && p.batch <= 65535, ErrorKind::kValue,
        "q: the CUDA backend supports at most 65535 heads and 65535 batches, got (", p.batch, ", ",
        p.num_heads, ")");
  if (p.batch == 0 || p.seqlen_q == 0 || p.num_heads == 0) return;
  check_seq_tensor("q", p.q, p.q_strides);
  check_seq_tensor("k", p.k, p.k_strides);
  check_seq_tensor("v", p.v, p.v_strides);
  check_seq_tensor("out", p.out, p.out_strides);

  DeviceGuard guard(p.device_id);
  const FwdArgs a = make_fwd_args(p);
  auto stream = static_cast<cudaStream_t>(p.stream);
  const bool bf16 = p.dtype == DType::kBFloat16;
  switch (hd) {
    case 64: bf16 ? run_fwd<cutlass::bfloat16_t, 64>(a, stream) : run_fwd<cutlass::half_t, 64>(a, stream); break;
    case 128: bf16 ? run_fwd<cutlass::bfloat16_t, 128>(a, stream) : run_fwd<cutlass::half_t, 128>(a, stream); break;
    case 256: bf16 ? run_fwd<cutlass::bfloat16_t, 256>(a, stream) : run_fwd<cutlass::half_t, 256>(a, stream); break;
    default: fail(ErrorKind::kValue, "q: head_dim ", p.head_dim, " has no CUDA instantiation");
  }
}

void backward(const BackwardParams&) {
  fail(ErrorKind::kNotImplemented, "backward: the CUDA backend's backward pass is not implemented yet");
}

}  // namespace dmattn::cuda
