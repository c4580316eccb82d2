"""Padded batches as packed variable-length batches: a 2D padding mask (B, Sk) (True = a real
token) turns q/k/v in (B, S, H, D) layout into dmattn.attention_varlen's packed layout, and the
packed output back into (B, Sq, H, D). Padded query rows get what the dense key-masked call
gives them, which is what the static cache's 4D mask gives on the dense path (so a model's
dynamic and static caches agree on every row) and what transformers' sdpa attention gives: a
padded row after a sequence's last token sees every token of it, as under eager too (causal or
not; right padding: a generation step after a right-padded prompt reads the last such row's
output), one before its first token sees none and gives 0 (left padding; eager averages the
values of every key slot there, see docs/semantics.md). Those after the last token cost their
count times the sequence's tokens (a second packed call, without a causal mask); left padding
costs no work at all (the dense path with a key mask still computes the padded queries and the
key blocks that hold both padding and tokens).

Which query rows are real, for Sq query rows against Sk keys (as HF's FlashAttention
integration decides):
* Sq == Sk (training, prefill): the mask's own rows;
* Sq == 1 (decoding): every sequence's single query;
* otherwise (chunked prefill against a cache): the last Sq columns of the mask.
Causal and window then apply per sequence, bottom-right aligned with its own lengths, which is
the dense semantics (query at absolute position p sees keys up to p) whenever the padding of each
sequence is contiguous (left or right padding).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..interface import attention_varlen

__all__ = ["Unpadded", "unpad_rows", "key_side_bias", "padded_attention"]


class Unpadded(NamedTuple):
    """Rows kept from a (B, S) grid: their flat indices into B * S, cu_seqlens, longest length."""
    indices: Tensor
    cu_seqlens: Tensor
    max_seqlen: int


def unpad_rows(real: Tensor) -> Unpadded:
    """real: bool (B, S). One host synchronization (the longest length; nonzero's count)."""
    lengths = real.sum(dim=-1, dtype=torch.int32)
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    indices = torch.nonzero(real.reshape(-1), as_tuple=False).reshape(-1)
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    return Unpadded(indices, cu_seqlens, max_seqlen)


def _query_rows(key_real: Tensor, num_queries: int) -> Tensor:
    batch, num_keys = key_real.shape
    if num_queries == num_keys:
        return key_real
    if num_queries == 1:
        return torch.ones(batch, 1, dtype=torch.bool, device=key_real.device)
    return key_real[:, -num_queries:]


def key_side_bias(bias: Tensor, batch: int, num_keys: int) -> Optional[Tensor]:
    """A bias without a query dimension, (1 or B, Hb, 1, Sk), as a (Hb, B * Sk) view over the
    flattened key grid (gather it with the key indices to get attention_varlen's (Hb, total_k)).
    None for any other shape (the caller keeps the dense path)."""
    if bias.dim() != 4 or bias.shape[2] != 1 or bias.shape[0] not in (1, batch) or bias.shape[3] != num_keys:
        return None
    heads = bias.shape[1]
    return bias[:, :, 0, :].expand(batch, heads, num_keys).permute(1, 0, 2).reshape(heads, batch * num_keys)


def padded_attention(q: Tensor, k: Tensor, v: Tensor, key_real: Tensor, bias: Optional[Tensor] = None,
                     **varlen_kwargs) -> Tensor:
    """dmattn.attention_varlen over the real rows of a padded batch.

    q (B, Sq, H, D), k / v (B, Sk, Hkv, D), key_real bool (B, Sk) (each sequence's tokens
    contiguous), bias None or (1 or B, Hb, 1, Sk) (see key_side_bias). Returns out (B, Sq, H,
    D), equal on every row to the dense call with the key mask: the padded query rows after a
    sequence's last token (without causal: all its padded rows) attend to all of its tokens,
    those before its first token are 0 (see the module's docstring; with a window in
    varlen_kwargs, every padded row is 0). Gradients flow to q, k, v and bias.
    """
    batch, num_queries, heads, head_dim = q.shape
    num_keys = k.shape[1]
    real_q = _query_rows(key_real, num_queries)
    rows_q = unpad_rows(real_q)
    rows_k = unpad_rows(key_real)
    q_rows = q.reshape(batch * num_queries, heads, head_dim)
    q_packed = q_rows.index_select(0, rows_q.indices)
    k_packed = k.reshape(batch * num_keys, *k.shape[2:]).index_select(0, rows_k.indices)
    v_packed = v.reshape(batch * num_keys, *v.shape[2:]).index_select(0, rows_k.indices)
    bias_packed = None
    if bias is not None:
        flat = key_side_bias(bias, batch, num_keys)
        if flat is None:
            raise ValueError(f"bias: expected a bias without a query dimension (1 or B, Hb, 1, Sk) "
                             f"for a padded batch, got shape {tuple(bias.shape)}")
        bias_packed = flat.index_select(1, rows_k.indices)
    out_packed = attention_varlen(q_packed, k_packed, v_packed, rows_q.cu_seqlens, rows_k.cu_seqlens,
                                  rows_q.max_seqlen, rows_k.max_seqlen, bias=bias_packed, **varlen_kwargs)
    out = out_packed.new_zeros(batch * num_queries, heads, head_dim)
    out = out.index_copy(0, rows_q.indices, out_packed)
    late = _late_padded_rows(key_real, real_q, varlen_kwargs)
    if late is not None:
        # Every token of the sequence lies before these rows: one call without a causal mask.
        rows_l = unpad_rows(late)
        if rows_l.indices.numel() > 0:
            q_late = q_rows.index_select(0, rows_l.indices)
            kwargs = {name: value for name, value in varlen_kwargs.items() if name != "causal"}
            out_late = attention_varlen(q_late, k_packed, v_packed, rows_l.cu_seqlens, rows_k.cu_seqlens,
                                        rows_l.max_seqlen, rows_k.max_seqlen, bias=bias_packed, **kwargs)
            out = out.index_copy(0, rows_l.indices, out_late)
    return out.reshape(batch, num_queries, heads, head_dim)


def _late_padded_rows(key_real: Tensor, real_q: Tensor, varlen_kwargs: dict) -> Optional[Tensor]:
    """bool (B, Sq): the padded query rows (not real_q, _query_rows's) that see every token of
    their sequence -- under causal those after its last token (query row r at key column
    Sk - Sq + r, as _query_rows places it), without it every padded row of a sequence with
    tokens; None where there are none to compute (one query per row, always real; a window,
    which would see part of the tokens)."""
    num_keys, num_queries = key_real.shape[1], real_q.shape[1]
    window = varlen_kwargs.get("window", (-1, -1))
    if num_queries == 1 or num_queries > num_keys or num_keys == 0 or tuple(window) != (-1, -1):
        return None
    columns = torch.arange(1, num_keys + 1, device=key_real.device)
    end = (key_real * columns).amax(dim=-1, keepdim=True)  # one past the last token; 0: no token
    late = ~real_q & (end > 0)
    if varlen_kwargs.get("causal", False):
        late &= columns[None, num_keys - num_queries:] > end  # (column + 1 > end: column >= end)
    return late
