"""dmattn.dynamic_mask: the top-k ("dynamic") mask selected from a learnable bias.

Pure torch ops, so it runs wherever the bias lives (CPU or CUDA). The selection is
non-differentiable by nature; it reads a detached bias and never modifies or expands it, so
the same bias can then go to dmattn.attention unchanged and receive its gradient in its own
shape. See docs/semantics.md, "Dynamic masks (top-k)".
"""

from __future__ import annotations

import functools
import numbers
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["dynamic_mask"]

_MAX_RANK = 4


def check_keep(keep) -> int:
    if type(keep) is int and keep > 0:  # (the usual call, without the abc machinery)
        return keep
    if isinstance(keep, bool) or not isinstance(keep, numbers.Integral):
        raise TypeError(f"keep: expected a positive int, got {type(keep).__name__}")
    if keep <= 0:
        raise ValueError(f"keep: expected a positive int (the number of keys kept per row), got {keep}")
    return int(keep)


def _check_bias(bias) -> None:
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected a torch.Tensor, got {type(bias).__name__}")
    if not bias.dtype.is_floating_point:
        raise TypeError(f"bias: expected a floating-point tensor, got dtype {bias.dtype}")
    if not 1 <= bias.dim() <= _MAX_RANK:
        raise ValueError(f"bias: expected rank 1 to {_MAX_RANK} with keys last, got shape {tuple(bias.shape)}")


def _check_mask(mask, bias: Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask: expected a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected dtype torch.bool (True = may attend), got {mask.dtype}")
    if mask.dim() > _MAX_RANK:
        raise ValueError(f"mask: expected rank <= {_MAX_RANK}, got shape {tuple(mask.shape)}")
    if mask.device != bias.device:
        raise ValueError(f"mask: on device {mask.device}, expected bias's device {bias.device}")


def check_broadcast(t: Tensor, name: str, full: Tuple[int, int, int, int], heads_kv: int,
                    key_axis: str = "key (Sk)") -> None:
    """A mask / bias tensor t against the call's (B, H, Sq, Sk) = full: rank <= 4, right-aligned,
    every dim 1 or full (heads also Hkv), as the native validation rules; the message names t
    (for callers that derive other operands from t before the native call sees it)."""
    if t.dim() > 4:
        raise ValueError(f"{name}: expected at most 4 dimensions broadcastable to (B, H, Sq, Sk) = {full}, "
                         f"got shape {tuple(t.shape)}")
    shape = (1,) * (4 - t.dim()) + tuple(t.shape)
    for d, (got, want) in enumerate(zip(shape, full)):
        if got not in (1, want) and not (d == 1 and got == heads_kv):
            names = ("batch (B)", "heads (H)", "query (Sq)", key_axis)
            also = f" (or Hkv = {heads_kv})" if d == 1 and heads_kv != want else ""
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not broadcast to (B, H, Sq, Sk) = {full}: its "
                             f"{names[d]} dimension is {got}, expected 1 or {want}{also}")


def bias_over_keys(bias: Tensor, num_keys: int) -> Tensor:
    """The bias as the selection must see it in an attention with ``num_keys`` keys: a key
    dimension of 1 (or a scalar) broadcasts over all of them, i.e. ``num_keys`` tied keys.
    A view; nothing is copied."""
    if bias.dim() == 0:
        return bias.expand(num_keys)
    if bias.shape[-1] == 1 and num_keys != 1:
        return bias.expand(*bias.shape[:-1], num_keys)
    return bias


def _result_shape(bias: Tensor, mask: Optional[Tensor]) -> Tuple[int, ...]:
    if mask is None:
        return tuple(bias.shape)
    try:
        return tuple(torch.broadcast_shapes(bias.shape, mask.shape))
    except RuntimeError:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not broadcast with bias shape "
                         f"{tuple(bias.shape)}") from None


def selection_shape(bias: Tensor, keep: int, mask: Optional[Tensor]) -> Tuple[int, ...]:
    """The checks of dynamic_mask (host-side: types, ranks, devices, shapes; no tensor values
    are read) and the shape of its result, the broadcast shape of bias and mask."""
    _check_bias(bias)
    check_keep(keep)
    if mask is not None:
        _check_mask(mask, bias)
    return _result_shape(bias, mask)


# The integer dtype of the same width as a bias dtype whose bit patterns selection_key orders.
# float64 has no wider integer to hold its bits and a key index: dynamic_mask's way there.
_BITS_DTYPE = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    # torch.cuda.is_available() costs microseconds a call (it counts the devices again); asked
    # on the host path of every cached index tensor.
    return torch.cuda.is_available()


def _graph_being_built(cuda: bool) -> bool:
    """Whether torch.compile traces, or (cuda) a CUDA graph is captured on the current stream."""
    return torch.compiler.is_compiling() or (cuda and torch.cuda.is_current_stream_capturing())


def host_reads_allowed(t: Tensor) -> bool:
    """Whether a value of t may be read on the host now (a synchronization on CUDA): not while
    torch.compile traces (a graph break) nor while a CUDA graph is captured (an error that ends
    the capture). Callers that would read one take a path without it instead."""
    return not _graph_being_built(t.device.type == "cuda")


_index_tensors: dict = {}
_INDEX_TENSORS_MAX = 64


