"""The gather path: attention over only the kept keys when every query of a (batch, head)
shares one key set (a mask, and a bias, without a query dimension).

Instead of scanning all Sk keys and masking most of them out, the kept keys' indices are
compacted per (batch, head) into sorted int32 ``key_positions`` (padded with -1 to a width K;
for attention_topk, the sorted indices of a top-k over an integer selection key),
the K, V and bias rows at those positions are gathered (differentiable torch gathers, so
autograd scatters dk, dv and dbias back onto the original rows and sums GQA groups), and
dmattn::fwd runs on the K gathered rows with the positions, against which causal and window
are tested. Where no row is read twice (attention_topk without a mask), one autograd node does
the gathers and the scatter-back, and on CUDA the selection kernel writes the bias rows and the
kernels read the kept K and V rows in place (``key_rows``, indexed keys) instead of copies.
Work and memory then scale with K instead of Sk. Results equal the dense masked path up to the
order of floating-point summation. See docs/semantics.md, "Gather path".

Padding rows (position -1) read key 0 but are never attended to: the kernels treat any
position outside [0, Sk) as masked and give those rows zero gradients, so nothing flows back
to key 0 from them.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .masks import (bias_over_keys, cached_index_tensor, dynamic_mask, host_reads_allowed, selection_key,
                    selection_shape)
from ._op_utils import records_no_gradient
from .decode_kernel import fwd_decode_splits
from .ops import (_GLUE_DTYPES, _call_op, attention_backward, attention_forward, forward_with_grad, gather_key_rows,
                  native_glue_available, scatter_key_rows, select_topk_positions, supports_key_positions)

__all__ = ["KeySet", "mask_key_set", "topk_key_set", "attention_over_key_set", "force_path", "path_forced"]

# dmattn.attention gathers by itself only when at most this fraction of the keys is kept by
# any (batch, head) (the dense path's masked keys cost about as much as kept ones), and only
# for key sequences long enough that skipping keys can save whole key blocks.
_MAX_KEPT_FRACTION = 0.5
_MIN_KEYS = 128

_forced: Optional[str] = None

# On CUDA the kernels read a key set's K and V rows in place (indexed keys) instead of from a
# gathered copy; DMATTN_INDEXED_KEYS=0 makes the copy (comparisons).
INDEXED_KEYS = os.environ.get("DMATTN_INDEXED_KEYS", "1") != "0"


@contextlib.contextmanager
def force_path(path: Optional[str]) -> Iterator[None]:
    """For tests and benchmarks: "gather" makes dmattn.attention gather whenever the key set
    allows it (whatever fraction is kept), "dense" makes it and dmattn.attention_topk always
    take the dense masked path, None restores the automatic choice. With either path forced,
    attention_topk also leaves its native inference and training forms (topk.py) for the
    general path's layers (same results). Not thread-local."""
    global _forced
    if path not in (None, "gather", "dense"):
        raise ValueError(f"path: expected 'gather', 'dense' or None, got {path!r}")
    previous, _forced = _forced, path
    try:
        yield
    finally:
        _forced = previous


def path_forced() -> bool:
    """Whether force_path pins the path (tests and benchmarks): the routes that would take a
    masked or top-k call elsewhere by themselves (the decode direct route, attention_topk's
    native forms) then leave it to the general path's choice."""
    return _forced is not None


class KeySet(NamedTuple):
    """Keys kept per (batch, head), shared by all queries, as the gathered rows: ``positions``
    int32 (1 or B, 1 / Hkv / H, K), per row the kept key indices in increasing order, then -1
    (the key_positions operand); ``index`` int64, same shape, the key row each gathered row
    reads (the position, 0 for padding), or None for ``positions`` itself (a full set, made
    when needed). ``full``: no padding, i.e. the rows of a (batch, head) read distinct keys
    (their gradients can be copied back rather than accumulated). ``bias_rows``: given when the
    set was selected from the call's bias, that bias at the kept keys, (positions' leading
    dims, 1, K) (the native selection writes it: no gather)."""
    positions: Tensor
    index: Optional[Tensor]
    full: bool = False
    bias_rows: Optional[Tensor] = None

    @property
    def width(self) -> int:
        """K, the number of gathered rows per (batch, head)."""
        return self.positions.shape[-1]

    def key_index(self) -> Tensor:
        """``index``, made from the positions when the set left it to be made."""
        return self.positions.long() if self.index is None else self.index


