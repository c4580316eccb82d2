"""User-facing functions: dmattn.attention and the flash-dmattn drop-in flash_dmattn_func.

Python-level checks here cover only what the native validation cannot see (argument types,
Python values); shapes, dtypes, devices and strides are checked once, in C++
(src/api/make_params.cpp), for every backend.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import gate_skip, gather, window_parts
from ._op_utils import _cuda_layout, check_devices
from .decode_kernel import AUTO_MAX_ROWS, _run_decode, decode_enabled, direct_decode_splits
from .ops import _check_rank, forward_with_grad, varlen_forward_with_grad

__all__ = ["attention", "attention_varlen", "flash_dmattn_func"]


def _require_tensor(x, name: str, optional: bool = False) -> None:
    if x is None and optional:
        return
    if not isinstance(x, torch.Tensor):
        expected = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name}: expected {expected}, got {type(x).__name__}")


def _last_dim_contiguous(x: Tensor) -> Tensor:
    # As FlashAttention: kernels need unit stride along head_dim; copy only when it is not.
    return x if x.dim() == 0 or x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


_INT64_MAX = 2**63 - 1


def _parse_window(window) -> Tuple[int, int]:
    # (a tuple of two plain ints, the usual call, is checked without the abc machinery)
    if type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int:
        left, right = window
    elif (not isinstance(window, Sequence) or isinstance(window, str) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window: expected a pair of ints (left, right), -1 = unbounded, got {window!r}")
    else:
        left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window: expected values >= -1 (-1 = unbounded), got {(left, right)}")
    # (a bound past int64 reaches every position, as int64's largest does: the native side
    # takes int64 and makes such bounds unbounded)
    if left > _INT64_MAX or right > _INT64_MAX:
        left, right = min(left, _INT64_MAX), min(right, _INT64_MAX)
    return left, right


def _is_finite(x: float) -> bool:
    # Plain arithmetic instead of math.isfinite: torch.compile (dynamo) refuses to trace
    # math.isfinite on a Python float, but folds comparisons. x - x is NaN for +-inf and NaN.
    return x - x == 0


def _parse_float(x, name: str, allow_none: bool) -> Optional[float]:
    if x is None and allow_none:
        return None
    if type(x) is float:  # (the usual call, without the abc machinery)
        return x
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(x).__name__}")
    return float(x)


def _parse_options(window, scale, softcap) -> Tuple[int, int, Optional[float], float]:
    """(left, right, scale, softcap), checked; shared by attention and attention_varlen."""
    # (the defaults, the usual call, without a helper call each: host time on every call)
    if type(window) is tuple and window == (-1, -1) and scale is None and type(softcap) is float and softcap == 0.0:
        return -1, -1, None, 0.0
    left, right = _parse_window(window)
    scale = _parse_float(scale, "scale", allow_none=True)
    if scale is not None and not (_is_finite(scale) and scale > 0):
        raise ValueError(f"scale: expected a finite positive float or None, got {scale}")
    softcap = _parse_float(softcap, "softcap", allow_none=False)
    if not (_is_finite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {softcap}")
    return left, right, scale, softcap


_GATE_FNS = {"logsigmoid": 0, "linear": 1}


def _parse_score_terms(gate, gate_fn, windows) -> Tuple[Optional[Tensor], Optional[Tensor], int, Optional[Tensor]]:
    """(alpha, delta, gate_fn code, windows), checked for what the native validation cannot see:
    Python types and the gate_fn name. Shapes, dtypes and devices are checked natively."""
    alpha = delta = None
    if gate is not None:
        if not isinstance(gate, (tuple, list)) or len(gate) != 2:
            raise TypeError(f"gate: expected a pair of tensors (alpha, delta), got {type(gate).__name__}")
        alpha, delta = gate
        _require_tensor(alpha, "gate[0] (alpha)")
        _require_tensor(delta, "gate[1] (delta)")
    if gate_fn not in _GATE_FNS:
        raise ValueError(f"gate_fn: expected one of {sorted(_GATE_FNS)}, got {gate_fn!r}")
    _require_tensor(windows, "windows", optional=True)
    if windows is not None and windows.dtype != torch.int32:
        # (checked natively too; here the message can name torch's dtype)
        raise TypeError(f"windows: expected dtype int32, got {windows.dtype}; use .to(torch.int32)")
    return alpha, delta, _GATE_FNS[gate_fn], windows


def _check_gate_skipping(alpha: Optional[Tensor], delta: Optional[Tensor], windows: Optional[Tensor], q: Tensor,
                         k: Tensor, packed: bool) -> None:
    """Gate skipping's arguments, and the gate's shapes against q and k: the skipped cells are
    computed before the native call, which validates the rest (the same messages)."""
    if alpha is None:
        raise ValueError("gate_threshold: gate skipping needs a gate (gate=(alpha, delta))")
    if windows is not None:
        raise NotImplementedError("gate_threshold: gate skipping does not take windows with sinks yet")
    if packed:
        _check_rank(q, "q", "(total_q, num_heads, head_dim)", rank=3)
        _check_rank(k, "k", "(total_k, num_heads_kv, head_dim)", rank=3)
        rows = ((alpha, "alpha", "(total_q, num_heads)", tuple(q.shape[:2])),
                (delta, "delta", "(total_k, num_heads_kv)", tuple(k.shape[:2])))
    else:
        _check_rank(q, "q", "(batch, seqlen_q, num_heads, head_dim)")
        _check_rank(k, "k", "(batch, seqlen_k, num_heads_kv, head_dim)")
        rows = ((alpha, "alpha", "(batch, seqlen_q, num_heads)", tuple(q.shape[:3])),
                (delta, "delta", "(batch, seqlen_k, num_heads_kv)", tuple(k.shape[:3])))
    for t, name, layout, shape in rows:
        _check_rank(t, name, layout, rank=len(shape))
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def _softmax_scale(q: Tensor, scale: Optional[float]) -> float:
    """The softmax scale a call uses (its default 1 / sqrt(D))."""
    return float(scale) if scale is not None else q.shape[-1] ** -0.5


def _parse_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {x}")
    return int(x)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *,
    causal: bool = False,
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    gate: Optional[Tuple[Tensor, Tensor]] = None,
    gate_fn: str = "logsigmoid",
    windows: Optional[Tensor] = None,
    gate_threshold: Optional[float] = None,
    gate_adaptive: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention with an optional boolean mask and an optional learnable additive bias.

    q: (B, Sq, H, D); k, v: (B, Sk, Hkv, D) with H % Hkv == 0 (GQA/MQA).
    mask: bool, broadcastable to (B, H, Sq, Sk) (each dim 1 or full; head dim may be Hkv);
        True = may attend.
    bias: q's dtype or float32, same broadcast rule; added to the scaled (and soft-capped)
        scores. Receives a gradient of its own shape when it requires grad.
    causal: bottom-right aligned (key j allowed for query i iff j <= i + Sk - Sq).
    window: (left, right), -1 = unbounded, aligned like causal.
    scale: softmax scale, default 1/sqrt(D).  softcap: 0 = off, else softcap*tanh(s/softcap).
    deterministic: bitwise-reproducible gradients.
    gate: (alpha, delta), alpha (B, Sq, H) and delta (B, Sk, Hkv) in q's dtype or float32:
        gated attention, scores += scale * gate_fn(alpha_i * delta_j) (after softcap, before
        the bias); both may require grad. gate_fn: "logsigmoid" (default) or "linear".
    gate_threshold: None or 0 (default): exact. > 0: gate skipping, an approximation: cells of
        128 queries x 128 keys whose gates all lie more than -ln(gate_threshold) / scale below
        the largest gate their query block can reach count as masked (docs/semantics.md, "Gate
        skipping"; dmattn.gate_skip). Needs a gate; not with windows. gate_adaptive: under
        causal, a query block's threshold times the visible fraction of its first row's keys
        (flash-sparse-attn's is_adapt_gate).
    windows: int32 (1, 4), (Hkv, 4) or (H, 4), rows [sink, near, gap, far]: windows with sinks
        (implies causal): with d = i + Sk - Sq - j, key j is visible iff d >= 0 and (j < sink or
        d < near or near + gap <= d < near + gap + far).
    Returns out (B, Sq, H, D), plus lse (B, H, Sq) when return_lse (rows with no allowed key:
    out 0, lse -inf). See docs/semantics.md.

    A mask (and bias) without a query dimension, e.g. (B, H, 1, Sk), that keeps at most half
    of Sk >= 128 keys runs on the gathered kept keys only (same results; one host sync to
    count them; not under torch.compile), unless the decode kernel takes the call (a few
    query rows without a gradient on CUDA: it reads the mask in place, no sync):
    docs/semantics.md, "Gather path".
    """
    if gate is None and windows is None and not gate_threshold:
        direct = _direct_decode(q, k, v, mask, bias, causal, window, scale, softcap, return_lse)
        if direct is not None:
            return direct
    return attention_on(q, k, v, mask, bias, None, causal=causal, window=window, scale=scale,
                        softcap=softcap, deterministic=deterministic, return_lse=return_lse, gate=gate,
                        gate_fn=gate_fn, windows=windows, gate_threshold=gate_threshold,
                        gate_adaptive=gate_adaptive)


