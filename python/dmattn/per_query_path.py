"""dmattn.attention_topk(..., causal=True, per_query=True): the argument checks, and the
interval path that runs the per-query selection in O(S) memory.

The interval path (docs/semantics.md, "Per-query causal top-k"): the queries are cut into
segments of ``SEGMENT_LEN``; a segment's queries may only keep the keys kept by its first query
plus the keys inside it, at most keep + SEGMENT_LEN candidates, which interval_ends /
segment_candidates list per (batch, segment, head) (those before the segment by when they stop
being kept, then its own keys; docs/design.md). Each segment becomes one
batch entry of the gathered-keys kernels (K and V rows read in place by the CUDA kernels,
indexed keys, or gathered per segment; bias rows gathered): causal on
the candidates' positions gives j <= i, and the candidates' key_ends give i < end_j, so every
element is exactly the per-query selection. Work ~ Sq * (keep + SEGMENT_LEN), memory ~ Sq / L
* (keep + L) gathered rows; no (Sq, Sk) tensor and no host synchronization.
Gradients: dq from the kernels; dk, dv and dbias of the gathered rows summed back onto the
original keys in float32 (a key is a candidate of several segments).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import gather
from .gather import _key_side_dims, _key_side_view, _to_heads, _combined_heads
from .interface import _last_dim_contiguous, _parse_options, _parse_window, attention_on
from .masks import bias_over_keys, cached_index_tensor
from .ops import (_GLUE_DTYPES, _call_op, attention_backward, attention_forward, forward_with_grad,
                  gather_segment_rows, native_glue_available, per_query_glue_available, segment_candidates,
                  sum_segment_rows, supports_key_positions)
from .per_query import interval_ends, per_query_mask

__all__ = ["attention_per_query_topk", "SEGMENT_LEN"]

# Queries per segment: larger segments gather fewer rows (~ Sq / L * keep), smaller ones compute
# fewer masked-out elements (~ Sq * L / 2). None: keep rounded up to a multiple of 128, within
# [512, 2048] (on an H100 at keep = 2048, with the general Hopper backward: 8.4 ms fwd+bwd at B=2,
# S=8192 with L = 2048, 9.0 ms with 512; docs/design.md). DMATTN_PER_QUERY_SEGMENT sets it.
SEGMENT_LEN: Optional[int] = int(os.environ["DMATTN_PER_QUERY_SEGMENT"]) if "DMATTN_PER_QUERY_SEGMENT" in os.environ \
    else None

_forced_dense = False

# On CUDA the kernels read the candidates' K and V rows in place (indexed keys) instead of from
# a gathered copy; DMATTN_INDEXED_KEYS=0 makes the copy (comparisons).
INDEXED_KEYS = gather.INDEXED_KEYS


def _check_key_side(t: Optional[Tensor], name: str, q: Tensor, k: Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    batch, heads, heads_kv, num_keys = q.shape[0], q.shape[2], k.shape[2], k.shape[1]
    if _key_side_dims(t, batch, heads, heads_kv, num_keys) is None:  # (the rule alone: no view made)
        raise ValueError(
            f"{name}: per_query=True needs a key-side {name} without a query dimension, "
            f"(1 or B, 1 / Hkv / H, 1, Sk) = (1 or {batch}, 1 / {heads_kv} / {heads}, 1, {num_keys}), "
            f"got shape {tuple(t.shape)}")


def _interval_path_allowed(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, mask: Optional[Tensor],
                           deterministic: bool) -> bool:
    if _forced_dense or not per_query_glue_available() or not supports_key_positions(q.device.type):
        return False
    if any(t is not None and t.device != q.device for t in (k, v, bias, mask)):
        return False  # the dense path reports it
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[0] != q.shape[0]:
        return False
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0 or q.shape[3] != k.shape[3]:
        return False
    num_queries, num_keys = q.shape[1], k.shape[1]
    if num_queries == 0 or num_keys == 0 or num_queries > num_keys or num_keys >= 1 << 30:
        return False
    # The backward sums the gathered rows' gradients with atomics on CUDA.
    return not (deterministic and q.device.type == "cuda")


def check_per_query_arguments(q, k: Tensor, bias: Tensor, mask: Optional[Tensor], window) -> None:
    """The argument rules of the per-query causal top-k (docs/semantics.md): q rank 4, key-side
    bias / mask, a bool mask, a floating bias, no window."""
    if not isinstance(q, Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected rank 4 (B, Sq, H, D), got shape {tuple(q.shape)}")
    if _parse_window(window) != (-1, -1):
        raise ValueError(f"window: per_query=True selects among all the keys a query sees under causal; "
                         f"a sliding window is not supported (got {tuple(window)})")
    _check_key_side(bias, "bias", q, k)
    _check_key_side(mask, "mask", q, k)
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask: expected dtype torch.bool (True = may attend), got {mask.dtype}")
    if not bias.dtype.is_floating_point:
        raise TypeError(f"bias: expected a floating-point tensor, got dtype {bias.dtype}")


def attention_per_query_topk(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, keep: int,
                             mask: Optional[Tensor], *, window: Tuple[int, int], scale: Optional[float],
                             softcap: float, deterministic: bool,
                             return_lse: bool) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    check_per_query_arguments(q, k, bias, mask, window)
    options = dict(causal=True, window=(-1, -1), scale=scale, softcap=softcap,
                   deterministic=deterministic, return_lse=return_lse)
    if _interval_path_allowed(q, k, v, bias, mask, deterministic):
        _, _, scale, softcap = _parse_options((-1, -1), scale, softcap)
        out, lse = _interval_attention(q, k, v, bias, keep, mask, scale, softcap, deterministic, return_lse)
        return (out, lse) if return_lse else out
    num_queries, num_keys = q.shape[1], k.shape[1]
    selected = per_query_mask(bias_over_keys(bias, num_keys), keep, mask, num_queries)
    return attention_on(q, k, v, selected, bias, None, **options)


class _SegmentRows(torch.autograd.Function):
    """The K and V rows of every segment's candidates, (B * segments, W, G, D), from k, v (B, S,
    Hkv, D) and the candidates' key index (B * segments, 1 or G, W; -1: padding, a zero row); the
    backward sums each key's rows over the segments (and the G / Hkv heads of its kv head) in
    float32 (float64 for float64) and rounds once. CUDA: one native kernel each way
    (gather_segment_rows / sum_segment_rows, with the candidates' slots); CPU: index_select and
    index_add_."""

    @staticmethod
    def forward(ctx, k, v, index, slots, heads, native):
        batch, num_keys, heads_kv, head_dim = k.shape
        ctx.native, ctx.k_shape = native, k.shape
        if native:
            ctx.save_for_backward(slots)
            return _call_op(gather_segment_rows, k, v, index, heads)
        rows_b, width = index.shape[0], index.shape[2]
        num_segments = rows_b // batch
        seg_index = index.expand(rows_b, heads, width) if index.shape[1] == 1 else index
        kv_head = torch.arange(heads, device=k.device) // (heads // heads_kv)
        batch_of = torch.arange(rows_b, device=k.device) // num_segments
        rows = (batch_of.view(-1, 1, 1) * num_keys + seg_index.clamp_min(0).transpose(1, 2).long()) * heads_kv + kv_head
        flat_rows = rows.reshape(-1)  # (B * segments, W, G)
        ctx.save_for_backward(flat_rows)
        shape = (rows_b, width, heads, head_dim)
        return (k.reshape(-1, head_dim).index_select(0, flat_rows).view(shape),
                v.reshape(-1, head_dim).index_select(0, flat_rows).view(shape))

    @staticmethod
    def backward(ctx, dk_rows, dv_rows):
        (saved,) = ctx.saved_tensors
        if ctx.native:
            dk, dv = _call_op(sum_segment_rows, dk_rows, dv_rows, saved, ctx.k_shape[2])
            return dk, dv, None, None, None, None
        head_dim = ctx.k_shape[3]

        def sum_back(rows):
            acc_dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
            acc = torch.zeros(ctx.k_shape.numel() // head_dim, head_dim, dtype=acc_dtype, device=rows.device)
            acc.index_add_(0, saved, rows.reshape(-1, head_dim).to(acc_dtype))
            return acc.to(rows.dtype).view(ctx.k_shape)

        return sum_back(dk_rows), sum_back(dv_rows), None, None, None, None


class _IndexedSegments(torch.autograd.Function):
    """The attention of the segments (B * segments, seg_len, H, D) on their candidates, whose K
    and V rows the CUDA kernels read in place from k, v (B, S, Hkv, D): the candidates' key
    index is the key_rows operand (row of batch b // segments). The backward's dk, dv come one
    row per candidate and are summed over the segments by the native sum (slots), as
    _SegmentRows' are."""

    @staticmethod
    def forward(ctx, q_seg, k, v, bias_rows, index, slots, positions, key_ends, original, scale, softcap):
        out, lse = _call_op(attention_forward, q_seg, k, v, None, bias_rows, True, -1, -1, scale, softcap, False,
                            positions, original, key_ends, index)
        ctx.save_for_backward(q_seg, k, v, bias_rows, index, slots, positions, key_ends, out, lse)
        ctx.options = (original, scale, softcap)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 11
        q_seg, k, v, bias_rows, index, slots, positions, key_ends, out, lse = ctx.saved_tensors
        original, scale, softcap = ctx.options
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        want_dbias = ctx.needs_input_grad[3]
        dq, dk_rows, dv_rows, dbias = _call_op(
            attention_backward, dout, q_seg, k, v, out, lse, None, bias_rows, want_dbias, True, -1, -1, scale,
            softcap, False, positions, original, key_ends, False, index)[:4]
        dk, dv = _call_op(sum_segment_rows, dk_rows, dv_rows, slots, k.shape[2])
        return (dq, dk, dv, dbias if want_dbias else None) + (None,) * 7


def _segments(num_queries: int, keep: int) -> Tuple[int, int]:
    """(segment length, number of segments) for Sq queries."""
    preferred = SEGMENT_LEN if SEGMENT_LEN is not None else min(2048, max(512, -(-keep // 128) * 128))
    seg_len = max(1, min(preferred, num_queries))
    return seg_len, -(-num_queries // seg_len)


def _bias_row_base(batch: int, num_segments: int, bias_batch: int, rows_h: int, num_keys: int, device) -> Tensor:
    """int64 (B * segments, rows_h, 1): the offset of each candidate row's bias row in the flat
    (bias_batch, rows_h, Sk) bias."""
    batch_of = torch.arange(batch * num_segments, device=device) // num_segments
    if bias_batch == 1:
        batch_of = torch.zeros_like(batch_of)
    return (batch_of.view(-1, 1, 1) * rows_h + torch.arange(rows_h, device=device).view(1, -1, 1)) * num_keys


def _interval_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, keep: int, mask: Optional[Tensor],
                        scale: Optional[float], softcap: float, deterministic: bool,
                        want_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    batch, num_queries, heads, head_dim = q.shape
    num_keys, heads_kv = k.shape[1], k.shape[2]
    offset = num_keys - num_queries
    seg_len, num_segments = _segments(num_queries, keep)

    # The selection's rows: (1 or B, 1 / Hkv / H) of bias and mask together.
    bias3 = _key_side_view(bias, batch, heads, heads_kv, num_keys)
    mask3 = None if mask is None else _key_side_view(mask, batch, heads, heads_kv, num_keys)
    rows_h = bias3.shape[1] if mask3 is None else _combined_heads(bias3.shape[1], mask3.shape[1], heads, heads_kv)
    scores = _to_heads(bias3.detach(), rows_h, heads, heads_kv).expand(batch, rows_h, num_keys)
    allowed = None if mask3 is None else _to_heads(mask3, rows_h, heads, heads_kv).expand(batch, rows_h, num_keys)
    ends = interval_ends(scores.contiguous(), None if allowed is None else allowed.contiguous(), keep)
    width = min(keep + seg_len, num_keys)
    positions, key_ends, index, slots = _call_op(segment_candidates, ends, offset, seg_len, num_segments, width)

    # Queries as (B * segments, seg_len, H, D): zero rows pad the last segment (their output is
    # dropped and their zero output gradient contributes nothing).
    padded = num_segments * seg_len
    q_seg = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, padded - num_queries)) if padded != num_queries else q
    q_seg = _last_dim_contiguous(q_seg.contiguous().view(batch * num_segments, seg_len, heads, head_dim))

    # K, V rows per (segment, gathered head): one head per kv head when the selection's rows are
    # shared by a kv head's queries, else one per query head (the kernels' positions rule). The
    # selection's rows (1, Hkv or H) are then 1 or the gathered heads: index / slots fit as they are.
    gathered_heads = heads if rows_h == heads != heads_kv else heads_kv
    native = (k.is_cuda and k.dtype in _GLUE_DTYPES and v.dtype == k.dtype and head_dim <= 256
              and native_glue_available())
    # Indexed keys: the kernels read one row per kv head (the selection's rows shared by a kv
    # head's queries). (Deterministic mode never gets here on CUDA: _interval_path_allowed.)
    indexed = native and INDEXED_KEYS and gathered_heads == heads_kv
    if not indexed:
        k_rows, v_rows = _SegmentRows.apply(_last_dim_contiguous(k), _last_dim_contiguous(v), index, slots,
                                            gathered_heads, native)

    # The bias at the candidates, float32 (a key's gradient sums over segments in float32;
    # float64 stays float64): index_select from the flat (1 or B, rows_h, Sk) rows, whose
    # backward adds into that size (padding candidates read key 0; the kernels give them no
    # weight and a zero gradient). The rows' offsets depend on the shapes only: cached.
    acc_dtype = torch.float64 if bias.dtype == torch.float64 else torch.float32
    bias_heads = _to_heads(bias3, rows_h, heads, heads_kv).to(acc_dtype)
    bias_flat = bias_heads.expand(bias3.shape[0], rows_h, num_keys).reshape(-1)
    row_base = cached_index_tensor(("per_query_bias_rows", batch, num_segments, bias3.shape[0], rows_h, num_keys, q.device),
                                   lambda: _bias_row_base(batch, num_segments, bias3.shape[0], rows_h, num_keys, q.device))
    bias_rows = bias_flat.index_select(0, (index.clamp_min(0) + row_base).view(-1))
    bias_rows = bias_rows.view(batch * num_segments, rows_h, 1, width)

    original = padded + offset
    if indexed:
        out, lse = _IndexedSegments.apply(q_seg, _last_dim_contiguous(k), _last_dim_contiguous(v), bias_rows, index,
                                          slots, positions, key_ends, original, scale, softcap)
    else:
        out, lse = forward_with_grad(q_seg, k_rows, v_rows, None, bias_rows, True, -1, -1, scale, softcap,
                                     deterministic, positions, original, key_ends)
    out = out.view(batch, padded, heads, head_dim)
    if padded != num_queries:  # (a full-length slice would still cost a copy in the backward)
        out = out[:, :num_queries]
    if not want_lse:
        return out, None
    lse = lse.view(batch, num_segments, heads, seg_len).transpose(1, 2).reshape(batch, heads, padded)
    return out, lse[..., :num_queries]
