"""Drop-in for flash-sparse-attn 2.0's public API, computed by dmattn. Switching is one import:

    import flash_sparse_attn                    ->  from dmattn import flash_sparse_attn
    from flash_sparse_attn import <function>    ->  from dmattn.flash_sparse_attn import <function>

The twelve functions keep flash-sparse-attn's names, argument names, order and defaults, layouts
and return values (``out``, or ``(out, lse)`` with ``return_lse=True``; lse is the natural-log
logsumexp, float32):

    family          query / key, value                          alpha / delta             out / lse
    batched         (B, Sq, H, D) / (B, Sk, Hkv, D)             (B, Sq, H) / (B, Sk, Hkv) like query / (B, H, Sq)
    varlen          (total_q, H, D) / (total_k, Hkv, D)         (total_q, H) / (total_k, Hkv) like query / (H, total_q)
    with_kvcache    (B, H, D) / (B, Sk, Hkv, D), or pages       (B, H) / (B, Sk, Hkv),    (B, H, D) / (B, H)
                    (num_pages, page_size, Hkv, D) + page_table  or (num_pages, page_size, Hkv)
    varlen_with_kvcache  (B, H, D) / (total_k, Hkv, D)          (B, H) / (total_k, Hkv)   (B, H, D) / (B, H)

Mapping (flash-sparse-attn argument -> dmattn):

    is_causal               causal, bottom-right aligned. Turned off when Sq == 1 (max_seqlen_q in
                            varlen) as flash-sparse-attn does; with bottom-right alignment that changes
                            no result.
    softmax_scale           scale (None: 1 / sqrt(D)).
    alpha, delta            gate=(alpha, delta): scores = scale * (q.k + g(alpha_i * delta_j)).
    is_logsigmoid_gate      gate_fn: "logsigmoid" (True, the default) or "linear" (False).
    window_sizes            windows: int32 rows [sink, left, right, near] (left: the distant band's
                            width, right: the gap before it) become dmattn's [sink, near, gap, far] =
                            [sink, near, right, left]; one row per kv head (dmattn also takes 1 or H
                            rows). Windows imply causal, in both libraries.
    is_local                without window_sizes: `window_sizes_heuristic` (seqlen_k, num_heads_kv),
                            flash-sparse-attn's default bands. With window_sizes: implied.
    softmax_threshold       accepted; dmattn computes exactly (see below).
    gate_threshold,         gate skipping (dmattn.gate_skip; None: 1 / seqlen_k as flash-sparse-attn,
    is_adapt_gate           0.0: exact): cells of 128 x 128 whose gates lie more than
                            -ln(gate_threshold) / scale below the largest gate their query block can
                            reach count as masked; is_adapt_gate under causal scales the threshold
                            by the visible fraction of the block's first row (see below).
    page_table, seqused_k   with_kvcache: `dmattn.attention_with_kvcache`'s block_table and
                            cache_seqlens (the varlen cache as pages of one key). In the batched
                            functions: the same route, forward only.
    out=, lse=              preallocated outputs: the results are copied into them and they are
                            returned, as flash-sparse-attn does.
    is_autotune, tile_mn, skip_checks, is_split_kv, is_split_qo, pack_gqa, num_splits
                            tuning of flash-sparse-attn's kernels: accepted and ignored.

Thresholds. ``gate_threshold`` skips cells of the gated functions as dmattn's gate skipping does
(docs/semantics.md, "Gate skipping"): flash-sparse-attn's test with two differences, both so that
a skip means what the threshold says. The gates are compared (g(ub) - g(R), not the products:
with the logsigmoid gate and positive products the products' gap overstates the gates' gap, so
flash-sparse-attn skips blocks whose gates are near the largest), and R is the largest bound over
the query block's visible key blocks rather than the running one (the rule does not depend on the
order blocks are visited, so the backward skips exactly the forward's cells; flash-sparse-attn's
backward re-decides per key block). The kvcache functions and windows compute the gate exactly.
``softmax_threshold`` is accepted and validated and computed exactly, which is what
flash-sparse-attn computes with it 0.0 (its skip test compares against log2(0) = -inf and never
passes). Where flash-sparse-attn would have skipped (a threshold None, its default, or > 0) and
dmattn computes exactly, the first such call in a process warns once; pass 0.0 to ask for exact
attention explicitly.

Not supported (NotImplementedError naming the argument): fp8 (``is_quant=True`` or
query_scale / key_scale / value_scale), ``gather_kv_indices`` (dmattn.attention_topk selects
and gathers keys itself), ``seqused_q`` and ``seqused_k`` in the varlen functions, and a
gradient through ``page_table`` / ``seqused_k`` in the batched functions.

Backends: the gate and windows run on every backend (on Hopper both on the warp-specialized
kernels; on other GPUs windows the same for every head as sliding-window calls,
dmattn.window_parts). The kvcache functions pass them to attention_with_kvcache as an fp32 bias
(B, H, Sq, Sk; fp64 for fp64 queries) and a bool mask. Gradients reach query, key, value, alpha
and delta through dmattn's autograd (the kvcache functions are inference only, like
flash-sparse-attn's).
"""