def _key_set_of_mask(kept: Tensor, width: int) -> KeySet:
    positions = compact_positions(kept, width)
    return KeySet(positions, positions.long().clamp_min(0))


def _key_side_dims(t: Tensor, batch: int, heads: int, heads_kv: int,
                   num_keys: int) -> Optional[Tuple[int, int, int]]:
    """(b, h, s) of a mask/bias of rank <= 4 right-aligned to (b, h, 1, s), when it has no query
    dimension and follows the broadcast rule (b 1 or B, h 1 / Hkv / H, s 1 or Sk), else None."""
    if t.dim() > 4:
        return None
    b, h, q, s = (1,) * (4 - t.dim()) + tuple(t.shape)
    if q != 1 or b not in (1, batch) or h not in (1, heads_kv, heads) or s not in (1, num_keys):
        return None
    return b, h, s


def _key_side_view(t: Tensor, batch: int, heads: int, heads_kv: int, num_keys: int) -> Optional[Tensor]:
    """A mask/bias of rank <= 4 without a query dimension as a (1 or B, 1 / Hkv / H, Sk) view
    (its key dimension expanded), or None when it has a query dimension or does not follow the
    broadcast rule (the dense path then reports the error)."""
    dims = _key_side_dims(t, batch, heads, heads_kv, num_keys)
    if dims is None:
        return None
    if t.dim() >= 2:  # squeeze, not t[..., 0, :]: its backward is a view (select's copies)
        t = t.squeeze(-2)
    return t.expand(dims[0], dims[1], num_keys)  # adds the missing leading dims


def _gather_allowed(q: Tensor, k: Tensor, deterministic: bool) -> bool:
    """Shapes the gather can index, and a backend that reads key positions. The backward of
    a gather is a scatter-add, which uses atomics on CUDA, so deterministic=True gathers only
    on the CPU."""
    if q.dim() != 4 or k.dim() != 4 or q.numel() == 0 or k.shape[1] == 0:
        return False
    if k.shape[0] != q.shape[0] or k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        return False
    if deterministic and q.device.type != "cpu":
        return False
    return supports_key_positions(q.device.type)


def _same_device(q: Tensor, *others: Optional[Tensor]) -> bool:
    """Optional tensors on q's device (anything else: the dense path reports it)."""
    return all(t is None or (isinstance(t, Tensor) and t.device == q.device) for t in others)


def mask_key_set(q: Tensor, k: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
                 deterministic: bool) -> Optional[KeySet]:
    """dmattn.attention's choice: the key set of ``mask`` when the gather path applies and
    pays off, else None (dense path). Deciding needs the largest kept count, i.e. one host
    synchronization, and is skipped under torch.compile and while a CUDA graph is captured
    (always dense there: a synchronization would break the capture), and for an inference call
    the decode kernel takes (a decoding step: the kernel reads the mask in place, and the
    synchronization would cost each step its overlap with the host)."""
    if _forced == "dense" or mask is None or not host_reads_allowed(q):
        return None
    if mask.dtype != torch.bool or not _same_device(q, mask, bias) or not _gather_allowed(q, k, deterministic):
        return None
    batch, _, heads, _ = q.shape
    heads_kv, num_keys = k.shape[2], k.shape[1]
    kept = _key_side_view(mask, batch, heads, heads_kv, num_keys)
    if kept is None or (bias is not None and _key_side_view(bias, batch, heads, heads_kv, num_keys) is None):
        return None
    if _forced is None and (num_keys < _MIN_KEYS or (records_no_gradient(q, k, bias) and fwd_decode_splits(q, k))):
        return None
    width = int(kept.sum(dim=-1).max())  # the host synchronization
    if _forced is None and width > _MAX_KEPT_FRACTION * num_keys:
        return None
    return _key_set_of_mask(kept, width)


