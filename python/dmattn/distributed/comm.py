"""Communication of context parallelism over torch.distributed: the ring's point-to-point
exchange, and the sequence all-gather whose backward sums the gradients back onto their owners.

No host synchronization beyond what torch.distributed itself needs: nothing here reads tensor
values. On CUDA with NCCL, point-to-point and collective ops run on NCCL's own stream, which
waits for the current stream when the op is issued; ``wait()`` on the returned work makes the
current stream wait for the transfer (the host does not block). So a transfer issued before a
computation overlaps it, and the computation that reads the received buffer is ordered after it.
With gloo (CPU) the transfers run on gloo's threads and ``wait()`` blocks the host.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import global_from_rank_major, rank_major_from_global

__all__ = ["resolve_group", "RingExchange", "all_gather_sequence", "GatherSequence"]


def resolve_group(group) -> Tuple[object, int, int]:
    """(group, world size, this process's rank in it); group None is the default (world) group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first (a group of one process works too)")
    if group is None:
        group = dist.group.WORLD
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group, world_size, rank


def _global_rank(group, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _sendable(t: Tensor) -> Tensor:
    # bool goes over the wire as uint8 (same bytes); point-to-point needs contiguous tensors.
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


class _Pending:
    def __init__(self, works, received: List[Tensor], dtypes: List[torch.dtype]):
        self._works, self._received, self._dtypes = works, received, dtypes

    def wait(self) -> List[Tensor]:
        for work in self._works:
            work.wait()
        return [r.view(torch.bool) if d == torch.bool else r for r, d in zip(self._received, self._dtypes)]


class RingExchange:
    """Sends tensors to the next rank of the ring and receives the same shapes from the previous
    one, asynchronously (torch.distributed.batch_isend_irecv). Every rank must start the same
    sequence of exchanges with tensors of the same shapes and dtypes."""

    def __init__(self, group, world_size: int, rank: int):
        self.group = group
        self.next = _global_rank(group, (rank + 1) % world_size)
        self.prev = _global_rank(group, (rank - 1) % world_size)

    def start(self, tensors: Sequence[Tensor]) -> _Pending:
        sends = [_sendable(t) for t in tensors]
        received = [torch.empty_like(s, memory_format=torch.contiguous_format) for s in sends]
        ops = [dist.P2POp(dist.isend, s, self.next, self.group) for s in sends]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        works = dist.batch_isend_irecv(ops)
        return _Pending(works, received, [t.dtype for t in tensors])


def _all_gather_rank_major(x: Tensor, dim: int, group, world_size: int) -> Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order."""
    if world_size == 1:
        return x
    send = _sendable(x)
    parts = [torch.empty_like(send) for _ in range(world_size)]
    dist.all_gather(parts, send, group=group)
    if x.dtype == torch.bool:
        parts = [p.view(torch.bool) for p in parts]
    return torch.cat(parts, dim)


def _index(x: Tensor, dim: int, index: Optional[Tensor]) -> Tensor:
    return x if index is None else x.index_select(dim, index.to(x.device))


def all_gather_sequence(x: Tensor, dim: int, group, world_size: int, layout: str) -> Tensor:
    """Every rank's ``x`` (its rows of a sequence along ``dim``) gathered into global order
    (no gradient)."""
    gathered = _all_gather_rank_major(x, dim, group, world_size)
    local_len = x.shape[dim]
    return _index(gathered, dim, global_from_rank_major(layout, world_size, local_len, x.device))


def _sum_to_owners(grad: Tensor, dim: int, group, world_size: int) -> Tensor:
    """grad: this rank's gradient of the whole sequence in rank-major order along ``dim``;
    returns the sum over the ranks of their gradients of this rank's rows, added in rank order
    (all_to_all, then a fixed-order sum: bitwise reproducible whatever the backend's reduction
    algorithm)."""
    if world_size == 1:
        return grad
    sends = [p.contiguous() for p in grad.chunk(world_size, dim)]
    received = [torch.empty_like(sends[0]) for _ in range(world_size)]
    dist.all_to_all(received, sends, group=group)
    total = received[0]
    for part in received[1:]:
        total = total + part
    return total


class GatherSequence(torch.autograd.Function):
    """all_gather_sequence with a gradient: the backward sends each rank the gradients of its rows
    from every rank and sums them there in float32 (float64 for float64), in rank order, then
    casts once to x's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group, world_size: int, layout: str) -> Tensor:
        ctx.dim, ctx.group, ctx.world_size, ctx.layout = dim, group, world_size, layout
        ctx.local_len, ctx.dtype = x.shape[dim], x.dtype
        gathered = all_gather_sequence(x, dim, group, world_size, layout)
        return x.view_as(x) if gathered is x else gathered  # (one rank: a view, not the input itself)

    @staticmethod
    def backward(ctx, grad: Tensor):
        acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
        to_rank_major = rank_major_from_global(ctx.layout, ctx.world_size, ctx.local_len, grad.device)
        grad = _index(grad.to(acc), ctx.dim, to_rank_major)
        local = _sum_to_owners(grad, ctx.dim, ctx.group, ctx.world_size)
        return local.to(ctx.dtype), None, None, None, None