from __future__ import annotations

import functools
import numbers
import re
import warnings
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .interface import _parse_int, _require_tensor, attention, attention_on, attention_varlen
from .kvcache import attention_with_kvcache
from .ops import _check_rank

__all__ = [
    "flash_dense_attn_func",
    "flash_dense_attn_with_kvcache_func",
    "flash_dense_attn_varlen_func",
    "flash_dense_attn_varlen_with_kvcache_func",
    "flash_sparse_attn_func",
    "flash_sparse_attn_with_kvcache_func",
    "flash_sparse_attn_varlen_func",
    "flash_sparse_attn_varlen_with_kvcache_func",
    "flash_gated_attn_func",
    "flash_gated_attn_with_kvcache_func",
    "flash_gated_attn_varlen_func",
    "flash_gated_attn_varlen_with_kvcache_func",
    "window_sizes_heuristic",
]

Result = Union[Tensor, Tuple[Tensor, Tensor]]


# ---------------------------------------------------------------------------------------------
# Argument conversion
# ---------------------------------------------------------------------------------------------


def _flag(x, name: str) -> bool:
    if not isinstance(x, (bool, numbers.Integral)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return bool(x)


def _no_fp8(is_quant, query_scale, key_scale, value_scale) -> None:
    if _flag(is_quant, "is_quant") or any(s is not None for s in (query_scale, key_scale, value_scale)):
        raise NotImplementedError("is_quant / query_scale / key_scale / value_scale: fp8 attention is not "
                                  "supported by dmattn yet; pass bfloat16 or float16 tensors")


def _no_gather(gather_kv_indices) -> None:
    if gather_kv_indices is not None:
        raise NotImplementedError("gather_kv_indices: gathered top-k decoding is not supported by this drop-in "
                                  "yet; dmattn.attention_topk selects and gathers the keys itself")


def _index_tensor(t, name: str) -> Tensor:
    """An integer tensor (page_table, seqused_k, cu_seqlens) as int32."""
    _require_tensor(t, name)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor (int32), got dtype {t.dtype}")
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def window_sizes_heuristic(
    seqlen_k: int,
    num_heads_kv: int,
    device: Optional[torch.device] = None,
    equal_bandwidth: bool = True,
    window_near: int = 1024,
    window_sink: int = 64,
    num_heads_kv_global: Optional[int] = None,
    tp_rank: Optional[int] = None,
    tp_size: Optional[int] = None,
) -> Tensor:
    """flash-sparse-attn's default windows for ``is_local=True`` without ``window_sizes``, in its
    convention: int32 (num_heads_kv, 4), rows [sink, left, right, near].

    Every kv head keeps the first ``window_sink`` keys and the ``window_near`` nearest; the
    distances beyond (``seqlen_k - sink - near`` of them) are cut into one band per kv head of
    the whole model (``num_heads_kv_global``, default ``num_heads_kv``; with tensor parallelism
    this rank holds the heads from ``tp_rank * num_heads_kv``, or, where ranks share a kv head,
    from its group's first), head h taking distances [e_h, e_{h+1}) past the near window: ``left
    = e_{h+1} - e_h``, ``right = e_h``. The edges e are equally spaced (``equal_bandwidth``: the
    same number of keys per head, balanced decoding) or at ``1 - sqrt(1 - h / heads)`` of the
    span (equal areas of the causal triangle, balanced training), computed in float32 and
    truncated, as flash-sparse-attn does, so the bands are the same."""
    total = num_heads_kv if num_heads_kv_global is None else num_heads_kv_global
    rank = tp_rank or 0
    if tp_size is not None and tp_size > total:
        first = rank // (tp_size // total) * num_heads_kv  # ranks share a kv head
    else:
        first = rank * num_heads_kv
    near = min(max(window_near, 0), seqlen_k)
    sink = min(max(window_sink, 0), max(seqlen_k - near, 0))
    span = max(seqlen_k - sink - near, 0)
    heads = torch.arange(first, first + num_heads_kv + 1, dtype=torch.float32)
    if equal_bandwidth:
        edges = span * heads / total
    else:
        edges = span * (1.0 - torch.sqrt(1.0 - heads / total))
    edges = edges.to(torch.int32)
    left, right = edges[1:] - edges[:-1], edges[:-1]
    rows = torch.stack([torch.full_like(left, sink), left, right, torch.full_like(left, near)], dim=1)
    return rows if device is None else rows.to(device)


# flash-sparse-attn's columns [sink, left, right, near] in dmattn's order [sink, near, gap, far].
_TO_WINDOWS = [0, 3, 2, 1]


@functools.lru_cache(maxsize=64)
def _heuristic_windows(seqlen_k: int, num_heads_kv: int, device: torch.device) -> Tensor:
    # (cached per shape and device like flash-sparse-attn's; never handed to the caller)
    return window_sizes_heuristic(seqlen_k, num_heads_kv)[:, _TO_WINDOWS].contiguous().to(device)


def _windows(window_sizes, is_local, seqlen_k: int, heads: int, heads_kv: int, device) -> Optional[Tensor]:
    """dmattn's ``windows`` for flash-sparse-attn's window_sizes / is_local, or None."""
    if window_sizes is None:
        return _heuristic_windows(int(seqlen_k), int(heads_kv), device) if _flag(is_local, "is_local") else None
    _require_tensor(window_sizes, "window_sizes", optional=True)
    if window_sizes.dtype != torch.int32:
        raise TypeError(f"window_sizes: expected dtype int32, got {window_sizes.dtype}; use .to(torch.int32)")
    if window_sizes.dim() != 2 or window_sizes.shape[1] != 4 or window_sizes.shape[0] not in (1, heads_kv, heads):
        raise ValueError(f"window_sizes: expected shape (num_heads_kv, 4) = ({heads_kv}, 4) with columns [sink, "
                         f"left, right, near] (or 1 or num_heads = {heads} rows), got {tuple(window_sizes.shape)}")
    return window_sizes[:, _TO_WINDOWS]


_warned_exact = False


def _thresholds(softmax_threshold, gate_threshold=0.0) -> None:
    """Checks the thresholds that dmattn computes exactly; warns once per process where
    flash-sparse-attn would have skipped blocks (a threshold None, its default, or > 0)."""
    if any(_would_skip(x, name) for x, name in ((softmax_threshold, "softmax_threshold"),
                                                (gate_threshold, "gate_threshold"))):
        _warn_exact()


def _would_skip(x, name: str) -> bool:
    """Whether flash-sparse-attn skips with threshold x (None: its default, which does), checked."""
    if x is None:
        return True
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a float or None, got {type(x).__name__}")
    if x != x:
        raise ValueError(f"{name}: expected a float or None, got nan")
    return x > 0


def _warn_exact() -> None:
    global _warned_exact
    if not _warned_exact:
        _warned_exact = True
        warnings.warn("dmattn.flash_sparse_attn computes this call exactly: softmax_threshold (and gate_threshold "
                      "beside windows or a KV cache) are accepted but skip nothing there. Pass 0.0 to request exact "
                      "attention explicitly. (Shown once per process.)", UserWarning, stacklevel=4)


def _gate_skipping(gate_threshold, is_adapt_gate, seqlen_k: int) -> Tuple[Optional[float], bool]:
    """(threshold, adaptive) of dmattn's gate skipping from flash-sparse-attn's arguments: None
    -> 1 / seqlen_k (its default), 0 -> None (exact)."""
    if not _would_skip(gate_threshold, "gate_threshold"):
        return None, False
    threshold = 1.0 / max(seqlen_k, 1) if gate_threshold is None else float(gate_threshold)
    return threshold, _flag(is_adapt_gate, "is_adapt_gate")


def _store(o: Tensor, l: Tensor, out, lse, return_lse) -> Result:
    """The results, copied into the preallocated ``out`` / ``lse`` where given (then returned)."""
    for dst, src, name in ((out, o, "out"), (lse, l, "lse")):
        if dst is not None:
            _require_tensor(dst, name)
            if dst.shape != src.shape:
                raise ValueError(f"{name}: expected a preallocated tensor of shape {tuple(src.shape)}, "
                                 f"got {tuple(dst.shape)}")
    if out is not None:
        o = out.copy_(o)
    if lse is not None:
        l = lse.copy_(l.detach())
    return (o, l) if _flag(return_lse, "return_lse") else o


def _gate_fn(is_logsigmoid_gate) -> str:
    return "logsigmoid" if _flag(is_logsigmoid_gate, "is_logsigmoid_gate") else "linear"


def _heads(query: Tensor, key: Tensor) -> Tuple[int, int]:
    """(num_heads, num_heads_kv); 0 where a rank is off (the native validation reports it)."""
    return (query.shape[-2] if query.dim() >= 2 else 0), (key.shape[-2] if key.dim() >= 2 else 0)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------------------------
# The families
# ---------------------------------------------------------------------------------------------


def _batched(query, key, value, alpha, delta, gate_fn, is_causal, softmax_scale, window_sizes, is_local,
             page_table, seqused_k, out, lse, return_lse, gate_threshold=0.0, is_adapt_gate=False) -> Result:
    for t, n in ((query, "query"), (key, "key"), (value, "value")):
        _require_tensor(t, n)
    # (flash-sparse-attn turns causal off for one query: bottom-right aligned, it sees every key anyway)
    causal = _flag(is_causal, "is_causal") and not (query.dim() == 4 and query.shape[1] == 1)
    if page_table is not None or seqused_k is not None:
        if _needs_grad(query, key, value, alpha, delta):
            raise NotImplementedError("page_table / seqused_k: dmattn runs paged or length-limited keys forward "
                                      "only (attention_with_kvcache); call under torch.no_grad(), or pass "
                                      "contiguous keys without seqused_k for a gradient")
        if alpha is not None and _would_skip(gate_threshold, "gate_threshold"):
            _warn_exact()
        o, l = _cache(query, key, value, alpha, delta, gate_fn, causal, softmax_scale, window_sizes, is_local,
                      page_table, seqused_k)
    else:
        seqlen_k = key.shape[1] if key.dim() == 4 else 0
        windows = _windows(window_sizes, is_local, seqlen_k, *_heads(query, key), query.device)
        gate = None if alpha is None else (alpha, delta)
        threshold, adaptive = _gate_skipping(gate_threshold, is_adapt_gate, seqlen_k)
        if windows is not None and threshold is not None:
            _warn_exact()
            threshold = None
        o, l = attention_on(query, key, value, None, None, None, causal=causal, window=(-1, -1),
                            scale=softmax_scale, softcap=0.0, deterministic=False, return_lse=True, gate=gate,
                            gate_fn=gate_fn, windows=windows, gate_threshold=threshold, gate_adaptive=adaptive)
    return _store(o, l, out, lse, return_lse)


def _varlen(query, key, value, alpha, delta, gate_fn, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            is_causal, softmax_scale, window_sizes, is_local, seqused_q, seqused_k, out, lse, return_lse,
            gate_threshold=0.0, is_adapt_gate=False) -> Result:
    for t, n in ((query, "query"), (key, "key"), (value, "value")):
        _require_tensor(t, n)
    for t, n in ((seqused_q, "seqused_q"), (seqused_k, "seqused_k")):
        if t is not None:
            raise NotImplementedError(f"{n}: the varlen functions take each sequence's length from cu_seqlens; "
                                      f"{n} is not supported by dmattn yet")
    max_seqlen_q, max_seqlen_k = _parse_int(max_seqlen_q, "max_seqlen_q"), _parse_int(max_seqlen_k, "max_seqlen_k")
    causal = _flag(is_causal, "is_causal") and max_seqlen_q != 1
    windows = _windows(window_sizes, is_local, max_seqlen_k, *_heads(query, key), query.device)
    gate = None if alpha is None else (alpha, delta)
    threshold, adaptive = _gate_skipping(gate_threshold, is_adapt_gate, max_seqlen_k)
    if windows is not None and threshold is not None:
        _warn_exact()
        threshold = None
    o, l = attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal=causal, scale=softmax_scale, return_lse=True, gate=gate, gate_fn=gate_fn,
                            windows=windows, gate_threshold=threshold, gate_adaptive=adaptive)
    return _store(o, l, out, lse, return_lse)


