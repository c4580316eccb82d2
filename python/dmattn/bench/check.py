"""The check of dmattn's rows: its output, and the gradients that belong to single query rows
(q's and, gated, alpha's), against a float64 reference on a slice of query rows (every key);
every gradient for finiteness and against the first exact peer's. Where the peer disagrees,
the peer's own rows are held against the reference too, so that the check names which side
is off.
Tolerances as FlashAttention's tests take them: the larger of a fixed floor and three times
PyTorch's own error, the same reference computed in the run's dtype (bf16 rounding of P, dS and
the output), so that inputs whose gradients cancel (a row of closed gates) are judged against
what a bf16 computation can give there.
"""

from __future__ import annotations

import math

import torch

from .config import Config, Inputs


def reference_rows(cfg: Config, x: Inputs, rows: torch.Tensor, with_grads: bool = False,
                   dtype: torch.dtype = torch.float64):
    """Reference output for the query rows `rows` (every key), (B, len(rows), H, D), computed in
    `dtype` (float64: the reference; the run's dtype: PyTorch's own error), and with with_grads
    the gradients of those rows' q and alpha (theirs alone: no other row's output depends on
    them) for the upstream gradient x.dout, as [dq] or [dq, dalpha] ([] without), float64."""
    q = x.q.detach()[:, rows].to("cpu", dtype).requires_grad_(with_grads)
    alpha = None
    if x.alpha is not None:
        alpha = x.alpha.detach()[:, rows].to("cpu", dtype).requires_grad_(with_grads)
    with torch.set_grad_enabled(with_grads):
        out = _reference_out(cfg, x, rows, q, alpha)
    if not with_grads:
        return out.double(), []
    leaves = [q] + ([alpha] if alpha is not None else [])
    row_grads = torch.autograd.grad(out, leaves, x.dout.detach()[:, rows].to("cpu", dtype))
    return out.detach().double(), [g.double() for g in row_grads]


def _reference_out(cfg: Config, x: Inputs, rows: torch.Tensor, q: torch.Tensor, alpha) -> torch.Tensor:
    dtype = q.dtype
    k, v = (t.detach().to("cpu", dtype) for t in (x.k, x.v))
    h, hkv = q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(h // hkv, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(cfg.head_dim)
    allowed = torch.ones_like(s, dtype=torch.bool)
    if x.bias is not None:
        bias = x.bias.detach().to("cpu", dtype)
        bias = bias[:, :, rows] if bias.shape[2] > 1 else bias
        s = s + bias
    if x.mask is not None:
        m = x.mask.cpu()
        allowed = allowed & (m[:, :, rows] if m.shape[2] > 1 else m)
    if alpha is not None:  # scale * logsigmoid(alpha_i * delta_j)
        a = alpha.transpose(1, 2).unsqueeze(-1)
        d = x.delta.detach().to("cpu", dtype).repeat_interleave(h // hkv, dim=2).transpose(1, 2).unsqueeze(2)
        s = s + torch.nn.functional.logsigmoid(a * d) / math.sqrt(cfg.head_dim)
    if x.windows is not None:  # the same row for every head; implies causal
        sink, near, gap, far = x.windows[0].tolist()
        j = torch.arange(cfg.seqlen)
        dist = rows[:, None] - j[None, :]
        band = (dist >= near + gap) & (dist < near + gap + far)
        allowed = allowed & (dist >= 0) & ((j < sink) | (dist < near) | band)
    if cfg.causal:
        j = torch.arange(cfg.seqlen)
        allowed = allowed & (j[None, :] <= rows[:, None])
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)


def _row_grads(x: Inputs, grads, rows: torch.Tensor):
    """The rows `rows` of q's and alpha's gradients (grads in the order of x.leaves()), float64
    on the CPU."""
    by_leaf = {id(t): g for t, g in zip(x.leaves(), grads)}
    picked = [x.q] + ([x.alpha] if x.alpha is not None else [])
    return [by_leaf[id(t)].detach()[:, rows].double().cpu() for t in picked]


def _grads_error(got, ref) -> float:
    return max(_rel_err(g, r) for g, r in zip(got, ref))


def check(cfg: Config, x: Inputs, out: torch.Tensor, grads, peer_grads) -> str:
    rows = torch.unique(torch.linspace(0, cfg.seqlen - 1, steps=min(cfg.seqlen, 64)).long())
    with_grads = grads is not None  # (a forward-only run: the output alone)
    ref, ref_grads = reference_rows(cfg, x, rows, with_grads)
    own, own_grads = reference_rows(cfg, x, rows, with_grads, dtype=x.q.dtype)
    err = _rel_err(out.detach()[:, rows].double().cpu(), ref)
    tol = max(1e-4 if cfg.dtype == "float32" else 2e-2, 3 * _rel_err(own, ref))
    own_grad_err = _grads_error(own_grads, ref_grads) if with_grads else 0.0
    grad_floor = 1e-3 if cfg.dtype == "float32" else 5e-2
    grad_tol = max(grad_floor, 3 * own_grad_err)
    finite = all(torch.isfinite(g).all().item() for g in (grads or [])) and torch.isfinite(out).all().item()
    msg = f"out err {err:.1e}"
    ok = finite and err <= tol
    if grads is not None:
        row_err = _grads_error(_row_grads(x, grads, rows), ref_grads)
        msg += f", row grads err {row_err:.1e}"
        if grad_tol > grad_floor:  # (PyTorch's own error sets the bar: name it)
            msg += f" (torch {cfg.dtype}: {own_grad_err:.1e})"
        ok = ok and row_err <= grad_tol
    if peer_grads is not None and grads is not None:
        worst = max(_rel_err(g.double(), pg.double()) for g, pg in zip(grads, peer_grads))
        msg += f", grads vs peer {worst:.1e}"
        if worst > grad_tol:
            peer_row_err = _grads_error(_row_grads(x, peer_grads, rows), ref_grads)
            msg += f" (the peer's row grads err {peer_row_err:.1e})"
            # a disagreement counts against dmattn unless the peer's own rows are the ones off
            ok = ok and peer_row_err > grad_tol and row_err <= grad_tol
    return ("ok: " if ok else "FAIL: ") + msg + ("" if finite else ", NON-FINITE")
