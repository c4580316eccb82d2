"""The check of dmattn's rows: its output, and the gradients that belong to single query rows
(q's and, gated, alpha's), against a float64 reference on a slice of query rows (every key);
every gradient for finiteness and against the first exact peer's. Where the peer disagrees,
the peer's own rows are held against the reference too, so that the check names which side
is off.
"""

from __future__ import annotations

import math

import torch

from .config import Config, Inputs


def reference_rows(cfg: Config, x: Inputs, rows: torch.Tensor, with_grads: bool = False):
    """float64 reference output for the query rows `rows` (every key), (B, len(rows), H, D); with
    with_grads also the gradients of those rows' q and alpha (theirs alone: no other row's output
    depends on them) for the upstream gradient x.dout, as [dq] or [dq, dalpha]."""
    q = x.q.detach()[:, rows].double().cpu().requires_grad_(with_grads)
    alpha = None
    if x.alpha is not None:
        alpha = x.alpha.detach()[:, rows].double().cpu().requires_grad_(with_grads)
    with torch.set_grad_enabled(with_grads):
        out = _reference_out(cfg, x, rows, q, alpha)
    if not with_grads:
        return out
    leaves = [q] + ([alpha] if alpha is not None else [])
    row_grads = torch.autograd.grad(out, leaves, x.dout.detach()[:, rows].double().cpu())
    return out.detach(), list(row_grads)


def _reference_out(cfg: Config, x: Inputs, rows: torch.Tensor, q: torch.Tensor, alpha) -> torch.Tensor:
    k, v = (t.detach().double().cpu() for t in (x.k, x.v))
    h, hkv = q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(h // hkv, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(cfg.head_dim)
    allowed = torch.ones_like(s, dtype=torch.bool)
    if x.bias is not None:
        bias = x.bias.detach().double().cpu()
        bias = bias[:, :, rows] if bias.shape[2] > 1 else bias
        s = s + bias
    if x.mask is not None:
        m = x.mask.cpu()
        allowed = allowed & (m[:, :, rows] if m.shape[2] > 1 else m)
    if alpha is not None:  # scale * logsigmoid(alpha_i * delta_j)
        a = alpha.transpose(1, 2).unsqueeze(-1)
        d = x.delta.detach().double().cpu().repeat_interleave(h // hkv, dim=2).transpose(1, 2).unsqueeze(2)
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


def _row_grads_error(x: Inputs, grads, rows: torch.Tensor, ref_grads) -> float:
    """The largest error of the gradients' rows `rows` (q's, then alpha's: in the benchmark's
    order of leaves, q first and alpha after an optional bias) over max |reference|."""
    ours = [grads[0]] + ([grads[4 if x.bias is not None else 3]] if x.alpha is not None else [])
    worst = 0.0
    for g, ref in zip(ours, ref_grads):
        got = g.detach()[:, rows].double().cpu()
        worst = max(worst, (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6))
    return worst


def check(cfg: Config, x: Inputs, out: torch.Tensor, grads, peer_grads) -> str:
    rows = torch.unique(torch.linspace(0, cfg.seqlen - 1, steps=min(cfg.seqlen, 64)).long())
    ref, ref_grads = reference_rows(cfg, x, rows, with_grads=True)
    got = out.detach()[:, rows].double().cpu()
    err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    tol = 1e-4 if cfg.dtype == "float32" else 2e-2
    grad_tol = 1e-3 if cfg.dtype == "float32" else 5e-2
    finite = all(torch.isfinite(g).all().item() for g in (grads or [])) and torch.isfinite(out).all().item()
    msg = f"out err {err:.1e}"
    ok = finite and err <= tol
    if grads is not None:
        row_err = _row_grads_error(x, grads, rows, ref_grads)
        msg += f", row grads err {row_err:.1e}"
        ok = ok and row_err <= grad_tol
    if peer_grads is not None and grads is not None:
        worst = 0.0
        for g, pg in zip(grads, peer_grads):
            denom = max(pg.abs().max().item(), 1e-6)
            worst = max(worst, (g.double() - pg.double()).abs().max().item() / denom)
        msg += f", grads vs peer {worst:.1e}"
        if worst > grad_tol:
            peer_row_err = _row_grads_error(x, peer_grads, rows, ref_grads)
            msg += f" (the peer's row grads err {peer_row_err:.1e})"
            # a disagreement counts against dmattn unless the peer's own rows are the ones off
            ok = ok and peer_row_err > grad_tol and row_err <= grad_tol
    return ("ok: " if ok else "FAIL: ") + msg + ("" if finite else ", NON-FINITE")