def _check_shape(t: Tensor, shape, name: str, layout: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {layout} = {tuple(shape)}, got {tuple(t.shape)}")


def _check_packed_keys(cu: Tensor, max_seqlen_k: int, total_k: int) -> None:
    """The varlen cache's rows: lengths in [0, max_seqlen_k], keys inside key's total_k rows."""
    lens = cu[1:].long() - cu[:-1].long()
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 0 or hi > max_seqlen_k:
        raise ValueError(f"cu_seqlens_k: expected non-decreasing entries whose differences are at most max_seqlen_k = "
                         f"{max_seqlen_k}, got lengths in [{lo}, {hi}]")
    first, last = int(cu[0]), int(cu[-1])
    if first < 0 or last > total_k:
        raise ValueError(f"cu_seqlens_k: expected entries in [0, {total_k}] (key's rows), got {first} .. {last}")


def _decode(query, key, value, alpha, delta, gate_fn, softmax_scale, window_sizes, is_local, page_table,
            seqused_k, gather_kv_indices, out, lse, return_lse, cu_seqlens_k=None, max_seqlen_k=None) -> Result:
    """One decoding query per row (the with_kvcache functions): query (B, H, D)."""
    _no_gather(gather_kv_indices)
    for t, n in ((query, "query"), (key, "key"), (value, "value")):
        _require_tensor(t, n)
    _check_rank(query, "query", "(batch, num_heads, head_dim)", rank=3)
    batch, heads = query.shape[:2]
    if alpha is not None:
        _check_shape(alpha, (batch, heads), "alpha", "(batch, num_heads)")
        alpha = alpha.unsqueeze(1)
    if cu_seqlens_k is not None:
        # The packed keys (total_k, Hkv, D) as pages of one key: row b's key j is key cu_seqlens_k[b] + j.
        cu = _index_tensor(cu_seqlens_k, "cu_seqlens_k")
        _check_shape(cu, (batch + 1,), "cu_seqlens_k", "(batch + 1,)")
        max_seqlen_k = _parse_int(max_seqlen_k, "max_seqlen_k")
        _check_rank(key, "key", "(total_k, num_heads_kv, head_dim)", rank=3)
        if delta is not None:
            _check_shape(delta, key.shape[:2], "delta", "(total_k, num_heads_kv)")
            delta = delta.unsqueeze(1)
        if cu.device.type == "cpu" and batch and not torch.compiler.is_compiling():  # (no device sync)
            _check_packed_keys(cu, max_seqlen_k, key.shape[0])
        width = max_seqlen_k if key.shape[0] else 0  # (no keys at all: no page to point at)
        positions = cu[:-1].long().view(-1, 1) + torch.arange(width, device=cu.device)
        page_table = positions.clamp(max=max(key.shape[0] - 1, 0)).to(torch.int32)
        if seqused_k is None:
            seqused_k = cu[1:] - cu[:-1]
        key, value = key.unsqueeze(1), value.unsqueeze(1)
    o, l = _cache(query.unsqueeze(1), key, value, alpha, delta, gate_fn, False, softmax_scale, window_sizes,
                  is_local, page_table, seqused_k)
    return _store(o.squeeze(1), l.squeeze(-1), out, lse, return_lse)


def _cache(q, k_cache, v_cache, alpha, delta, gate_fn, causal, scale, window_sizes, is_local, page_table,
           seqused_k) -> Tuple[Tensor, Tensor]:
    """attention_with_kvcache on q (B, Sq, H, D), with the gate as an fp32 bias (B, H, Sq, Sk; fp64
    for fp64 queries) and windows with sinks as a bool mask (B, rows, Sq, Sk), both aligned with
    each row's length."""
    _check_rank(q, "query", "(batch, seqlen_q, num_heads, head_dim)")
    paged = page_table is not None
    _check_rank(k_cache, "key", "(num_pages, page_size, num_heads_kv, head_dim)" if paged else
                "(batch, seqlen_k, num_heads_kv, head_dim)")
    batch, seqlen_q, heads, head_dim = q.shape
    if paged:
        page_table = _index_tensor(page_table, "page_table")
    seqlen_k = k_cache.shape[1] * (page_table.shape[1] if paged else 1)
    windows = _windows(window_sizes, is_local, seqlen_k, heads, k_cache.shape[2], q.device)
    if seqused_k is None:
        cache_seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=q.device)
    else:
        cache_seqlens = _index_tensor(seqused_k, "seqused_k")
        _check_shape(cache_seqlens, (batch,), "seqused_k", "(batch,)")
    if scale is None:
        scale = head_dim ** -0.5
    mask = bias = None
    if windows is not None:
        w = windows.long()
        sink, near, gap, far = (w[:, c].view(1, -1, 1, 1) for c in range(4))
        j = torch.arange(seqlen_k, device=q.device).view(1, 1, 1, -1)
        d = (torch.arange(seqlen_q, device=q.device).view(1, 1, -1, 1)
             + (cache_seqlens.long() - seqlen_q).view(-1, 1, 1, 1) - j)
        mask = (d >= 0) & ((j < sink) | (d < near) | ((d >= near + gap) & (d < near + gap + far)))
    if alpha is not None:
        _require_tensor(alpha, "alpha")
        _require_tensor(delta, "delta")
        _check_shape(alpha, (batch, seqlen_q, heads), "alpha", "(batch, seqlen_q, num_heads)")
        _check_shape(delta, k_cache.shape[:3], "delta", "(num_pages, page_size, num_heads_kv)" if paged else
                     "(batch, seqlen_k, num_heads_kv)")
        if paged:
            delta = delta[page_table.long().clamp(0, max(delta.shape[0] - 1, 0))].flatten(1, 2)
        # (fp32, or fp64 for fp64 queries: the bias dtypes the cache call takes)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        x = (alpha.to(acc).transpose(1, 2).unsqueeze(-1)  # (B, H, Sq, 1) x (B, H, 1, Sk)
             * delta.to(acc).repeat_interleave(heads // delta.shape[-1], dim=2).transpose(1, 2).unsqueeze(2))
        bias = scale * (torch.nn.functional.logsigmoid(x) if gate_fn == "logsigmoid" else x)
    try:
        return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=page_table,
                                      mask=mask, bias=bias, causal=causal, scale=scale, return_lse=True)
    except (ValueError, TypeError) as err:  # the cache call's checks, in this module's argument names
        message = str(err)
        if not any(message.startswith(ours + ":") for ours in _CACHE_NAMES):
            raise
        raise type(err)(_CACHE_NAME_WORDS.sub(lambda m: _CACHE_NAMES[m.group(0)], message)) from None


