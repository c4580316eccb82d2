"""Gate skipping: which cells of gated attention are skipped (docs/semantics.md, "Gate skipping").

A cell is 128 queries x 128 keys of one (batch, head), in each sequence's own positions. From
the extremes of alpha over the cell's queries and of delta over its keys, the largest product
``alpha_i * delta_j`` the cell's pairs can reach is ``ub`` (the largest of the four corner
products). For a block of queries, ``R`` is the largest ``ub`` over the key blocks its rows can
see (causal, sliding window). A visible cell is skipped when

    ub < R  and  scale * (g(ub) - g(R)) < ln(threshold)

(g the gate's function: the gates of its pairs all lie more than ``-ln(threshold) / scale``
below the largest gate the row block can reach). Its pairs then count as masked in the
forward and the backward alike. The rule depends on alpha and delta alone (not on the order
in which a kernel visits blocks), so every backend and both passes skip the same cells; the
cell with the largest ``ub`` is never skipped; a NaN anywhere in a cell keeps it (and a NaN
``R`` keeps the whole row block).

``adaptive`` (flash-sparse-attn's ``is_adapt_gate`` with causal attention): the threshold of
a query block is ``threshold * visible / Sk`` with ``visible`` the key count of its first row.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

CELL = 128  # queries and keys per cell (the native GateOperand::kKeepCell)

__all__ = ["CELL", "gate_keep_cells", "gate_keep_cells_varlen"]


def _check_threshold(threshold) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"gate_threshold: expected a float or None, got {type(threshold).__name__}")
    t = float(threshold)
    if not t >= 0.0 or math.isinf(t):
        raise ValueError(f"gate_threshold: expected a finite value >= 0, got {threshold}")
    return t


def skips(threshold) -> bool:
    """Whether a gate_threshold argument asks for skipping (None and 0 compute exactly)."""
    return threshold is not None and _check_threshold(threshold) > 0.0


def _block_extremes(x: Tensor, lengths: Optional[Tensor], blocks: int) -> Tuple[Tensor, Tensor]:
    """(max, min) of x (B, S, heads) over blocks of CELL rows: (B, heads, blocks) in float32;
    rows at or past a sequence's length (lengths (B,) or None) are left out (an empty block:
    max -inf, min +inf)."""
    b, s, heads = x.shape
    x = x.float()
    pad = blocks * CELL - s
    hi = torch.nn.functional.pad(x, (0, 0, 0, pad), value=-math.inf)
    lo = torch.nn.functional.pad(x, (0, 0, 0, pad), value=math.inf)
    if lengths is not None:
        beyond = torch.arange(blocks * CELL, device=x.device).view(1, -1, 1) >= lengths.view(-1, 1, 1)
        hi = hi.masked_fill(beyond, -math.inf)
        lo = lo.masked_fill(beyond, math.inf)
    hi = hi.view(b, blocks, CELL, heads).amax(2).transpose(1, 2)
    lo = lo.view(b, blocks, CELL, heads).amin(2).transpose(1, 2)
    return hi, lo


def _visible_cells(len_q: Tensor, len_k: Tensor, m_blocks: int, n_blocks: int, causal: bool,
                   window: Tuple[int, int]) -> Tensor:
    """(B, m_blocks, n_blocks) bool: whether any query of the block sees any key of the block
    under causal / the sliding window (bottom-right aligned per sequence: d = i + Sk - Sq - j)."""
    dev = len_q.device
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    i0 = (torch.arange(m_blocks, device=dev) * CELL).view(1, -1, 1)
    j0 = (torch.arange(n_blocks, device=dev) * CELL).view(1, 1, -1)
    lq, lk = len_q.view(-1, 1, 1).long(), len_k.view(-1, 1, 1).long()
    i1 = torch.minimum(i0 + CELL, lq)  # (rows [i0, i1) of the sequence)
    j1 = torch.minimum(j0 + CELL, lk)
    offset = lk - lq
    visible = (i0 < i1) & (j0 < j1)
    # (a bound past every query / key bounds nothing and is left out: no sum below with it can
    # overflow int64)
    if 0 <= right < m_blocks * CELL:  # some key j0 <= i + offset + right for the block's last row
        visible = visible & (j0 <= i1 - 1 + offset + right)
    if 0 <= left < n_blocks * CELL:  # some key j1 - 1 >= i + offset - left for its first row
        visible = visible & (j1 - 1 >= i0 + offset - left)
    return visible


def _keep_from_extremes(a_hi: Tensor, a_lo: Tensor, d_hi: Tensor, d_lo: Tensor, visible: Tensor, len_q: Tensor,
                        len_k: Tensor, *, scale: float, gate_fn: str, threshold: float, adaptive: bool,
                        causal: bool) -> Tensor:
    """The rule on block extremes: a (B, H, M), d (B, H, N), visible (B, M, N) -> keep (B, H, M, N)."""
    a_hi, a_lo = a_hi.unsqueeze(-1), a_lo.unsqueeze(-1)
    d_hi, d_lo = d_hi.unsqueeze(-2), d_lo.unsqueeze(-2)
    # (maximum keeps a NaN: a cell with a NaN product is never skipped)
    ub = torch.maximum(torch.maximum(a_hi * d_hi, a_hi * d_lo), torch.maximum(a_lo * d_hi, a_lo * d_lo))
    vis = visible.unsqueeze(1)
    ub = torch.where(vis, ub, torch.full_like(ub, -math.inf))
    r = ub.amax(-1, keepdim=True)
    g = torch.nn.functional.logsigmoid if gate_fn == "logsigmoid" else (lambda x: x)
    gap = scale * (g(ub) - g(r))
    m_blocks = a_hi.shape[-2]
    if adaptive and causal:  # threshold * (keys the block's first row sees) / Sk
        first = (torch.arange(m_blocks, device=ub.device) * CELL).view(1, -1)
        lq, lk = len_q.view(-1, 1).double(), len_k.view(-1, 1).double()
        seen = (first + lk - lq + 1).clamp(min=0.0)
        thr = threshold * torch.minimum(seen, lk) / lk.clamp(min=1.0)
        log_thr = torch.log(thr).to(gap.dtype).view(thr.shape[0], 1, m_blocks, 1)  # (0 -> -inf: nothing skipped)
    else:
        log_thr = math.log(threshold)
    skip = vis & (ub < r) & (gap < log_thr)
    return ~skip


def _native(alpha: Tensor, delta: Tensor, cu_q, cu_k, max_q: int, max_k: int, shape, *, scale: float, gate_fn: str,
            threshold: float, causal: bool, window: Tuple[int, int], adaptive: bool) -> Optional[Tensor]:
    """The cells by the CUDA kernel (one launch: a training step's host time), or None where it
    does not run them (the CPU, a build without it, too many cells for its shared memory)."""
    if not alpha.is_cuda or torch.compiler.is_compiling():
        return None
    from ._lib import lib
    if not hasattr(lib(), "gate_keep_cells"):
        return None
    keep = torch.empty(shape, dtype=torch.bool, device=alpha.device)
    done = lib().gate_keep_cells(alpha.detach(), delta.detach(), cu_q, cu_k, max_q, max_k, float(scale),
                                 0 if gate_fn == "logsigmoid" else 1, float(threshold), bool(causal), bool(adaptive),
                                 int(window[0]), int(window[1]), keep)
    return keep if done else None


def gate_keep_cells(alpha: Tensor, delta: Tensor, *, scale: float, gate_fn: str, threshold: float,
                    causal: bool, window: Tuple[int, int] = (-1, -1), adaptive: bool = False,
                    native: bool = True) -> Tensor:
    """The kept cells of a dense batch: alpha (B, Sq, H), delta (B, Sk, Hkv) -> bool (B, H,
    ceil(Sq / 128), ceil(Sk / 128)), True where the cell is computed (on alpha's device, no
    gradient). ``scale`` is the softmax scale the call uses. On CUDA one kernel computes them
    (native=False: the framework ops there too, for comparisons), elsewhere framework ops (the
    same rule, in float32)."""
    with torch.no_grad():
        b, sq, h = alpha.shape
        sk, hkv = delta.shape[1], delta.shape[2]
        m_blocks, n_blocks = -(-sq // CELL), -(-sk // CELL)
        if m_blocks == 0 or n_blocks == 0:
            return torch.ones((b, h, m_blocks, n_blocks), dtype=torch.bool, device=alpha.device)
        cells = _native(alpha, delta, None, None, sq, sk, (b, h, m_blocks, n_blocks), scale=scale, gate_fn=gate_fn,
                        threshold=threshold, causal=causal, window=window, adaptive=adaptive) if native else None
        if cells is not None:
            return cells
        a_hi, a_lo = _block_extremes(alpha.detach(), None, m_blocks)
        d_hi, d_lo = _block_extremes(delta.detach(), None, n_blocks)
        if hkv != h:  # (a query head reads its kv head's delta)
            d_hi, d_lo = d_hi.repeat_interleave(h // hkv, 1), d_lo.repeat_interleave(h // hkv, 1)
        len_q = torch.full((b,), sq, device=alpha.device, dtype=torch.int64)
        len_k = torch.full((b,), sk, device=alpha.device, dtype=torch.int64)
        visible = _visible_cells(len_q, len_k, m_blocks, n_blocks, causal, window)
        keep = _keep_from_extremes(a_hi, a_lo, d_hi, d_lo, visible, len_q, len_k, scale=scale, gate_fn=gate_fn,
                                   threshold=threshold, adaptive=adaptive, causal=causal)
        return keep.contiguous()


def gate_keep_cells_varlen(alpha: Tensor, delta: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *, scale: float, gate_fn: str,
                           threshold: float, causal: bool, window: Tuple[int, int] = (-1, -1),
                           adaptive: bool = False, native: bool = True) -> Tensor:
    """The kept cells of a packed batch: alpha (total_q, H), delta (total_k, Hkv) -> bool (B, H,
    ceil(max_seqlen_q / 128), ceil(max_seqlen_k / 128)), cells in each sequence's own positions
    (on CUDA by the kernel, as gate_keep_cells)."""
    with torch.no_grad():
        dev = alpha.device
        shape = (cu_seqlens_q.numel() - 1, alpha.shape[1], -(-max_seqlen_q // CELL), -(-max_seqlen_k // CELL))
        if native and shape[2] > 0 and shape[3] > 0 and cu_seqlens_q.is_cuda and cu_seqlens_q.dtype == torch.int32:
            cells = _native(alpha, delta, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, shape, scale=scale,
                            gate_fn=gate_fn, threshold=threshold, causal=causal, window=window, adaptive=adaptive)
            if cells is not None:
                return cells
        cu_q, cu_k = cu_seqlens_q.to(dev).long(), cu_seqlens_k.to(dev).long()
        len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        m_blocks, n_blocks = max(1, -(-max_seqlen_q // CELL)), max(1, -(-max_seqlen_k // CELL))

        def padded(x: Tensor, cu: Tensor, rows: int) -> Tensor:  # (total, heads) -> (B, rows, heads)
            pos = torch.arange(rows, device=dev).view(1, -1)
            index = (cu[:-1].view(-1, 1) + pos).clamp(max=max(x.shape[0] - 1, 0))
            if x.shape[0] == 0:
                return x.new_zeros((cu.numel() - 1, rows, x.shape[1]))
            return x.detach()[index]

        a_hi, a_lo = _block_extremes(padded(alpha, cu_q, m_blocks * CELL), len_q, m_blocks)
        d_hi, d_lo = _block_extremes(padded(delta, cu_k, n_blocks * CELL), len_k, n_blocks)
        h, hkv = alpha.shape[1], delta.shape[1]
        if hkv != h:
            d_hi, d_lo = d_hi.repeat_interleave(h // hkv, 1), d_lo.repeat_interleave(h // hkv, 1)
        visible = _visible_cells(len_q, len_k, m_blocks, n_blocks, causal, window)
        keep = _keep_from_extremes(a_hi, a_lo, d_hi, d_lo, visible, len_q, len_k, scale=scale, gate_fn=gate_fn,
                                   threshold=threshold, adaptive=adaptive, causal=causal)
        # the map's shape over the max lengths as given (ceil(0 / 128) = 0 cells where a max is 0)
        return keep[:, :, : -(-max_seqlen_q // CELL), : -(-max_seqlen_k // CELL)].contiguous()
