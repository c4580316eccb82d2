"""dmattn: fast, numerically safe attention with dynamic masks and learnable biases.

    import dmattn
    out = dmattn.attention(q, k, v, mask=mask, bias=bias, causal=True)
    out = dmattn.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, mask=key_mask, bias=key_bias, causal=True)

flash-sparse-attn 2.0's API (dense, sparse and gated attention, their varlen and KV-cache
forms) on dmattn: ``from dmattn import flash_sparse_attn``.

See README.md and docs/semantics.md.
"""

from . import flash_sparse_attn  # the drop-in: torch and dmattn only (no triton, no flash-sparse-attn)
from . import integrations  # cheap: transformers is imported only by register()
from ._lib import cuda_available, persistent_kernels
from .interface import attention, attention_varlen, flash_dmattn_func
from .kvcache import attention_with_kvcache
from .masks import dynamic_mask
from .topk import attention_topk

__version__ = "0.1.0"

__all__ = ["attention", "attention_topk", "attention_varlen", "attention_with_kvcache", "dynamic_mask",
           "flash_dmattn_func", "flash_sparse_attn",
           "cuda_available", "persistent_kernels", "integrations", "__version__"]
