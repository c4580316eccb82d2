"""The split-KV decode kernel's calls (docs/decode.md): short query lengths against long keys.

``dmattn::fwd`` takes the decode kernels for ``Sq * (H / Hkv) <= AUTO_MAX_ROWS``
(``maybe_decode_forward``, called by ops.py), and ``dmattn::fwd_varlen`` for the sequences of a
packed batch with that few rows (``varlen_decode_forward``), each with the kernel and splits of
its own dense call, so that a packed batch still equals its sequences run one by one, bit for
bit; DMATTN_DECODE=0 turns both off. attention_with_kvcache's op (decode.py) and
attention_topk's decoding step (topk.py, ``gathered_decode``) call the kernels too. No call
reads a tensor value on the host: the split count comes from the shapes and the GPU only, and
the split-KV workspace is allocated here with torch (caching allocator, CUDA graphs).

Below ops.py: it imports only the library and the per-call checks of _op_utils.py.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._lib import check_cuda_index, lib
from ._op_utils import _aligned_rows, _cuda_layout, _is_compiling, _no_dispatch_layers, _scale_arg

__all__ = ["maybe_decode_forward", "fwd_decode_splits", "direct_decode_splits", "varlen_decode_splits", "varlen_decode_forward", "decode_enabled",
           "decode_rows_fit", "gathered_decode", "gathered_decode_splits", "native_allocates", "AUTO_MAX_ROWS",
           "KVCACHE_MAX_ROWS", "KERNEL_DTYPES"]

# dmattn.attention and attention_varlen take the decode kernels on CUDA for (sequences of) up to
# this many query rows (queries x query heads per kv head: one 16-row tile, or one 64-row chunk),
# where they are 1.4x to 6x faster than the general kernels (docs/decode.md); the transformers
# integration's decoding steps too. (The native kDecodePackedMaxRows.)
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
    if not q.is_cuda or q.dim() != 4 or q.dtype not in KERNEL_DTYPES:
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
    """(out, lse) of the decode kernel with ``splits`` key splits (the count the heuristic
    picks for two CTAs an SM; on Hopper the narrow kernel reads two of them a CTA where the GPU
    stays full: docs/decode.md, "Two splits a CTA"); lse None unless want_lse.
    cache_call: attention_with_kvcache's call (both its routes): the native validation names k
    and v "k_cache" and "v_cache", and the call may take the balanced form (docs/decode.md,
    "Balanced shares"), where native_allocates() (otherwise the split form, on both routes
    alike). key_positions: indexed keys (gathered_decode)."""
    q = _aligned_rows(q)  # (splits > 0: the decode kernels' shapes)
    # (new_empty / empty_like: a few microseconds less host time each than torch.empty with a
    # shape, dtype and device to parse.)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32) if want_lse else None
    if native_allocates():  # out and the workspace allocated by the native call
        out = lib().decode_attention(q, k, v, lse, mask, bias, causal, window_left, window_right,
                                     _scale_arg(scale), softcap, seqlens, block_table, splits, cache_call,
                                     key_positions)
        return out, lse
    batch, seqlen_q, heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
    workspace = None
    if splits > 1:
        workspace = q.new_empty((splits * batch * heads * seqlen_q * (head_dim + 1),), dtype=torch.float32)
    lib().forward_decode(q, k, v, out, lse, mask, bias, causal, window_left, window_right, _scale_arg(scale),
                         softcap, seqlens, block_table, workspace, splits, key_positions)
    return out, lse


def direct_decode_splits(q, k, v, operands: tuple, max_rows: int, pages: int = 1) -> int:
    """The split count of a call that may go straight to the native decode call (the direct
    routes of dmattn.attention and attention_with_kvcache, docs/decode.md "Host time"), or 0:
    eager (not traced, no dispatch mode, transform or profiler), plain CUDA tensors q, k, v
    (B, S, H, D) and ``operands`` (the call's other tensors, None where absent), 16-bit q, torch
    lending its allocator, no gradient to record, and shapes the decode kernels take (up to
    max_rows query rows a kv head, k.shape[1] * pages keys: pages of a paged cache). The native
    call then validates every tensor. (One pass of inline tests: a decoding step runs this per
    layer, and every function call and lookup is host time that the GPU waits for.)"""
    if _is_compiling():  # (traced: the op, whose body picks the kernel at run time)
        return 0
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and q.is_cuda and k.is_cuda
            and v.is_cuda and q.dim() == 4 and k.dim() == 4):
        return 0
    grad = torch.is_grad_enabled()  # (records_no_gradient's rule, inline)
    if grad and (q.requires_grad or k.requires_grad or v.requires_grad):
        return 0
    for t in operands:
        if t is not None and not (type(t) is Tensor and t.is_cuda and not (grad and t.requires_grad)):
            return 0
    if q.dtype not in KERNEL_DTYPES or not native_allocates():
        return 0
    device = q.get_device()
    batch, seqlen_q, heads, head_dim = q.shape
    key_shape = k.shape
    splits = _splits(device, batch, seqlen_q, heads, key_shape[2], head_dim, key_shape[1] * pages, max_rows)
    if not splits or not _no_dispatch_layers():
        return 0
    check_cuda_index(device)
    return splits


def decode_enabled() -> bool:
    """Whether dmattn::fwd and dmattn::fwd_varlen take the decode kernels for short queries (on
    unless DMATTN_DECODE=0, which keeps them on the general kernels, for comparison)."""
    return os.environ.get("DMATTN_DECODE", "1") != "0"


def fwd_decode_splits(q: Tensor, k: Tensor) -> int:
    """The key splits with which dmattn::fwd's body takes the decode kernel for q (B, Sq, H, D)
    against k (B, Sk, Hkv, D) (CUDA, short Sq), 0 where it takes the general kernels."""
    if not decode_enabled() or k.dim() != 4 or q.dim() != 4:
        return 0
    return _decode_splits(q, k.shape[2], k.shape[1], AUTO_MAX_ROWS)


def maybe_decode_forward(q, k, v, mask, bias, causal, window_left, window_right, scale,
                         softcap) -> Optional[Tuple[Tensor, Tensor]]:
    """(out, lse) from the decode kernel when dmattn::fwd should take it (CUDA, short Sq), else None."""
    splits = fwd_decode_splits(q, k)
    if splits == 0:
        return None
    return _run_decode(q, _cuda_layout(k), _cuda_layout(v), mask, bias, causal, window_left, window_right, scale,
                       softcap, None, None, splits)


@functools.lru_cache(maxsize=4096)
def _packed_splits(device_index: int, heads: int, heads_kv: int, head_dim: int, max_seqlen_q: int,
                   max_seqlen_k: int) -> int:
    return int(lib().decode_packed_splits(device_index, heads, heads_kv, head_dim, max_seqlen_q, max_seqlen_k))


def varlen_decode_splits(q: Tensor, heads_kv: int, max_seqlen_q: int, max_seqlen_k: int) -> int:
    """The split count varlen_decode_forward needs for a packed q (total_q, H, D) on CUDA, or 0
    where the decode kernels take none of its sequences (all above AUTO_MAX_ROWS rows, another
    device or dtype, DMATTN_DECODE=0)."""
    if not decode_enabled() or q.device.type != "cuda" or q.dim() != 3 or q.dtype not in KERNEL_DTYPES:
        return 0
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    _, heads, head_dim = q.shape
    return _packed_splits(index, heads, heads_kv, head_dim, max_seqlen_q, max_seqlen_k)


def varlen_decode_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, mask, bias,
                          causal, window_left, window_right, scale, softcap, splits: int) -> None:
    """The rows of out (total_q, H, D) and lse (H, total_q) of the packed sequences of at most
    AUTO_MAX_ROWS query rows, in place, on the decode kernels with ``splits`` (varlen_decode_splits'
    answer, > 0): each sequence with the kernel and the splits of its own dense call (the
    maybe_decode_forward of it alone), so its rows equal that call's bit for bit. The other rows
    are left as they are."""
    total_q, heads, head_dim = q.shape
    workspace = None
    if splits > 1:
        workspace = q.new_empty((splits * heads * total_q * (head_dim + 1),), dtype=torch.float32)
    lib().forward_varlen_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, mask,
                                bias, causal, window_left, window_right, _scale_arg(scale), softcap, workspace,
                                splits)


def decode_rows_fit(q: Tensor, heads_kv: int, max_rows: int) -> bool:
    """Whether q (B, Sq, H, D) on CUDA has the shapes the decode kernels take for up to max_rows
    query rows per kv head (the native decode_splits' shape rules, from shapes alone: traceable
    under torch.compile, where the op body then picks the split count)."""
    if not q.is_cuda or q.dim() != 4 or q.dtype not in KERNEL_DTYPES:
        return False
    _, seqlen_q, heads, head_dim = q.shape
    if heads_kv < 1 or heads % heads_kv or head_dim % 8 or not 8 <= head_dim <= 256:
        return False
    return 1 <= seqlen_q * (heads // heads_kv) <= max_rows


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
