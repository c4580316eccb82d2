"""dmattn.attention_topk: select the top-k keys from the bias and attend, in one call."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .interface import attention
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
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention restricted, per row of bias/mask, to the ``keep`` keys with the largest bias.

    Same as ``dmattn.attention(q, k, v, dynamic_mask(bias, keep, mask), bias, ...)``: the
    selection is made on the detached bias among the keys ``mask`` allows (ties: lower key
    index), then causal/window apply on top, so with ``causal=True`` an early query whose
    selected keys all lie in its future attends to nothing (out 0, lse -inf). Gradients
    reach q, k, v and the bias (through the attention; the selection has none).
    Arguments and return values as in ``dmattn.attention``; ``bias`` is required.
    """
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected a torch.Tensor (the selection needs it), got {type(bias).__name__}")
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"k: expected a torch.Tensor, got {type(k).__name__}")
    if k.dim() != 4:
        raise ValueError(f"k: expected rank 4 (B, Sk, Hkv, D), got shape {tuple(k.shape)}")
    # For now the selection is materialized as a bool mask and the dense kernels skip the
    # unselected keys. A gather path in the kernels (reading only the kept keys) will replace
    # these two lines; the signature and the results of this function stay as they are.
    num_keys = k.shape[1]
    if check_keep(keep) >= num_keys:
        selected = mask  # every allowed key is kept: no new (possibly broadcast-size) mask
    else:
        selected = dynamic_mask(bias_over_keys(bias, num_keys), keep, mask)
    return attention(q, k, v, selected, bias, causal=causal, window=window, scale=scale,
                     softcap=softcap, deterministic=deterministic, return_lse=return_lse)
