"""Windows with sinks as up to three sliding-window calls merged by their lse (docs/design.md,
"Windows with sinks by parts").

With d = i + (Sk - Sq) - j, key j is visible to query i under a row [sink, near, gap, far] iff
d >= 0 and (j < sink or d < near or near + gap <= d < near + gap + far) (docs/semantics.md). With
s = min(sink, Sk), three disjoint key sets cover that rule, each one call of the dense kernels,
which skip the key blocks outside their window:
  - sinks: keys [0, s), visible for d >= 0 (no causal mask; window (-1, Sk - s) on its keys);
  - near band: keys [s, Sk), causal with window (near - 1, 0);
  - far band: keys [s, Sk - near - gap), causal with window (far - 1, 0) (bottom-right
    alignment on the shortened keys shifts the band by near + gap).
The partial results merge in float32 (as dmattn.distributed's ring: lse = logaddexp, out the
weighted sum; a row no part reaches stays out 0 / lse -inf). The backward runs each part's
dmattn::bwd with ``forward_stats=True`` on the merged out and lse, which yields that part's share
of the gradients; dk, dv, ddelta (and a key-wise dbias) add up on the parts' key ranges.

On CUDA this replaces the sm80-class kernels' per-element windows (every causal key block
visited) with the dense kernels' window sweeps wherever every head has the same row, the other
window arguments are unset and there is no mask (``use_parts``), except where the
warp-specialized Hopper kernels take the windows themselves, forward and backward (on plain
scores, their walk over the key blocks of the sinks and bands: one launch each way, no merge;
``_native_on_device``).
DMATTN_WINDOW_PARTS=0 turns it off, =1 takes it wherever it applies, the CPU and Hopper too
(tests, comparisons).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ._op_utils import _is_compiling
from .lse_merge import NEG_INF, merge_into
from .ops import _call_op, _lse_dtype, attention_backward, attention_forward


class Part(NamedTuple):
    """One call: keys [k_lo, k_hi) of the sequence, with (causal, window_left, window_right)."""
    k_lo: int
    k_hi: int
    causal: bool
    left: int
    right: int


def parts_of(row: Tuple[int, int, int, int], seqlen_q: int, seqlen_k: int) -> List[Part]:
    """The calls that cover window row [sink, near, gap, far] (entries >= 0) on Sq x Sk."""
    sink, near, gap, far = row
    s = min(sink, seqlen_k)
    parts = []
    if s > 0:
        parts.append(Part(0, s, False, -1, seqlen_k - s))
    if near > 0 and seqlen_k > s:
        parts.append(Part(s, seqlen_k, True, near - 1, 0))
    far_end = seqlen_k - near - gap
    if far > 0 and far_end > s:
        parts.append(Part(s, far_end, True, far - 1, 0))
    return parts


def _mode() -> str:
    return os.environ.get("DMATTN_WINDOW_PARTS", "")


@functools.lru_cache(maxsize=None)
def _runs_hopper_kernels(index: int) -> bool:
    from ._lib import device_kernel_path

    return device_kernel_path(index) == "native sm_90a"


def _native_on_device(q: Tensor, bias: Optional[Tensor], softcap: float, deterministic: bool,
                      gated: bool) -> bool:
    """Whether the warp-specialized Hopper kernels take the windows themselves, forward and
    backward (as fwd_ws_supports / bwd_ws_supports decide in the library: head dims 64 and 128,
    16-bit inputs, the windows on plain scores -- no gate, bias, mask or softcap --, dQ's adds
    unordered)."""
    if not q.is_cuda or q.shape[-1] not in (64, 128) or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if gated or deterministic or softcap or bias is not None:
        return False
    if any(os.environ.get(name, "").startswith("0") for name in ("DMATTN_FWD_SM90", "DMATTN_BWD_SM90_WS")):
        return False
    return _runs_hopper_kernels(q.device.index if q.device.index is not None else torch.cuda.current_device())


def use_parts(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
              windows: Optional[Tensor], window: Tuple[int, int], softcap: float = 0.0,
              deterministic: bool = False, gated: bool = False) -> Optional[Tuple[int, int, int, int]]:
    """The window row to take by parts, or None for the native path (which also reports every
    argument error: a problem with a questionable argument never comes here)."""
    mode = _mode()
    if windows is None or mode == "0" or (mode != "1" and not q.is_cuda) or _is_compiling():
        return None
    if mode != "1" and _native_on_device(q, bias, softcap, deterministic, gated):
        return None
    if mask is not None or window != (-1, -1) or q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return None
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        return None
    if bias is not None and (bias.dim() != 4 or bias.shape[-1] not in (1, k.shape[1])):
        return None
    if windows.dim() != 2 or windows.shape[1] != 4 or windows.shape[0] not in (1, k.shape[2], q.shape[2]):
        return None
    rows = _rows(windows)
    if len(set(rows)) != 1 or min(rows[0]) < 0:
        return None
    return rows[0]


# The window rows of a tensor, by (id, version): a model passes the same windows to every layer,
# forward and backward (one host copy per step, as ops.py's cu_seqlens check).
_rows_seen: dict = {}


def _rows(windows: Tensor) -> List[Tuple[int, int, int, int]]:
    key = id(windows)
    seen = _rows_seen.get(key)
    if seen is not None and seen[0]() is windows and seen[1] == windows._version:
        return seen[2]
    rows = [tuple(r) for r in windows.tolist()]
    if len(_rows_seen) > 64:
        _rows_seen.clear()
    _rows_seen[key] = (weakref.ref(windows), windows._version, rows)
    return rows


def _keys(x: Optional[Tensor], part: Part, seqlen_k: int, dim: int) -> Optional[Tensor]:
    """x's slice of the part's keys along `dim` (a dimension of size 1 broadcasts: kept)."""
    if x is None or x.shape[dim] != seqlen_k:
        return x
    return x.narrow(dim, part.k_lo, part.k_hi - part.k_lo)


class WindowParts(torch.autograd.Function):
    """(q, k, v, bias, alpha, delta, parts, scale, softcap, deterministic, gate_fn) -> (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, alpha, delta, parts, scale, softcap, deterministic, gate_fn):
        sk = k.shape[1]
        acc = _lse_dtype(q)  # (float32, float64 for float64 inputs)
        out_acc = lse_acc = None
        for part in parts:
            out, lse = _call_op(attention_forward, q, _keys(k, part, sk, 1), _keys(v, part, sk, 1), None,
                                _keys(bias, part, sk, 3), part.causal, part.left, part.right, scale, softcap,
                                deterministic, None, 0, None, None, alpha, _keys(delta, part, sk, 1), gate_fn, None)
            if out_acc is None:
                out_acc, lse_acc = out.to(acc), lse.to(acc)
            else:
                merge_into(out_acc, lse_acc, out, lse)
        if out_acc is None:  # no part: every row empty
            out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
            lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), NEG_INF, dtype=acc, device=q.device)
        out, lse = out_acc.to(q.dtype), lse_acc  # (lse in the accumulators' dtype: dmattn::fwd's)
        ctx.save_for_backward(q, k, v, bias, alpha, delta, out, lse)
        ctx.options = (parts, scale, softcap, deterministic, gate_fn)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 11
        q, k, v, bias, alpha, delta, out, lse = ctx.saved_tensors
        parts, scale, softcap, deterministic, gate_fn = ctx.options
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        sk = k.shape[1]
        acc = _lse_dtype(q)
        bias_grad = bias is not None and ctx.needs_input_grad[3]
        gate_grad = alpha is not None and (ctx.needs_input_grad[4] or ctx.needs_input_grad[5])
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        dbias = torch.zeros(bias.shape, dtype=acc, device=q.device) if bias_grad else None
        dalpha = torch.zeros(alpha.shape, dtype=acc, device=q.device) if gate_grad else None
        ddelta = torch.zeros(delta.shape, dtype=acc, device=q.device) if gate_grad else None
        for part in parts:
            gq, gk, gv, gb, ga, gd = _call_op(
                attention_backward, dout, q, _keys(k, part, sk, 1), _keys(v, part, sk, 1), out, lse, None,
                _keys(bias, part, sk, 3), bias_grad, part.causal, part.left, part.right, scale, softcap,
                deterministic, None, 0, None, True, None, alpha, _keys(delta, part, sk, 1), gate_fn, None, gate_grad)
            dq += gq
            _keys(dk, part, sk, 1).add_(gk)
            _keys(dv, part, sk, 1).add_(gv)
            if bias_grad:
                _keys(dbias, part, sk, 3).add_(gb)
            if gate_grad:
                dalpha += ga
                _keys(ddelta, part, sk, 1).add_(gd)
        need = ctx.needs_input_grad
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                dbias.to(bias.dtype) if bias_grad and need[3] else None,
                dalpha.to(alpha.dtype) if gate_grad and need[4] else None,
                ddelta.to(delta.dtype) if gate_grad and need[5] else None,
                None, None, None, None, None)


def attention_by_parts(q, k, v, bias, alpha, delta, row, scale, softcap, deterministic, gate_fn):
    """(out, lse) of windows row ``row`` on (q, k, v) by parts (see the module's docstring)."""
    parts = parts_of(row, q.shape[1], k.shape[1])
    return WindowParts.apply(q, k, v, bias, alpha, delta, parts, scale, softcap, deterministic, gate_fn)
