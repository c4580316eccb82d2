"""Per-query causal top-k (Doge's selection): for query i, the ``keep`` keys with the largest
per-key score among the keys i may see (causal, bottom-right aligned, and the key mask applied
before the selection).

Key j is kept by query i iff j is visible to i and fewer than ``keep`` visible keys beat it
(a larger score, or an equal score and a lower index). Visibility only grows with i, so the
rank of j among the visible keys never decreases and the queries that keep j form one
interval. In terms of the visible prefix v = i + Sk - Sq of a query, key j is kept for
v in [j, end_j): ``interval_ends`` computes end_j for every key in O(S log S) work and O(S)
memory per row (a sort, one streaming pass, a binary search per key), and the attention then
runs on it (per_query_path.py). ``per_query_mask`` is the dense O(Sq * Sk) form, the exact
reference. See docs/semantics.md, "Per-query causal top-k".
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .masks import cached_index_tensor, dynamic_mask, nan_as_inf, selection_key
from .ops import (_call_op, interval_ends_of_sorted, native_interval_ends_available, native_selection_key,
                  prefix_thresholds)

# Score dtypes whose selection key the CUDA glue computes (dmattn::selection_key).
_NATIVE_KEY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

__all__ = ["per_query_mask", "visible_keys", "selection_ranks", "interval_ends"]


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


def _arange(num_keys: int, dtype: torch.dtype, device) -> Tensor:
    return cached_index_tensor(("arange", num_keys, dtype, device),
                               lambda: torch.arange(num_keys, dtype=dtype, device=device))


def selection_ranks(scores: Tensor, allowed: Optional[Tensor]) -> tuple:
    """(ranks, order), int32 (..., Sk) each: the rank of every key in the selection order of
    dynamic_mask (larger score first, ties by the lower index; -0.0 == 0.0), Sk for keys that
    ``allowed`` excludes, and the key at each rank of an allowed key (Sk at the ranks after
    them, which the excluded keys take)."""
    num_keys = scores.shape[-1]
    key = selection_key(scores, allowed)
    if key is not None:  # distinct integers: one sort
        order = key.argsort(dim=-1, descending=True)
    else:  # float64: by score (stable: ties keep the index order), then allowed keys first
        order = nan_as_inf(scores).argsort(dim=-1, descending=True, stable=True)
        if allowed is not None:
            excluded_first = (~allowed).gather(-1, order)
            order = order.gather(-1, excluded_first.to(torch.int8).argsort(dim=-1, stable=True))
    positions = _arange(num_keys, torch.int32, scores.device).expand(order.shape)
    ranks = torch.empty(order.shape, dtype=torch.int32, device=scores.device).scatter_(-1, order, positions)
    if allowed is not None:
        ranks = ranks.masked_fill(~allowed, num_keys)
        order = order.masked_fill(~allowed.gather(-1, order), num_keys)
    return ranks, order.to(torch.int32)


def interval_ends(scores: Tensor, allowed: Optional[Tensor], keep: int) -> Tensor:
    """int32 (..., Sk): per key j of each row of ``scores`` (..., Sk) (keys ``allowed`` excludes
    are never kept), the end of the interval of visible prefixes [j, end_j) that keep it (end_j
    = j: never kept, Sk: kept to the end). O(Sk) memory per row, no host synchronization."""
    shape, num_keys = scores.shape, scores.shape[-1]
    if scores.is_cuda and scores.dtype in _NATIVE_KEY_DTYPES and native_interval_ends_available():
        # CUDA: the key (one kernel), the sort, then one native call (three kernels)
        rows_allowed = None if allowed is None else allowed.reshape(-1, num_keys).contiguous()
        key = _call_op(native_selection_key, scores.reshape(-1, num_keys).contiguous(), rows_allowed)
        order = key.argsort(dim=-1, descending=True)
        return _call_op(interval_ends_of_sorted, order, rows_allowed, keep).view(shape)
    ranks, order = selection_ranks(scores, allowed)
    ranks, order = ranks.reshape(-1, num_keys), order.reshape(-1, num_keys)
    thresholds = _call_op(prefix_thresholds, ranks, order, keep)  # non-increasing along each row
    # The first prefix whose threshold falls below j's rank; before j, j is not visible yet.
    first_drop = torch.searchsorted(thresholds.neg(), ranks.neg(), right=True, out_int32=True)
    index = _arange(num_keys, torch.int32, scores.device)
    ends = torch.maximum(first_drop, index)
    ends = torch.where(ranks < num_keys, ends, index)  # never selectable: never kept
    return ends.view(shape)
