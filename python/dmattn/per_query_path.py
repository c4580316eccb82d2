"""dmattn.attention_topk(..., causal=True, per_query=True): the argument checks and the choice
between the O(S) interval path and the dense reference mask (per_query.py)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .gather import _key_side_view
from .interface import _parse_window, attention_on
from .masks import bias_over_keys
from .per_query import per_query_mask

__all__ = ["attention_per_query_topk"]


def _check_key_side(t: Optional[Tensor], name: str, q: Tensor, k: Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    batch, heads, heads_kv, num_keys = q.shape[0], q.shape[2], k.shape[2], k.shape[1]
    if _key_side_view(t, batch, heads, heads_kv, num_keys) is None:
        raise ValueError(
            f"{name}: per_query=True needs a key-side {name} without a query dimension, "
            f"(1 or B, 1 / Hkv / H, 1, Sk) = (1 or {batch}, 1 / {heads_kv} / {heads}, 1, {num_keys}), "
            f"got shape {tuple(t.shape)}")


def attention_per_query_topk(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, keep: int,
                             mask: Optional[Tensor], *, window: Tuple[int, int], scale: Optional[float],
                             softcap: float, deterministic: bool,
                             return_lse: bool) -> Union[Tensor, Tuple[Tensor, Tensor]]:
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
    options = dict(causal=True, window=(-1, -1), scale=scale, softcap=softcap,
                   deterministic=deterministic, return_lse=return_lse)
    num_queries, num_keys = q.shape[1], k.shape[1]
    selected = per_query_mask(bias_over_keys(bias, num_keys), keep, mask, num_queries)
    return attention_on(q, k, v, selected, bias, None, **options)