def cached_index_tensor(key: tuple, make: Callable[[], Tensor]) -> Tensor:
    """make(), an index tensor that depends only on ``key`` (sizes, dtype, device; an arange or
    the gather path's row offsets), kept for the next call with the same key: one kernel launch
    less each time (host time). Read-only by contract. Not cached under torch.compile or while a
    CUDA graph is captured (the tensor would belong to the graph's memory pool)."""
    if _graph_being_built(_cuda_available()):
        return make()
    t = _index_tensors.get(key)
    if t is None:
        if len(_index_tensors) >= _INDEX_TENSORS_MAX:
            _index_tensors.clear()
        t = _index_tensors[key] = make()
    return t


def nan_as_inf(scores: Tensor) -> Tensor:
    """``scores`` with every NaN (either sign) replaced by +inf: the selection ranks a NaN bias
    as +inf, so that it is kept and reaches the attention (docs/semantics.md, "NaN in, NaN
    out"), the same on every path. Left to itself, torch.topk's NaN would make dynamic_mask's
    threshold NaN and empty the row, and a sign-magnitude key would put -NaN last."""
    return scores.masked_fill(scores.isnan(), float("inf"))


def selection_key_dtype(score_dtype: torch.dtype, num_keys: int) -> torch.dtype:
    """The dtype of selection_key's key for scores of ``score_dtype`` over ``num_keys`` keys:
    int32 for 16-bit scores up to 2^16 keys (|ordered| < 2^15 fits beside the index), else
    int64 (also for a dtype without a key, which selection_key and the native key refuse)."""
    return torch.int32 if _BITS_DTYPE.get(score_dtype) == torch.int16 and num_keys <= 1 << 16 else torch.int64


def selection_key(scores: Tensor, allowed: Optional[Tensor]) -> Optional[Tensor]:
    """An integer key per entry of ``scores`` (..., Sk), distinct within each row and ordered as
    dynamic_mask selects: the larger score first (NaN as +inf), equal scores (-0.0 == 0.0) by
    the lower key index, keys that ``allowed`` (bool, same shape, or None) excludes below every
    allowed key,
    at the key dtype's minimum. The top-``keep`` keys of a row are then exactly the keys
    dynamic_mask keeps, plus excluded ones when fewer than ``keep`` are allowed. None for a
    dtype without such a key (float64). Elementwise ops only, no host synchronization.

    A float's bit pattern read as a signed integer is sign and magnitude: ordered like the
    floats for non-negative values, reversed for negative ones. ``ordered`` is the two's
    complement of it (-magnitude for negative floats, so -0.0 and 0.0 both give 0), and the
    key is ordered * 2^n - index, with 2^n above every index (n = 16 or 32)."""
    bits_dtype = _BITS_DTYPE.get(scores.dtype)
    if bits_dtype is None:
        return None
    num_keys = scores.shape[-1]
    key_dtype = selection_key_dtype(scores.dtype, num_keys)
    shift = 1 << 16 if key_dtype == torch.int32 else 1 << 32
    bits = nan_as_inf(scores).view(bits_dtype)
    # For negative bits (= MIN + magnitude), MIN - bits = -magnitude; the other branch's value
    # (which may wrap) is not used.
    ordered = torch.where(bits < 0, torch.iinfo(bits_dtype).min - bits, bits)
    minus_index = cached_index_tensor(
        ("minus index", num_keys, key_dtype, scores.device),
        lambda: torch.arange(0, -num_keys, -1, dtype=key_dtype, device=scores.device))
    key = torch.add(minus_index, ordered, alpha=shift)  # in key_dtype: ordered * 2^n - index
    if allowed is not None:
        key = torch.where(allowed, key, torch.iinfo(key_dtype).min)  # below any allowed key
    return key


def dynamic_mask(bias: Tensor, keep: int, mask: Optional[Tensor] = None) -> Tensor:
    """Boolean mask keeping, per row, the ``keep`` keys with the largest bias.

    bias: floating point, rank 1..4, keys last (e.g. a per-key (B, H, 1, Sk) bias).
    keep: keys kept per row, >= 1; keep >= Sk keeps every key the mask allows.
    mask: optional bool mask, broadcastable with bias; keys it masks out are never selected,
        and a row with fewer than ``keep`` allowed keys keeps exactly its allowed keys.

    Returns a new bool tensor of the broadcast shape of bias and mask (True = selected):
    a bias and mask without a query dimension give one key set per (batch, head) and nothing
    of shape (B, H, Sq, Sk) is allocated. Ties are broken by the lower key index; a NaN bias
    ranks as +inf (so a NaN reaches the attention instead of emptying its row). The
    selection runs on a detached bias; the bias is neither modified nor expanded. Causal and
    window constraints are not part of the selection (the attention call applies them).
    """
    shape = selection_shape(bias, keep, mask)
    keep = int(keep)
    num_keys = shape[-1]

    if keep >= num_keys:
        if mask is None:
            return torch.ones(shape, dtype=torch.bool, device=bias.device)
        return mask.expand(shape).contiguous()

    scores = nan_as_inf(bias.detach()).expand(shape)
    allowed = None if mask is None else mask.expand(shape)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    # torch.topk leaves the order of equal values unspecified, so only its values are used:
    # the keep-th largest score per row is the threshold. Every key above it is kept, and the
    # remaining places go to the keys equal to it in key order (lower index first); this is
    # exact on every device and dtype, in O(Sk) per row.
    threshold = torch.topk(scores, keep, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > threshold  # masked keys hold -inf: never above
    at = scores == threshold
    if allowed is not None:
        # When fewer than keep keys are allowed and finite, the threshold is -inf, which masked
        # keys share with allowed keys whose bias is -inf; only the allowed ones may fill in.
        at &= allowed
    places_left = keep - above.sum(dim=-1, keepdim=True)
    selected = above | (at & (at.cumsum(dim=-1) <= places_left))
    return selected