# attention_with_kvcache's argument names -> flash-sparse-attn's, for the errors its checks raise.
_CACHE_NAMES = {"cache_seqlens": "seqused_k", "block_table": "page_table", "k_cache": "key", "v_cache": "value",
                "q": "query"}
_CACHE_NAME_WORDS = re.compile(r"\b(" + "|".join(_CACHE_NAMES) + r")\b(?!\.)")


# ---------------------------------------------------------------------------------------------
# flash-sparse-attn's public functions
# ---------------------------------------------------------------------------------------------

_T = Optional[Tensor]
_TileMN = Optional[Tuple[int, int]]


def flash_dense_attn_func(
    query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False, softmax_scale: Optional[float] = None,
    query_scale: _T = None, key_scale: _T = None, value_scale: _T = None, window_sizes: _T = None,
    is_local: bool = False, is_quant: bool = False, is_split_kv: bool = False, is_split_qo: bool = False,
    pack_gqa: bool = False, num_splits: Optional[int] = None, page_table: _T = None, seqused_k: _T = None,
    out: _T = None, lse: _T = None, is_autotune: bool = True, tile_mn: _TileMN = None, skip_checks: bool = False,
    return_lse: bool = False,
) -> Result:
    """Attention of query (B, Sq, H, D) over key / value (B, Sk, Hkv, D): `dmattn.attention`.
    Returns out like query, and with return_lse the float32 lse (B, H, Sq). window_sizes /
    is_local: windows with sinks (module docstring). page_table / seqused_k: forward only.
    Tuning arguments are ignored; fp8 raises NotImplementedError."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    return _batched(query, key, value, None, None, "logsigmoid", is_causal, softmax_scale, window_sizes, is_local,
                    page_table, seqused_k, out, lse, return_lse)


def flash_dense_attn_with_kvcache_func(
    query: Tensor, key: Tensor, value: Tensor, softmax_scale: Optional[float] = None, query_scale: _T = None,
    key_scale: _T = None, value_scale: _T = None, window_sizes: _T = None, is_local: bool = False,
    is_quant: bool = False, num_splits: Optional[int] = None, page_table: _T = None, gather_kv_indices: _T = None,
    seqused_k: _T = None, out: _T = None, lse: _T = None, is_autotune: bool = True, tile_mn: _TileMN = None,
    skip_checks: bool = False, return_lse: bool = False,
) -> Result:
    """One decoding query per row, query (B, H, D), over a cache key / value (B, Sk, Hkv, D), or
    pages (num_pages, page_size, Hkv, D) with page_table (B, max_pages); the first seqused_k[b]
    keys of row b (all Sk without it): `dmattn.attention_with_kvcache`. Returns out (B, H, D),
    and with return_lse lse (B, H). Inference only. gather_kv_indices, fp8: NotImplementedError."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    return _decode(query, key, value, None, None, "logsigmoid", softmax_scale, window_sizes, is_local, page_table,
                   seqused_k, gather_kv_indices, out, lse, return_lse)