def topk_key_set(q: Tensor, k: Tensor, bias: Tensor, keep: int, mask: Optional[Tensor],
                 deterministic: bool) -> Optional[KeySet]:
    """dmattn.attention_topk's choice: the top-``keep`` key set of ``bias`` (among the keys
    ``mask`` allows) when bias and mask have no query dimension and the backend reads key
    positions, else None (dense path). Width min(keep, Sk): no host synchronization.

    The kept keys are those of dynamic_mask: the top-``keep`` of masks.selection_key (distinct
    integers in the selection's order), sorted into positions; ``keep`` ints sorted per row
    instead of a bool mask over Sk and its compaction (a float64 bias, which has no such key,
    goes that way)."""
    if _forced == "dense" or not _same_device(q, bias, mask) or not _gather_allowed(q, k, deterministic):
        return None
    batch, _, heads, _ = q.shape
    heads_kv, num_keys = k.shape[2], k.shape[1]
    if keep >= num_keys and mask is None:
        return None  # every key is kept: the unmasked dense path reads them without copies
    bias_dims = _key_side_dims(bias, batch, heads, heads_kv, num_keys)
    if bias_dims is None or (mask is not None and _key_side_dims(mask, batch, heads, heads_kv, num_keys) is None):
        return None
    # dynamic_mask's errors; the broadcast of two (1 or B, 1 / Hkv / H) pairs is one of them.
    shape = selection_shape(bias_over_keys(bias, num_keys), keep, mask)
    rows = ((1,) * (4 - len(shape)) + shape)[:2]
    width = min(keep, num_keys)
    if mask is None and bias.is_cuda and bias.dtype in _GLUE_DTYPES and native_glue_available():
        # The same selection as below (the order of selection_key) in one kernel, no torch ops;
        # it also writes the bias at the kept keys (the bias operand of the gathered keys). Its
        # rows are the bias's own (b, h): a (b, h, 1, Sk) bias is read as it is.
        source = bias if bias.dim() == 4 and bias_dims[2] == num_keys else \
            _key_side_view(bias, batch, heads, heads_kv, num_keys)
        positions = bias.new_empty((*rows, width), dtype=torch.int32)
        bias_rows = bias.new_empty((*rows, 1, width))
        select_topk_positions(source, width, positions, bias_rows)
        return KeySet(positions, None, full=True, bias_rows=bias_rows)
    scores = _key_side_view(bias, batch, heads, heads_kv, num_keys).detach().expand(*rows, num_keys)
    allowed = None if mask is None else _key_side_view(mask, batch, heads, heads_kv, num_keys).expand(*rows, num_keys)
    key = selection_key(scores, allowed)
    if key is None:  # float64: the selection as a bool mask, compacted
        kept = _key_side_view(dynamic_mask(bias_over_keys(bias, num_keys), keep, mask), batch, heads,
                              heads_kv, num_keys)
        return _key_set_of_mask(kept, width)
    values, index = key.topk(width, dim=-1, sorted=False)
    if mask is None:  # keep < Sk keys, all allowed: every row is full
        index = index.sort(dim=-1).values
        return KeySet(index.int(), index, full=True)
    # Rows with fewer allowed keys than the width also hold excluded keys (key = minimum):
    # those sort last as Sk, then become padding (-1; the gathered row reads key 0).
    index = index.masked_fill(values == torch.iinfo(key.dtype).min, num_keys).sort(dim=-1).values
    positions = index.masked_fill(index == num_keys, -1).int()
    return KeySet(positions, index.remainder(num_keys))


def compact_positions(kept: Tensor, width: int) -> Tensor:
    """int32 (..., width): per row, the indices of the True entries of ``kept`` (..., Sk) in
    increasing order, then -1. O(Sk) per row (a running count and a scatter), no sort."""
    rank = kept.cumsum(dim=-1) - 1
    # Dropped keys (and any beyond the width) all go to one extra slot, cut off below.
    slot = torch.where(kept & (rank < width), rank, width)
    index = torch.arange(kept.shape[-1], dtype=torch.int32, device=kept.device).expand(kept.shape)
    positions = torch.full((*kept.shape[:-1], width + 1), -1, dtype=torch.int32, device=kept.device)
    positions.scatter_(-1, slot, index)
    return positions[..., :width]


def _combined_heads(a: int, b: int, heads: int, heads_kv: int) -> int:
    """The head count fine enough for two head dims each of size 1, Hkv or H."""
    if heads in (a, b):
        return heads
    return heads_kv if heads_kv in (a, b) else 1


