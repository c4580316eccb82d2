"""What the transformers integration's modules share: the dtypes a CUDA call computes in
(``_cuda_dtypes``, for the attention function and the Doge hook) and which attention
implementation names the Doge hook serves (``DOGE_NAMES``, ``runs_compact``, for the hook and
the mask function).

Below transformers.py, doge.py and hf_mask.py, which import it and not each other (except
register(), in transformers.py, installing the other two). It does not import transformers.
"""

from __future__ import annotations

from typing import Optional, Set, Tuple

import torch
from torch import Tensor

__all__ = ["DOGE_NAMES", "runs_compact"]

# Names under which dmattn's attention function is registered with the Doge hook installed
# (doge.install adds to it, only where transformers has Doge).
DOGE_NAMES: Set[str] = set()


def runs_compact(config) -> bool:
    """Whether the Doge hook runs a model with this config from a compact (None / 2D) mask, i.e.
    it is installed and config is a Doge config (the mask function then returns the compact form
    although Doge asks for a materialized mask)."""
    return (getattr(config, "model_type", None) == "doge"
            and getattr(config, "_attn_implementation", None) in DOGE_NAMES)


def _weight_dtype(module: torch.nn.Module) -> Optional[torch.dtype]:
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            return layer.weight.dtype
    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return None


def _cuda_dtypes(module: torch.nn.Module, query: Tensor) -> Optional[Tuple[torch.dtype, torch.dtype]]:
    """(compute dtype, output dtype) when fp32 q/k/v on CUDA must be cast (the CUDA kernels take
    fp16/bf16 only); None when no cast is needed. fp32 on CPU is computed as is."""
    if not query.is_cuda or query.dtype != torch.float32:
        return None
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return dtype, dtype
    weights = _weight_dtype(module)
    if weights in (torch.bfloat16, torch.float16):
        # fp32 activations around half-precision weights (e.g. layer norms kept in fp32):
        # the output goes back into the module's half-precision projections, as with HF's FA.
        return weights, weights
    # An fp32 model on CUDA: compute in bf16, hand fp32 back to the fp32 projections.
    return torch.bfloat16, torch.float32
