"""dmattn's mask function for transformers (AttentionMaskInterface): the compact form where it is
exact, sdpa's 4D bool mask everywhere else.

transformers' create_causal_mask & co. call the mask function registered for the model's
attention implementation. sdpa's materializes a (B, 1, Sq, Sk) bool mask; for a plain causal
pattern dmattn needs no such tensor, only which keys are padding:

* None: no padding and ``Sq == Sk`` or ``Sq == 1`` (the attention function applies causal,
  bottom-right aligned, which equals HF's causal pattern there);
* the 2D padding mask (B, Sk), bool, True = a real token: otherwise (padding, or a query chunk
  against a cache, Sk > Sq > 1, where a missing mask would read as sdpa's top-left skip).

Compact only when that is the whole pattern: the mask pattern is transformers' own
``causal_mask_function`` (no sliding window, chunking, packed sequences from position ids,
blockwise or user overlays, bidirectional), keys start at position 0 (``kv_offset == 0``), the
queries are the last ``Sq`` keys (``q_offset + Sq == Sk`` with an int offset: a dynamic cache,
not a static cache with empty slots), and the 2D mask, if any, covers the ``Sk`` keys. And the
caller allows a mask that is not materialized (``allow_is_causal_skip``), or it is a Doge
model, whose attention the Doge hook (doge.py) runs from the compact form. Anything else goes
to transformers' ``sdpa_mask`` with the same arguments.

Telling "no padding" from padding reads the mask: one host synchronization per model call (as
sdpa's and FlashAttention's mask functions do); under torch.compile and while a CUDA graph is
captured it is skipped and the 2D mask is returned.

Imported by register() only: it imports transformers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformers.masking_utils import causal_mask_function, sdpa_mask

from ..masks import host_reads_allowed
from .hf_common import runs_compact

__all__ = ["compact_causal_mask"]


def _is_plain_causal(q_length: int, kv_length: int, q_offset, kv_offset, mask_function,
                     attention_mask: Optional[Tensor], allow_skip: bool, config) -> bool:
    if mask_function is not causal_mask_function:
        return False
    if not (allow_skip or runs_compact(config)):
        return False  # the caller post-processes a materialized mask
    # Tensor offsets (static caches) mean empty slots past the queries: not bottom-right.
    if isinstance(q_offset, Tensor) or isinstance(kv_offset, Tensor):
        return False
    if kv_offset != 0 or q_offset + q_length != kv_length:
        return False
    return attention_mask is None or (attention_mask.dim() == 2 and attention_mask.shape[-1] >= kv_length)


def compact_causal_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                        mask_function=causal_mask_function, attention_mask: Optional[Tensor] = None,
                        **kwargs) -> Optional[Tensor]:
    """transformers mask function: None, a 2D padding mask (B, Sk), or sdpa_mask's result (see
    the module docstring for which)."""
    allow_skip = kwargs.get("allow_is_causal_skip", True)
    if not _is_plain_causal(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                            allow_skip, kwargs.get("config")):
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         **kwargs)
    aligned = q_length == 1 or q_length == kv_length  # bottom-right == top-left causal
    if attention_mask is None:
        if aligned:
            return None
        device = kwargs.get("device", "cpu")
        return torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    keys = attention_mask[:, :kv_length]
    keys = keys if keys.dtype == torch.bool else keys != 0
    if aligned and host_reads_allowed(keys) and bool(keys.all()):
        return None
    return keys
