"""The one shared materialized reference for the dmattn test-suite, and its tolerance rule.

``reference_attention`` implements the contract (docs/semantics.md)
literally, on a materialized (B, H, Sq, Sk) score matrix:

    s = scale * q k^T ; s = softcap * tanh(s / softcap) if softcap > 0
    s = s + scale * gate_fn(alpha_i * delta_j)  (gated attention) ; s = s + bias
    allowed = mask & causal_ok & window_ok & windows_ok & (bias != -inf)  (bottom-right aligned)
    p = softmax over the allowed keys ; out = p v ; lse = logsumexp over the allowed keys
    rows without an allowed key: out = 0, lse = -inf, every gradient contribution exactly 0

It is differentiable with torch autograd; the masking is written with the "double where"
idiom so that neither empty rows nor disallowed positions (whatever the bias holds there:
finite, finfo.min, -inf) ever produce NaN gradients: disallowed scores never reach exp().

Two precisions:
  * ``upcast=True`` (the ground truth): every input is converted to float64 first.
  * ``upcast=False`` ("PyTorch's own math in the low precision"): the computation runs in the
    input dtype like PyTorch's math SDPA / FlashAttention's ``attention_ref(upcast=False)``:
    q k^T, scale, softcap, bias add and p v in the input dtype (with torch's type promotion
    for an fp32 bias), only the softmax (max, exp, sum, log) in float32, p cast back to the
    input dtype before the p v product.

Tolerance rule (FlashAttention's): for every output X,
    max|X_ours - X_ref64| <= factor * max(max|X_low - X_ref64|, rounding(X_ref64 -> dtype))
                             + floor
with factor 2 for the forward (out, lse) and 3 for gradients, floor = 1e-5 * max|X_ref64|
(for a reduced dbias, 1e-5 * max of the same reduction applied to |dS|, because a bias
broadcast over keys has an exact gradient of 0 obtained by cancellation; see
``check_close``). ``rounding`` is the error of merely storing the exact result in the
output dtype: no implementation returning that dtype can do better, so it is a floor too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "allowed_window",
    "allowed_windows",
    "expand_operand",
    "reference_attention",
    "RefResult",
    "run_reference",
    "check_close",
    "assert_finite",
    "check_against_reference",
    "FWD_FACTOR",
    "BWD_FACTOR",
    "FLOOR",
]

FWD_FACTOR = 2.0
BWD_FACTOR = 3.0
FLOOR = 1e-5


# ---------------------------------------------------------------------------------------------
# The reference itself
# ---------------------------------------------------------------------------------------------


def allowed_window(sq: int, sk: int, causal: bool, window: Sequence[int], device=None) -> Tensor:
    """Bool (Sq, Sk): causal/window constraint, bottom-right aligned (offset Sk - Sq)."""
    left, right = int(window[0]), int(window[1])
    i = torch.arange(sq, device=device).view(-1, 1)
    j = torch.arange(sk, device=device).view(1, -1)
    diag = i + (sk - sq)  # the key aligned with query i
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= diag
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def allowed_windows(sq: int, sk: int, windows: Tensor, h: int, device=None) -> Tensor:
    """Bool (H, Sq, Sk): windows with sinks, rows [sink, near, gap, far] of (1 / Hkv / H, 4):
    with d = i + Sk - Sq - j, key j is visible iff d >= 0 and (j < sink or d < near or
    near + gap <= d < near + gap + far)."""
    w = windows.detach().cpu().long()
    w = w.repeat_interleave(h // w.shape[0], dim=0) if w.shape[0] != h else w
    i = torch.arange(sq).view(1, -1, 1)
    j = torch.arange(sk).view(1, 1, -1)
    d = i + (sk - sq) - j
    sink, near, gap, far = (w[:, c].view(-1, 1, 1) for c in range(4))
    ok = (d >= 0) & ((j < sink) | (d < near) | ((d >= near + gap) & (d < near + gap + far)))
    return ok.to(device)


def gate_term(alpha: Tensor, delta: Tensor, gate_fn: str, h: int) -> Tensor:
    """g(alpha_i * delta_j) as (B, H, Sq, Sk): alpha (B, Sq, H), delta (B, Sk, Hkv)."""
    hkv = delta.shape[2]
    a = alpha.transpose(1, 2).unsqueeze(-1)  # (B, H, Sq, 1)
    d = delta.transpose(1, 2).repeat_interleave(h // hkv, dim=1).unsqueeze(-2)  # (B, H, 1, Sk)
    x = a * d
    return torch.nn.functional.logsigmoid(x) if gate_fn == "logsigmoid" else x


def expand_operand(t: Optional[Tensor], b: int, h: int, hkv: int, sq: int, sk: int) -> Optional[Tensor]:
    """Right-align a mask/bias of rank <= 4 to (B, H, Sq, Sk) following the dmattn rule.

    Each dim is 1 or full; the head dim may also be Hkv (query head h then uses entry
    h // (H / Hkv), like the kv heads). Differentiable (expand / repeat_interleave), so the
    gradient of a bias lands in the bias's own shape.
    """
    if t is None:
        return None
    assert t.dim() <= 4, t.shape
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t
    if t4.shape[1] == hkv and hkv != h and hkv != 1:
        t4 = t4.repeat_interleave(h // hkv, dim=1)
    return t4.expand(b, h, sq, sk)


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    causal: bool = False,
    window: Sequence[int] = (-1, -1),
    scale: Optional[float] = None,
    softcap: float = 0.0,
    *,
    upcast: bool = True,
    gate: Optional[Tuple[Tensor, Tensor]] = None,
    gate_fn: str = "logsigmoid",
    windows: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Materialized attention following the dmattn contract. Returns (out, lse).
    gate (alpha, delta) / gate_fn / windows: gated attention and windows with sinks.

    q (B, Sq, H, D), k/v (B, Sk, Hkv, D), layout like dmattn. upcast=True: float64
    throughout (out float64, lse float64). upcast=False: input-dtype math with a float32
    softmax (out in q's dtype, lse float32, or float64 for float64 inputs).
    """
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    assert h % hkv == 0
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
        bias = bias.double() if bias is not None else None
        gate = None if gate is None else (gate[0].double(), gate[1].double())
        soft_dtype = torch.float64
    else:
        soft_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = h // hkv
    qh = q.transpose(1, 2)  # (B, H, Sq, D)
    kh = k.transpose(1, 2).repeat_interleave(g, dim=1)  # (B, H, Sk, D)
    vh = v.transpose(1, 2).repeat_interleave(g, dim=1)

    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap and softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if gate is not None:
        s = s + scale * gate_term(gate[0], gate[1], gate_fn, h).to(s.dtype)
    allowed = allowed_window(sq, sk, causal, window, device=q.device).expand(b, h, sq, sk)
    if windows is not None:
        allowed = allowed & allowed_windows(sq, sk, windows, h, device=q.device)
    if mask is not None:
        allowed = allowed & expand_operand(mask, b, h, hkv, sq, sk)
    if bias is not None:
        bias4 = expand_operand(bias, b, h, hkv, sq, sk)
        allowed = allowed & (bias4 != float("-inf"))
        s = s + bias4
    s = s.to(soft_dtype)

    row_any = allowed.any(dim=-1, keepdim=True)
    # Disallowed scores never reach exp(): replaced before (the value) and after (the grad).
    s_in = torch.where(allowed, s, torch.zeros((), dtype=soft_dtype, device=s.device))
    m = torch.where(allowed, s_in, torch.full((), float("-inf"), dtype=soft_dtype, device=s.device))
    m = m.amax(dim=-1, keepdim=True) if sk > 0 else torch.zeros_like(row_any, dtype=soft_dtype)
    m = torch.where(row_any, m, torch.zeros((), dtype=soft_dtype, device=s.device)).detach()
    z = torch.where(allowed, s_in - m, torch.full((), float("-inf"), dtype=soft_dtype, device=s.device))
    e = torch.exp(z)
    denom = e.sum(dim=-1, keepdim=True)
    denom = torch.where(row_any, denom, torch.ones((), dtype=soft_dtype, device=s.device))
    p = e / denom
    lse = torch.where(row_any, torch.log(denom) + m,
                      torch.full((), float("-inf"), dtype=soft_dtype, device=s.device))
    lse = lse.squeeze(-1)  # (B, H, Sq)
    if upcast:
        out = torch.matmul(p, vh)
    else:
        out = torch.matmul(p.to(v.dtype), vh)
    return out.transpose(1, 2), lse


# ---------------------------------------------------------------------------------------------
# Running a case: reference forward + autograd backward in both precisions
# ---------------------------------------------------------------------------------------------


@dataclass
class RefResult:
    out: Tensor
    lse: Tensor
    grads: Dict[str, Tensor] = field(default_factory=dict)  # "q", "k", "v", "bias"


def run_reference(q, k, v, mask=None, bias=None, *, causal=False, window=(-1, -1), scale=None,
                  softcap=0.0, dout=None, bias_grad=False, upcast=True, gate=None, gate_fn="logsigmoid",
                  windows=None) -> RefResult:
    """Forward (and backward with ``dout`` when given) of the reference on detached copies.
    With a gate (alpha, delta) and ``dout``, grads also holds "alpha" and "delta"."""
    conv = (lambda t: t.detach().double()) if upcast else (lambda t: t.detach().clone())
    want_grad = dout is not None
    qr, kr, vr = (conv(t).requires_grad_(want_grad) for t in (q, k, v))
    br = None
    if bias is not None:
        br = conv(bias).requires_grad_(want_grad and bias_grad)
    gr_ = None if gate is None else tuple(conv(t).requires_grad_(want_grad) for t in gate)
    with torch.enable_grad():
        out, lse = reference_attention(qr, kr, vr, mask, br, causal, window, scale, softcap,
                                       upcast=upcast, gate=gr_, gate_fn=gate_fn, windows=windows)
        res = RefResult(out.detach(), lse.detach())
        named = [("q", qr), ("k", kr), ("v", vr)]
        if br is not None and bias_grad:
            named.append(("bias", br))
        if gr_ is not None:
            named += [("alpha", gr_[0]), ("delta", gr_[1])]
        if want_grad and out.numel() > 0:
            d = dout.detach().double() if upcast else dout.detach().to(out.dtype)
            grads = torch.autograd.grad(out, [t for _, t in named], d, allow_unused=True)
            for (n, inp), gr in zip(named, grads):
                res.grads[n] = torch.zeros_like(inp) if gr is None else gr
        elif want_grad:
            res.grads = {n: torch.zeros_like(t) for n, t in named}
    return res


def dbias_abs_scale(q, k, v, mask, bias, *, causal, window, scale, softcap, dout) -> Tensor:
    """|dS| (float64, materialized) reduced onto the bias's shape: the natural error scale of
    a reduced dbias (a sum of n terms carries rounding error relative to sum|terms|, not to
    |sum|, which may be exactly 0: a key-broadcast bias has gradient 0 by cancellation)."""
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    full = torch.zeros(b, h, sq, sk, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        b4 = expand_operand(bias.detach().double(), b, h, hkv, sq, sk)
        out, _ = reference_attention(q.detach().double(), k.detach().double(), v.detach().double(),
                                     mask, b4 + full, causal, window, scale, softcap)
        if out.numel() == 0:
            return torch.zeros(bias.shape, dtype=torch.float64)
        (ds,) = torch.autograd.grad(out, full, dout.detach().double())
    # Same reduction as the gradient of expand_operand, applied to |dS|.
    leaf = torch.zeros(bias.shape, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        e = expand_operand(leaf, b, h, hkv, sq, sk)
        (red,) = torch.autograd.grad(e, leaf, ds.abs())
    return red


# ---------------------------------------------------------------------------------------------
# Assertions
# ---------------------------------------------------------------------------------------------


def assert_finite(name: str, x: Tensor, allow_neg_inf_where: Optional[Tensor] = None) -> None:
    """NaN never passes; +-inf never passes, except -inf exactly where allowed (empty rows)."""
    assert not torch.isnan(x).any(), f"{name}: contains NaN ({int(torch.isnan(x).sum())} of {x.numel()})"
    nonfinite = ~torch.isfinite(x)
    if allow_neg_inf_where is not None:
        ok = allow_neg_inf_where.to(x.device) & (x == float("-inf"))
        nonfinite = nonfinite & ~ok
    assert not nonfinite.any(), (
        f"{name}: contains Inf ({int(nonfinite.sum())} of {x.numel()}) at e.g. "
        f"{nonfinite.nonzero()[:4].tolist()}")


def _max(x: Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def check_close(name: str, actual: Tensor, ref: Tensor, ref_low: Optional[Tensor], factor: float,
                *, floor_scale: Optional[Tensor] = None, context: str = "") -> None:
    """The FlashAttention rule; see the module docstring. ``ref`` is float64."""
    actual = actual.detach().cpu()
    ref = ref.detach().cpu().double()
    assert tuple(actual.shape) == tuple(ref.shape), (
        f"{name}: shape {tuple(actual.shape)} != expected {tuple(ref.shape)} {context}")
    inf_rows = ref == float("-inf")
    assert_finite(name, actual, allow_neg_inf_where=inf_rows)
    if inf_rows.any():
        bad = inf_rows & (actual != float("-inf"))
        assert not bad.any(), (
            f"{name}: expected -inf (empty rows) at {bad.nonzero()[:4].tolist()}, got "
            f"{actual[bad][:4].tolist()} {context}")
        extra = ~inf_rows & (actual == float("-inf"))
        assert not extra.any(), f"{name}: unexpected -inf at {extra.nonzero()[:4].tolist()} {context}"
    fin = torch.isfinite(ref)
    a = actual.double()[fin]
    r = ref[fin]
    if r.numel() == 0:
        return
    err = _max(a - r)
    base = 0.0
    if ref_low is not None:
        base = _max(ref_low.detach().cpu().double()[fin] - r)
    rounding = _max(r.to(actual.dtype).double() - r) if actual.dtype != torch.float64 else 0.0
    scale_t = floor_scale.detach().cpu().double()[fin] if floor_scale is not None else r
    floor = FLOOR * max(_max(scale_t), _max(r))
    tol = factor * max(base, rounding) + floor
    if not err <= tol:
        diff = (actual.double() - ref).abs()
        diff[~fin] = 0
        idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        raise AssertionError(
            f"{name}: max error {err:.3e} > tol {tol:.3e} (= {factor} * max(pytorch-math err "
            f"{base:.3e}, rounding {rounding:.3e}) + floor {floor:.3e}); worst at {idx}: got "
            f"{float(actual.double()[idx]):.6e}, expected {float(ref[idx]):.6e}; "
            f"max|ref| {_max(r):.3e} {context}")


def check_against_reference(q, k, v, mask, bias, out, lse, grads: Optional[Dict[str, Tensor]] = None,
                            *, causal=False, window=(-1, -1), scale=None, softcap=0.0, dout=None,
                            context: str = "") -> None:
    """Checks out/lse (and dq/dk/dv/dbias when ``grads`` is given, from ``dout``) of a dmattn
    call against the float64 reference with the low-precision PyTorch-math baseline."""
    bias_grad = grads is not None and grads.get("bias") is not None
    kw = dict(causal=causal, window=window, scale=scale, softcap=softcap,
              dout=dout if grads is not None else None, bias_grad=bias_grad)
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    qc, kc, vc, mc, bc = map(cpu, (q, k, v, mask, bias))
    if kw["dout"] is not None:
        kw["dout"] = cpu(kw["dout"])
    ref = run_reference(qc, kc, vc, mc, bc, upcast=True, **kw)
    low = run_reference(qc, kc, vc, mc, bc, upcast=False, **kw)

    expected_lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    assert out.dtype == q.dtype, f"out: dtype {out.dtype} != q's {q.dtype} {context}"
    assert lse.dtype == expected_lse_dtype, f"lse: dtype {lse.dtype} != {expected_lse_dtype} {context}"
    check_close("out", out, ref.out, low.out, FWD_FACTOR, context=context)
    check_close("lse", lse, ref.lse, low.lse, FWD_FACTOR, context=context)
    if grads is None:
        return
    for n, src in (("q", q), ("k", k), ("v", v)):
        gr = grads.get(n)
        assert gr is not None, f"d{n}: missing gradient {context}"
        assert gr.dtype == src.dtype, f"d{n}: dtype {gr.dtype} != {src.dtype} {context}"
        check_close(f"d{n}", gr, ref.grads[n], low.grads.get(n), BWD_FACTOR, context=context)
    if bias_grad:
        gb = grads["bias"]
        assert tuple(gb.shape) == tuple(bias.shape), (
            f"dbias: shape {tuple(gb.shape)} != bias shape {tuple(bias.shape)} {context}")
        assert gb.dtype == bias.dtype, f"dbias: dtype {gb.dtype} != bias dtype {bias.dtype} {context}"
        fs = dbias_abs_scale(qc, kc, vc, mc, bc, causal=causal, window=window, scale=scale,
                             softcap=softcap, dout=kw["dout"])
        check_close("dbias", gb, ref.grads["bias"], low.grads.get("bias"), BWD_FACTOR,
                    floor_scale=fs, context=context)