def _to_heads(t: Tensor, target: int, heads: int, heads_kv: int) -> Tensor:
    """Dim 1 of size 1, Hkv or H brought to ``target`` heads (query head h uses entry
    h // (H / Hkv) of an Hkv-sized dim, the GQA rule)."""
    size = t.shape[1]
    if size == target:
        return t
    if size == 1:
        return t.expand(t.shape[0], target, *t.shape[2:])
    return t.repeat_interleave(heads // heads_kv, dim=1)  # Hkv -> H


def _flat_row_index(index: Tensor, batch: int, gathered_heads: int, num_keys: int,
                    heads_kv: int) -> Tensor:
    """int64 (B * K * G,): for gathered row j of head g in batch b (key indices ``index``
    (1 or B, 1 or G, K)), the row of k or v flattened to (B * Sk * Hkv, D) that it reads:
    (b * Sk + index[b, g, j]) * Hkv + g // (G / Hkv). Shared by k and v."""
    def offsets_of() -> Tensor:  # (B, 1, G), tiny
        kv_head = torch.arange(gathered_heads, device=index.device) // (gathered_heads // heads_kv)
        batch_base = torch.arange(0, batch * num_keys * heads_kv, num_keys * heads_kv, device=index.device)
        return batch_base.view(batch, 1, 1) + kv_head

    offsets = cached_index_tensor(("row offsets", batch, gathered_heads, num_keys, heads_kv, index.device),
                                  offsets_of)
    # (B, K, G): a copy when index has G > 1 rows (its transpose is not contiguous).
    return torch.add(offsets, index.transpose(1, 2), alpha=heads_kv).reshape(-1)


class _GatherRowsSummed(torch.autograd.Function):
    """index_select of rows whose backward accumulates in float32: when several gathered
    heads read one kv row (key sets per query head under GQA), their 16-bit gradients are
    summed once in fp32 and rounded once, as the dense path's kernel does over a GQA group."""

    @staticmethod
    def forward(ctx, flat_x: Tensor, flat_index: Tensor) -> Tensor:
        ctx.save_for_backward(flat_index)
        ctx.shape, ctx.dtype = flat_x.shape, flat_x.dtype
        return flat_x.index_select(0, flat_index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (flat_index,) = ctx.saved_tensors
        acc = torch.zeros(ctx.shape, dtype=torch.float32, device=grad.device)
        return acc.index_add_(0, flat_index, grad.float()).to(ctx.dtype), None


class _GatherDistinctRows(torch.autograd.Function):
    """index_select of distinct rows (no row read twice): the backward copies each gathered
    row's gradient into its row of a zero tensor (index_copy_: no atomics, deterministic),
    where index_select's own backward accumulates with atomics (3-4x slower for 16-bit rows)."""

    @staticmethod
    def forward(ctx, flat_x: Tensor, flat_index: Tensor) -> Tensor:
        ctx.save_for_backward(flat_index)
        ctx.shape = flat_x.shape
        return flat_x.index_select(0, flat_index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (flat_index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).index_copy_(0, flat_index, grad), None


def _gather_rows(x: Tensor, flat_index: Tensor, width: int, gathered_heads: int, distinct: bool) -> Tensor:
    """(B, K, G, D) rows of k or v (B, Sk, Hkv, D) at ``flat_index`` (_flat_row_index). An
    index_select over the flattened rows: its backward is one index_add_ onto zeros (each
    original row receives the gradients of the gathered rows that read it, summed over
    repeats and GQA groups), where advanced indexing's backward would sort the indices;
    ``distinct`` (no row read twice): copied back instead of added."""
    batch, _, heads_kv, head_dim = x.shape
    flat_x = x.reshape(-1, head_dim)
    if distinct and gathered_heads == heads_kv:
        rows = _GatherDistinctRows.apply(flat_x, flat_index)
    elif gathered_heads != heads_kv and x.element_size() < 4:
        rows = _GatherRowsSummed.apply(flat_x, flat_index)
    else:  # each original row is read at most once per batch: nothing to round twice
        rows = flat_x.index_select(0, flat_index)
    return rows.view(batch, width, gathered_heads, head_dim)


def _gather_bias(bias: Tensor, index: Tensor, batch: int, heads: int, heads_kv: int,
                 num_keys: int) -> Tensor:
    """The bias at the gathered keys, (1 or B, 1 / Hkv / H, 1, K): fine enough in batch and
    heads for both the bias and the positions ``index`` (1 or B, 1 / Hkv / H, K)."""
    bias3 = _key_side_view(bias, batch, heads, heads_kv, num_keys)
    out_batch = max(bias3.shape[0], index.shape[0])
    out_heads = _combined_heads(bias3.shape[1], index.shape[1], heads, heads_kv)
    bias3 = _to_heads(bias3, out_heads, heads, heads_kv).expand(out_batch, out_heads, num_keys)
    index = _to_heads(index, out_heads, heads, heads_kv).expand(out_batch, out_heads, -1)
    return torch.gather(bias3, -1, index).unsqueeze(2)


def _distinct_rows_forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], key_set: KeySet, mode: str,
                           options: tuple) -> Tuple[Tensor, Tensor, tuple]:
    """The forward of _DistinctRowsAttention: (out, lse, what its backward needs). ``mode``:
    "indexed" (CUDA: the kernels read the kept K / V rows in place, the bias rows come from the
    selection), "native" (CUDA: one kernel gathers the K, V and bias rows), "torch" (torch
    gathers)."""
    batch, num_keys, heads_kv, _ = k.shape
    positions, width = key_set.positions, key_set.width
    key_rows = flat_index = None  # (flat_index: the torch gathers', which the backward's copies reuse)
    if mode == "indexed":
        k_rows, v_rows, key_rows = k, v, positions
        bias_rows = None if bias is None else key_set.bias_rows
    elif mode == "native":
        k_rows, v_rows, bias_rows = gather_key_rows(k, v, positions, None if bias is None else bias[:, :, 0])
    else:
        index = key_set.key_index()
        flat_index = _flat_row_index(index, batch, heads_kv, num_keys, heads_kv)
        k_rows = _gather_rows(k, flat_index, width, heads_kv, distinct=False)  # (no autograd in here)
        v_rows = _gather_rows(v, flat_index, width, heads_kv, distinct=False)
        bias_rows = None if bias is None else bias.gather(-1, index.unsqueeze(-2))
    out, lse = _call_op(attention_forward, q, k_rows, v_rows, None, bias_rows, *options, positions, num_keys, None,
                        key_rows)
    return out, lse, (q, k_rows, v_rows, bias_rows, out, lse, positions, key_rows, flat_index)


class _DistinctRowsAttention(torch.autograd.Function):
    """The gather path when no key row is read twice (a full key set, one gathered head per kv
    head: attention_topk's per-key selection): the attention op on the kept rows (read in place,
    or gathered), and in the backward the copy of dK, dV, dbias back onto the original rows, as
    ONE autograd node. Same values as the composed path (index_select, the op, index_copy_ /
    scatter back; on CUDA one kernel, ops.scatter_key_rows, writes the full-size gradients);
    the gathers are not recorded by autograd and the backward runs one node instead of about
    ten: host time, which the GPU waits on at these sizes. Without a gradient to compute,
    attention_over_key_set calls the forward's body directly (no node)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, key_set, mode, options):
        out, lse, saved = _distinct_rows_forward(q, k, v, bias, key_set, mode, options)
        ctx.save_for_backward(*saved)
        ctx.options, ctx.num_keys, ctx.key_set, ctx.mode = options, k.shape[1], key_set, mode
        ctx.shapes = (k.shape, v.shape, None if bias is None else bias.shape)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # out did not reach the loss
            return (None,) * len(ctx.needs_input_grad)
        q, k_rows, v_rows, bias_rows, out, lse, positions, key_rows, flat_index = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        want_dbias = bias_rows is not None and ctx.needs_input_grad[3]
        # With key_rows (read in place) dk / dv come back one row per kept row, as from a copy.
        dq, dk_rows, dv_rows, dbias_rows = _call_op(
            attention_backward, dout, q, k_rows, v_rows, out, lse, None, bias_rows, want_dbias, *ctx.options,
            positions, ctx.num_keys, None, False, key_rows)[:4]
        k_shape, v_shape, bias_shape = ctx.shapes
        needs = ctx.needs_input_grad
        if ctx.mode != "torch":  # CUDA: one kernel writes dK, dV (and dbias) at full size
            dk, dv, dbias = scatter_key_rows(dk_rows, dv_rows, positions, k_shape,
                                             dbias_rows if want_dbias else None, bias_shape)
            return dq, dk if needs[1] else None, dv if needs[2] else None, dbias, None, None, None
        index = ctx.key_set.key_index()
        if flat_index is None:
            flat_index = _flat_row_index(index, k_shape[0], k_shape[2], k_shape[1], k_shape[2])

        def rows_back(rows: Tensor, shape) -> Tensor:  # zeros, then each gathered row's gradient
            full = rows.new_zeros(shape)
            full.view(-1, shape[-1]).index_copy_(0, flat_index, rows.reshape(-1, shape[-1]))
            return full

        dk = rows_back(dk_rows, k_shape) if needs[1] else None
        dv = rows_back(dv_rows, v_shape) if needs[2] else None
        dbias = dbias_rows.new_zeros(bias_shape).scatter_(-1, index.unsqueeze(-2), dbias_rows) if want_dbias else None
        return dq, dk, dv, dbias, None, None, None


def attention_over_key_set(q: Tensor, k: Tensor, v: Tensor, key_set: KeySet, bias: Optional[Tensor],
                           causal: bool, window_left: int, window_right: int, scale: Optional[float],
                           softcap: float, deterministic: bool) -> Tuple[Tensor, Tensor]:
    """(out, lse) of attention restricted to ``key_set`` (plus causal/window and a -inf bias,
    as in the dense path), computed on the gathered keys only."""
    batch, _, heads, _ = q.shape
    num_keys, heads_kv = k.shape[1], k.shape[2]
    positions = key_set.positions
    # One kept set per kv head (positions heads 1 or Hkv): gather Hkv heads, the kernel's GQA
    # shares them. One per query head (H != Hkv): gather per query head.
    gathered_heads = heads if positions.shape[1] == heads != heads_kv else heads_kv
    # One autograd node when no row is read twice and the bias (if any) has the key set's rows.
    bias_fits = bias is None or (bias.dim() == 4 and bias.shape[2] == 1 and bias.shape[3] == num_keys
                                 and tuple(bias.shape[:2]) == tuple(positions.shape[:2]))
    if key_set.full and gathered_heads == heads_kv and bias_fits and not torch.compiler.is_compiling():
        native = (k.is_cuda and k.dtype in _GLUE_DTYPES and v.dtype == k.dtype and k.stride(-1) == 1
                  and v.stride(-1) == 1 and positions.is_contiguous()
                  and (bias is None or bias.dtype in _GLUE_DTYPES) and native_glue_available())
        mode = "torch"
        if native:
            mode = "indexed" if INDEXED_KEYS and (bias is None or key_set.bias_rows is not None) else "native"
        options = (causal, window_left, window_right, scale, softcap, deterministic)
        if not records_no_gradient(q, k, v, bias):
            return _DistinctRowsAttention.apply(q, k, v, bias, key_set, mode, options)
        return _distinct_rows_forward(q, k, v, bias, key_set, mode, options)[:2]
    index = key_set.key_index()
    # Padding rows (-1) read key 0 (index); the kernel never attends to them (zero gradient).
    flat_index = _flat_row_index(index, batch, gathered_heads, num_keys, heads_kv)
    k_rows = _gather_rows(k, flat_index, key_set.width, gathered_heads, key_set.full)
    v_rows = _gather_rows(v, flat_index, key_set.width, gathered_heads, key_set.full)
    bias_rows = bias
    if bias is not None and bias.dim() > 0 and bias.shape[-1] != 1:
        bias_rows = _gather_bias(bias, index, batch, heads, heads_kv, num_keys)
    # else: a key-broadcast bias broadcasts over the gathered rows as over all keys; passed as
    # is, its gradient is exactly zero as on the dense path (gathered, it would be a sum of
    # rounded per-row gradients that only cancel in exact arithmetic).
    return forward_with_grad(q, k_rows, v_rows, None, bias_rows, causal, window_left, window_right,
                             scale, softcap, deterministic, positions, num_keys)
