"""PyTorch custom ops over the native library: dmattn::fwd and dmattn::bwd, and their packed
variable-length counterparts dmattn::fwd_varlen and dmattn::bwd_varlen.

Both ops allocate their outputs (and the CUDA backend's scratch) with torch, so memory comes
from PyTorch's caching allocator and the ops can be captured in CUDA graphs; the native
library only fills the buffers it is given. register_fake makes them traceable by
torch.compile, register_autograd connects the two.

Mask and bias are passed exactly as the user gave them (any rank <= 4, broadcast strides):
the native validation right-aligns them to (B, H, Sq, Sk) and never expands them.

dmattn::fwd / dmattn::bwd optionally take gathered keys (the gather path, gather.py): k and v
then hold only the rows listed in ``key_positions`` (int32 (1 or B, 1 / Hkv / H, K), original
positions, strictly increasing, padding -1 last) out of ``seqlen_k_original`` keys; see
docs/semantics.md, "Gather path". ``supports_key_positions(device)`` says whether the backend
of a device reads them.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.compiler import is_compiling as _is_compiling

from ._lib import lib
from ._op_utils import _cuda_layout, _plain_eager, _scale_arg, check_devices, records_no_gradient
from .decode_kernel import AUTO_MAX_ROWS, maybe_decode_forward, varlen_decode_forward, varlen_decode_splits
from .masks import selection_key_dtype

__all__ = ["attention_forward", "attention_backward", "attention_varlen_forward",
           "attention_varlen_backward", "supports_key_positions", "forward_with_grad",
           "varlen_forward_with_grad"]


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _check_rank(t: Tensor, name: str, layout: str, rank: int = 4) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-D tensor {layout}, got shape {tuple(t.shape)}")


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


@functools.lru_cache(maxsize=None)
def _native_supports_key_positions(device_type: str) -> bool:
    return bool(lib().supports_key_positions(device_type))


@torch.compiler.assume_constant_result
def supports_key_positions(device_type: str) -> bool:
    """Whether the backend of ``device_type`` ("cpu", "cuda") reads key_positions; constant
    for torch.compile (a property of the loaded library)."""
    return _native_supports_key_positions(device_type)


# ---------------------------------------------------------------------------------------------
# The gather path's glue on CUDA (native kernels instead of a dozen torch ops: host time).
# ---------------------------------------------------------------------------------------------

_GLUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def native_glue_available() -> bool:
    """Whether the loaded library has the CUDA glue (select_topk_positions, gather_key_rows,
    scatter_key_rows)."""
    try:
        return lib().cuda_available() and hasattr(lib(), "scatter_key_rows")
    except Exception:  # noqa: BLE001 (no library: the ops report it where they are used)
        return False


def select_topk_positions(scores: Tensor, keep: int, positions: Optional[Tensor] = None,
                          values: Optional[Tensor] = None) -> Tensor:
    """int32 (R_b, R_h, keep): per row of ``scores`` (R_b, R_h, Sk) on CUDA (16/32-bit floats,
    any strides), the ``keep`` keys with the largest score in increasing order (ties: the lower
    index; -0.0 == 0.0: dynamic_mask's selection). One kernel. Written into ``positions`` when
    given; ``values`` (scores' dtype, (R_b, R_h, keep) or (R_b, R_h, 1, keep)), when given,
    receives the scores at the selected keys."""
    if positions is None:
        positions = torch.empty((*scores.shape[:2], keep), dtype=torch.int32, device=scores.device)
    lib().select_topk_positions(scores, keep, positions, values)
    return positions


def gather_key_rows(k: Tensor, v: Tensor, positions: Tensor,
                    bias3: Optional[Tensor]) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """The rows of k, v (B, Sk, Hkv, D) at ``positions`` (1 or B, 1 or Hkv, K), as (B, K, Hkv,
    D), and of bias3 (positions' leading dims, Sk) as (.., 1, K). One kernel (two with a bias)."""
    batch, _, heads_kv, head_dim = k.shape
    width = positions.shape[-1]
    k_rows = torch.empty((batch, width, heads_kv, head_dim), dtype=k.dtype, device=k.device)
    v_rows = torch.empty_like(k_rows)
    bias_rows = None
    if bias3 is not None:
        bias_rows = torch.empty((*bias3.shape[:2], 1, width), dtype=bias3.dtype, device=bias3.device)
    lib().gather_key_rows(k, v, positions, k_rows, v_rows, bias3,
                          None if bias_rows is None else bias_rows.view(*bias3.shape[:2], width))
    return k_rows, v_rows, bias_rows


def scatter_key_rows(dk_rows: Tensor, dv_rows: Tensor, positions: Tensor, key_shape,
                     dbias_rows: Optional[Tensor] = None,
                     bias_shape=None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """The inverse of gather_key_rows for the gradients: dk, dv of shape ``key_shape`` (B, Sk,
    Hkv, D) holding the rows dk_rows, dv_rows (B, K, Hkv, D) at ``positions`` (1 or B, 1 or Hkv,
    K; distinct, increasing, padding -1 last) and zeros elsewhere, and, given, dbias of
    ``bias_shape`` (positions' leading dims, 1, Sk) from dbias_rows (.., 1, K) the same way.
    One kernel, every output element written once (no zero fill, no atomics)."""
    dk, dv = dk_rows.new_empty(key_shape), dv_rows.new_empty(key_shape)
    dbias = None if dbias_rows is None else dbias_rows.new_empty(bias_shape)
    lib().scatter_key_rows(dk_rows, dv_rows, positions, dk, dv, dbias_rows, dbias)
    return dk, dv, dbias


# ---------------------------------------------------------------------------------------------
# Per-query causal top-k glue (per_query.py): CPU or CUDA, int32 tensors.
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _lib_has(*names: str) -> bool:
    """Whether the loaded library exports all of ``names`` (False without a library)."""
    try:
        return all(hasattr(lib(), name) for name in names)
    except Exception:  # noqa: BLE001 (no library: the ops report it where they are used)
        return False


@torch.compiler.assume_constant_result
def native_interval_ends_available() -> bool:
    """Whether the loaded library has dmattn::selection_key and dmattn::interval_ends (CUDA's
    selection in native calls around the sort); constant for torch.compile."""
    return _lib_has("interval_ends", "selection_key")


@torch.compiler.assume_constant_result
def per_query_glue_available() -> bool:
    """Whether the loaded library has the per-query glue (prefix_thresholds, segment_candidates);
    constant for torch.compile (a property of the loaded library)."""
    return _lib_has("prefix_thresholds")


# Custom ops (with fake implementations), so that torch.compile traces the per-query path
# without graph breaks.
@torch.library.custom_op("dmattn::prefix_thresholds", mutates_args=())
def prefix_thresholds(ranks: Tensor, order: Tensor, keep: int) -> Tensor:
    """int32 (R, S): per row, the keep-th smallest rank among the selectable keys 0..v (S while
    fewer are); ranks / order int32 (R, S) contiguous (dmattn/api.h)."""
    thresholds = torch.empty_like(ranks)
    lib().prefix_thresholds(ranks, order, keep, thresholds)
    return thresholds


@prefix_thresholds.register_fake
def _(ranks, order, keep):
    return torch.empty_like(ranks)


@torch.library.custom_op("dmattn::selection_key", mutates_args=())
def native_selection_key(scores: Tensor, allowed: Optional[Tensor]) -> Tensor:
    """CUDA: dmattn.masks.selection_key of (R, S) contiguous float16 / bfloat16 / float32 scores
    in one kernel (int32 keys for 16-bit scores and S <= 2^16, else int64; dmattn/api.h)."""
    key = torch.empty(scores.shape, dtype=selection_key_dtype(scores.dtype, scores.shape[-1]), device=scores.device)
    lib().selection_key(scores, allowed, key)
    return key


@native_selection_key.register_fake
def _(scores, allowed):
    return scores.new_empty(scores.shape, dtype=selection_key_dtype(scores.dtype, scores.shape[-1]))


@torch.library.custom_op("dmattn::interval_ends", mutates_args=())
def interval_ends_of_sorted(sorted_keys: Tensor, allowed: Optional[Tensor], keep: int) -> Tensor:
    """CUDA: int32 (R, S) interval ends from the keys of each row in selection order (int64
    (R, S), excluded keys last; ``allowed`` bool (R, S) or None): ranks, thresholds and ends in
    three kernels of one call (dmattn/api.h, interval_ends; dmattn.per_query.interval_ends)."""
    scratch = [torch.empty(sorted_keys.shape, dtype=torch.int32, device=sorted_keys.device) for _ in range(4)]
    lib().interval_ends(sorted_keys, allowed, keep, *scratch)
    return scratch[3]


@interval_ends_of_sorted.register_fake
def _(sorted_keys, allowed, keep):
    return sorted_keys.new_empty(sorted_keys.shape, dtype=torch.int32)


@torch.library.custom_op("dmattn::segment_candidates", mutates_args=())
def segment_candidates(ends: Tensor, offset: int, seg_len: int, num_segments: int,
                       width: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(positions, key_ends, index), int32 (Rb * num_segments, Rh, width): the candidate keys of
    each segment of seg_len queries, from the interval ends (Rb, Rh, S); and slots, int32 (Rb,
    num_segments, Rh, S): each key's row in each segment's list, -1 where none (dmattn/api.h)."""
    rows_b, rows_h, num_keys = ends.shape
    shape = (rows_b * num_segments, rows_h, width)
    positions, key_ends, index = (torch.empty(shape, dtype=torch.int32, device=ends.device) for _ in range(3))
    slots = torch.empty((rows_b, num_segments, rows_h, num_keys), dtype=torch.int32, device=ends.device)
    lib().segment_candidates(ends, offset, seg_len, positions, key_ends, index, slots)
    return positions, key_ends, index, slots


@segment_candidates.register_fake
def _(ends, offset, seg_len, num_segments, width):
    shape = (ends.shape[0] * num_segments, ends.shape[1], width)
    slots = ends.new_empty((ends.shape[0], num_segments, ends.shape[1], ends.shape[2]))
    return (*(ends.new_empty(shape) for _ in range(3)), slots)


@torch.library.custom_op("dmattn::gather_segment_rows", mutates_args=())
def gather_segment_rows(k: Tensor, v: Tensor, index: Tensor, heads: int) -> Tuple[Tensor, Tensor]:
    """The K and V rows of each segment's candidates, (B * segments, W, heads, D), from k, v
    (B, S, Hkv, D) and index int32 (B * segments, 1 or heads, W) (CUDA; dmattn/api.h)."""
    shape = (index.shape[0], index.shape[2], heads, k.shape[3])
    k_rows = torch.empty(shape, dtype=k.dtype, device=k.device)
    v_rows = torch.empty(shape, dtype=v.dtype, device=v.device)
    lib().gather_segment_rows(k, v, index, k_rows, v_rows)
    return k_rows, v_rows


@gather_segment_rows.register_fake
def _(k, v, index, heads):
    shape = (index.shape[0], index.shape[2], heads, k.shape[3])
    return k.new_empty(shape), v.new_empty(shape)


@torch.library.custom_op("dmattn::sum_segment_rows", mutates_args=())
def sum_segment_rows(dk_rows: Tensor, dv_rows: Tensor, slots: Tensor, heads_kv: int) -> Tuple[Tensor, Tensor]:
    """The gradients of k and v, (B, S, heads_kv, D): each key's gathered rows summed over the
    segments (and the query heads of its kv head) in float32 (CUDA; dmattn/api.h)."""
    shape = (slots.shape[0], slots.shape[3], heads_kv, dk_rows.shape[3])
    dk = torch.empty(shape, dtype=dk_rows.dtype, device=dk_rows.device)
    dv = torch.empty(shape, dtype=dv_rows.dtype, device=dv_rows.device)
    lib().sum_segment_rows(dk_rows.contiguous(), dv_rows.contiguous(), slots, dk, dv)
    return dk, dv


@sum_segment_rows.register_fake
def _(dk_rows, dv_rows, slots, heads_kv):
    shape = (slots.shape[0], slots.shape[3], heads_kv, dk_rows.shape[3])
    return dk_rows.new_empty(shape), dv_rows.new_empty(shape)


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
    key_positions: Optional[Tensor] = None,
    seqlen_k_original: int = 0,
    key_ends: Optional[Tensor] = None,
    key_rows: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    delta: Optional[Tensor] = None,
    gate_fn: int = 0,
    windows: Optional[Tensor] = None,
    gate_keep: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Returns (out, lse): out like q, lse (B, H, Sq) float32 (float64 for float64 inputs).

    alpha (B, Sq, H), delta (B, Sk, Hkv), gate_fn (0 logsigmoid, 1 linear): gated attention;
    windows int32 (1 / Hkv / H, 4) [sink, near, gap, far]: windows with sinks (docs/semantics.md);
    gate_keep bool (B, H, query cells, key cells): gate skipping's cells (gate_skip.py).

    key_rows (CUDA, with key_positions): indexed keys. k, v are then the source (B / r, S, Hkv,
    D) for some r dividing B, and gathered row j of (b, h) is their row key_rows[b, h', j] of
    batch b // r (int32 of key_positions' shape; outside [0, S): a zero row), read in place."""
    check_devices(q=q, k=k, v=v, mask=mask, bias=bias, key_positions=key_positions, key_ends=key_ends,
                  key_rows=key_rows, alpha=alpha, delta=delta, windows=windows, gate_keep=gate_keep)
    _check_rank(q, "q", "(batch, seqlen_q, num_heads, head_dim)")
    # Short Sq: the split-KV kernels (decode_kernel.py; attention_varlen takes them for the same
    # sequences, so that a packed batch equals its sequences run one by one).
    if key_positions is None and alpha is None and windows is None and q.is_cuda:
        decoded = maybe_decode_forward(q, k, v, mask, bias, causal, window_left, window_right, scale, softcap)
        if decoded is not None:
            return decoded
    return native_forward(q, k, v, mask, bias, causal, window_left, window_right, scale, softcap, key_positions,
                          seqlen_k_original, key_ends, key_rows, alpha, delta, gate_fn, windows, gate_keep)


def native_forward(q, k, v, mask, bias, causal, window_left, window_right, scale, softcap, key_positions,
                   seqlen_k_original, key_ends, key_rows, alpha=None, delta=None, gate_fn=0,
                   windows=None, gate_keep=None) -> Tuple[Tensor, Tensor]:
    """dmattn::fwd's body past its checks and the decode kernel's choice: the outputs allocated
    and the native forward called. Also for callers that made those checks themselves
    (topk._inference_forward)."""
    # (new_empty: less host time than torch.empty with a shape, dtype and device to parse)
    out = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q))
    q, k, v = _cuda_layout(q), _cuda_layout(k), _cuda_layout(v)
    lib().forward(q, k, v, out, lse, mask, bias, causal, window_left, window_right,
                  _scale_arg(scale), softcap, key_positions, seqlen_k_original, key_ends, key_rows,
                  alpha, delta, gate_fn, windows, gate_keep)
    return out, lse


@attention_forward.register_fake
def _(q, k, v, mask, bias, causal, window_left, window_right, scale, softcap, deterministic,
      key_positions=None, seqlen_k_original=0, key_ends=None, key_rows=None, alpha=None, delta=None,
      gate_fn=0, windows=None, gate_keep=None):
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
    key_positions: Optional[Tensor] = None,
    seqlen_k_original: int = 0,
    key_ends: Optional[Tensor] = None,
    forward_stats: bool = False,
    key_rows: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    delta: Optional[Tensor] = None,
    gate_fn: int = 0,
    windows: Optional[Tensor] = None,
    gate_requires_grad: bool = False,
    gate_keep: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, dbias, dalpha, ddelta); dbias is an empty tensor unless
    bias_requires_grad, dalpha and ddelta unless gate_requires_grad (with a gate).

    forward_stats=False (the default): the softmax statistics and Delta are recomputed from the
    keys of this call; ``out`` and ``lse`` are not read on the CPU (and the CUDA exact path).
    forward_stats=True: P = exp(S - lse) and Delta = rowsum(dout * out) from the given ``lse``
    and ``out``, which may belong to a softmax over more keys than k holds: the call then returns
    these keys' share of the gradients of that softmax (context parallelism,
    dmattn.distributed). lse -inf marks an empty row.

    key_rows (indexed keys, as in dmattn::fwd): dk and dv are then one row per gathered row,
    (B, K, Hkv, D) with K = key_positions.shape[-1] (not summed onto the source rows)."""
    check_devices(dout=dout, q=q, k=k, v=v, out=out, lse=lse, mask=mask, bias=bias,
                   key_positions=key_positions, key_ends=key_ends, key_rows=key_rows, alpha=alpha, delta=delta,
                   windows=windows, gate_keep=gate_keep)
    dq, dk, dv, dbias, softmax_delta, dq_accum, dbias_accum = _grad_buffers(
        q, k, v, _key_grad_shape(q, k, key_positions, key_rows), _key_grad_shape(q, v, key_positions, key_rows),
        bias, bias_requires_grad, (q.shape[0], q.shape[2], q.shape[1]),
        lambda: _bias_shape4(bias) if _dbias_needs_accum(q, bias) else None)
    dalpha, ddelta = _gate_grads(alpha, delta, gate_requires_grad)
    dalpha_accum = _dalpha_accum(q, k.shape[1], q.shape[0] * q.shape[1], dalpha, deterministic)
    dout, q, k, v, out = (_cuda_layout(t) for t in (dout, q, k, v, out))
    lib().backward(q, k, v, out, lse, mask, bias, dout, dq, dk, dv, dbias, softmax_delta, dq_accum,
                   dbias_accum, causal, window_left, window_right, _scale_arg(scale), softcap,
                   deterministic, key_positions, seqlen_k_original, key_ends, bool(forward_stats), key_rows,
                   alpha, delta, gate_fn, windows, dalpha, ddelta, dalpha_accum, gate_keep)
    if dbias is None:
        dbias = q.new_empty((0,))
    return (dq, dk, dv, dbias, *_gate_grads_or_empty(q, dalpha, ddelta))


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, mask, bias, bias_requires_grad, causal, window_left,
      window_right, scale, softcap, deterministic, key_positions=None, seqlen_k_original=0, key_ends=None,
      forward_stats=False, key_rows=None, alpha=None, delta=None, gate_fn=0, windows=None,
      gate_requires_grad=False, gate_keep=None):
    dbias = bias.new_empty(bias.shape) if (bias_requires_grad and bias is not None) else q.new_empty((0,))
    return (q.new_empty(q.shape), k.new_empty(_key_grad_shape(q, k, key_positions, key_rows)),
            v.new_empty(_key_grad_shape(q, v, key_positions, key_rows)), dbias,
            *_gate_grads_or_empty(q, *_gate_grads(alpha, delta, gate_requires_grad)))


def _grad_buffers(q: Tensor, k: Tensor, v: Tensor, dk_shape, dv_shape, bias: Optional[Tensor],
                  bias_requires_grad: bool, stat_shape, dbias_accum_shape):
    """(dq, dk, dv, dbias, softmax_delta, dq_accum, dbias_accum) for a backward op's native call:
    dq like q, dk and dv of these shapes in k's and v's dtypes, dbias like the bias where it wants
    a gradient (else None); on CUDA the float32 scratch: Delta of stat_shape (lse's), dQ's
    accumulator like q, and dbias's of the shape dbias_accum_shape() gives where the kernels
    reduce it (None: no such buffer)."""
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(dk_shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(dv_shape, dtype=v.dtype, device=v.device)
    dbias = None
    if bias_requires_grad and bias is not None:
        dbias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
    softmax_delta = dq_accum = dbias_accum = None
    if q.device.type == "cuda":
        softmax_delta = torch.empty(stat_shape, dtype=torch.float32, device=q.device)
        dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        accum_shape = dbias_accum_shape() if dbias is not None else None
        if accum_shape is not None:
            dbias_accum = torch.empty(accum_shape, dtype=torch.float32, device=q.device)
    return dq, dk, dv, dbias, softmax_delta, dq_accum, dbias_accum


def _gate_grads(alpha: Optional[Tensor], delta: Optional[Tensor], wanted: bool):
    """(dalpha, ddelta) buffers like alpha and delta when the gate's gradients are wanted. Zeros
    where the other side is empty (no query: ddelta; no key: dalpha): an empty alpha or delta has
    no data, and the kernels then see no gate and write neither."""
    if not wanted or alpha is None or delta is None:
        return None, None
    def buffer(t: Tensor, other: Tensor) -> Tensor:
        return t.new_zeros(t.shape) if other.numel() == 0 else t.new_empty(t.shape)

    return buffer(alpha, delta), buffer(delta, alpha)


def _dalpha_accum(q: Tensor, seqlen_k: int, query_rows: int, dalpha: Optional[Tensor],
                  deterministic: bool) -> Optional[Tensor]:
    """The CUDA backward's float32 scratch for dalpha, laid out like lse: one slice (atomic adds),
    or in deterministic mode one per key block of the kernels (64 keys or more: ceil(Sk / 64)
    slices suffice). None on the CPU or without dalpha."""
    if dalpha is None or q.device.type != "cuda":
        return None
    slices = max(1, -(-seqlen_k // 64)) if deterministic else 1
    return torch.empty((slices, q.shape[-2] * query_rows), dtype=torch.float32, device=q.device)


def _gate_grads_or_empty(q: Tensor, dalpha: Optional[Tensor], ddelta: Optional[Tensor]):
    # (custom ops return tensors, never None: an empty one stands for "not computed"; one each,
    # since the outputs of a custom op may not alias one another)
    return (q.new_empty((0,)) if dalpha is None else dalpha, q.new_empty((0,)) if ddelta is None else ddelta)


def _key_grad_shape(q: Tensor, k: Tensor, key_positions: Optional[Tensor], key_rows: Optional[Tensor]):
    """The shape of dk (dv) from dmattn::bwd: k's, or with indexed keys one row per gathered row."""
    if key_rows is None or key_positions is None:
        return k.shape
    return (q.shape[0], key_positions.shape[-1], k.shape[2], k.shape[3])


def sum_indexed_rows(rows: Tensor, key_rows: Tensor, source_shape) -> Tensor:
    """The gradient of the source k (or v) of indexed keys: rows (B, K, Hkv, D), one per gathered
    row, summed onto the source rows key_rows names (of batch b // (B / source batch)) in float32
    (float64 for float64) and rounded once; rows whose index is outside the source add nothing."""
    batch, width, heads_kv, head_dim = rows.shape
    src_batch, src_len = source_shape[0], source_shape[1]
    index = key_rows.expand(batch, heads_kv, width).long()  # (1 or B, 1 or Hkv, K) -> (B, Hkv, K)
    valid = (index >= 0) & (index < src_len)
    src_b = torch.arange(batch, device=rows.device) // (batch // src_batch)
    flat = ((src_b.view(-1, 1, 1) * src_len + index.clamp(0, max(src_len - 1, 0))) * heads_kv
            + torch.arange(heads_kv, device=rows.device).view(1, -1, 1))
    acc_dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    grad = rows.transpose(1, 2).to(acc_dtype) * valid.unsqueeze(-1)  # (B, Hkv, K, D)
    acc = torch.zeros(src_batch * src_len * heads_kv, head_dim, dtype=acc_dtype, device=rows.device)
    acc.index_add_(0, flat.reshape(-1), grad.reshape(-1, head_dim))
    return acc.to(rows.dtype).view(source_shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, mask, bias, causal, window_left, window_right, scale, softcap, deterministic,
     key_positions, seqlen_k_original, key_ends, key_rows, alpha, delta, gate_fn, windows, gate_keep) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, bias, out, lse, key_positions, key_ends, key_rows, alpha, delta, windows,
                          gate_keep)
    ctx.options = (causal, window_left, window_right, scale, softcap, deterministic)
    ctx.seqlen_k_original = seqlen_k_original
    ctx.gate_fn = gate_fn
    ctx.bias_requires_grad = bias is not None and ctx.needs_input_grad[4]
    ctx.gate_requires_grad = alpha is not None and (ctx.needs_input_grad[15] or ctx.needs_input_grad[16])
    # lse is returned for inspection (as in FlashAttention); it carries no gradient.
    ctx.mark_non_differentiable(lse)
    # No zero-filled gradient for lse (never read) or for an unused out: one kernel fewer.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse):
    if dout is None:  # out did not reach the loss
        return (None,) * len(ctx.needs_input_grad)
    q, k, v, mask, bias, out, lse, key_positions, key_ends, key_rows, alpha, delta, windows, gate_keep = ctx.saved_tensors
    causal, window_left, window_right, scale, softcap, deterministic = ctx.options
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv, dbias, dalpha, ddelta = _call_op(
        attention_backward,
        dout, q, k, v, out, lse, mask, bias, ctx.bias_requires_grad, causal, window_left,
        window_right, scale, softcap, deterministic, key_positions, ctx.seqlen_k_original, key_ends,
        False, key_rows, alpha, delta, ctx.gate_fn, windows, ctx.gate_requires_grad, gate_keep)
    if key_rows is not None:  # one row per gathered row: summed onto the source rows
        dk, dv = sum_indexed_rows(dk, key_rows, k.shape), sum_indexed_rows(dv, key_rows, v.shape)
    gate = ctx.gate_requires_grad
    # Mask, options, key positions, ends, rows, windows and the gate's cells receive no gradient.
    return (dq, dk, dv, None, dbias if ctx.bias_requires_grad else None,
            None, None, None, None, None, None, None, None, None, None,
            dalpha if gate and ctx.needs_input_grad[15] else None,
            ddelta if gate and ctx.needs_input_grad[16] else None, None, None, None)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def _call_op(op, *args):
    """op(*args), through its Python body directly when _plain_eager allows (same results)."""
    return op._init_fn(*args) if _plain_eager(args) else op(*args)


def _eager_autograd(op, setup, backward_fn, differentiable: Tuple[int, ...], defaults: tuple = ()):
    """``op`` (a custom op with registered autograd), called in eager mode through a plain
    torch.autograd.Function with the same setup context and backward: the same results and
    graph, without torch.library's per-call binding of the arguments to the schema (it lists
    the 13 to 15 schema arguments once per argument: ~25 us of host time a call with torch
    2.13). Under torch.compile, and when no gradient is needed, the op is called as is.
    ``differentiable``: the positions of the inputs that may require grad.
    ``defaults``: the values of the op's trailing optional arguments (setup gets them all)."""
    num_args = len(op._opoverload._schema.arguments)

    class Function(torch.autograd.Function):
        # The ctx-style forward: a separate setup_context staticmethod would make every apply
        # bind the arguments with inspect.signature.
        @staticmethod
        def forward(ctx, *inputs):
            output = _call_op(op, *inputs)  # grad mode is off in here: the op's autograd is skipped
            setup(ctx, inputs, output)
            return output

        backward = staticmethod(backward_fn)

    def call(*inputs):
        if not _is_compiling() and not records_no_gradient(*(inputs[i] for i in differentiable if i < len(inputs))):
            missing = num_args - len(inputs)
            return Function.apply(*inputs, *(defaults[len(defaults) - missing:] if missing else ()))
        return _call_op(op, *inputs)

    return call


# dmattn::fwd with autograd, for the Python API (same arguments); q, k, v, mask, bias may
# require grad.
forward_with_grad = _eager_autograd(attention_forward, _setup_context, _backward, (0, 1, 2, 3, 4, 15, 16),
                                    (None, 0, None, None, None, None, 0, None, None))


# ---------------------------------------------------------------------------------------------
# Packed variable-length batches: q (total_q, H, D), k/v (total_k, Hkv, D), int32 cu_seqlens of
# length B + 1, key-side mask/bias (Hb, total_k), lse (H, total_q). See docs/semantics.md.
# ---------------------------------------------------------------------------------------------


# CUDA cu_seqlens pairs whose values passed the check: id(cu_seqlens_q) -> (weak references to
# both tensors, their version counters, the sizes they were checked against). A model passes the
# same two tensors to every layer, forward and backward: one host copy per step. Identity is
# tested with `is` on the live referents (a dead tensor's id may be reused; tensors' == is
# elementwise); the table is cleared when it grows past a few entries.
_checked_cu_seqlens: dict = {}
_CHECKED_CU_SEQLENS_MAX = 64


def _cu_seqlens_already_checked(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *sizes: int) -> bool:
    """True when this very pair of tensors, unmodified since (same version counters), passed the
    value check against the same max lengths and totals."""
    entry = _checked_cu_seqlens.get(id(cu_seqlens_q))
    if entry is None:
        return False
    ref_q, version_q, ref_k, version_k, checked_sizes = entry
    return (ref_q() is cu_seqlens_q and ref_k() is cu_seqlens_k and version_q == cu_seqlens_q._version
            and version_k == cu_seqlens_k._version and checked_sizes == sizes)


def _remember_cu_seqlens_checked(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *sizes: int) -> None:
    if len(_checked_cu_seqlens) >= _CHECKED_CU_SEQLENS_MAX:
        _checked_cu_seqlens.clear()
    _checked_cu_seqlens[id(cu_seqlens_q)] = (weakref.ref(cu_seqlens_q), cu_seqlens_q._version,
                                             weakref.ref(cu_seqlens_k), cu_seqlens_k._version, sizes)


def _check_cu_seqlens_values(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The native validation reads cu_seqlens itself when they are on the CPU. CUDA values are
    checked here, on a host copy (one synchronization), by the same native routine, once per
    pair of cu_seqlens tensors (until either is modified in place); skipped while a CUDA graph
    is being captured, where a copy to the host is not allowed."""
    if not cu_seqlens_q.is_cuda:
        return
    _check_rank(q, "q", "(total_q, num_heads, head_dim)", rank=3)
    _check_rank(k, "k", "(total_k, num_heads_kv, head_dim)", rank=3)
    sizes = (max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0])
    # (the table first: the usual call, already checked, then costs no capture query)
    if _cu_seqlens_already_checked(cu_seqlens_q, cu_seqlens_k, *sizes) or torch.cuda.is_current_stream_capturing():
        return
    lib().check_cu_seqlens(cu_seqlens_q.cpu(), cu_seqlens_k.cpu(), *sizes)
    _remember_cu_seqlens_checked(cu_seqlens_q, cu_seqlens_k, *sizes)


def _varlen_lse_shape(q: Tensor) -> Tuple[int, int]:
    _check_rank(q, "q", "(total_q, num_heads, head_dim)", rank=3)
    return (q.shape[1], q.shape[0])


@torch.library.custom_op("dmattn::fwd_varlen", mutates_args=())
def attention_varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],
    softcap: float,
    deterministic: bool,
    alpha: Optional[Tensor] = None,
    delta: Optional[Tensor] = None,
    gate_fn: int = 0,
    windows: Optional[Tensor] = None,
    gate_keep: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Returns (out, lse): out like q, lse (H, total_q) float32 (float64 for float64 inputs).
    The gate's alpha (total_q, H) and delta (total_k, Hkv), gate_fn, windows and gate_keep (B, H,
    cells of max_seqlen_q, cells of max_seqlen_k) as in dmattn::fwd."""
    check_devices(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, mask=mask,
                   bias=bias, alpha=alpha, delta=delta, windows=windows, gate_keep=gate_keep)
    _check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # (new_empty: less host time than torch.empty with a shape, dtype and device to parse)
    out = q.new_empty(q.shape)
    lse = q.new_empty(_varlen_lse_shape(q), dtype=_lse_dtype(q))
    q, k, v = _cuda_layout(q), _cuda_layout(k), _cuda_layout(v)
    # The sequences of at most AUTO_MAX_ROWS query rows take the decode kernels, as each one's
    # dense call does (maybe_decode_forward), after the general kernels computed the rest (and,
    # needlessly, them too: they skip no sequence by length).
    splits = 0
    if alpha is None and windows is None and q.is_cuda:
        splits = varlen_decode_splits(q, k.shape[1], max_seqlen_q, max_seqlen_k)
    if splits == 0 or max_seqlen_q * (q.shape[1] // k.shape[1]) > AUTO_MAX_ROWS:
        lib().forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
                             lse, mask, bias, causal, window_left, window_right, _scale_arg(scale),
                             softcap, alpha, delta, gate_fn, windows, gate_keep)
    if splits:
        varlen_decode_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, mask, bias,
                              causal, window_left, window_right, scale, softcap, splits)
    return out, lse


@attention_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, bias, causal,
      window_left, window_right, scale, softcap, deterministic, alpha=None, delta=None, gate_fn=0,
      windows=None, gate_keep=None):
    return q.new_empty(q.shape), q.new_empty(_varlen_lse_shape(q), dtype=_lse_dtype(q))