def flash_dense_attn_varlen_func(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, is_causal: bool = False, softmax_scale: Optional[float] = None, query_scale: _T = None,
    key_scale: _T = None, value_scale: _T = None, window_sizes: _T = None, is_local: bool = False,
    is_quant: bool = False, is_split_kv: bool = False, is_split_qo: bool = False, pack_gqa: bool = False,
    num_splits: Optional[int] = None, seqused_q: _T = None, seqused_k: _T = None, out: _T = None, lse: _T = None,
    is_autotune: bool = True, tile_mn: _TileMN = None, skip_checks: bool = False, return_lse: bool = False,
) -> Result:
    """Attention over a packed batch, query (total_q, H, D), key / value (total_k, Hkv, D),
    int32 cu_seqlens_q / cu_seqlens_k (B + 1,): `dmattn.attention_varlen`. Returns out like
    query, and with return_lse lse (H, total_q). seqused_q / seqused_k, fp8: NotImplementedError."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    return _varlen(query, key, value, None, None, "logsigmoid", cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, is_causal, softmax_scale, window_sizes, is_local, seqused_q, seqused_k, out, lse,
                   return_lse)


def flash_dense_attn_varlen_with_kvcache_func(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_k: Tensor, max_seqlen_k: int,
    softmax_scale: Optional[float] = None, query_scale: _T = None, key_scale: _T = None, value_scale: _T = None,
    window_sizes: _T = None, is_local: bool = False, is_quant: bool = False, seqused_k: _T = None,
    gather_kv_indices: _T = None, num_splits: Optional[int] = None, out: _T = None, lse: _T = None,
    is_autotune: bool = True, tile_mn: _TileMN = None, skip_checks: bool = False, return_lse: bool = False,
) -> Result:
    """One decoding query per sequence, query (B, H, D), over packed keys / values (total_k, Hkv,
    D) with cu_seqlens_k (B + 1,) (row b: keys cu_seqlens_k[b] + [0, seqused_k[b] or its length)):
    `dmattn.attention_with_kvcache` on pages of one key. Returns out (B, H, D), and with
    return_lse lse (B, H). Inference only. gather_kv_indices, fp8: NotImplementedError."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    return _decode(query, key, value, None, None, "logsigmoid", softmax_scale, window_sizes, is_local, None,
                   seqused_k, gather_kv_indices, out, lse, return_lse, cu_seqlens_k, max_seqlen_k)


