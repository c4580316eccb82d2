"""kv_exchange="allgather": K and V (and a key-side bias / mask) are gathered once into global
order, and this rank's queries run against them, one call per query chunk
(layout.allgather_calls): causal over keys [0, chunk end), which bottom-right alignment turns
into exactly "key j <= the query's global position". The backward is autograd's through those
calls (the dmattn::fwd op with its registered backward), and the gathered tensors' gradients go
back to their owners (comm.GatherSequence: all_to_all and a float32 sum in rank order).

With ``keep`` (Doge's per-query causal top-k) each chunk calls
``dmattn.attention_topk(..., causal=True, per_query=True)`` on the same keys: query i keeps the
``keep`` keys with the largest bias among the keys it sees, j <= i, all of which lie in [0, chunk
end), so the selection is exactly the single-process one.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..ops import forward_with_grad
from ..topk import attention_topk
from .comm import GatherSequence, all_gather_sequence
from .layout import allgather_calls
from .ring import Operand, as4d

__all__ = ["allgather_attention"]


def _gather(x: Optional[Tensor], dim: int, group, world_size: int, layout: str) -> Optional[Tensor]:
    if x is None:
        return None
    if x.requires_grad and torch.is_grad_enabled():
        return GatherSequence.apply(x, dim, group, world_size, layout)
    return all_gather_sequence(x, dim, group, world_size, layout)


def _operand(x4: Optional[Tensor], op: Optional[Operand], q_lo: int, q_hi: int, k_end: int) -> Optional[Tensor]:
    """x4: a gathered key-side operand (B|1, Hb, 1, S) or a global one (rows x global keys)."""
    if x4 is None:
        return None
    if op.kind == "global" and op.query_rows:
        x4 = x4[:, :, q_lo:q_hi]
    if op.kind == "key" or op.key_global:
        x4 = x4[..., :k_end]
    return x4


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor], *,
                        bias_op: Optional[Operand], mask_op: Optional[Operand], group, world_size: int,
                        rank: int, layout: str, causal: bool, scale: Optional[float], softcap: float,
                        deterministic: bool, keep: Optional[int]):
    local_len = q.shape[1]
    keys = _gather(k, 1, group, world_size, layout)
    values = _gather(v, 1, group, world_size, layout)
    bias4, mask4 = as4d(bias), as4d(mask)
    if bias_op is not None and bias_op.kind == "key":
        bias4 = _gather(bias4, 3, group, world_size, layout)
    if mask_op is not None and mask_op.kind == "key":
        mask4 = _gather(mask4, 3, group, world_size, layout)
    outs, lses = [], []
    for call in allgather_calls(layout, world_size, rank, local_len, causal):
        q_c = q[:, call.q_lo:call.q_hi]
        k_c, v_c = keys[:, :call.k_end], values[:, :call.k_end]
        bias_c = _operand(bias4, bias_op, call.q_lo, call.q_hi, call.k_end)
        mask_c = _operand(mask4, mask_op, call.q_lo, call.q_hi, call.k_end)
        if keep is not None:
            out, lse = attention_topk(q_c, k_c, v_c, bias_c, keep, mask=mask_c, causal=True, per_query=True,
                                      scale=scale, softcap=softcap, deterministic=deterministic,
                                      return_lse=True)
        else:
            # The op itself (dense): dmattn.attention's automatic gather path would read the
            # mask's kept count on the host.
            out, lse = forward_with_grad(q_c, k_c, v_c, mask_c, bias_c, call.causal, -1, -1, scale, softcap,
                                         deterministic)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 1), torch.cat(lses, 2)
