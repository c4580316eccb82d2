"""Sequence layouts of context parallelism: which global positions each rank holds, the sharding
helpers, and the plans of the op calls (which query rows meet which keys, causal or not).

A sequence of S = W * S_local positions is spread over the W ranks of a group:

* ``"contiguous"``: rank r holds positions [r * S_local, (r + 1) * S_local);
* ``"zigzag"``: the sequence is cut into 2W chunks of S_local / 2; rank r holds chunk r, then
  chunk 2W - 1 - r (so under a causal mask every rank has the same amount of work).

The local order of a rank's rows is always increasing in global position.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["LAYOUTS", "check_layout", "rank_chunks", "sequence_positions", "zigzag_shard",
           "zigzag_unshard", "contiguous_shard", "contiguous_unshard", "Call", "ring_plan",
           "allgather_calls", "global_from_rank_major", "rank_major_from_global"]

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'zigzag' or 'contiguous', got {layout!r}")
    return layout


def _check_world(world_size, rank: Optional[int] = None) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")


def rank_chunks(layout: str, world_size: int, rank: int, local_len: int) -> Tuple[Tuple[int, int], ...]:
    """The (global start, length) of the pieces of the sequence that ``rank`` holds, in local
    order (increasing global positions)."""
    if layout == "contiguous":
        return ((rank * local_len, local_len),)
    half = local_len // 2
    return ((rank * half, half), ((2 * world_size - 1 - rank) * half, half))


def sequence_positions(local_len: int, *, world_size: int, rank: int, layout: str = "zigzag",
                       device=None) -> Tensor:
    """int64 (S_local,): the global position of each local row of ``rank`` (e.g. the position
    ids of a rotary embedding)."""
    check_layout(layout)
    _check_world(world_size, rank)
    _check_local_len(local_len, layout)
    pieces = [torch.arange(start, start + n, device=device)
              for start, n in rank_chunks(layout, world_size, rank, local_len)]
    return torch.cat(pieces)


def _check_local_len(local_len: int, layout: str, name: str = "local_len") -> None:
    if layout == "zigzag" and local_len % 2:
        raise ValueError(f"{name}: layout='zigzag' cuts each rank's rows into two chunks of S_local / 2, "
                         f"so S_local must be even, got {local_len}")


@functools.lru_cache(maxsize=64)
def _rank_major_positions(layout: str, world_size: int, local_len: int) -> Tuple[int, ...]:
    positions: List[int] = []
    for rank in range(world_size):
        for start, n in rank_chunks(layout, world_size, rank, local_len):
            positions.extend(range(start, start + n))
    return tuple(positions)


def rank_major_from_global(layout: str, world_size: int, local_len: int, device) -> Optional[Tensor]:
    """Index (S,) that takes a tensor in global order to rank-major order (rank 0's rows, rank 1's
    rows, ...) by index_select; None where the two orders agree (contiguous, or one rank)."""
    positions = _rank_major_positions(layout, world_size, local_len)
    if positions == tuple(range(len(positions))):
        return None
    return torch.tensor(positions, dtype=torch.int64, device=device)


def global_from_rank_major(layout: str, world_size: int, local_len: int, device) -> Optional[Tensor]:
    """The inverse of rank_major_from_global: rank-major order -> global order."""
    positions = _rank_major_positions(layout, world_size, local_len)
    if positions == tuple(range(len(positions))):
        return None
    inverse = [0] * len(positions)
    for index, position in enumerate(positions):
        inverse[position] = index
    return torch.tensor(inverse, dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------------------------
# Sharding helpers (local, no communication).
# ---------------------------------------------------------------------------------------------


def _seq_dim(x: Tensor, dim: int, name: str) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected a dimension of a {x.dim()}-D tensor, got {dim!r}")
    return dim % x.dim()


def _check_divisible(x: Tensor, dim: int, parts: int, what: str) -> int:
    length = x.shape[dim]
    if length % parts:
        raise ValueError(f"x: its dimension {dim} has length {length}, which {what} ({parts} equal parts) "
                         f"cannot split evenly")
    return length // parts


def zigzag_shard(x: Tensor, dim: int, world_size: int, rank: int) -> Tensor:
    """Rank ``rank``'s rows of ``x`` (global order along ``dim``, length S divisible by
    2 * world_size) in the zigzag layout: chunk ``rank`` then chunk ``2W - 1 - rank`` of 2W
    chunks. A new tensor (the two chunks concatenated)."""
    dim = _seq_dim(x, dim, "x")
    _check_world(world_size, rank)
    chunk = _check_divisible(x, dim, 2 * world_size, "the zigzag layout's 2 * world_size chunks")
    return torch.cat([x.narrow(dim, rank * chunk, chunk),
                      x.narrow(dim, (2 * world_size - 1 - rank) * chunk, chunk)], dim)


def _shard_list(shards: Union[Tensor, Sequence[Tensor]], dim: int, world_size: int) -> List[Tensor]:
    if isinstance(shards, Tensor):
        dim = _seq_dim(shards, dim, "shards")
        _check_divisible(shards, dim, world_size, "world_size shards")
        return list(shards.chunk(world_size, dim))
    shards = list(shards)
    if len(shards) != world_size:
        raise ValueError(f"shards: expected {world_size} tensors (one per rank), got {len(shards)}")
    for s in shards:
        _seq_dim(s, dim, "shards")
    return shards


def zigzag_unshard(shards: Union[Tensor, Sequence[Tensor]], dim: int, world_size: int) -> Tensor:
    """The global-order tensor from the ranks' zigzag shards: a list of ``world_size`` tensors
    (rank order), or one tensor holding them concatenated along ``dim`` (an all-gather's
    result). Inverse of zigzag_shard."""
    _check_world(world_size)
    parts = _shard_list(shards, dim, world_size)
    dim = dim % parts[0].dim()
    pieces: List[Optional[Tensor]] = [None] * (2 * world_size)
    for rank, shard in enumerate(parts):
        half = _check_divisible(shard, dim, 2, "the zigzag layout's two chunks per rank")
        pieces[rank] = shard.narrow(dim, 0, half)
        pieces[2 * world_size - 1 - rank] = shard.narrow(dim, half, half)
    return torch.cat(pieces, dim)  # type: ignore[arg-type]


def contiguous_shard(x: Tensor, dim: int, world_size: int, rank: int) -> Tensor:
    """Rank ``rank``'s rows of ``x`` in the contiguous layout: the rank-th of world_size equal
    slices along ``dim`` (a view)."""
    dim = _seq_dim(x, dim, "x")
    _check_world(world_size, rank)
    length = _check_divisible(x, dim, world_size, "world_size shards")
    return x.narrow(dim, rank * length, length)


def contiguous_unshard(shards: Union[Tensor, Sequence[Tensor]], dim: int, world_size: int) -> Tensor:
    """The global-order tensor from the ranks' contiguous shards (a list in rank order, or one
    tensor holding them concatenated along ``dim``)."""
    _check_world(world_size)
    if isinstance(shards, Tensor):
        _shard_list(shards, dim, world_size)
        return shards
    parts = _shard_list(shards, dim, world_size)
    return torch.cat(parts, dim % parts[0].dim())


def shard_local(x: Tensor, dim: int, world_size: int, rank: int, layout: str) -> Tensor:
    check_layout(layout)
    return (zigzag_shard if layout == "zigzag" else contiguous_shard)(x, dim, world_size, rank)


def unshard_local(shards, dim: int, world_size: int, layout: str) -> Tensor:
    check_layout(layout)
    return (zigzag_unshard if layout == "zigzag" else contiguous_unshard)(shards, dim, world_size)


# ---------------------------------------------------------------------------------------------
# Plans: the op calls of a step.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One op call: query rows [q_lo, q_hi) of this rank against the first ``k_end`` keys of the
    key set at hand (a rank's local keys, or the gathered global keys), causal (bottom-right
    aligned) or fully visible."""
    q_lo: int
    q_hi: int
    k_end: int
    causal: bool