def _direct_decode(q, k, v, mask, bias, causal, window, scale, softcap, return_lse):
    """An inference call of a few query rows (a decoding step) straight onto the decode kernel,
    as the checked route below would run it (dmattn::fwd's body takes the decode kernel with the
    same split count): CUDA tensors, no gradient to record, eager mode, shapes the kernel takes.
    The native call validates every tensor, naming it as the checked route does, and allocates
    the outputs: the checked route's Python layers are host time that the GPU waits for when a
    step starts from idle. A key mask is read in place by the kernel, as on the checked route
    (gather.mask_key_set gathers no keys for such a call). None where the call takes the checked
    route (also where gather.force_path pins a masked call's path; attention_with_kvcache's
    direct route likewise)."""
    if mask is not None and gather.path_forced():
        return None
    splits = direct_decode_splits(q, k, v, (mask, bias), AUTO_MAX_ROWS)
    if not splits or not decode_enabled():
        return None
    left, right, scale, softcap = _parse_options(window, scale, softcap)
    q, k, v = _decode_rows(q), _decode_rows(k), _decode_rows(v)
    out, lse = _run_decode(q, k, v, mask, bias, bool(causal), left, right, scale, softcap, None, None, splits,
                           want_lse=return_lse)
    return (out, lse) if return_lse else out