@torch.library.custom_op("dmattn::bwd_varlen", mutates_args=())
def attention_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
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
    alpha: Optional[Tensor] = None,
    delta: Optional[Tensor] = None,
    gate_fn: int = 0,
    windows: Optional[Tensor] = None,
    gate_requires_grad: bool = False,
    gate_keep: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, dbias, dalpha, ddelta), as dmattn::bwd."""
    check_devices(dout=dout, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   out=out, lse=lse, mask=mask, bias=bias, alpha=alpha, delta=delta, windows=windows,
                   gate_keep=gate_keep)
    _check_cu_seqlens_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # (a key-side dbias is reduced across the query heads that share a bias head)
    dq, dk, dv, dbias, softmax_delta, dq_accum, dbias_accum = _grad_buffers(
        q, k, v, k.shape, v.shape, bias, bias_requires_grad, _varlen_lse_shape(q),
        lambda: bias.shape if bias.dim() == 2 and bias.shape[0] < q.shape[1] else None)
    dalpha, ddelta = _gate_grads(alpha, delta, gate_requires_grad)
    dalpha_accum = _dalpha_accum(q, max_seqlen_k, q.shape[0], dalpha, deterministic)
    dout, q, k, v, out = (_cuda_layout(t) for t in (dout, q, k, v, out))
    lib().backward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
                          lse, mask, bias, dout, dq, dk, dv, dbias, softmax_delta, dq_accum, dbias_accum,
                          causal, window_left, window_right, _scale_arg(scale), softcap,
                          deterministic, alpha, delta, gate_fn, windows, dalpha, ddelta, dalpha_accum,
                          gate_keep)
    if dbias is None:
        dbias = q.new_empty((0,))
    return (dq, dk, dv, dbias, *_gate_grads_or_empty(q, dalpha, ddelta))


@attention_varlen_backward.register_fake
def _(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, mask,
      bias, bias_requires_grad, causal, window_left, window_right, scale, softcap, deterministic,
      alpha=None, delta=None, gate_fn=0, windows=None, gate_requires_grad=False, gate_keep=None):
    dbias = bias.new_empty(bias.shape) if (bias_requires_grad and bias is not None) else q.new_empty((0,))
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias,
            *_gate_grads_or_empty(q, *_gate_grads(alpha, delta, gate_requires_grad)))


def _setup_varlen_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, bias, causal,
     window_left, window_right, scale, softcap, deterministic, alpha, delta, gate_fn, windows, gate_keep) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, mask, bias, out, lse, alpha, delta, windows,
                          gate_keep)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.options = (causal, window_left, window_right, scale, softcap, deterministic)
    ctx.gate_fn = gate_fn
    ctx.bias_requires_grad = bias is not None and ctx.needs_input_grad[8]
    ctx.gate_requires_grad = alpha is not None and (ctx.needs_input_grad[15] or ctx.needs_input_grad[16])
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # as _setup_context


def _varlen_backward(ctx, dout, _dlse):
    if dout is None:  # as _backward
        return (None,) * len(ctx.needs_input_grad)
    q, k, v, cu_seqlens_q, cu_seqlens_k, mask, bias, out, lse, alpha, delta, windows, gate_keep = ctx.saved_tensors
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv, dbias, dalpha, ddelta = _call_op(
        attention_varlen_backward,
        dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, out, lse, mask, bias,
        ctx.bias_requires_grad, *ctx.options, alpha, delta, ctx.gate_fn, windows, ctx.gate_requires_grad, gate_keep)
    gate = ctx.gate_requires_grad
    # cu_seqlens, max_seqlen, mask, windows, the gate's cells and the options receive no gradient.
    return (dq, dk, dv, None, None, None, None, None,
            dbias if ctx.bias_requires_grad else None, None, None, None, None, None, None,
            dalpha if gate and ctx.needs_input_grad[15] else None,
            ddelta if gate and ctx.needs_input_grad[16] else None, None, None, None)


attention_varlen_forward.register_autograd(_varlen_backward, setup_context=_setup_varlen_context)
# dmattn::fwd_varlen with autograd, as forward_with_grad (q, k, v, mask, bias, alpha, delta).
varlen_forward_with_grad = _eager_autograd(attention_varlen_forward, _setup_varlen_context,
                                           _varlen_backward, (0, 1, 2, 7, 8, 15, 16), (None, None, 0, None, None))
