// Host side of the CUDA sm80-class backend: checks what only this backend requires
// (dtype, head dim, 16-byte alignment), fills FwdArgs in one place and dispatches to the
// instantiation for (dtype, head dim).
#include "cuda/host/cuda_backend.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "cuda/host/aligned_operand.h"
#include "cuda/common/bwd_args.h"
#include "cuda/host/bwd_launch.h"
#include "cuda/sm80/bwd_tile.h"
#include "cuda/common/check.h"
#include "cuda/common/fwd_args.h"
#include "cuda/host/fwd_launch.h"
#include "cuda/sm80/fwd_tile.h"
#include "cuda/host/host_operands.h"
#include "dmattn/error.h"

namespace dmattn::cuda {
namespace {

// Query / key rows of the whole batch: B * max length dense, the packed totals in varlen mode.
int64_t query_rows(const ForwardParams& p) { return p.is_varlen() ? p.total_q : p.batch * p.seqlen_q; }
int64_t key_rows(const ForwardParams& p) { return p.is_varlen() ? p.total_k : p.batch * p.seqlen_k; }

FwdArgs make_fwd_args(const ForwardParams& p) {
  FwdArgs a;
  a.q = p.q; a.k = p.k; a.v = p.v; a.out = p.out;
  a.lse = static_cast<float*>(p.lse);
  a.lse_bs = p.lse_batch_stride;
  a.lse_hs = p.lse_head_stride;
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
  // Packed batch: the kernels read each sequence's rows and lengths from cu_seqlens
  // (seq_bounds.h); the SeqTensors' batch strides are 0 and lse is (H, total_q).
  a.cu_seqlens_q = p.cu_seqlens_q;
  a.cu_seqlens_k = p.cu_seqlens_k;
  a.q_rows = query_rows(p);
  a.k_rows = p.is_varlen() ? p.total_k : p.batch * p.seqlen_k;
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
  if (p.gate.present()) {  // (score_terms.h)
    const GateOperand& g = p.gate;
    a.gate.alpha = static_cast<const char*>(g.alpha);
    a.gate.delta = static_cast<const char*>(g.delta);
    a.gate.alpha_bs = g.alpha_strides.batch_stride, a.gate.alpha_rs = g.alpha_strides.row_stride;
    a.gate.alpha_hs = g.alpha_strides.head_stride;
    a.gate.delta_bs = g.delta_strides.batch_stride, a.gate.delta_rs = g.delta_strides.row_stride;
    a.gate.delta_hs = g.delta_strides.head_stride;
    a.gate.alpha_fp32 = g.alpha_dtype == DType::kFloat32;
    a.gate.delta_fp32 = g.delta_dtype == DType::kFloat32;
    a.gate.linear = g.fn == GateFn::kLinear;
    a.gate.keep = g.keep;
    a.gate.keep_bs = g.keep_bs, a.gate.keep_hs = g.keep_hs, a.gate.keep_ms = g.keep_ms;
  }
  if (p.windows.present()) {  // windows with sinks imply causal: the kernels' key range is causal's
    a.windows = p.windows.ptr;
    a.windows_hs = p.windows.stride_h;
    a.windows_head_div = static_cast<int>(p.windows.head_div);
    a.window_right = 0;
  }
  if (p.has_key_positions()) {
    a.kpos.ptr = p.key_positions;
    a.kpos.stride_b = p.key_positions_stride_b;
    a.kpos.stride_h = p.key_positions_stride_h;
    a.kpos.head_div = static_cast<int>(p.key_positions_head_div);
    a.kpos.seqlen_k_original = static_cast<int>(p.seqlen_k_original);
    a.kpos.ends = p.key_ends;
    a.kpos.rows = p.key_rows;
    a.kpos.rows_batch_div = static_cast<int>(p.key_rows_batch_div);
    a.kpos.rows_source_len = static_cast<int>(p.key_rows_source_len);
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

// What every CUDA pass requires of the problem: half-precision inputs, a head dim with an
// instantiation (instantiated_hd > 0), operand dtypes the kernels read, and sizes that fit the
// grid and the kernels' 32-bit row indices. `pass` names the pass in the message.
void check_problem(const ForwardParams& p, int instantiated_hd, const char* pass) {
  check(p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16, ErrorKind::kType,
        "q: the CUDA backend supports float16 and bfloat16, got another dtype");
  check(p.head_dim > 0 && p.head_dim % 8 == 0 && instantiated_hd > 0, ErrorKind::kValue, "q: head_dim ",
        p.head_dim, " is not supported by ", pass, " (expected a multiple of 8 up to 256)");
  check(!p.mask.present() || p.mask.dtype == DType::kBool, ErrorKind::kType, "mask: expected dtype bool");
  check(!p.bias.present() || p.bias.dtype == DType::kFloat32 || p.bias.dtype == p.dtype, ErrorKind::kType,
        "bias: expected q's dtype or float32");
  check(p.seqlen_q < (int64_t(1) << 31) && p.seqlen_k < (int64_t(1) << 31), ErrorKind::kValue,
        "q/k: sequence lengths must be below 2^31 for the CUDA backend");
  check(p.num_heads <= 65535 && p.batch <= 65535, ErrorKind::kValue,
        "q: the CUDA backend supports at most 65535 heads and 65535 batches, got (", p.batch, ", ",
        p.num_heads, ")");
  if (p.has_key_positions()) {
    check(p.seqlen_k_original < (int64_t(1) << 31), ErrorKind::kValue,
          "seqlen_k_original: must be below 2^31 for the CUDA backend");
    check(p.key_rows_source_len < (int64_t(1) << 31), ErrorKind::kValue,
          "k: with key_rows, the source length (k.shape[1]) must be below 2^31 for the CUDA backend");
    // The key-block-major backward kernel reads one positions row per kv head, shared by the
    // query heads of its group: rows that differ per query head need k/v gathered per query
    // head (num_heads_kv == num_heads), which is what dmattn.gather does.
    const bool per_query_head = p.key_positions_stride_h != 0 && p.key_positions_head_div == 1;
    check(!per_query_head || p.group_size() == 1, ErrorKind::kNotImplemented,
          "key_positions: one row per query head with GQA (num_heads ", p.num_heads, " != num_heads_kv ",
          p.num_heads_kv, ") is not implemented on CUDA; gather k and v per query head");
  }
}

}  // namespace

void forward(const ForwardParams& p) {
  const int hd = fwd_instantiated_head_dim(static_cast<int>(p.head_dim));
  check_problem(p, hd, "the CUDA backend");
  if (query_rows(p) == 0 || p.num_heads == 0) return;
  check_seq_tensor("q", p.q, p.q_strides);
  check_seq_tensor("k", p.k, p.k_strides);
  check_seq_tensor("v", p.v, p.v_strides);
  check_seq_tensor("out", p.out, p.out_strides);

  DeviceGuard guard(p.device_id);
  FwdArgs a = make_fwd_args(p);
  auto stream = static_cast<cudaStream_t>(p.stream);
  // (rows the kernels would read element by element: a padded copy for this call)
  const AlignedOperandCopy mask_rows(a.mask, a.batch, a.num_heads, a.seqlen_q, a.seqlen_k, stream);
  const AlignedOperandCopy bias_rows(a.bias, a.batch, a.num_heads, a.seqlen_q, a.seqlen_k, stream);
  const bool bf16 = p.dtype == DType::kBFloat16;
  switch (hd) {
    case 64: bf16 ? run_fwd<cutlass::bfloat16_t, 64>(a, stream) : run_fwd<cutlass::half_t, 64>(a, stream); break;
    case 128: bf16 ? run_fwd<cutlass::bfloat16_t, 128>(a, stream) : run_fwd<cutlass::half_t, 128>(a, stream); break;
    case 256: bf16 ? run_fwd<cutlass::bfloat16_t, 256>(a, stream) : run_fwd<cutlass::half_t, 256>(a, stream); break;
    default: fail(ErrorKind::kValue, "q: head_dim ", p.head_dim, " has no CUDA instantiation");
  }
}

namespace {

// Checks of the backward pass (dtype, head dim, operand dtypes, sizes).
void check_bwd_problem(const ForwardParams& p) {
  check_problem(p, bwd_instantiated_head_dim(static_cast<int>(p.head_dim)),
                "the CUDA backward pass");
}

// dbias: how the main kernel reduces it (see BwdDbiasMode in bwd_args.h).
void set_dbias_mode(const BackwardParams& p, BwdArgs& a) {
  const ForwardParams& f = p.fwd;
  const BroadcastOperand& bias = f.bias;
  a.dbias = p.dbias;
  a.db_sb = bias.size_b == 1 ? 0 : p.dbias_stride_b;
  a.db_sh = bias.size_h == 1 ? 0 : p.dbias_stride_h;
  a.db_sq = bias.size_q == 1 ? 0 : p.dbias_stride_q;
  a.db_sk = bias.size_k == 1 ? 0 : p.dbias_stride_k;
  a.bsize_b = bias.size_b, a.bsize_h = bias.size_h, a.bsize_q = bias.size_q, a.bsize_k = bias.size_k;
  a.bias_head_div = static_cast<int>(bias.head_div);
  a.dbias_accum = static_cast<float*>(p.dbias_accum);
  const int esize = bias.dtype == DType::kFloat32 ? 4 : 2;
  const auto al = [&](int64_t s) { return (s * esize) % 16 == 0; };
  a.db_vec = a.db_sk == 1 && aligned16(p.dbias) && al(a.db_sb) && al(a.db_sh) && al(a.db_sq);

  // A key-broadcast bias (size_k == 1) adds one constant per row, to which softmax is invariant:
  // sum_j dS_ij = sum_j P_ij dP_ij - Delta_i = 0 exactly, so its gradient is written as zeros.
  if (bias.size_k == 1) { a.dbias_mode = kDbNone; return; }
  // A packed batch's key-side bias (Hb, total_k) has one entry per key of one sequence: no
  // element is shared across sequences, so the batch dimension reduces nothing (and is never
  // folded: each CTA's bounds are its own sequence's).
  const bool batch_full = bias.size_b == f.batch || f.batch == 1 || f.is_varlen();
  const bool heads_full = (bias.size_h == f.num_heads && bias.head_div == 1) || f.num_heads == 1;
  // Several CTAs (batches, kv heads) contribute to one dbias element.
  const bool cross = (!batch_full && bias.size_b == 1) || (bias.size_h == 1 && f.num_heads_kv > 1);
  if (bias.size_q == 1) {
    a.dbias_mode = kDbColSum;
    a.db_colsum_to_accum = cross;
  } else if (batch_full && heads_full) {
    a.dbias_mode = kDbDirect;
  } else {
    a.dbias_mode = kDbAccum;
  }
  if (cross) {
    if (p.deterministic) {
      a.fold_batch = !batch_full && bias.size_b == 1;
      a.fold_heads = bias.size_h == 1 && f.num_heads_kv > 1;
    } else {
      a.db_atomic = true;
    }
  }
  const bool needs_accum = a.dbias_mode == kDbAccum || (a.dbias_mode == kDbColSum && a.db_colsum_to_accum);
  if (key_rows(f) == 0) return;  // only zeros to write (run_bwd)
  check(!needs_accum || p.dbias_accum != nullptr, ErrorKind::kValue,
        "dbias_accum: the CUDA backend needs a float32 accumulator of the bias's size for a bias ",
        "broadcast over batch or heads, got none");
}

}  // namespace

void backward(const BackwardParams& p) {
  const ForwardParams& f = p.fwd;
  check_bwd_problem(f);
  // Empty tensors are not checked (torch may give them any strides or a null pointer); with
  // B == 0 only a dbias without a batch dimension has elements (zeros).
  const bool q_side = query_rows(f) > 0, k_side = key_rows(f) > 0;
  if (q_side) {
    check_seq_tensor("q", f.q, f.q_strides);
    check_seq_tensor("out", f.out, f.out_strides);
    check_seq_tensor("dout", p.dout, p.dout_strides);
    check_seq_tensor("dq", p.dq, p.dq_strides);
    check(p.softmax_delta != nullptr, ErrorKind::kValue,
          "softmax_delta: the CUDA backend needs a (B, H, Sq) float32 scratch buffer, got none");
    check(p.deterministic || p.dq_accum != nullptr, ErrorKind::kValue,
          "dq_accum: the CUDA backend needs a (B, Sq, H, D) float32 scratch buffer, got none");
    check(p.dq_accum == nullptr || aligned16(p.dq_accum), ErrorKind::kValue,
          "dq_accum: expected a 16-byte aligned buffer");
  }
  if (k_side) {
    check_seq_tensor("k", f.k, f.k_strides);
    check_seq_tensor("v", f.v, f.v_strides);
    check_seq_tensor("dk", p.dk, p.dk_strides);
    check_seq_tensor("dv", p.dv, p.dv_strides);
  }
  if (!q_side && !k_side && p.dbias == nullptr) return;

  DeviceGuard guard(f.device_id);
  BwdArgs a;
  a.f = make_fwd_args(f);
  a.dout = p.dout;
  a.do_bs = p.dout_strides.batch_stride, a.do_rs = p.dout_strides.row_stride, a.do_hs = p.dout_strides.head_stride;
  a.dq = p.dq;
  a.dq_bs = p.dq_strides.batch_stride, a.dq_rs = p.dq_strides.row_stride, a.dq_hs = p.dq_strides.head_stride;
  a.dk = p.dk;
  a.dk_bs = p.dk_strides.batch_stride, a.dk_rs = p.dk_strides.row_stride, a.dk_hs = p.dk_strides.head_stride;
  a.dv = p.dv;
  a.dv_bs = p.dv_strides.batch_stride, a.dv_rs = p.dv_strides.row_stride, a.dv_hs = p.dv_strides.head_stride;
  a.delta = static_cast<float*>(p.softmax_delta);
  // (deterministic: used by the warp-specialized kernel's ordered adds only; run_bwd drops it for the others)
  a.dq_accum = static_cast<float*>(p.dq_accum);
  a.num_heads_kv = static_cast<int>(f.num_heads_kv);
  if (p.dbias != nullptr) set_dbias_mode(p, a);
  if (p.dalpha != nullptr || p.ddelta != nullptr) {  // the gate's gradients (score_terms.h)
    check(p.dalpha == nullptr || p.dalpha_accum != nullptr || query_rows(f) * f.num_heads == 0, ErrorKind::kValue,
          "dalpha_accum: the CUDA backend needs a float32 scratch buffer for dalpha, got none");
    a.dalpha = p.dalpha;
    a.dalpha_bs = p.dalpha_strides.batch_stride, a.dalpha_rs = p.dalpha_strides.row_stride;
    a.dalpha_hs = p.dalpha_strides.head_stride;
    a.dalpha_accum = static_cast<float*>(p.dalpha_accum);
    a.dalpha_slices = p.deterministic ? p.dalpha_accum_slices : 1;
    a.ddelta = p.ddelta;
    a.ddelta_bs = p.ddelta_strides.batch_stride, a.ddelta_rs = p.ddelta_strides.row_stride;
    a.ddelta_hs = p.ddelta_strides.head_stride;
  }

  // Problems up to kExactMaxScores score elements take the exact three-pass path (Delta and the
  // softmax statistics recomputed in fp32, as the CPU backend: the extra pass costs little
  // there, and the gradients of rows with very few keys or of key-reduced biases carry no
  // rounding noise of the stored O); larger ones take FlashAttention-2's rowsum(dO * O).
  // DMATTN_BWD_EXACT=0/1 forces either.
  constexpr double kExactMaxScores = double(int64_t(1) << 28);
  bool exact = double(f.batch) * double(f.num_heads) * double(f.seqlen_q) * double(f.seqlen_k) <= kExactMaxScores;
  if (const char* env = std::getenv("DMATTN_BWD_EXACT")) exact = env[0] == '1';
  exact = exact && !p.forward_stats;  // the given lse and out are the statistics
  // (deterministic mode: the lse path at every size)
  exact = exact && p.dq_accum != nullptr && !p.deterministic;
  if (const char* env = std::getenv("DMATTN_BWD_EXP")) a.exp_flags = std::atoi(env);

  auto stream = static_cast<cudaStream_t>(f.stream);
  const AlignedOperandCopy mask_rows(a.f.mask, a.f.batch, a.f.num_heads, a.f.seqlen_q, a.f.seqlen_k, stream);
  const AlignedOperandCopy bias_rows(a.f.bias, a.f.batch, a.f.num_heads, a.f.seqlen_q, a.f.seqlen_k, stream);
  const bool bf16 = f.dtype == DType::kBFloat16;
  switch (bwd_instantiated_head_dim(static_cast<int>(f.head_dim))) {
    case 64:
      bf16 ? run_bwd<cutlass::bfloat16_t, 64>(a, p.deterministic, exact, stream)
           : run_bwd<cutlass::half_t, 64>(a, p.deterministic, exact, stream);
      break;
    case 128:
      bf16 ? run_bwd<cutlass::bfloat16_t, 128>(a, p.deterministic, exact, stream)
           : run_bwd<cutlass::half_t, 128>(a, p.deterministic, exact, stream);
      break;
    case 256:
      bf16 ? run_bwd<cutlass::bfloat16_t, 256>(a, p.deterministic, exact, stream)
           : run_bwd<cutlass::half_t, 256>(a, p.deterministic, exact, stream);
      break;
    default: fail(ErrorKind::kValue, "q: head_dim ", f.head_dim, " has no CUDA instantiation");
  }
}

}  // namespace dmattn::cuda