def _merge(calls: List[Call], call: Call) -> None:
    """Appends ``call``, merged into the previous call when one call over both row ranges gives
    each row exactly its keys: both fully visible over the same keys, or both causal with the
    same diagonal (bottom-right alignment: the earlier rows see k_end - len(later rows) keys)."""
    if calls:
        last = calls[-1]
        if last.q_hi == call.q_lo and last.causal == call.causal:
            same = (last.k_end == call.k_end) if not call.causal \
                else (last.k_end == call.k_end - (call.q_hi - call.q_lo))
            if same:
                calls[-1] = Call(last.q_lo, call.q_hi, call.k_end, call.causal)
                return
    calls.append(call)


def block_calls(q_chunks, k_chunks, causal: bool) -> Tuple[Call, ...]:
    """The calls of this rank's query chunks against one rank's key chunks (both lists of
    (global start, length) in local order). Under causal, a query chunk sees a prefix of the key
    chunks (local order is global order): the chunks wholly before it (fully visible), then at
    most its own diagonal chunk (same start and length: plain causal). One call per query chunk
    over that prefix, bottom-right aligned, is exactly that; invisible chunks get no call."""
    total_keys = sum(n for _, n in k_chunks)
    calls: List[Call] = []
    offset = 0
    for q_start, q_len in q_chunks:
        lo, hi = offset, offset + q_len
        offset = hi
        if q_len == 0 or total_keys == 0:
            continue
        if not causal:
            _merge(calls, Call(lo, hi, total_keys, False))
            continue
        k_end, diagonal = 0, False
        for k_start, k_len in k_chunks:
            if k_start + k_len - 1 <= q_start:
                k_end += k_len  # every key at or before the chunk's first query
            elif k_start <= q_start + q_len - 1:
                # Chunks of one layout never straddle each other: a partial overlap is the diagonal.
                assert k_start == q_start and k_len == q_len, (q_chunks, k_chunks)
                k_end += k_len
                diagonal = True
                break
            else:
                break
        if k_end:
            _merge(calls, Call(lo, hi, k_end, diagonal))
    return tuple(calls)


@functools.lru_cache(maxsize=256)
def ring_plan(layout: str, world_size: int, rank: int, local_len: int,
              causal: bool) -> Tuple[Tuple[int, Tuple[Call, ...]], ...]:
    """Per ring step t: (source rank of the K/V block held then, (rank - t) mod W, its calls)."""
    q_chunks = rank_chunks(layout, world_size, rank, local_len)
    plan = []
    for step in range(world_size):
        source = (rank - step) % world_size
        k_chunks = rank_chunks(layout, world_size, source, local_len)
        plan.append((source, block_calls(q_chunks, k_chunks, causal)))
    return tuple(plan)


@functools.lru_cache(maxsize=256)
def allgather_calls(layout: str, world_size: int, rank: int, local_len: int,
                    causal: bool) -> Tuple[Call, ...]:
    """The calls of this rank's queries against the gathered keys in global order: one per query
    chunk, over keys [0, chunk end) causal (bottom-right alignment puts the chunk's first query
    at its global position), or one over every key; together they cover rows [0, S_local) in
    order."""
    total = world_size * local_len
    calls: List[Call] = []
    offset = 0
    for start, n in rank_chunks(layout, world_size, rank, local_len):
        lo, hi = offset, offset + n
        offset = hi
        if n:
            _merge(calls, Call(lo, hi, start + n, True) if causal else Call(lo, hi, total, False))
    return tuple(calls)
