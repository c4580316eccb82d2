"""The decode path (docs/decode.md): short query lengths against long keys, on the split-KV
CUDA kernel, and ``attention_with_kvcache`` (FlashAttention's KV-cache call).

``dmattn::fwd`` takes the decode kernel, with DMATTN_DECODE=1, for ``Sq * (H / Hkv) <=
AUTO_MAX_ROWS`` (``maybe_decode_forward``); ``dmattn::fwd_kvcache`` is the cache call's custom
op. Neither reads a tensor value on the host: the split count comes from the shapes and the GPU
only, and the split-KV workspace is allocated here with torch (caching allocator, CUDA graphs).
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._lib import lib

__all__ = ["attention_with_kvcache", "kvcache_forward", "maybe_decode_forward", "AUTO_MAX_ROWS",
           "KVCACHE_MAX_ROWS"]

# With DMATTN_DECODE=1, dmattn.attention takes the decode kernel on CUDA for up to this many
# query rows (queries x query heads per kv head: one 16-row tile), where it is 2.5x faster than
# the general kernels (docs/decode.md). Off by default: its results differ from the general
# kernels' in the last bits, so a packed batch (attention_varlen) would no longer equal its
# sequences run one by one bit for bit (the varlen contract).
AUTO_MAX_ROWS = 16
# attention_with_kvcache takes the kernel up to this many rows (it reads per-batch lengths and
# pages in place); above it the cache is gathered and masked with torch ops, which cost less
# there than several row chunks each reading every key.
KVCACHE_MAX_ROWS = 16


@functools.lru_cache(maxsize=4096)
def _splits(device_index: int, batch: int, seqlen_q: int, heads: int, heads_kv: int, head_dim: int,
            seqlen_k: int, max_rows: int) -> int:
    return int(lib().decode_splits("cuda", device_index, batch, seqlen_q, heads, heads_kv, head_dim,
                                   seqlen_k, max_rows))


def _decode_splits(q: Tensor, heads_kv: int, seqlen_k: int, max_rows: int) -> int:
    """Key splits of the decode kernel for q (B, Sq, H, D) on CUDA, 0 where it does not apply."""
    if q.device.type != "cuda" or q.dim() != 4 or q.dtype not in (torch.float16, torch.bfloat16):
        return 0
    batch, seqlen_q, heads, head_dim = q.shape
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _splits(index, batch, seqlen_q, heads, heads_kv, head_dim, seqlen_k, max_rows)


def _run_decode(q, k, v, mask, bias, causal, window_left, window_right, scale, softcap, seqlens,
                block_table, splits) -> Tuple[Tensor, Tensor]:
    from .ops import _cuda_layout, _scale_arg

    batch, seqlen_q, heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    workspace = None
    if splits > 1:
        workspace = torch.empty(splits * batch * heads * seqlen_q * (head_dim + 1), dtype=torch.float32,
                                device=q.device)
    q = _cuda_layout(q)
    lib().forward_decode(q, k, v, out, lse, mask, bias, causal, window_left, window_right, _scale_arg(scale),
                         softcap, seqlens, block_table, workspace, splits)
    return out, lse


def maybe_decode_forward(q, k, v, mask, bias, causal, window_left, window_right, scale,
                         softcap) -> Optional[Tuple[Tensor, Tensor]]:
    """(out, lse) from the decode kernel when dmattn::fwd should take it (CUDA, short Sq), else None."""
    if os.environ.get("DMATTN_DECODE", "0") != "1" or k.dim() != 4 or q.dim() != 4:
        return None
    splits = _decode_splits(q, k.shape[2], k.shape[1], AUTO_MAX_ROWS)
    if splits == 0:
        return None
    return _run_decode(q, k, v, mask, bias, causal, window_left, window_right, scale, softcap, None, None,
                       splits)


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache
# ---------------------------------------------------------------------------------------------


def _gathered_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens: Tensor,
                    block_table: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """(k, v, valid): the caches as (B, Sk, Hkv, D) with zeros at positions >= the row's length
    (so that a NaN left there cannot reach the result), and valid bool (B, Sk)."""
    if block_table is not None:
        pages = block_table.long().clamp(0, max(k_cache.shape[0] - 1, 0))
        k_cache, v_cache = (c[pages].flatten(1, 2) for c in (k_cache, v_cache))
    positions = torch.arange(k_cache.shape[1], device=q.device)
    valid = positions.view(1, -1) < seqlens.view(-1, 1).long()
    keep = valid.view(*valid.shape, 1, 1)
    zero = torch.zeros((), dtype=k_cache.dtype, device=q.device)
    return torch.where(keep, k_cache, zero), torch.where(keep, v_cache, zero), valid


def _composed_forward(q, k_cache, v_cache, seqlens, block_table, mask, bias, causal, window_left,
                      window_right, scale, softcap) -> Tuple[Tensor, Tensor]:
    """The cache call on dmattn::fwd: the keys gathered into one (B, Sk, Hkv, D) tensor and the
    per-row lengths, causal and window folded into one (B, 1, Sq, Sk) mask. Torch ops only (no
    host synchronization); the CPU backend and the CUDA rows beyond KVCACHE_MAX_ROWS."""
    from .ops import attention_forward

    seqlen_q = q.shape[1]
    k, v, valid = _gathered_cache(q, k_cache, v_cache, seqlens, block_table)
    positions = torch.arange(k.shape[1], device=q.device).view(1, 1, -1)
    diag = (torch.arange(seqlen_q, device=q.device).view(1, -1, 1)
            + (seqlens.long() - seqlen_q).view(-1, 1, 1))  # the key aligned with each query
    allowed = valid.unsqueeze(1)
    right = 0 if causal else window_right
    if right >= 0:
        allowed = allowed & (positions <= diag + right)
    if window_left >= 0:
        allowed = allowed & (positions >= diag - window_left)
    allowed = allowed.unsqueeze(1)  # (B, 1, Sq, Sk)
    if mask is not None:
        allowed = allowed & mask
    if bias is not None:  # a NaN behind a row's length must not reach it either
        bias = bias.masked_fill(~valid.view(valid.shape[0], 1, 1, -1), 0)
    return attention_forward(q, k, v, allowed, bias, False, -1, -1, scale, softcap, False)


@torch.library.custom_op("dmattn::fwd_kvcache", mutates_args=())
def kvcache_forward(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens: Tensor, block_table: Optional[Tensor],
                    mask: Optional[Tensor], bias: Optional[Tensor], causal: bool, window_left: int,
                    window_right: int, scale: Optional[float], softcap: float) -> Tuple[Tensor, Tensor]:
    """(out, lse) of q against the first seqlens[b] keys of each row of the cache (contiguous
    (B, Sk, Hkv, D), or pages (num_blocks, page_size, Hkv, D) with block_table); causal and window
    aligned with seqlens[b]. Reads the cache only (the append happens before)."""
    from .ops import check_devices

    check_devices(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, block_table=block_table,
                  mask=mask, bias=bias)
    seqlen_k = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    splits = _decode_splits(q, k_cache.shape[2], seqlen_k, KVCACHE_MAX_ROWS)
    if splits > 0:
        return _run_decode(q, k_cache, v_cache, mask, bias, causal, window_left, window_right, scale, softcap,
                           seqlens, block_table, splits)
    return _composed_forward(q, k_cache, v_cache, seqlens, block_table, mask, bias, causal, window_left,
                             window_right, scale, softcap)


@kvcache_forward.register_fake
def _(q, k_cache, v_cache, seqlens, block_table, mask, bias, causal, window_left, window_right, scale, softcap):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=lse_dtype)


def _no_gradient(ctx, grad_out, grad_lse):
    raise NotImplementedError("attention_with_kvcache: inference only, it has no gradient; use dmattn.attention "
                              "(with the cached keys as k, v) to train")


kvcache_forward.register_autograd(_no_gradient)


def _append(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, cache_seqlens: Tensor,
            block_table: Optional[Tensor]) -> None:
    """Writes k, v (B, Sn, Hkv, D) at positions cache_seqlens[b] + [0, Sn) of each row, in place."""
    batch, new = k.shape[0], k.shape[1]
    positions = cache_seqlens.long().view(-1, 1) + torch.arange(new, device=k.device).view(1, -1)
    if block_table is not None:
        page_size = k_cache.shape[1]
        rows = block_table.long().gather(1, positions // page_size)
        slots = positions % page_size
    else:
        rows = torch.arange(batch, device=k.device).view(-1, 1).expand(batch, new)
        slots = positions
    k_cache[rows, slots] = k
    v_cache[rows, slots] = v
