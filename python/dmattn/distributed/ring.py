"""The ring: K/V blocks travel around the ranks, each step's op calls are merged by their lse, and
the backward sends the K/V gradients around the ring behind their blocks.

Forward, at step t rank r holds the K/V block of rank s = (r - t) mod W (its key-side bias and
mask with it) and runs the plan's calls (layout.ring_plan) with ``dmattn::fwd``; the next
block's transfer is issued before the calls. Partial results are merged in float32 (float64 for
float64 inputs): lse = logaddexp(lse_a, lse_b), out = out_a * exp(lse_a - lse) + out_b *
exp(lse_b - lse), weights 0 where both are -inf (an empty row stays out 0 / lse -inf), NaN kept.

Backward: each call runs ``dmattn::bwd`` with ``forward_stats=True`` on the saved global out and
lse (P = exp(S - lse), Delta = rowsum(dO * out)), which yields exactly that block's share of
the gradients. dQ (and the rows x keys slices of a full dbias) accumulate locally; dK, dV and a
key-side dbias accumulate in float32 in buffers that follow their block around the ring (each
rank adds its share, in ring order) and reach the owner after W hops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .._lib import persistent_kernels
from ..lse_merge import merge_into
from ..ops import _call_op, attention_backward, attention_forward
from .comm import RingExchange
from .layout import Call, global_from_rank_major, rank_major_from_global

__all__ = ["RingSpec", "RingAttention"]

NEG_INF = float("-inf")


@dataclass
class Operand:
    """How a mask or bias is laid out. kind "key": (B|1, Hb, 1, S_local), this rank's keys; it
    travels with them. kind "global": (B|1, Hb, S_local|1, S|1), this rank's query rows (or one
    row for all) x the keys of the whole sequence in global order (or one key); each call takes
    its rows x its keys."""
    kind: str
    query_rows: bool  # query dim S_local (else 1)
    key_global: bool  # key dim S (else 1); kind "global" only


@dataclass
class RingSpec:
    comm: Optional[RingExchange]
    plan: Tuple[Tuple[int, Tuple[Call, ...]], ...]
    world_size: int
    local_len: int
    layout: str
    scale: Optional[float]
    softcap: float
    deterministic: bool
    bias: Optional[Operand]
    mask: Optional[Operand]


def as4d(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rank_major_keys(x4: Optional[Tensor], op: Optional[Operand], spec: RingSpec) -> Optional[Tensor]:
    """A global operand with its key axis in rank-major order, so that the keys of rank s are
    the contiguous columns [s * S_local, (s + 1) * S_local) (a copy only for zigzag)."""
    if x4 is None or op.kind != "global" or not op.key_global:
        return x4
    index = rank_major_from_global(spec.layout, spec.world_size, spec.local_len, x4.device)
    return x4 if index is None else x4.index_select(3, index)


def _slice(x4: Optional[Tensor], op: Optional[Operand], call: Call, source: int, local_len: int):
    """The operand of one call: key-side (travelling, already rank s's) -> its first k_end keys;
    global (rank-major keys) -> the call's rows x rank s's first k_end keys."""
    if x4 is None:
        return None
    if op.kind == "key":
        return x4[..., :call.k_end]
    if op.query_rows:
        x4 = x4[:, :, call.q_lo:call.q_hi]
    if op.key_global:
        x4 = x4[..., source * local_len:source * local_len + call.k_end]
    return x4


class _Operands:
    """The mask and bias of one ring pass: key-side ones travel with K and V (4-D views), global
    ones stay (4-D, keys in rank-major order); ``for_call`` cuts each call's operands."""

    def __init__(self, bias: Optional[Tensor], mask: Optional[Tensor], spec: RingSpec):
        self.spec = spec
        self.key_bias = as4d(bias) if spec.bias is not None and spec.bias.kind == "key" else None
        self.key_mask = as4d(mask) if spec.mask is not None and spec.mask.kind == "key" else None
        self.glob_bias = _rank_major_keys(as4d(bias), spec.bias, spec) if self.key_bias is None else None
        self.glob_mask = _rank_major_keys(as4d(mask), spec.mask, spec) if self.key_mask is None else None

    def blocks(self, k: Tensor, v: Tensor) -> List[Tensor]:
        """What travels: K, V and the key-side operands."""
        return [t for t in (k, v, self.key_bias, self.key_mask) if t is not None]

    def unpack(self, blocks: List[Tensor]):
        rest = list(blocks[2:])
        key_bias = rest.pop(0) if self.key_bias is not None else None
        key_mask = rest.pop(0) if self.key_mask is not None else None
        return blocks[0], blocks[1], key_bias, key_mask

    def for_call(self, call: Call, source: int, key_bias: Optional[Tensor], key_mask: Optional[Tensor]):
        """(mask, bias) of one call; key_bias / key_mask: the travelling ones held now."""
        spec = self.spec
        mask = _slice(key_mask if key_mask is not None else self.glob_mask, spec.mask, call, source, spec.local_len)
        bias = _slice(key_bias if key_bias is not None else self.glob_bias, spec.bias, call, source, spec.local_len)
        return mask, bias


def _single_call(spec: RingSpec) -> bool:
    """One rank whose one call covers every row and key (with one rank every layout's plan is
    that, causal or not)."""
    if len(spec.plan) != 1 or len(spec.plan[0][1]) != 1:
        return False
    call = spec.plan[0][1][0]
    return call.q_lo == 0 and call.q_hi == spec.local_len and call.k_end == spec.local_len


def _saved(ctx, q, k, v, bias, mask, out, lse):
    ctx.save_for_backward(q, k, v, bias, mask, out, lse)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    return out, lse


class RingAttention(torch.autograd.Function):
    """(q, k, v, bias, mask, spec) -> (out, lse); bias / mask: the user's tensors (or None), laid
    out as spec.bias / spec.mask say."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                spec: RingSpec):
        acc = _acc_dtype(q.dtype)
        operands = _Operands(bias, mask, spec)
        ctx.spec = spec
        if _single_call(spec):  # one rank: the op's own results, no accumulators
            (_, (call,)), = spec.plan
            out, lse = _call_op(attention_forward, q, k, v, *operands.for_call(call, 0, operands.key_bias,
                                                                               operands.key_mask),
                                call.causal, -1, -1, spec.scale, spec.softcap, spec.deterministic)
            return _saved(ctx, q, k, v, bias, mask, out, lse)

        out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), NEG_INF, dtype=acc, device=q.device)
        blocks = operands.blocks(k, v)
        for step, (source, calls) in enumerate(spec.plan):
            pending = spec.comm.start(blocks) if step + 1 < len(spec.plan) else None
            k_blk, v_blk, kb_blk, km_blk = operands.unpack(blocks)
            # While a transfer is in flight, no persistent kernel: NCCL's kernels need
            # multiprocessors, which a persistent forward holds until it ends (docs/design.md).
            with persistent_kernels(pending is None):
                for call in calls:
                    rows = slice(call.q_lo, call.q_hi)
                    out, lse = _call_op(attention_forward, q[:, rows], k_blk[:, :call.k_end], v_blk[:, :call.k_end],
                                        *operands.for_call(call, source, kb_blk, km_blk), call.causal, -1, -1,
                                        spec.scale, spec.softcap, spec.deterministic)
                    if step == 0:  # the first step's calls cover disjoint rows: nothing to merge yet
                        out_acc[:, rows].copy_(out)
                        lse_acc[:, :, rows].copy_(lse)
                    else:
                        merge_into(out_acc[:, rows], lse_acc[:, :, rows], out, lse)
            if pending is not None:
                blocks = pending.wait()

        return _saved(ctx, q, k, v, bias, mask, out_acc.to(q.dtype), lse_acc)

    @staticmethod
    def backward(ctx, dout: Optional[Tensor], _dlse):
        spec: RingSpec = ctx.spec
        if dout is None:
            return None, None, None, None, None, None
        q, k, v, bias, mask, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        acc = _acc_dtype(q.dtype)
        bias_op = spec.bias
        # A bias constant over the keys has the gradient 0 by definition (docs/semantics.md).
        bias_grad = ctx.needs_input_grad[3] and not (bias_op.kind == "global" and not bias_op.key_global)
        operands = _Operands(bias, mask, spec)
        if _single_call(spec):  # one rank: the op's own backward (its statistics are the whole row's)
            (_, (call,)), = spec.plan
            dq, dk, dv, dbias = _call_op(
                attention_backward, dout, q, k, v, out, lse,
                *operands.for_call(call, 0, operands.key_bias, operands.key_mask),
                bias_grad, call.causal, -1, -1, spec.scale, spec.softcap, spec.deterministic)[:4]
            if ctx.needs_input_grad[3]:
                dbias = dbias.reshape(bias.shape) if bias_grad else torch.zeros_like(bias)
            return dq, dk, dv, dbias if ctx.needs_input_grad[3] else None, None, None

        dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        dglob_bias = torch.zeros(operands.glob_bias.shape, dtype=acc, device=q.device) \
            if bias_grad and operands.glob_bias is not None else None
        key_bias_grad = bias_grad and operands.key_bias is not None
        blocks = operands.blocks(k, v)
        grads_pending = None
        grads: List[Tensor] = []
        last = len(spec.plan) - 1
        for step, (source, calls) in enumerate(spec.plan):
            pending = spec.comm.start(blocks) if step < last else None
            k_blk, v_blk, kb_blk, km_blk = operands.unpack(blocks)
            share = None  # this rank's share of the block's dK, dV (, dbias)
            for call in calls:
                rows = slice(call.q_lo, call.q_hi)
                dq, dk, dv, dbias = _call_op(
                    attention_backward, dout[:, rows], q[:, rows], k_blk[:, :call.k_end], v_blk[:, :call.k_end],
                    out[:, rows], lse[:, :, rows].contiguous(), *operands.for_call(call, source, kb_blk, km_blk),
                    bias_grad, call.causal, -1, -1, spec.scale, spec.softcap, spec.deterministic, None, 0, None, True)[:4]
                dq_acc[:, rows] += dq
                if share is None:
                    share = [torch.zeros(k_blk.shape, dtype=acc, device=q.device),
                             torch.zeros(v_blk.shape, dtype=acc, device=q.device)]
                    if key_bias_grad:
                        share.append(torch.zeros(kb_blk.shape, dtype=acc, device=q.device))
                share[0][:, :call.k_end] += dk
                share[1][:, :call.k_end] += dv
                if key_bias_grad:
                    share[2][..., :call.k_end] += dbias
                elif dglob_bias is not None:
                    _slice(dglob_bias, bias_op, call, source, spec.local_len).add_(dbias)
            # The block's accumulators so far (from the previous rank, except at the first step)
            # plus this rank's share, then on to the next rank: after the last step that hop
            # takes them to their owner.
            if grads_pending is not None:
                grads = grads_pending.wait()
                if share is not None:
                    grads = [g.add_(s) for g, s in zip(grads, share)]
            else:
                grads = share if share is not None else [
                    torch.zeros(t.shape, dtype=acc, device=q.device)
                    for t in ([k_blk, v_blk] + ([kb_blk] if key_bias_grad else []))]
            if spec.comm is not None:
                grads_pending = spec.comm.start(grads)
            if pending is not None:
                blocks = pending.wait()
        if grads_pending is not None:
            grads = grads_pending.wait()

        dq = dq_acc.to(q.dtype)
        dk, dv = grads[0].to(k.dtype), grads[1].to(v.dtype)
        dbias = None
        if ctx.needs_input_grad[3]:
            if key_bias_grad:
                dbias = grads[2].to(bias.dtype).reshape(bias.shape)
            elif dglob_bias is not None:
                index = global_from_rank_major(spec.layout, spec.world_size, spec.local_len, q.device) \
                    if bias_op.key_global else None
                dglob = dglob_bias if index is None else dglob_bias.index_select(3, index)
                dbias = dglob.to(bias.dtype).reshape(bias.shape)
            else:
                dbias = torch.zeros_like(bias)
        return dq, dk, dv, dbias, None, None