def flash_sparse_attn_func(
    query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False, softmax_scale: Optional[float] = None,
    query_scale: _T = None, key_scale: _T = None, value_scale: _T = None, window_sizes: _T = None,
    softmax_threshold: Optional[float] = None, is_local: bool = False, is_quant: bool = False,
    is_split_kv: bool = False, is_split_qo: bool = False, pack_gqa: bool = False, num_splits: Optional[int] = None,
    page_table: _T = None, seqused_k: _T = None, out: _T = None, lse: _T = None, is_autotune: bool = True,
    tile_mn: _TileMN = None, skip_checks: bool = False, return_lse: bool = False,
) -> Result:
    """`flash_dense_attn_func` with flash-sparse-attn's sparse softmax. Exact: softmax_threshold
    skips nothing in dmattn yet (warned once per process where it would have)."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    _thresholds(softmax_threshold)
    return _batched(query, key, value, None, None, "logsigmoid", is_causal, softmax_scale, window_sizes, is_local,
                    page_table, seqused_k, out, lse, return_lse)


def flash_sparse_attn_with_kvcache_func(
    query: Tensor, key: Tensor, value: Tensor, softmax_scale: Optional[float] = None, query_scale: _T = None,
    key_scale: _T = None, value_scale: _T = None, window_sizes: _T = None,
    softmax_threshold: Optional[float] = None, is_local: bool = False, is_quant: bool = False,
    num_splits: Optional[int] = None, page_table: _T = None, gather_kv_indices: _T = None, seqused_k: _T = None,
    out: _T = None, lse: _T = None, is_autotune: bool = True, tile_mn: _TileMN = None, skip_checks: bool = False,
    return_lse: bool = False,
) -> Result:
    """`flash_dense_attn_with_kvcache_func` with the sparse softmax. Exact: softmax_threshold
    skips nothing in dmattn yet (warned once per process where it would have)."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    _thresholds(softmax_threshold)
    return _decode(query, key, value, None, None, "logsigmoid", softmax_scale, window_sizes, is_local, page_table,
                   seqused_k, gather_kv_indices, out, lse, return_lse)


