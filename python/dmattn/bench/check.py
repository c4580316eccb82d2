"""The check of dmattn's rows: its output against a float64 reference on a slice of query rows
(every key), every gradient for finiteness and against the first exact peer's.
"""

from __future__ import annotations

import math

import torch

from .config import Config, Inputs


def reference_rows(cfg: Config, x: Inputs, rows: torch.Tensor) -> torch.Tensor:
    """float64 reference output for the query rows `rows` (every key), (B, len(rows), H, D)."""
    q = x.q.detach()[:, rows].double().cpu()
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
    if x.alpha is not None:  # scale * logsigmoid(alpha_i * delta_j)
        a = x.alpha.detach()[:, rows].double().cpu().transpose(1, 2).unsqueeze(-1)
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


def check(cfg: Config, x: Inputs, out: torch.Tensor, grads, peer_grads) -> str:
    rows = torch.unique(torch.linspace(0, cfg.seqlen - 1, steps=min(cfg.seqlen, 64)).long())
    ref = reference_rows(cfg, x, rows)
    got = out.detach()[:, rows].double().cpu()
    err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    tol = 1e-4 if cfg.dtype == "float32" else 2e-2
    finite = all(torch.isfinite(g).all().item() for g in (grads or [])) and torch.isfinite(out).all().item()
    msg = f"out err {err:.1e}"
    ok = finite and err <= tol
    if peer_grads is not None and grads is not None:
        worst = 0.0
        for g, pg in zip(grads, peer_grads):
            denom = max(pg.abs().max().item(), 1e-6)
            worst = max(worst, (g.double() - pg.double()).abs().max().item() / denom)
        msg += f", grads vs peer {worst:.1e}"
        ok = ok and worst <= (1e-3 if cfg.dtype == "float32" else 5e-2)
    return ("ok: " if ok else "FAIL: ") + msg + ("" if finite else ", NON-FINITE")
