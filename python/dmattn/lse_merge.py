"""The softmax merge of partial attention results over disjoint key sets (context parallelism's
ring, windows with sinks by parts)."""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def merge_into(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """(out_acc, lse_acc) <- the softmax merge of itself with (out, lse), in place, in the
    accumulators' dtype: lse = logaddexp(lse_acc, lse), out = out_acc * exp(lse_acc - lse) +
    out * exp(lse - lse); weights 0 where both are -inf (an empty row stays out 0 / lse -inf),
    NaN kept. out: (B, S, H, D), lse: (B, H, S)."""
    new = torch.logaddexp(lse_acc, lse)
    empty = new == NEG_INF  # both -inf: weights 0 (not exp(-inf - -inf) = NaN); NaN stays NaN
    w_acc = torch.exp(lse_acc - new).masked_fill_(empty, 0.0).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse - new).masked_fill_(empty, 0.0).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(w_acc).add_(out.to(out_acc.dtype) * w_new)
    lse_acc.copy_(new)
