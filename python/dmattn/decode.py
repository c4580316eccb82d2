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
from .ops import _cuda_layout, _plain_eager, _scale_arg, attention_forward, check_devices, records_no_gradient

__all__ = ["kvcache_forward", "kvcache_attention", "cache_attention", "maybe_decode_forward", "decode_step",
           "decode_rows_fit", "gathered_decode", "gathered_decode_splits", "native_allocates", "AUTO_MAX_ROWS",
           "KVCACHE_MAX_ROWS", "KERNEL_DTYPES"]

# With DMATTN_DECODE=1, dmattn.attention takes the decode kernels on CUDA for up to this many
# query rows (queries x query heads per kv head: one 16-row tile, or one 64-row chunk), where
# they are 1.4x to 6x faster than the general kernels (docs/decode.md); the transformers
# integration's decoding steps too. Off by default in dmattn.attention: its results differ from
# the general kernels' in the last bits, so a packed batch (attention_varlen) would no longer
# equal its sequences run one by one bit for bit (the varlen contract).
AUTO_MAX_ROWS = 64
# The decode kernels' dtypes.
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# attention_with_kvcache takes the decode kernels up to this many rows (they read per-batch
# lengths and pages in place): one 16-row tile, or 64-row chunks that each read every key once
# (two chunks here, side by side, the second read from L2). Above it the cache is gathered and
# masked with torch ops, which copies the whole cache (docs/decode.md).
KVCACHE_MAX_ROWS = 128


@functools.lru_cache(maxsize=4096)
def _splits(device_index: int, batch: int, seqlen_q: int, heads: int, heads_kv: int, head_dim: int,
            seqlen_k: int, max_rows: int) -> int:
    return int(lib().decode_splits("cuda", device_index, batch, seqlen_q, heads, heads_kv, head_dim,
                                   seqlen_k, max_rows))


def _decode_splits(q: Tensor, heads_kv: int, seqlen_k: int, max_rows: int) -> int:
    """Key splits of the decode kernel for q (B, Sq, H, D) on CUDA, 0 where it does not apply."""
    if q.device.type != "cuda" or q.dim() != 4 or q.dtype not in KERNEL_DTYPES:
        return 0
    batch, seqlen_q, heads, head_dim = q.shape
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _splits(index, batch, seqlen_q, heads, heads_kv, head_dim, seqlen_k, max_rows)


@functools.lru_cache(maxsize=None)
def native_allocates() -> bool:
    """Whether the native decode call can allocate its outputs through torch (tvm-ffi's
    environment allocator, which torch exports to it from 2.10 on); otherwise _run_decode
    allocates them here."""
    return bool(lib().has_env_allocator(torch.empty(0)))


def _run_decode(q, k, v, mask, bias, causal, window_left, window_right, scale, softcap, seqlens,
                block_table, splits, want_lse: bool = True, cache_call: bool = False,
                key_positions: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """(out, lse) of the decode kernel with ``splits`` key splits; lse None unless want_lse.
    cache_call: the native validation names k and v "k_cache" and "v_cache" (only where
    native_allocates(), the one caller that sets it checks that). key_positions: indexed keys
    (gathered_decode)."""
    batch, seqlen_q, heads, head_dim = q.shape
    q = _cuda_layout(q)
    # (new_empty / empty_like: a few microseconds less host time each than torch.empty with a
    # shape, dtype and device to parse.)
    lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32) if want_lse else None
    if native_allocates():  # out and the workspace allocated by the native call
        out = lib().decode_attention(q, k, v, lse, mask, bias, causal, window_left, window_right, _scale_arg(scale),
                                     softcap, seqlens, block_table, splits, cache_call, key_positions)
        return out, lse
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
    workspace = None
    if splits > 1:
        workspace = q.new_empty((splits * batch * heads * seqlen_q * (head_dim + 1),), dtype=torch.float32)
    lib().forward_decode(q, k, v, out, lse, mask, bias, causal, window_left, window_right, _scale_arg(scale),
                         softcap, seqlens, block_table, workspace, splits, key_positions)
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


def decode_rows_fit(q: Tensor, heads_kv: int, max_rows: int) -> bool:
    """Whether q (B, Sq, H, D) on CUDA has the shapes the decode kernels take for up to max_rows
    query rows per kv head (the native decode_splits' shape rules, from shapes alone: traceable
    under torch.compile, where the op body then picks the split count)."""
    if q.device.type != "cuda" or q.dim() != 4 or q.dtype not in KERNEL_DTYPES:
        return False
    _, seqlen_q, heads, head_dim = q.shape
    if heads_kv < 1 or heads % heads_kv or head_dim % 8 or not 8 <= head_dim <= 256:
        return False
    return 1 <= seqlen_q * (heads // heads_kv) <= max_rows


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
    if k.dtype != q.dtype or v.dtype != q.dtype or not records_no_gradient(q, k, v, bias):
        return None
    if k.shape[1] == 0 or not decode_rows_fit(q, k.shape[2], AUTO_MAX_ROWS):
        return None
    # Every key of every row: no per-row lengths (seqlens None).
    args = (q, k, v, None, None, mask, bias, bool(causal), -1, -1, scale, float(softcap))
    # Traced: the op; eager: its body directly, without the lse.
    out, _ = kvcache_forward(*args) if compiling else cache_attention(args, want_lse=False)
    return out


def gathered_decode(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, kept_bias: Tensor, scale: Optional[float],
                    softcap: float, splits: int, want_lse: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
    """(out, lse) of one query per row (q (B, 1, H, D)) against the kept keys of each (batch,
    kv head): ``positions`` int32 (1 or B, 1 or Hkv, K), contiguous, into k, v (B, Sk, Hkv, D),
    with ``kept_bias`` (1 or B, 1 or Hkv, 1, K) their bias; every kept key is visible (the query
    is the last position). On the decode kernel reading the kept rows in place (its indexed
    keys), the H / Hkv query heads of a kv head packed into one tile, so that each kept K / V
    row is read once per kv head, with ``splits`` key splits (gathered_decode_splits' answer,
    > 0). lse None unless want_lse."""
    return _run_decode(q, _cuda_layout(k), _cuda_layout(v), None, kept_bias, False, -1, -1, scale, softcap, None,
                       None, splits, want_lse, key_positions=positions)


def gathered_decode_splits(q: Tensor, k: Tensor, keep: int) -> int:
    """The decode kernel's key splits for one query per row (q (B, 1, H, D)) against `keep`
    kept keys of each (batch, kv head) of k (B, Sk, Hkv, D); 0 where it does not apply."""
    if q.dim() != 4 or q.shape[1] != 1 or keep == 0:
        return 0
    return _decode_splits(q, k.shape[2], keep, KVCACHE_MAX_ROWS)


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
        return _run_decode(q, k_cache, v_cache, mask, bias, causal, window_left, window_right, scale, softcap,
                           seqlens, block_table, splits, want_lse)
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
