"""transformers' Doge attention on dmattn.attention_topk(per_query=True): no 4D mask at all.

HF's DogeAttention builds a float (B, Hkv, Sq, Sk) mask (dt_states where a key is among the
``keep_window_size`` largest that the query may see, finfo.min elsewhere), repeats it to H heads
and hands it to the attention function. That selection is exactly dmattn's per-query causal
top-k of the per-key bias dt_states (B, Hkv, 1, Sk) among the keys each query sees (causal,
bottom-right aligned, and the key padding mask, applied before the selection), so
``install()`` (called by dmattn.integrations.transformers.register()) wraps
DogeAttention.forward: when ``config._attn_implementation`` is a name registered by dmattn and
the layer's mask is in compact form (None or a 2D padding mask (B, Sk), which dmattn's mask
function, hf_mask.py, returns for plain causal patterns), it runs HF's projections, norms,
rotary embedding, cache update and dt_states unchanged, then

    dmattn.attention_topk(q, k, v, dt_states[:, :, None, :], keep_window_size,
                          mask=<key padding mask (B, 1, 1, Sk) or None>, causal=True,
                          per_query=True, scale=module.scaling)

with q / k / v as (B, S, H, D) views of HF's layout. No (B, H, Sq, Sk) or (B, 1, Sq, Sk)
tensor is built here and nothing is read on the host.

Any other mask (a 4D mask: a sliding window -- config.sliding_window --, packed sequences, a
custom 4D mask, a static cache's empty slots) is not an interval pattern: HF's original forward
runs (with a one-time warning), its float mask then goes through the attention function as an
additive bias. Any other attention implementation runs HF's forward untouched.

Differences from HF's own path, on rows HF does not discard: none beyond floating-point
summation order. Ties between equal dt_states go to the lower key index (torch.topk leaves
them unspecified). Fully padded query rows (no visible key) give 0 where eager averages.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..topk import attention_topk
from .hf_common import DOGE_NAMES, _cuda_dtypes

try:
    from transformers.models.doge import modeling_doge
except ImportError:  # a transformers without Doge: nothing to hook
    modeling_doge = None

__all__ = ["install"]

_HOOK_FLAG = "_dmattn_doge_hook"
_warned = False


def install(name: str) -> None:
    """Wraps DogeAttention.forward once; ``name`` is a dmattn attention implementation name."""
    if modeling_doge is None:
        return  # (before adding the name: runs_compact reads a name there as "the hook is installed")
    DOGE_NAMES.add(name)
    cls = modeling_doge.DogeAttention
    if getattr(cls.forward, _HOOK_FLAG, False):
        return
    original = cls.forward

    @functools.wraps(original)
    def forward(self, hidden_states, position_embeddings, attention_mask=None, *args, **kwargs):
        if self.config._attn_implementation not in DOGE_NAMES:
            return original(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        if attention_mask is not None and (not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2):
            _warn_fallback(attention_mask)
            return original(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        return _topk_forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)

    setattr(forward, _HOOK_FLAG, True)
    forward._dmattn_original = original
    cls.forward = forward


def _warn_fallback(attention_mask) -> None:
    global _warned
    # (Not while torch.compile traces: a warning would break the graph, a fullgraph trace fails.)
    if _warned or torch.compiler.is_compiling():
        return
    _warned = True
    shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
    warnings.warn(
        f"dmattn: a Doge layer got a mask that is not plain causal + padding ({shape}: a sliding window, "
        "packed sequences, a static cache or a custom 4D mask); running transformers' DogeAttention with "
        "its dense (B, H, Sq, Sk) dynamic mask instead of dmattn.attention_topk(per_query=True). "
        "(Shown once.)", stacklevel=3)


def _pop_cache(args, kwargs):
    # The cache's keyword is `cache` in recent transformers, `past_key_values` before.
    if args:
        return args[0]
    cache = kwargs.pop("cache", None)
    legacy = kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy


def _key_mask(attention_mask: Optional[Tensor], num_keys: int) -> Optional[Tensor]:
    """The 2D padding mask (B, >= Sk) as dmattn's key mask (B, 1, 1, Sk), bool."""
    if attention_mask is None:
        return None
    if attention_mask.shape[-1] < num_keys:
        raise ValueError(f"attention_mask: a 2D padding mask must cover the {num_keys} keys, got shape "
                         f"{tuple(attention_mask.shape)}")
    keys = attention_mask[:, :num_keys]
    keys = keys if keys.dtype == torch.bool else keys != 0
    return keys[:, None, None, :]


def _topk_forward(self, hidden_states: Tensor, position_embeddings, attention_mask: Optional[Tensor],
                  *args, **kwargs):
    if self.training and self.attention_dropout:
        raise NotImplementedError(f"dropout: dmattn has no attention dropout, got {self.attention_dropout} in "
                                  "training mode; set the model's attention_dropout to 0")
    cache = _pop_cache(args, kwargs)
    # HF's DogeAttention.forward up to the attention call, unchanged.
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = modeling_doge.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    dt_states = self.dt_proj(value_states.transpose(1, 2).reshape(value_states.shape[0], value_states.shape[-2], -1))
    dt_states = torch.exp(self.A * F.softplus(dt_states)).transpose(-1, -2)  # (B, Hkv, Sk)

    num_queries, num_keys = query_states.shape[2], key_states.shape[2]
    if attention_mask is None and 1 < num_queries < num_keys:
        # Only sdpa's mask function returns None here (a prefill into an empty static cache,
        # top-left causal): the keys past Sq are empty slots, as in the attention function.
        key_states, value_states = key_states[:, :, :num_queries], value_states[:, :, :num_queries]
        dt_states = dt_states[..., :num_queries]
        num_keys = num_queries

    dtypes = _cuda_dtypes(self, query_states)
    if dtypes is not None:
        query_states, key_states, value_states = (x.to(dtypes[0]) for x in (query_states, key_states, value_states))
    # (B, S, H, D) views (no generator: a decoding step's every layer runs this)
    q, k, v = query_states.transpose(1, 2), key_states.transpose(1, 2), value_states.transpose(1, 2)
    out = attention_topk(q, k, v, dt_states[:, :, None, :], self.keep_window_size,
                         mask=_key_mask(attention_mask, num_keys), causal=True, per_query=True,
                         scale=self.scaling)
    if dtypes is not None:
        out = out.to(dtypes[1])
    attn_output = self.o_proj(out.reshape(*input_shape, -1).contiguous())
    return attn_output, None
