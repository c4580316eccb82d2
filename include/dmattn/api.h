// Public C++ entry points: validate + fill params, then run on the params' device.
#pragma once

#include "dmattn/error.h"
#include "dmattn/params.h"
#include "dmattn/types.h"

namespace dmattn {

struct AttentionOptions {
  bool causal = false;
  int64_t window_left = -1;   // -1 = unbounded; other negatives are an error
  int64_t window_right = -1;
  // Softmax scale; NaN means "default" = 1/sqrt(head_dim).
  double scale = __builtin_nan("");
  double softcap = 0.0;
  bool deterministic = false;
};

// Validates every argument (rank, shape, dtype, device, strides, head ratio, head dim,
// options) and fills ForwardParams. Throws dmattn::Error naming the offending argument.
//   q (B, Sq, H, D); k, v (B, Sk, Hkv, D); out like q; lse (B, H, Sq) float32 (float64 for
//   float64 inputs); mask/bias may be null, rank <= 4, right-aligned broadcast to (B, H, Sq, Sk).
ForwardParams make_forward_params(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                  const TensorDesc& out, const TensorDesc& lse,
                                  const TensorDesc* mask, const TensorDesc* bias,
                                  const AttentionOptions& options);

// Same, plus dout (like q), dq (like q), dk/dv (like k), dbias (null, or bias's exact shape and
// dtype), optional CUDA scratch (softmax_delta (B, H, Sq) float32, dq_accum (B, Sq, H, D)
// float32, dbias_accum float32 with the bias's sizes); the CPU backend ignores the scratch.
BackwardParams make_backward_params(const TensorDesc& q, const TensorDesc& k, const TensorDesc& v,
                                    const TensorDesc& out, const TensorDesc& lse,
                                    const TensorDesc* mask, const TensorDesc* bias,
                                    const TensorDesc& dout, const TensorDesc& dq,
                                    const TensorDesc& dk, const TensorDesc& dv,
                                    const TensorDesc* dbias, const TensorDesc* softmax_delta,
                                    const TensorDesc* dq_accum, const TensorDesc* dbias_accum,
                                    const AttentionOptions& options);

// Run on params.device. CPU always available; CUDA when built with it (otherwise an Error).
void run_forward(const ForwardParams& params);
void run_backward(const BackwardParams& params);

// Is the CUDA backend compiled in?
bool cuda_available();

}  // namespace dmattn
