"""``dmattn.attention_with_kvcache``: one decoding step against a KV cache, in FlashAttention's
convention (``flash_attn_with_kvcache``), with dmattn's mask and bias. The contract is in
docs/semantics.md ("KV cache"); the kernel in docs/decode.md.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ._op_utils import _aligned_rows, _cuda_layout, records_no_gradient
from .decode import _append, cache_attention, kvcache_forward
from .decode_kernel import KVCACHE_MAX_ROWS, _run_decode, direct_decode_splits
from .interface import _parse_options, _require_tensor
from .masks import check_broadcast

__all__ = ["attention_with_kvcache"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _rank(t: Tensor, name: str, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-D tensor {layout}, got shape {tuple(t.shape)}")


def _same_device(t: Tensor, q: Tensor, name: str) -> None:
    if t.device != q.device:
        raise ValueError(f"{name}: expected a tensor on q's device ({q.device}), got {t.device}")


def _check_operand(t: Optional[Tensor], name: str, full: Tuple[int, int, int, int], heads_kv: int) -> None:
    """mask / bias: rank <= 4, right-aligned, every dim 1 or full (heads also Hkv)."""
    if t is None:
        return
    _require_tensor(t, name)
    check_broadcast(t, name, full, heads_kv, key_axis="key (Sk: the cache's key axis)")


def _check_pages(block_table: Tensor, cache_seqlens: Tensor, new: int, page_size: int, num_blocks: int) -> None:
    """The table entries of the pages each row reads or appends to (its first ceil((cache_seqlens
    + new) / page_size)) name pages of the cache; entries behind them may hold anything."""
    used = (cache_seqlens.long() + new + page_size - 1) // page_size
    entries = block_table[torch.arange(block_table.shape[1]).view(1, -1) < used.view(-1, 1)]
    if entries.numel() and (int(entries.min()) < 0 or int(entries.max()) >= num_blocks):
        raise ValueError(f"block_table: the pages the rows read must lie in [0, {num_blocks}) (k_cache's blocks), "
                         f"got entries in [{int(entries.min())}, {int(entries.max())}]")


def _direct_decode(q, k_cache, v_cache, cache_seqlens, block_table, mask, bias, causal, window, scale, softcap,
                   return_lse):
    """The usual decoding step straight onto the decode kernel: CUDA tensors, no keys to append,
    no gradient to record, eager mode, shapes the kernel takes. The native call then validates
    every tensor, naming it as the checked route below does (whose Python checks are host time
    that the GPU waits for when a step starts from idle), and allocates the outputs. None where
    the call takes the checked route."""
    # (traced: direct_decode_splits says 0 first; the op's body runs at run time)
    if type(cache_seqlens) is not Tensor:  # (an int: the checked route makes the tensor)
        return None
    if block_table is None:
        pages = 1
    elif type(block_table) is Tensor and block_table.dim() == 2:
        pages = block_table.shape[1]
    else:
        return None
    splits = direct_decode_splits(q, k_cache, v_cache, (cache_seqlens, block_table, mask, bias), KVCACHE_MAX_ROWS,
                                  pages)
    if not splits:
        return None
    window_left, window_right, scale, softcap = _parse_options(window, scale, softcap)
    if block_table is None:  # (a cache whose rows the kernel cannot copy in 16-byte chunks is copied)
        k_cache, v_cache = _aligned_rows(k_cache), _aligned_rows(v_cache)
    out, lse = _run_decode(q, k_cache, v_cache, mask, bias, bool(causal), window_left, window_right, scale,
                           softcap, cache_seqlens, block_table, splits, want_lse=return_lse, cache_call=True)
    return (out, lse) if return_lse else out


def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    *,
    cache_seqlens: Union[Tensor, int],
    block_table: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    causal: bool = True,
    window: Sequence[int] = (-1, -1),
    scale: Optional[float] = None,
    softcap: float = 0.0,
    return_lse: bool = False,
):
    """Attention of q (B, Sq, H, D) against the cache rows' first ``cache_seqlens[b]`` keys, after
    appending k, v (B, Sn, Hkv, D), when given, in place at positions ``cache_seqlens[b] + [0, Sn)``.

    The cache is contiguous (B, Sk, Hkv, D), or paged: k_cache / v_cache (num_blocks, page_size,
    Hkv, D) and block_table int32 (B, max_blocks), key j of row b at page
    ``block_table[b, j // page_size]``, row ``j % page_size`` (Sk = max_blocks * page_size).
    cache_seqlens: int32 (B,) or an int. mask / bias broadcast to (B, H, Sq, Sk) over the cache's
    key axis. causal / window are bottom-right aligned with each row's length after the append.
    Keys at positions >= that length are never read into the result. Returns out like q, and
    with return_lse the float32 lse (B, H, Sq). Inference only (no gradient)."""
    if k is None and v is None:
        direct = _direct_decode(q, k_cache, v_cache, cache_seqlens, block_table, mask, bias, causal, window, scale,
                                softcap, return_lse)
        if direct is not None:
            return direct
    for t, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        _require_tensor(t, n)
    _rank(q, "q", 4, "(batch, seqlen_q, num_heads, head_dim)")
    paged = block_table is not None
    cache_layout = "(num_blocks, page_size, num_heads_kv, head_dim)" if paged else \
        "(batch, seqlen_k, num_heads_kv, head_dim)"
    _rank(k_cache, "k_cache", 4, cache_layout)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q: expected float16, bfloat16, float32 or float64, got {q.dtype}")
    for t, n in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.dtype != q.dtype:
            raise TypeError(f"{n}: expected q's dtype {q.dtype}, got {t.dtype}")
        _same_device(t, q, n)
    batch, seqlen_q, heads, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache: expected head_dim {head_dim} like q, got shape {tuple(k_cache.shape)}")
    if heads_kv < 1 or heads % heads_kv:
        raise ValueError(f"k_cache: num_heads_kv ({heads_kv}) must be >= 1 and divide num_heads ({heads})")
    if paged:
        _require_tensor(block_table, "block_table")
        _rank(block_table, "block_table", 2, "(batch, max_blocks)")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table: expected dtype torch.int32, got {block_table.dtype}")
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table: expected {batch} rows (q's batch), got shape {tuple(block_table.shape)}")
        _same_device(block_table, q, "block_table")
        if k_cache.shape[1] < 1:
            raise ValueError(f"k_cache: expected a page size >= 1, got shape {tuple(k_cache.shape)}")
        seqlen_k = block_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache: expected batch {batch} like q, got shape {tuple(k_cache.shape)}")
        seqlen_k = k_cache.shape[1]

    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    _require_tensor(cache_seqlens, "cache_seqlens")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens: expected an int or an int32 tensor, got dtype {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens: expected shape ({batch},) (q's batch), got {tuple(cache_seqlens.shape)}")
    _same_device(cache_seqlens, q, "cache_seqlens")

    new = 0
    if (k is None) != (v is None):
        raise ValueError("k, v: give both new keys and values, or neither")
    if k is not None:
        for t, n in ((k, "k"), (v, "v")):
            _require_tensor(t, n)
            _rank(t, n, 4, "(batch, seqlen_new, num_heads_kv, head_dim)")
            if t.dtype != q.dtype:
                raise TypeError(f"{n}: expected q's dtype {q.dtype}, got {t.dtype}")
            _same_device(t, q, n)
        if k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:] or v.shape != k.shape:
            raise ValueError(f"k, v: expected shape ({batch}, seqlen_new, {heads_kv}, {head_dim}), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        new = k.shape[1]
    if q.device.type == "cpu" and not torch.compiler.is_compiling():  # readable without a device sync
        lo, hi = int(cache_seqlens.min()) if batch else 0, int(cache_seqlens.max()) if batch else 0
        if lo < 0 or hi + new > seqlen_k:
            raise ValueError(f"cache_seqlens: expected 0 <= cache_seqlens and cache_seqlens + seqlen_new ({new}) "
                             f"<= the cache's {seqlen_k} positions, got values in [{lo}, {hi}]")
        if paged:
            _check_pages(block_table, cache_seqlens, new, k_cache.shape[1], k_cache.shape[0])

    full = (batch, heads, seqlen_q, seqlen_k)
    _check_operand(mask, "mask", full, heads_kv)
    _check_operand(bias, "bias", full, heads_kv)
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask: expected dtype torch.bool, got {mask.dtype}")
    window_left, window_right, scale, softcap = _parse_options(window, scale, softcap)

    if new:
        _append(k_cache, v_cache, k, v, cache_seqlens, block_table)
        cache_seqlens = cache_seqlens + new
    args = (q, k_cache, v_cache, cache_seqlens, block_table, mask, bias, bool(causal), window_left, window_right,
            scale, softcap)
    # Without a gradient to record (under no_grad, or tensors without one), the op's body
    # directly where plain eager mode allows (cache_attention). Otherwise the op, whose autograd
    # names the missing gradient.
    if records_no_gradient(q, k_cache, v_cache, bias):
        out, lse = cache_attention(args, want_lse=return_lse)
    else:
        out, lse = kvcache_forward(*args)
    return (out, lse) if return_lse else out
