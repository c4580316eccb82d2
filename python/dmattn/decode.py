"""The decode path's ops (docs/decode.md): ``attention_with_kvcache``'s custom op
``dmattn::fwd_kvcache`` (FlashAttention's KV-cache call) and a model's decoding step on it
(``decode_step``, the transformers integration's). The cache is read in place by the split-KV
decode kernel (decode_kernel.py) up to KVCACHE_MAX_ROWS query rows, and gathered and masked
onto ``dmattn::fwd`` (ops.py) beyond, or on the CPU. Nothing here reads a tensor value on the
host.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._op_utils import _aligned_rows, _cuda_layout, _plain_eager, check_devices, records_no_gradient
from .decode_kernel import (AUTO_MAX_ROWS, KVCACHE_MAX_ROWS, _decode_splits, _run_decode, decode_rows_fit,
                            direct_decode_splits)
from .ops import attention_forward

__all__ = ["kvcache_forward", "kvcache_attention", "cache_attention", "decode_step"]


def decode_step(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor], causal: bool,
                scale: Optional[float], softcap: float) -> Optional[Tensor]:
    """dmattn.attention(q, k, v, mask, bias, causal=causal, scale=scale, softcap=softcap) on the
    decode kernel, for an inference call of at most AUTO_MAX_ROWS query rows on CUDA (a
    decoding step of a model: the transformers integration, eager or under torch.compile); None
    where that does not apply (the caller then runs dmattn.attention). Same semantics (causal
    bottom-right aligned: the cache call with every key of the row); results equal to
    floating-point summation order."""
    compiling = torch.compiler.is_compiling()
    if not compiling and not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        return None
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        return None
    if k.dtype != q.dtype or v.dtype != q.dtype or k.shape[1] == 0 or not decode_rows_fit(q, k.shape[2], AUTO_MAX_ROWS):
        return None
    if not compiling:
        # Eager, plain CUDA tensors, nothing to record: the op body's native call, without its
        # layers (the direct routes' tests: docs/decode.md, "Host time"; a model's every layer
        # pays them once a step). Every key of every row: no per-row lengths.
        splits = direct_decode_splits(q, k, v, (mask, bias), KVCACHE_MAX_ROWS)
        if splits:
            out, _ = _run_decode(q, _aligned_rows(k), _aligned_rows(v), mask, bias, bool(causal), -1, -1, scale,
                                 float(softcap), None, None, splits, want_lse=False, cache_call=True)
            return out
    if not records_no_gradient(q, k, v, bias):
        return None
    args = (q, k, v, None, None, mask, bias, bool(causal), -1, -1, scale, float(softcap))
    # Traced: the op; eager: its body directly, without the lse.
    out, _ = kvcache_forward(*args) if compiling else cache_attention(args, want_lse=False)
    return out


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
    seqlen_q = q.shape[1]
    k, v, valid = _gathered_cache(q, k_cache, v_cache, seqlens, block_table)
    positions = torch.arange(k.shape[1], device=q.device).view(1, 1, -1)
    diag = (torch.arange(seqlen_q, device=q.device).view(1, -1, 1)
            + (seqlens.long() - seqlen_q).view(-1, 1, 1))  # the key aligned with each query
    allowed = valid.unsqueeze(1)
    # (a bound that reaches every key -- the right one past the last query's offset, the left one
    # past the cache -- bounds nothing and is left out: near int64's largest value the sums below
    # overflowed)
    right = 0 if causal else window_right
    if 0 <= right < seqlen_q:
        allowed = allowed & (positions <= diag + right)
    if 0 <= window_left < k.shape[1]:
        allowed = allowed & (positions >= diag - window_left)
    allowed = allowed.unsqueeze(1)  # (B, 1, Sq, Sk)
    if mask is not None:
        allowed = allowed & mask
    if bias is not None:  # a NaN behind a row's length must not reach it either
        bias = bias.masked_fill(~valid.view(valid.shape[0], 1, 1, -1), 0)
    return attention_forward(q, k, v, allowed, bias, False, -1, -1, scale, softcap, False)


def kvcache_attention(q, k_cache, v_cache, seqlens, block_table, mask, bias, causal, window_left, window_right,
                      scale, softcap, want_lse: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """The body of the op kvcache_forward (same arguments); lse None where not want_lse and the
    decode kernel runs."""
    check_devices(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, block_table=block_table,
                  mask=mask, bias=bias)
    seqlen_k = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    splits = _decode_splits(q, k_cache.shape[2], seqlen_k, KVCACHE_MAX_ROWS)
    if splits > 0:
        if block_table is None:  # (a cache whose rows the kernel cannot copy in 16-byte chunks is copied)
            k_cache, v_cache = _cuda_layout(k_cache), _cuda_layout(v_cache)
        # (cache_call as on the direct route, attention_with_kvcache's: the same form, so the same bits)
        return _run_decode(q, k_cache, v_cache, mask, bias, causal, window_left, window_right, scale, softcap,
                           seqlens, block_table, splits, want_lse, cache_call=True)
    if seqlens is None:
        seqlens = torch.full((q.shape[0],), seqlen_k, dtype=torch.int32, device=q.device)
    return _composed_forward(q, k_cache, v_cache, seqlens, block_table, mask, bias, causal, window_left,
                             window_right, scale, softcap)


@torch.library.custom_op("dmattn::fwd_kvcache", mutates_args=())
def kvcache_forward(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens: Optional[Tensor],
                    block_table: Optional[Tensor], mask: Optional[Tensor], bias: Optional[Tensor], causal: bool,
                    window_left: int, window_right: int, scale: Optional[float],
                    softcap: float) -> Tuple[Tensor, Tensor]:
    """(out, lse) of q against the first seqlens[b] keys of each row of the cache (contiguous
    (B, Sk, Hkv, D), or pages (num_blocks, page_size, Hkv, D) with block_table; seqlens None:
    all Sk keys of every row); causal and window aligned with seqlens[b]. Reads the cache only
    (the append happens before)."""
    return kvcache_attention(q, k_cache, v_cache, seqlens, block_table, mask, bias, causal, window_left,
                             window_right, scale, softcap)


def cache_attention(args: tuple, want_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """kvcache_forward(*args) without gradient to record: its body directly where _plain_eager
    allows (the dispatcher's Python layers cost host time; lse None unless want_lse), else the op."""
    return kvcache_attention(*args, want_lse=want_lse) if _plain_eager(args) else kvcache_forward(*args)


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