def flash_sparse_attn_varlen_func(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, is_causal: bool = False, softmax_scale: Optional[float] = None, query_scale: _T = None,
    key_scale: _T = None, value_scale: _T = None, window_sizes: _T = None, softmax_threshold: Optional[float] = None,
    is_local: bool = False, is_quant: bool = False, is_split_kv: bool = False, is_split_qo: bool = False,
    pack_gqa: bool = False, num_splits: Optional[int] = None, seqused_q: _T = None, seqused_k: _T = None,
    out: _T = None, lse: _T = None, is_autotune: bool = True, tile_mn: _TileMN = None, skip_checks: bool = False,
    return_lse: bool = False,
) -> Result:
    """`flash_dense_attn_varlen_func` with the sparse softmax. Exact: softmax_threshold skips
    nothing in dmattn yet (warned once per process where it would have)."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    _thresholds(softmax_threshold)
    return _varlen(query, key, value, None, None, "logsigmoid", cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, is_causal, softmax_scale, window_sizes, is_local, seqused_q, seqused_k, out, lse,
                   return_lse)


def flash_sparse_attn_varlen_with_kvcache_func(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_k: Tensor, max_seqlen_k: int,
    softmax_scale: Optional[float] = None, query_scale: _T = None, key_scale: _T = None, value_scale: _T = None,
    window_sizes: _T = None, softmax_threshold: Optional[float] = None, is_local: bool = False,
    is_quant: bool = False, seqused_k: _T = None, gather_kv_indices: _T = None, num_splits: Optional[int] = None,
    out: _T = None, lse: _T = None, is_autotune: bool = True, tile_mn: _TileMN = None, skip_checks: bool = False,
    return_lse: bool = False,
) -> Result:
    """`flash_dense_attn_varlen_with_kvcache_func` with the sparse softmax. Exact: softmax_threshold
    skips nothing in dmattn yet (warned once per process where it would have)."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    _thresholds(softmax_threshold)
    return _decode(query, key, value, None, None, "logsigmoid", softmax_scale, window_sizes, is_local, None,
                   seqused_k, gather_kv_indices, out, lse, return_lse, cu_seqlens_k, max_seqlen_k)


