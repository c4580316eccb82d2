"""dmattn.distributed's public functions: ring_attention, shard_sequence, unshard_sequence.

Every argument is checked here, before any communication, so that invalid inputs (which every
rank passes alike) raise the same error on every rank instead of leaving peers waiting.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..interface import _parse_options, _parse_window
from ..masks import check_keep
from .._op_utils import check_devices
from . import layout as lay
from .allgather import allgather_attention
from .comm import GatherSequence, RingExchange, all_gather_sequence, resolve_group
from .ring import Operand, RingAttention, RingSpec

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence"]

KV_EXCHANGES = ("ring", "allgather")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _require_tensor(x, name: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _require_tensor(x, name)
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor (batch, S_local, heads, head_dim), "
                             f"got shape {tuple(x.shape)}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name}: expected float16, bfloat16, float32 or float64, got {x.dtype}")
    check_devices(q=q, k=k, v=v)
    for x, name in ((k, "k"), (v, "v")):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {x.device}")
    batch, local_len, heads, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k: expected (batch, S_local, heads_kv, head_dim) with batch {batch} and head_dim "
                         f"{head_dim} like q, got shape {tuple(k.shape)}")
    if k.shape[1] != local_len:
        raise ValueError(f"k: every rank holds the same S_local positions of q, k and v (S = world_size * "
                         f"S_local); q has S_local = {local_len}, k has {k.shape[1]}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[2] == 0 or heads % k.shape[2]:
        raise ValueError(f"k: its heads ({k.shape[2]}) must divide q's heads ({heads}) (GQA)")


def _operand(x, name: str, q: Tensor, heads_kv: int, world_size: int) -> Optional[Operand]:
    """Checks a mask / bias and says how it is laid out (ring.Operand)."""
    if x is None:
        return None
    _require_tensor(x, name)
    if name == "mask" and x.dtype != torch.bool:
        raise TypeError(f"mask: expected dtype torch.bool (True = may attend), got {x.dtype}")
    if name == "bias" and x.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"bias: expected q's dtype {q.dtype} or float32, got {x.dtype}")
    if x.device != q.device:
        raise ValueError(f"{name}: expected q's device {q.device}, got {x.device}")
    batch, local_len, heads, _ = q.shape
    total = world_size * local_len
    layouts = (f"key-side (B|1, H|Hkv|1, 1, S_local) = (1 or {batch}, 1 / {heads_kv} / {heads}, 1, "
               f"{local_len}), travelling with this rank's keys; or this rank's query rows x the global keys "
               f"(B|1, H|Hkv|1, S_local|1, S|1) with S = world_size * S_local = {total}")
    if x.dim() > 4:
        raise ValueError(f"{name}: expected rank <= 4, {layouts}; got shape {tuple(x.shape)}")
    b, h, sq, sk = (1,) * (4 - x.dim()) + tuple(x.shape)
    if b not in (1, batch) or h not in (1, heads_kv, heads):
        raise ValueError(f"{name}: its batch / heads dims must be 1 or B = {batch} / 1, Hkv = {heads_kv} or "
                         f"H = {heads}; got shape {tuple(x.shape)}")
    if sk == local_len and sq == 1:
        return Operand("key", False, False)
    if sk in (total, 1) and sq in (local_len, 1):
        return Operand("global", sq == local_len and local_len != 1, sk == total and total != 1)
    raise ValueError(f"{name}: expected {layouts}; got shape {tuple(x.shape)}")


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *,
    group=None,
    causal: bool = False,
    layout: str = "zigzag",
    kv_exchange: str = "ring",
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    keep: Optional[int] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Context-parallel attention: ``dmattn.attention`` over a sequence spread across the ranks of
    ``group`` (None: the default group), each rank holding S_local positions of q, k, v in
    ``layout`` (``shard_sequence``). Returns this rank's rows of the output (and of lse).

    q: (B, S_local, H, D); k, v: (B, S_local, Hkv, D); the same shapes on every rank.
    mask (bool) / bias: key-side (B|1, H|Hkv|1, 1, S_local): this rank's keys (travels with
        them); or (B|1, H|Hkv|1, S_local|1, S|1): this rank's query rows (local order) x the keys
        of the whole sequence in global order. dbias comes back in the bias's shape.
    causal: over global positions. layout: "zigzag" (balanced causal work; S_local even) or
        "contiguous". kv_exchange: "ring" (K/V blocks travel, transfers overlap compute) or
        "allgather" (K/V gathered once; better with few kv heads).
    keep: Doge's per-query causal top-k (``attention_topk(..., causal=True, per_query=True)``):
        needs a key-side bias, causal=True and kv_exchange="allgather".
    window: only (-1, -1). Other arguments as in ``dmattn.attention``. docs/semantics.md,
    "Context parallelism".
    """
    _check_qkv(q, k, v)
    lay.check_layout(layout)
    if not isinstance(kv_exchange, str) or kv_exchange not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange: expected 'ring' or 'allgather', got {kv_exchange!r}")
    if _parse_window(window) != (-1, -1):
        raise ValueError(f"window: ring_attention does not support a sliding window (got {tuple(window)}); "
                         f"pass (-1, -1)")
    _, _, scale, softcap = _parse_options((-1, -1), scale, softcap)
    causal, deterministic = bool(causal), bool(deterministic)
    group, world_size, rank = resolve_group(group)
    lay._check_local_len(q.shape[1], layout, name="q")
    heads_kv = k.shape[2]
    bias_op = _operand(bias, "bias", q, heads_kv, world_size)
    mask_op = _operand(mask, "mask", q, heads_kv, world_size)
    if keep is not None:
        keep = check_keep(keep)
        if bias is None:
            raise ValueError("keep: the per-query top-k selects by the bias; pass a key-side bias "
                             "(B|1, H|Hkv|1, 1, S_local)")
        if bias_op.kind != "key" or (mask_op is not None and mask_op.kind != "key"):
            name = "bias" if bias_op.kind != "key" else "mask"
            raise ValueError(f"{name}: keep (per-query top-k) needs a key-side {name} (B|1, H|Hkv|1, 1, "
                             f"S_local), got shape {tuple((bias if name == 'bias' else mask).shape)}")
        if not causal:
            raise ValueError("causal: keep (Doge's per-query top-k) is causal; pass causal=True")
        if kv_exchange != "allgather":
            raise ValueError("kv_exchange: keep (per-query top-k) needs every key a query sees for its "
                             "selection; pass kv_exchange='allgather'")

    if q.shape[1] == 0:  # nothing to attend on any rank (the shapes are the same everywhere)
        out = q * 0
        lse = torch.full((q.shape[0], q.shape[2], 0), float("-inf"), dtype=torch.float64
                         if q.dtype == torch.float64 else torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # (as dmattn.attention)
    if kv_exchange == "allgather":
        out, lse = allgather_attention(q, k, v, bias, mask, bias_op=bias_op, mask_op=mask_op, group=group,
                                       world_size=world_size, rank=rank, layout=layout, causal=causal,
                                       scale=scale, softcap=softcap, deterministic=deterministic, keep=keep)
    else:
        spec = RingSpec(
            comm=RingExchange(group, world_size, rank) if world_size > 1 else None,
            plan=lay.ring_plan(layout, world_size, rank, q.shape[1], causal),
            world_size=world_size, local_len=q.shape[1], layout=layout, scale=scale, softcap=softcap,
            deterministic=deterministic, bias=bias_op, mask=mask_op)
        out, lse = RingAttention.apply(q, k, v, bias, mask, spec)
    return (out, lse) if return_lse else out


def shard_sequence(x: Tensor, dim: int = 1, *, group=None, layout: str = "zigzag") -> Tensor:
    """This rank's rows of ``x`` (the whole sequence, in global order along ``dim``, the same on
    every rank) in ``layout``: what ring_attention expects of q, k, v, a key-side bias
    (dim=-1) or the query rows of a full bias (dim=-2)."""
    lay.check_layout(layout)
    _, world_size, rank = resolve_group(group)
    return lay.shard_local(x, dim, world_size, rank, layout)


def unshard_sequence(x: Tensor, dim: int = 1, *, group=None, layout: str = "zigzag") -> Tensor:
    """The whole sequence in global order from every rank's rows ``x`` along ``dim`` (an
    all-gather; the same shapes on every rank). Differentiable: the gradient of the result
    flows back to each rank's rows, summed over the ranks."""
    _require_tensor(x, "x")
    lay.check_layout(layout)
    group, world_size, _ = resolve_group(group)
    dim = lay._seq_dim(x, dim, "x")
    if layout == "zigzag":
        lay._check_local_len(x.shape[dim], layout, name="x")
    if x.requires_grad and torch.is_grad_enabled():
        return GatherSequence.apply(x, dim, group, world_size, layout)
    return all_gather_sequence(x, dim, group, world_size, layout)
