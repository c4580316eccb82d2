"""dmattn.attention_topk: select the top-k keys from the bias and attend, in one call."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import gather, per_query_path
from .interface import attention_on
from .ops import check_devices
from .masks import bias_over_keys, check_keep, dynamic_mask

__all__ = ["attention_topk"]


def attention_topk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    keep: int,
    *,
    mask: Optional[Tensor] = None,
    causal: bool = False,
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    per_query: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention restricted, per row of bias/mask, to the ``keep`` keys with the largest bias.

    Same as ``dmattn.attention(q, k, v, dynamic_mask(bias, keep, mask), bias, ...)``: the
    selection is made on the detached bias among the keys ``mask`` allows (ties: lower key
    index), then causal/window apply on top, so with ``causal=True`` an early query whose
    selected keys all lie in its future attends to nothing (out 0, lse -inf). Gradients
    reach q, k, v and the bias (through the attention; the selection has none).
    Arguments and return values as in ``dmattn.attention``; ``bias`` is required.

    When bias and mask have no query dimension (one key set per (batch, head), e.g. a
    (B, H, 1, Sk) bias), the kernels read only the min(keep, Sk) selected keys of each
    (batch, head) (the gather path, no host synchronization; docs/semantics.md, "Gather
    path") where the backend supports it; otherwise the selection becomes a bool mask for the
    dense kernels. Both give the same results.
    """
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected a torch.Tensor (the selection needs it), got {type(bias).__name__}")
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"k: expected a torch.Tensor, got {type(k).__name__}")
    if k.dim() != 4:
        raise ValueError(f"k: expected rank 4 (B, Sk, Hkv, D), got shape {tuple(k.shape)}")
    check_devices(q=q, k=k, v=v, bias=bias, mask=mask)  # before the selection touches them
    keep = check_keep(keep)
    if per_query and causal:
        return per_query_path.attention_per_query_topk(
            q, k, v, bias, keep, mask, window=window, scale=scale, softcap=softcap,
            deterministic=bool(deterministic), return_lse=return_lse)
    # per_query without causal: every query sees every key, one key set per (batch, head).
    options = dict(causal=causal, window=window, scale=scale, softcap=softcap,
                   deterministic=deterministic, return_lse=return_lse)
    if isinstance(q, torch.Tensor):
        key_set = gather.topk_key_set(q, k, bias, keep, mask, bool(deterministic))
        if key_set is not None:
            return attention_on(q, k, v, None, bias, key_set, **options)
    # Dense path: the selection as a bool mask; the kernels skip the unselected keys.
    num_keys = k.shape[1]
    if keep >= num_keys:
        selected = mask  # every allowed key is kept: no new (possibly broadcast-size) mask
    else:
        selected = dynamic_mask(bias_over_keys(bias, num_keys), keep, mask)
    return attention_on(q, k, v, selected, bias, None, **options)
