"""PyTorch custom ops over the native library: dmattn::fwd and dmattn::bwd.

Both ops allocate their outputs (and the CUDA backend's scratch) with torch, so memory comes
from PyTorch's caching allocator and the ops can be captured in CUDA graphs; the native
library only fills the buffers it is given. register_fake makes them traceable by
torch.compile, register_autograd connects the two.

Mask and bias are passed exactly as the user gave them (any rank <= 4, broadcast strides):
the native validation right-aligns them to (B, H, Sq, Sk) and never expands them.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._lib import lib

__all__ = ["attention_forward", "attention_backward"]


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _check_rank(t: Tensor, name: str, layout: str) -> None:
    if t.dim() != 4:
        raise ValueError(f"{name}: expected a 4-D tensor {layout}, got shape {tuple(t.shape)}")


def _scale_arg(scale: Optional[float]) -> float:
    # NaN asks the native side for the default 1/sqrt(head_dim).
    return math.nan if scale is None else float(scale)


def _bias_shape4(bias: Tensor) -> Tuple[int, int, int, int]:
    shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    return shape  # type: ignore[return-value]


def _dbias_needs_accum(q: Tensor, bias: Tensor) -> bool:
    """The CUDA backward reduces a batch- or head-broadcast dbias in an fp32 buffer of the
    bias's own size. A key-broadcast bias (last dim 1) has an exactly zero gradient and needs none."""
    if q.device.type != "cuda" or bias.dim() > 4:
        return False
    b, h, _, sk = _bias_shape4(bias)
    return sk > 1 and (b < q.shape[0] or h < q.shape[2])


@torch.library.custom_op("dmattn::fwd", mutates_args=())
def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],
    softcap: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor]:
    """Returns (out, lse): out like q, lse (B, H, Sq) float32 (float64 for float64 inputs)."""
    _check_rank(q, "q", "(batch, seqlen_q, num_heads, head_dim)")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q), device=q.device)
    lib().forward(q, k, v, out, lse, mask, bias, causal, window_left, window_right,
                  _scale_arg(scale), softcap)
    return out, lse


@attention_forward.register_fake
def _(q, k, v, mask, bias, causal, window_left, window_right, scale, softcap, deterministic):
    _check_rank(q, "q", "(batch, seqlen_q, num_heads, head_dim)")
    out = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q))
    return out, lse


@torch.library.custom_op("dmattn::bwd", mutates_args=())
def attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    bias_requires_grad: bool,
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],
    softcap: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, dbias); dbias is an empty tensor unless bias_requires_grad."""
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dbias = None
    if bias_requires_grad and bias is not None:
        dbias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
    delta = dq_accum = dbias_accum = None
    if q.device.type == "cuda":
        b, sq, h, d = q.shape
        delta = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
        dq_accum = torch.empty((b, sq, h, d), dtype=torch.float32, device=q.device)
        if dbias is not None and _dbias_needs_accum(q, bias):
            dbias_accum = torch.empty(_bias_shape4(bias), dtype=torch.float32, device=q.device)
    lib().backward(q, k, v, out, lse, mask, bias, dout, dq, dk, dv, dbias, delta, dq_accum,
                   dbias_accum, causal, window_left, window_right, _scale_arg(scale), softcap,
                   deterministic)
    if dbias is None:
        dbias = q.new_empty((0,))
    return dq, dk, dv, dbias


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, mask, bias, bias_requires_grad, causal, window_left,
      window_right, scale, softcap, deterministic):
    dbias = bias.new_empty(bias.shape) if (bias_requires_grad and bias is not None) else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _setup_context(ctx, inputs, output):
    q, k, v, mask, bias, causal, window_left, window_right, scale, softcap, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, bias, out, lse)
    ctx.options = (causal, window_left, window_right, scale, softcap, deterministic)
    ctx.bias_requires_grad = bias is not None and ctx.needs_input_grad[4]
    # lse is returned for inspection (as in FlashAttention); it carries no gradient.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, mask, bias, out, lse = ctx.saved_tensors
    causal, window_left, window_right, scale, softcap, deterministic = ctx.options
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv, dbias = attention_backward(
        dout, q, k, v, out, lse, mask, bias, ctx.bias_requires_grad, causal, window_left,
        window_right, scale, softcap, deterministic)
    return (dq, dk, dv, None, dbias if ctx.bias_requires_grad else None,
            None, None, None, None, None, None)


attention_forward.register_autograd(_backward, setup_context=_setup_context)