def flash_gated_attn_func(
    query: Tensor, key: Tensor, value: Tensor, alpha: Tensor, delta: Tensor, is_causal: bool = False,
    softmax_scale: Optional[float] = None, query_scale: _T = None, key_scale: _T = None, value_scale: _T = None,
    window_sizes: _T = None, softmax_threshold: Optional[float] = None, gate_threshold: Optional[float] = None,
    is_logsigmoid_gate: bool = True, is_adapt_gate: bool = True, is_local: bool = False, is_quant: bool = False,
    is_split_kv: bool = False, is_split_qo: bool = False, pack_gqa: bool = False, num_splits: Optional[int] = None,
    page_table: _T = None, seqused_k: _T = None, out: _T = None, lse: _T = None, is_autotune: bool = True,
    tile_mn: _TileMN = None, skip_checks: bool = False, return_lse: bool = False,
) -> Result:
    """Gated attention, alpha (B, Sq, H), delta (B, Sk, Hkv): `dmattn.attention` with
    gate=(alpha, delta) (scores = scale * (q.k + g(alpha_i * delta_j)), g = logsigmoid or identity
    by is_logsigmoid_gate); otherwise as `flash_dense_attn_func`; gradients reach alpha and delta.
    gate_threshold / is_adapt_gate: dmattn's gate skipping (module docstring); softmax_threshold is
    computed exactly (warned once per process)."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    _thresholds(softmax_threshold)
    _require_tensor(alpha, "alpha")
    _require_tensor(delta, "delta")
    return _batched(query, key, value, alpha, delta, _gate_fn(is_logsigmoid_gate), is_causal, softmax_scale,
                    window_sizes, is_local, page_table, seqused_k, out, lse, return_lse, gate_threshold,
                    is_adapt_gate)


def flash_gated_attn_with_kvcache_func(
    query: Tensor, key: Tensor, value: Tensor, alpha: Tensor, delta: Tensor, softmax_scale: Optional[float] = None,
    query_scale: _T = None, key_scale: _T = None, value_scale: _T = None, window_sizes: _T = None,
    softmax_threshold: Optional[float] = None, gate_threshold: Optional[float] = None,
    is_logsigmoid_gate: bool = True, is_local: bool = False, is_quant: bool = False, num_splits: Optional[int] = None,
    page_table: _T = None, gather_kv_indices: _T = None, seqused_k: _T = None, out: _T = None, lse: _T = None,
    is_autotune: bool = True, tile_mn: _TileMN = None, skip_checks: bool = False, return_lse: bool = False,
) -> Result:
    """`flash_dense_attn_with_kvcache_func` gated: alpha (B, H), delta (B, Sk, Hkv) or, paged,
    (num_pages, page_size, Hkv); the gate reaches attention_with_kvcache as an fp32 bias.
    softmax_threshold / gate_threshold are computed exactly here (warned once per process)."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    _thresholds(softmax_threshold, gate_threshold)
    _require_tensor(alpha, "alpha")
    _require_tensor(delta, "delta")
    return _decode(query, key, value, alpha, delta, _gate_fn(is_logsigmoid_gate), softmax_scale, window_sizes,
                   is_local, page_table, seqused_k, gather_kv_indices, out, lse, return_lse)


def flash_gated_attn_varlen_func(
    query: Tensor, key: Tensor, value: Tensor, alpha: Tensor, delta: Tensor, cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool = False,
    softmax_scale: Optional[float] = None, query_scale: _T = None, key_scale: _T = None, value_scale: _T = None,
    window_sizes: _T = None, softmax_threshold: Optional[float] = None, gate_threshold: Optional[float] = None,
    is_logsigmoid_gate: bool = True, is_adapt_gate: bool = True, is_local: bool = False, is_quant: bool = False,
    is_split_kv: bool = False, is_split_qo: bool = False, pack_gqa: bool = False, num_splits: Optional[int] = None,
    seqused_q: _T = None, seqused_k: _T = None, out: _T = None, lse: _T = None, is_autotune: bool = True,
    tile_mn: _TileMN = None, skip_checks: bool = False, return_lse: bool = False,
) -> Result:
    """`flash_dense_attn_varlen_func` gated: alpha (total_q, H), delta (total_k, Hkv), packed like
    query and key; gradients reach alpha and delta. gate_threshold / is_adapt_gate: dmattn's gate
    skipping; softmax_threshold is computed exactly (warned once per process)."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    _thresholds(softmax_threshold)
    _require_tensor(alpha, "alpha")
    _require_tensor(delta, "delta")
    return _varlen(query, key, value, alpha, delta, _gate_fn(is_logsigmoid_gate), cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, is_causal, softmax_scale, window_sizes, is_local, seqused_q, seqused_k,
                   out, lse, return_lse, gate_threshold, is_adapt_gate)


def flash_gated_attn_varlen_with_kvcache_func(
    query: Tensor, key: Tensor, value: Tensor, alpha: Tensor, delta: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_k: int, softmax_scale: Optional[float] = None, query_scale: _T = None, key_scale: _T = None,
    value_scale: _T = None, window_sizes: _T = None, softmax_threshold: Optional[float] = None,
    gate_threshold: Optional[float] = None, is_logsigmoid_gate: bool = True, is_local: bool = False,
    is_quant: bool = False, seqused_k: _T = None, gather_kv_indices: _T = None, num_splits: Optional[int] = None,
    out: _T = None, lse: _T = None, is_autotune: bool = True, tile_mn: _TileMN = None, skip_checks: bool = False,
    return_lse: bool = False,
) -> Result:
    """`flash_dense_attn_varlen_with_kvcache_func` gated: alpha (B, H), delta (total_k, Hkv); the
    gate reaches attention_with_kvcache as an fp32 bias. softmax_threshold / gate_threshold are
    computed exactly here (warned once per process)."""
    _no_fp8(is_quant, query_scale, key_scale, value_scale)
    _thresholds(softmax_threshold, gate_threshold)
    _require_tensor(alpha, "alpha")
    _require_tensor(delta, "delta")
    return _decode(query, key, value, alpha, delta, _gate_fn(is_logsigmoid_gate), softmax_scale, window_sizes,
                   is_local, None, seqused_k, gather_kv_indices, out, lse, return_lse, cu_seqlens_k, max_seqlen_k)
