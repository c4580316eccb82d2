"""Per-query causal top-k (Doge's selection): for query i, the ``keep`` keys with the largest
per-key score among the keys i may see (causal, bottom-right aligned, and the key mask applied
before the selection).

Key j is kept by query i iff j is visible to i and fewer than ``keep`` visible keys beat it
(a larger score, or an equal score and a lower index). Visibility only grows with i, so the
rank of j among the visible keys never decreases and the queries that keep j form one interval
[j + Sq - Sk, end_j) (in query indices). This module holds:

* ``per_query_mask``: the selection as a dense bool (B, H, Sq, Sk) mask, the exact reference
  (O(Sq * Sk) memory), used where no faster path applies;
* the interval ends (``interval_ends``) that the O(S) path runs on (per_query_path.py).

See docs/semantics.md, "Per-query causal top-k".
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .masks import dynamic_mask

__all__ = ["per_query_mask", "visible_keys"]


def visible_keys(num_queries: int, num_keys: int, device) -> Tensor:
    """bool (Sq, Sk): key j visible to query i under causal, bottom-right aligned
    (j <= i + Sk - Sq)."""
    i = torch.arange(num_queries, device=device).unsqueeze(1)
    j = torch.arange(num_keys, device=device)
    return j <= i + (num_keys - num_queries)


def per_query_mask(bias: Tensor, keep: int, mask: Optional[Tensor], num_queries: int) -> Tensor:
    """The per-query causal top-``keep`` selection of a key-side ``bias`` (..., 1, Sk) as a bool
    (..., Sq, Sk) mask: causal and ``mask`` (key-side, broadcastable) restrict the candidates
    before the selection. Ties: the lower key index. O(Sq * Sk) memory."""
    num_keys = bias.shape[-1]
    visible = visible_keys(num_queries, num_keys, bias.device)
    allowed = visible if mask is None else mask & visible
    return dynamic_mask(bias, keep, allowed)