def _decode_rows(x: Tensor) -> Tensor:
    """_cuda_layout(_last_dim_contiguous(x)) for a tensor of the decode kernels' shapes (last
    dimension a multiple of 8, elements held): the usual contiguous, 16-byte aligned tensor as
    it is with two tests (each call of the direct route is host time the GPU waits for)."""
    return x if x.is_contiguous() and x.data_ptr() % 16 == 0 else _cuda_layout(_last_dim_contiguous(x))


def attention_on(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    key_set: Optional[gather.KeySet],
    *,
    causal: bool,
    window: Tuple[int, int],
    scale: Optional[float],
    softcap: float,
    deterministic: bool,
    return_lse: bool,
    gate: Optional[Tuple[Tensor, Tensor]] = None,
    gate_fn: str = "logsigmoid",
    windows: Optional[Tensor] = None,
    gate_threshold: Optional[float] = None,
    gate_adaptive: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """`attention`, on the keys of ``key_set`` (gather path; ``mask`` is then ignored) when
    given, else on the path `gather.mask_key_set` chooses. For attention_topk. A gate or windows
    with sinks take the dense kernels (the gather path's kernels do not read them; callers that
    pass a key_set pass neither). gate_adaptive: gate skipping's threshold per query block as
    flash-sparse-attn's is_adapt_gate (gate_skip.py)."""
    _require_tensor(q, "q")
    _require_tensor(k, "k")
    _require_tensor(v, "v")
    _require_tensor(mask, "mask", optional=True)
    _require_tensor(bias, "bias", optional=True)
    alpha = delta = None
    fn = 0
    if gate is not None or windows is not None or gate_fn != "logsigmoid":
        alpha, delta, fn, windows = _parse_score_terms(gate, gate_fn, windows)
    check_devices(q=q, k=k, v=v, mask=mask, bias=bias, alpha=alpha, delta=delta, windows=windows)
    left, right, scale, softcap = _parse_options(window, scale, softcap)
    causal, deterministic = bool(causal), bool(deterministic)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    gate_keep = None
    if gate_skip.skips(gate_threshold):
        _check_gate_skipping(alpha, delta, windows, q, k, packed=False)
        gate_keep = gate_skip.gate_keep_cells(alpha, delta, scale=_softmax_scale(q, scale), gate_fn=gate_fn,
                                              threshold=float(gate_threshold), causal=causal, window=(left, right),
                                              adaptive=gate_adaptive)
    terms = alpha is not None or windows is not None
    if key_set is None and not terms:
        key_set = gather.mask_key_set(q, k, mask, bias, deterministic)
    if key_set is not None:
        out, lse = gather.attention_over_key_set(q, k, v, key_set, bias, causal, left, right,
                                                 scale, softcap, deterministic)
    elif terms:
        row = window_parts.use_parts(q, k, v, mask, bias, windows, (left, right), softcap, deterministic,
                                     alpha is not None)
        if row is not None:  # windows with sinks as sliding-window calls (window_parts.py)
            out, lse = window_parts.attention_by_parts(q, k, v, bias, alpha, delta, row, scale, softcap,
                                                       deterministic, fn)
        else:
            out, lse = forward_with_grad(q, k, v, mask, bias, causal, left, right, scale, softcap,
                                         deterministic, None, 0, None, None, alpha, delta, fn, windows, gate_keep)
    else:
        out, lse = forward_with_grad(q, k, v, mask, bias, causal, left, right, scale, softcap,
                                     deterministic)
    return (out, lse) if return_lse else out


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *,
    causal: bool = False,
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    gate: Optional[Tuple[Tensor, Tensor]] = None,
    gate_fn: str = "logsigmoid",
    windows: Optional[Tensor] = None,
    gate_threshold: Optional[float] = None,
    gate_adaptive: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a packed batch of variable-length sequences (FlashAttention's varlen).

    q: (total_q, H, D); k, v: (total_k, Hkv, D). cu_seqlens_q / cu_seqlens_k: int32 of length
    B + 1, starting at 0, non-decreasing, ending at total_q / total_k: sequence b holds query
    rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows cu_seqlens_k[b]:cu_seqlens_k[b+1].
    max_seqlen_q / max_seqlen_k: ints >= every sequence's length. Lengths may be 0.
    mask (bool) / bias: key-side, (Hb, total_k) with Hb in {1, Hkv, H}, shared by all the
    queries of each sequence (a padding mask, a per-key learnable bias); dbias has that shape.
    causal / window: bottom-right aligned per sequence. gate: (alpha, delta) packed like q and k,
    alpha (total_q, H) and delta (total_k, Hkv); gate_threshold's cells in each sequence's own
    positions (gate_adaptive: flash-sparse-attn's is_adapt_gate). Other arguments as in
    `attention`.
    Returns out (total_q, H, D), plus lse (H, total_q) when return_lse. See docs/semantics.md.
    """
    for x, name in ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"),
                    (cu_seqlens_k, "cu_seqlens_k")):
        _require_tensor(x, name)
    _require_tensor(mask, "mask", optional=True)
    _require_tensor(bias, "bias", optional=True)
    for cu, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        # Checked natively too; here the message can name torch's dtype (often int64, from
        # cumsum), which the native side does not represent.
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype int32, got {cu.dtype}; use .to(torch.int32)")
    max_seqlen_q = _parse_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _parse_int(max_seqlen_k, "max_seqlen_k")
    left, right, scale, softcap = _parse_options(window, scale, softcap)
    alpha, delta, fn, windows = _parse_score_terms(gate, gate_fn, windows)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    gate_keep = None
    if gate_skip.skips(gate_threshold):
        _check_gate_skipping(alpha, delta, windows, q, k, packed=True)
        gate_keep = gate_skip.gate_keep_cells_varlen(alpha, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     max_seqlen_k, scale=_softmax_scale(q, scale), gate_fn=gate_fn,
                                                     threshold=float(gate_threshold), causal=bool(causal),
                                                     window=(left, right), adaptive=gate_adaptive)
    out, lse = varlen_forward_with_grad(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, mask, bias, bool(causal), left, right,
                                        scale, softcap, bool(deterministic), alpha, delta, fn, windows,
                                        gate_keep)
    return (out, lse) if return_lse else out


def flash_dmattn_func(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    attn_bias: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    is_causal: Optional[bool] = None,
    softcap: Optional[float] = None,
    deterministic: Optional[bool] = None,
    return_attn_probs: Optional[bool] = None,
):
    """Drop-in for flash-dmattn's flash_dmattn_func (same arguments and layout (B, S, H, D)).

    None means the flash-dmattn default (not causal, no softcap, non-deterministic).
    return_attn_probs=True returns (out, lse, None): like flash-dmattn, the probabilities
    themselves are never materialized.
    """
    # The lse only where it is returned: a decoding step's call then allocates and converts one
    # tensor less before its launch (host time that an idle GPU waits for).
    result = attention(
        query, key, value, attn_mask, attn_bias,
        causal=bool(is_causal) if is_causal is not None else False,
        scale=softmax_scale,
        softcap=0.0 if softcap is None else softcap,
        deterministic=bool(deterministic) if deterministic is not None else False,
        return_lse=bool(return_attn_probs),
    )
    if return_attn_probs:
        out, lse = result
        return out, lse, None
    return result
