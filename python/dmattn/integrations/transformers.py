"""dmattn as a Hugging Face transformers attention implementation.

    import dmattn
    from transformers import AutoModelForCausalLM
    dmattn.integrations.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(model_name, attn_implementation="dmattn")

transformers is imported only inside register(); importing dmattn never needs it. register()
installs three pieces under the name:
* the attention function below (AttentionInterface);
* dmattn's mask function (hf_mask.py, AttentionMaskInterface): for a plain causal pattern it
  hands over None (no padding) or the 2D padding mask (B, Sk) instead of a 4D mask, and sdpa's
  4D bool mask for every other pattern (sliding window, chunked, packed sequences, static
  cache slots, bidirectional, ...);
* the Doge hook (doge.py): DogeAttention runs dmattn.attention_topk(per_query=True) on its
  per-key dt_states instead of building a (B, H, Sq, Sk) dynamic mask.

What the attention function accepts (HF layout (B, H, S, D), GQA through the k/v head count):
* attention_mask: None; a 4D bool mask (True = attend), used as the mask without expansion; a
  4D float additive mask (0 where allowed, finfo.min or -inf where not, any other value a bias),
  used as an additive bias with values <= finfo.min / 2 made -inf (= masked), decided without
  reading it on the host; each (B, 1 or H, Sq, Sk); or a 2D padding mask (B, Sk) (nonzero =
  attend) with causal: the real tokens run packed through dmattn.attention_varlen
  (padding.py; padded query rows as the dense key-masked call gives them: after the last token
  the whole sequence, before the first token 0), or, for one query per row (a decoding step), with
  keep_window_size, a bias that has a query dimension, or under torch.compile (packing reads
  the lengths on the host), it is a key mask (B, 1, 1, Sk) on the dense path.
* kwargs: is_causal, softcap, attention_bias (an additive, learnable bias broadcastable to
  (B, H, Sq, Sk)) and keep_window_size (keep only that many keys per row, selected from
  attention_bias by dmattn.dynamic_mask, as flash-dmattn's integration does).

A decoding step (no gradient to record, at most decode_kernel.AUTO_MAX_ROWS query rows per kv
head, on CUDA; eager, or compiled as transformers compiles a StaticCache's steps) runs on the split-KV
decode kernels (decode.decode_step, docs/decode.md): the same attention, the cache read in place.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..decode import decode_step
from ..interface import attention
from ..masks import bias_over_keys, dynamic_mask, host_reads_allowed
from .hf_common import _cuda_dtypes
from .padding import key_side_bias, padded_attention

__all__ = ["register", "attention_forward"]

_INSTALL_HINT = ("dmattn.integrations.transformers.register() needs Hugging Face transformers: "
                 "pip install transformers")


def register(name: str = "dmattn") -> None:
    """Registers dmattn under ``name`` with transformers' AttentionInterface, dmattn's mask
    function (hf_mask.compact_causal_mask) with AttentionMaskInterface, and the Doge hook
    (doge.py: DogeAttention on dmattn.attention_topk(per_query=True) for that name)."""
    try:
        from transformers import AttentionInterface
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers before masking_utils: masks are built per model
        return
    from . import doge, hf_mask

    # transformers builds masks only for implementations its mask registry knows and passes
    # attention_mask=None to any other, which would silently drop padding. dmattn's mask
    # function gives the compact form (None or the 2D padding mask) for plain causal patterns
    # and sdpa's 4D bool mask for every other pattern.
    AttentionMaskInterface.register(name, hf_mask.compact_causal_mask)
    doge.install(name)


# ---------------------------------------------------------------------------------------------
# Inputs: dtypes and masks
# ---------------------------------------------------------------------------------------------


def _is_paged_cache(cache) -> bool:
    if cache is None:
        return False
    try:
        from transformers.generation.continuous_batching import PagedAttentionCache
    except ImportError:
        return False
    return isinstance(cache, PagedAttentionCache)


def _float_mask_bias(mask: Tensor) -> Tensor:
    """A float additive mask as dmattn's additive bias, decided without reading its values on
    the host (no synchronization, no graph break): values at or below finfo.min / 2 (HF uses
    finfo.min, some code -inf, and sums of them saturate there) become -inf, which dmattn
    treats as masked (docs/semantics.md, "Masked positions and empty rows"): those positions
    never contribute and a row with no other key gives 0, as with a bool mask. Every other
    value is added to the scores as is, and gradients flow back to it."""
    return mask.masked_fill(mask <= torch.finfo(mask.dtype).min / 2, float("-inf"))


def _split_attention_mask(attention_mask, num_keys: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """HF's attention_mask as (bool mask or None, additive bias or None) for dmattn, never
    expanded."""
    if attention_mask is None:
        return None, None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a torch.Tensor or None, got "
                        f"{type(attention_mask).__name__} (flex_attention BlockMasks are not supported)")
    if attention_mask.dim() == 2:  # padding mask (B, Sk), nonzero = attend
        keys = attention_mask[:, :num_keys]
        keys = keys if keys.dtype == torch.bool else keys != 0
        return keys[:, None, None, :], None
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask: expected a 2D padding mask (B, Sk) or a 4D mask "
                         f"(B, 1 or H, Sq, Sk), got shape {tuple(attention_mask.shape)}")
    mask = attention_mask[..., :num_keys]  # HF may hand a mask longer than the keys (as eager)
    if mask.dtype == torch.bool:
        return mask, None
    if mask.dtype.is_floating_point:
        return None, _float_mask_bias(mask)
    raise TypeError(f"attention_mask: expected a bool or floating-point 4D mask, got dtype {mask.dtype}")


def _add_biases(attention_bias: Optional[Tensor], additive: Optional[Tensor]) -> Optional[Tensor]:
    if additive is None:
        return attention_bias
    return additive if attention_bias is None else attention_bias + additive


def _bias_for(bias: Optional[Tensor], q_dtype: torch.dtype) -> Optional[Tensor]:
    # dmattn takes a bias in q's dtype or fp32 (fp32 keeps a learnable bias's precision).
    if bias is None or bias.dtype in (q_dtype, torch.float32):
        return bias
    return bias.to(q_dtype)


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers attention function: query (B, H, Sq, D), key/value (B, Hkv, Sk, D).

    Returns (attn_output (B, Sq, H, D), None): like sdpa and FlashAttention, no weights.
    """
    if dropout and getattr(module, "training", False):
        raise NotImplementedError(f"dropout: dmattn has no attention dropout, got {dropout} in "
                                  "training mode; set the model's attention_dropout to 0")
    for unsupported in ("s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"{unsupported}: not supported by the dmattn attention function")
    if _is_paged_cache(kwargs.get("cache")):
        raise NotImplementedError("cache: continuous batching (PagedAttentionCache) is not supported "
                                  "by the dmattn attention function")

    dtypes = _cuda_dtypes(module, query)
    if dtypes is not None:
        query, key, value = (x.to(dtypes[0]) for x in (query, key, value))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D) views
    num_queries, num_keys = q.shape[1], k.shape[1]

    mask, additive = _split_attention_mask(attention_mask, num_keys)
    bias = _add_biases(kwargs.get("attention_bias"), additive)

    # As HF's sdpa / FlashAttention integrations: the kwarg wins over the module's flag. A 4D
    # mask already holds the causal pattern (and may deliberately differ from it), so causal
    # applies only without one: with no mask, or with a 2D padding mask (FlashAttention's case).
    is_causal = kwargs.get("is_causal")
    is_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = is_causal and (attention_mask is None or attention_mask.dim() == 2)
    if causal and attention_mask is None and 1 < num_queries < num_keys:
        # HF's sdpa mask function returns None for a prefill into an empty static cache and
        # relies on top-left causal alignment; the keys past Sq are empty cache slots.
        # dmattn aligns bottom-right, so drop them as HF's sdpa integration does.
        k, v = k[:, :num_queries], v[:, :num_queries]
        if bias is not None and bias.dim() >= 1 and bias.shape[-1] == num_keys:
            bias = bias[..., :num_queries]
        num_keys = num_queries

    keep = kwargs.get("keep_window_size")
    if keep is not None and bias is None:
        raise ValueError("keep_window_size: needs attention_bias, the bias the kept keys are selected by")
    selects = keep is not None and not (isinstance(keep, int) and keep >= num_keys)
    if selects:
        # (keep >= Sk keeps every key: no selection, no extra mask.) dynamic_mask checks keep.
        mask = dynamic_mask(bias_over_keys(bias, num_keys), keep, mask)

    softcap = kwargs.get("softcap")
    softcap = 0.0 if softcap is None else softcap
    bias = _bias_for(bias, q.dtype)
    padding_2d = attention_mask is not None and attention_mask.dim() == 2
    # Packing needs the real lengths on the host (two synchronizations), which torch.compile
    # cannot trace without a graph break and a CUDA graph's capture does not allow: there the key
    # mask runs on the dense path instead (the same values on every row).
    # A decode step (one query per row) stays dense with the key mask: the one query of every row
    # is real and no lengths are read on the host.
    packs = padding_2d and not selects and num_queries > 1 and host_reads_allowed(q)
    if packs and (bias is None or key_side_bias(bias, q.shape[0], num_keys) is not None):
        # Only the real tokens are computed (FlashAttention's unpad / pad).
        out = padded_attention(q, k, v, mask[:, 0, 0, :], bias, causal=causal, scale=scaling, softcap=softcap)
    else:
        # A decoding step without gradients (a few query rows per kv head against the cache)
        # runs on the split-KV decode kernel (docs/decode.md), anything else on dmattn.attention.
        out = decode_step(q, k, v, mask, bias, causal, scaling, softcap)
        if out is None:
            out = attention(q, k, v, mask, bias, causal=causal, scale=scaling, softcap=softcap)
    if dtypes is not None:
        out = out.to(dtypes[1])
    return out, None
