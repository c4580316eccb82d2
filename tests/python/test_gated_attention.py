"""Gated attention (``gate=(alpha, delta)``) and windows with sinks (``windows=``) against the
float64 reference (reference.py), forward and every gradient, with the FlashAttention tolerance
rule; edge cases of docs/semantics.md ("Gated attention", "Windows with sinks"); errors."""

from __future__ import annotations

import os

import pytest
import torch

import dmattn
from reference import BWD_FACTOR, FWD_FACTOR, check_close, run_reference

GATE_FNS = ["logsigmoid", "linear"]


def _inputs(b, sq, sk, h, hkv, d, dtype, device, gate_dtype=None, gate_range=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dtype).to(device)  # noqa: E731
    q, k, v = mk(b, sq, h, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d)
    gd = gate_dtype or dtype
    # alpha * delta spans +-gate_range^2 / 2: large products too (logsigmoid saturates there)
    alpha = (torch.randn(b, sq, h, generator=g) * gate_range).to(gd).to(device)
    delta = (torch.randn(b, sk, hkv, generator=g) * gate_range / 2).to(gd).to(device)
    dout = mk(b, sq, h, d)
    return q, k, v, alpha, delta, dout


def _run(q, k, v, dout, *, gate=None, bias=None, backward=True, bias_grad=True, **kw):
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    gate_l = None if gate is None else tuple(t.detach().clone().requires_grad_(backward) for t in gate)
    bias_l = None if bias is None else bias.detach().clone().requires_grad_(backward and bias_grad)
    out, lse = dmattn.attention(*leaves, bias=bias_l, gate=gate_l, return_lse=True, **kw)
    grads = {}
    if backward:
        out.backward(dout)
        grads = dict(zip("qkv", (t.grad for t in leaves)))
        if gate_l is not None:
            grads["alpha"], grads["delta"] = gate_l[0].grad, gate_l[1].grad
        if bias_l is not None and bias_grad:
            grads["bias"] = bias_l.grad
    return out, lse, grads


def _check(q, k, v, dout, out, lse, grads, *, gate=None, gate_fn="logsigmoid", windows=None, bias=None,
           context="", **kw):
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    args = dict(gate=None if gate is None else tuple(map(cpu, gate)), gate_fn=gate_fn,
                windows=cpu(windows), dout=cpu(dout) if grads else None, bias_grad="bias" in grads, **kw)
    ref = run_reference(cpu(q), cpu(k), cpu(v), None, cpu(bias), upcast=True, **args)
    low = run_reference(cpu(q), cpu(k), cpu(v), None, cpu(bias), upcast=False, **args)
    check_close("out", out, ref.out, low.out, FWD_FACTOR, context=context)
    check_close("lse", lse, ref.lse, low.lse, FWD_FACTOR, context=context)
    for name, grad in grads.items():
        assert grad is not None, f"d{name}: no gradient {context}"
        check_close(f"d{name}", grad, ref.grads[name], low.grads.get(name), BWD_FACTOR, context=context)


@pytest.mark.parametrize("gate_fn", GATE_FNS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 37, 53, 4, 2, 24), (1, 70, 70, 2, 1, 64), (2, 65, 129, 3, 3, 16)])
def test_gate_matches_reference(device, nan_poison, gate_fn, causal, dtype, shape):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 inputs are CPU only")
    b, sq, sk, h, hkv, d = shape
    q, k, v, alpha, delta, dout = _inputs(b, sq, sk, h, hkv, d, dtype, device)
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), gate_fn=gate_fn, causal=causal)
    assert grads["alpha"].dtype == alpha.dtype and grads["delta"].shape == delta.shape
    _check(q, k, v, dout, out, lse, grads, gate=(alpha, delta), gate_fn=gate_fn, causal=causal,
           context=f"{gate_fn} causal={causal} {dtype} {shape}")


# Sequences of several query and key blocks of the CUDA kernels (the Hopper ones take the gate with
# key rows at head dims up to 128 -- 96 on the 128 instantiation --, each backward path, deterministic
# mode, a key bias beside it).
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["fa2_bwd", "exact_bwd", "deterministic", "key_bias", "fp16_fp32_gate"])
def test_gate_on_long_sequences_matches_reference(monkeypatch, nan_poison, d, causal, mode):
    b, sq, sk, h, hkv = 2, 300, 517, 4, 2
    dtype = torch.float16 if mode == "fp16_fp32_gate" else torch.bfloat16
    gate_dtype = torch.float32 if mode == "fp16_fp32_gate" else None
    q, k, v, alpha, delta, dout = _inputs(b, sq, sk, h, hkv, d, dtype, "cuda", gate_dtype=gate_dtype, seed=d)
    monkeypatch.setenv("DMATTN_BWD_EXACT", "1" if mode == "exact_bwd" else "0")
    bias = torch.randn(b, h, 1, sk).to(dtype).cuda() if mode == "key_bias" else None
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), bias=bias, bias_grad=False, causal=causal,
                           deterministic=mode == "deterministic")
    _check(q, k, v, dout, out, lse, grads, gate=(alpha, delta), bias=bias, causal=causal, context=f"d={d} {mode}")


# The Hopper kernels' gate at its least precise: softmax scale 1 (the gate's share of a score is
# then 11x the default scale's) with products of typical size 60 (and some of several hundred),
# where logsigmoid's logarithm term and its saturation both matter; every gradient against the
# float64 reference.
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gate_at_scale_one_matches_reference(nan_poison, d, causal):
    b, sq, sk, h, hkv = 1, 260, 390, 2, 1
    q, k, v, alpha, delta, dout = _inputs(b, sq, sk, h, hkv, d, torch.bfloat16, "cuda", gate_range=11.0, seed=7)
    q = q * d ** -0.5  # (scores of the default scale's size: the gate's terms are what scale 1 changes)
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), causal=causal, scale=1.0)
    _check(q, k, v, dout, out, lse, grads, gate=(alpha, delta), causal=causal, scale=1.0,
           context=f"d={d} causal={causal} scale=1")


# A NaN in alpha (or delta) on the Hopper kernels reaches the row (or the rows that see the key)
# and nothing else, forward and backward, as on the CPU.
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("which", ["alpha", "delta"])
def test_gpu_nan_in_the_gate_reaches_what_it_touches(d, which):
    b, s, h, hkv = 1, 384, 2, 2
    q, k, v, alpha, delta, dout = _inputs(b, s, s, h, hkv, d, torch.bfloat16, "cuda", seed=3)
    row = 200
    if which == "alpha":
        alpha[0, row, 1] = float("nan")
    else:
        delta[0, row, 1] = float("nan")
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), causal=True)
    hit = torch.zeros(s, dtype=torch.bool, device="cuda")  # the rows it must reach (head 1)
    clear = torch.ones(s, dtype=torch.bool, device="cuda")  # the rows it must not reach
    if which == "alpha":
        hit[row] = True  # query row 200
        clear[row] = False
    else:
        hit[row:] = True  # every query that attends the key (causal)
        clear[128:] = False  # (rows sharing a tile with the key may or may not be reached)
    lse_h = lse[0, 1]
    assert torch.isnan(lse_h[hit]).all(), "a row the NaN reaches kept a finite lse"
    assert torch.isfinite(lse_h[clear]).all() and torch.isfinite(lse[0, 0]).all(), "the NaN reached another row"
    assert torch.isnan(out[0, hit, 1]).any(dim=-1).all(), "a row the NaN reaches kept a finite output"
    assert torch.isfinite(out[0, clear, 1]).all() and torch.isfinite(out[0, :, 0]).all()
    # head 0 shares nothing with head 1 (its own kv head): its gradients stay finite
    for name in "qkv":
        assert torch.isfinite(grads[name][0, :, 0]).all(), f"d{name}: the NaN reached head 0"
    assert torch.isfinite(grads["alpha"][0, :, 0]).all() and torch.isfinite(grads["delta"][0, :, 0]).all()


# A key bias's -inf keys beside the gate: masked keys stay masked whatever their products (the
# Hopper kernels add the gate to the biased score without a test: g is never +inf, the linear
# gate's product capped at fp32's largest value), a (batch, head) whose keys are all masked has
# empty rows, and the rest matches the float64 reference. Deterministic, so that the call with
# products beyond fp32's range on the masked keys can be held to the same bits.
@pytest.mark.parametrize("gate_fn", GATE_FNS)
def test_gate_beside_a_key_bias_with_masked_keys(device, nan_poison, gate_fn):
    b, sq, sk, h, hkv, d = 2, 300, 517, 4, 2, 64
    q, k, v, alpha, delta, dout = _inputs(b, sq, sk, h, hkv, d, torch.bfloat16, device, seed=3)
    masked = torch.zeros(sk, dtype=torch.bool)
    masked[::7] = True
    bias = torch.randn(b, h, 1, sk)
    bias[..., masked] = float("-inf")
    bias[1, 2] = float("-inf")  # every key of (batch 1, head 2): its rows are empty
    bias = bias.to(torch.bfloat16).to(device)
    options = dict(gate_fn=gate_fn, bias=bias, bias_grad=False, causal=True, deterministic=True)
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), **options)
    assert (out[1, :, 2] == 0).all() and torch.isneginf(lse[1, 2]).all()
    assert (grads["alpha"][1, :, 2] == 0).all(), "dalpha of an empty row must be exactly 0"
    _check(q, k, v, dout, out, lse, grads, gate=(alpha, delta), gate_fn=gate_fn, bias=bias, causal=True)
    huge = delta.clone()
    huge[:, masked.to(device)] = 1e38  # products up to ~1e39 on the masked keys
    out_h, lse_h, grads_h = _run(q, k, v, dout, gate=(alpha, huge), **options)
    assert torch.equal(out_h, out) and torch.equal(lse_h, lse)
    for name in ("q", "k", "v", "alpha"):
        assert torch.equal(grads_h[name], grads[name]), f"d{name}"
    assert torch.equal(grads_h["delta"], grads["delta"]), "ddelta (0 on the masked keys in both)"
    assert (grads["delta"][:, masked.to(device)] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("gate_fn", GATE_FNS)
def test_packed_gate_matches_reference_per_sequence(nan_poison, gate_fn):
    """A packed batch with the gate alone (no windows: the Hopper kernels' packed path), sequences
    of several blocks, one of no keys and one of no queries, each against the float64 reference."""
    torch.manual_seed(2)
    lens_q, lens_k = [130, 0, 257, 64, 5], [200, 9, 257, 0, 300]
    h, hkv, d = 4, 2, 128
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    mk = lambda *shape, s=1.0: (torch.randn(*shape) * s).to(torch.bfloat16).cuda()  # noqa: E731
    q, k, v = mk(sum(lens_q), h, d), mk(sum(lens_k), hkv, d), mk(sum(lens_k), hkv, d)
    alpha, delta, dout = mk(sum(lens_q), h, s=3.0), mk(sum(lens_k), hkv, s=1.5), mk(sum(lens_q), h, d)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha, delta)]
    out, lse = dmattn.attention_varlen(*leaves[:3], cu_q, cu_k, max(lens_q), max(lens_k), gate=leaves[3:],
                                       gate_fn=gate_fn, causal=True, return_lse=True)
    out.backward(dout)
    for bi in range(len(lens_q)):
        rq, rk = slice(int(cu_q[bi]), int(cu_q[bi + 1])), slice(int(cu_k[bi]), int(cu_k[bi + 1]))
        if lens_q[bi] == 0:
            assert (leaves[4].grad[rk] == 0).all(), "keys of a sequence without queries: ddelta 0"
            continue
        if lens_k[bi] == 0:
            assert (out[rq] == 0).all() and (leaves[3].grad[rq] == 0).all()
            continue
        grads = {n: t.grad[r][None] for n, t, r in zip("qkv", leaves, (rq, rk, rk))}
        grads["alpha"], grads["delta"] = leaves[3].grad[rq][None], leaves[4].grad[rk][None]
        sub = [t[r][None] for t, r in zip((q, k, v, alpha, delta, dout), (rq, rk, rk, rq, rk, rq))]
        _check(*sub[:3], sub[5], out[rq][None], lse[:, rq][None], grads, gate=tuple(sub[3:5]), gate_fn=gate_fn,
               causal=True, context=f"sequence {bi}")


def test_gate_float64_matches_reference_tightly():
    q, k, v, alpha, delta, dout = _inputs(2, 19, 23, 4, 2, 8, torch.float64, "cpu", gate_range=6.0)
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), causal=True, softcap=3.0)
    _check(q, k, v, dout, out, lse, grads, gate=(alpha, delta), causal=True, softcap=3.0)


def test_gate_gradcheck_float64():
    q, k, v, alpha, delta, _ = _inputs(1, 5, 7, 2, 1, 4, torch.float64, "cpu", gate_range=2.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha, delta)]
    fn = lambda q_, k_, v_, a_, d_: dmattn.attention(q_, k_, v_, gate=(a_, d_), causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_gate_with_bias_mask_softcap_and_float32_gate(device, nan_poison, gate_dtype):
    b, sq, sk, h, hkv, d = 2, 33, 47, 4, 2, 32
    q, k, v, alpha, delta, dout = _inputs(b, sq, sk, h, hkv, d, torch.bfloat16, device, gate_dtype=gate_dtype)
    bias = torch.randn(b, h, 1, sk).to(torch.bfloat16).to(device)
    mask = (torch.rand(b, 1, sq, sk) > 0.3).to(device)
    mask[0, 0, 3] = False  # a fully masked row: out 0, lse -inf, zero gradients
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), bias=bias, causal=True, softcap=5.0,
                           **{"mask": None})
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, alpha, delta, bias)]
    out, lse = dmattn.attention(*leaves[:3], mask, leaves[5], gate=(leaves[3], leaves[4]), causal=True,
                                softcap=5.0, return_lse=True)
    out.backward(dout)
    assert lse[0, 0, 3].item() == float("-inf") and (out[0, 3] == 0).all()
    assert (leaves[3].grad[0, 3] == 0).all(), "dalpha of an empty row must be exactly 0"
    cpu = lambda t: t.detach().cpu()  # noqa: E731
    args = dict(gate=(cpu(alpha), cpu(delta)), causal=True, softcap=5.0, dout=cpu(dout), bias_grad=True)
    ref = run_reference(cpu(q), cpu(k), cpu(v), cpu(mask), cpu(bias), upcast=True, **args)
    low = run_reference(cpu(q), cpu(k), cpu(v), cpu(mask), cpu(bias), upcast=False, **args)
    check_close("out", out, ref.out, low.out, FWD_FACTOR)
    for name, leaf in zip(["q", "k", "v", "alpha", "delta", "bias"], leaves):
        assert leaf.grad.dtype == leaf.dtype
        check_close(f"d{name}", leaf.grad, ref.grads[name], low.grads[name], BWD_FACTOR)


def test_gate_gradients_only_where_required():
    q, k, v, alpha, delta, dout = _inputs(1, 9, 9, 2, 2, 8, torch.float32, "cpu")
    a = alpha.clone().requires_grad_()
    out = dmattn.attention(q, k, v, gate=(a, delta))
    out.backward(dout)
    assert a.grad is not None and delta.grad is None
    ref = run_reference(q, k, v, gate=(alpha, delta), dout=dout)
    check_close("dalpha", a.grad, ref.grads["alpha"], None, BWD_FACTOR)


def test_logsigmoid_gate_saturates_without_overflow():
    """Products far beyond exp's range: logsigmoid(x) = x for x << 0 (a hard gate, finite), 0 for
    x >> 0 (no gate); never Inf or NaN."""
    q, k, v, _, _, dout = _inputs(1, 16, 16, 1, 1, 8, torch.float32, "cpu")
    alpha = torch.full((1, 16, 1), 100.0)
    delta = torch.linspace(-30, 30, 16).view(1, 16, 1)
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta))
    for name, t in [("out", out), ("lse", lse), *grads.items()]:
        assert torch.isfinite(t).all(), name
    _check(q, k, v, dout, out, lse, grads, gate=(alpha, delta))


@pytest.mark.parametrize("gate_fn", GATE_FNS)
def test_infinite_products(device, gate_fn):
    """alpha_i = +inf (docs/semantics.md, "Infinite products"): against negative delta every
    product is -inf, the row empty (out 0, lse -inf, zero dq); against positive ones the linear gate
    takes the largest finite value (finite results), logsigmoid saturates at 0. The other rows are
    those of the finite gate."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, alpha, _, dout = _inputs(1, 6, 9, 2, 1, 16, dtype, device, gate_dtype=torch.float32)
    alpha[0, 2, :] = float("inf")
    for sign in (-1.0, 1.0):
        delta = (torch.rand(1, 9, 1, device=device) + 0.5) * sign
        out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), gate_fn=gate_fn)
        finite_rows = [0, 1, 3, 4, 5]
        _check(q[:, finite_rows], k, v, dout[:, finite_rows], out[:, finite_rows], lse[:, :, finite_rows], {},
               gate=(alpha[:, finite_rows], delta), gate_fn=gate_fn)
        if sign < 0:
            assert (out[0, 2] == 0).all() and (lse[0, :, 2] == float("-inf")).all()
            assert (grads["q"][0, 2] == 0).all()
        else:
            assert torch.isfinite(out[0, 2]).all() and torch.isfinite(lse[0, :, 2]).all()
        for name in ("q", "k", "v"):
            assert torch.isfinite(grads[name]).all(), (sign, name)


def _windows(rows, device):
    return torch.tensor(rows, dtype=torch.int32, device=device)


WINDOW_CASES = [
    # (Sq, Sk, H, Hkv, rows [sink, near, gap, far] per (1 | Hkv | H))
    (64, 64, 2, 2, [[4, 8, 16, 8], [0, 16, 0, 0]]),
    (40, 90, 4, 2, [[3, 5, 7, 11]]),
    (90, 40, 2, 1, [[100, 0, 0, 0]]),            # sink > Sk: plain causal; queries before the keys: empty
    (33, 33, 2, 2, [[0, 0, 3, 5], [2, 0, 0, 4]]),  # near = 0: only the band (and sinks)
    (50, 70, 4, 4, [[1, 2, 3, 4], [0, 70, 0, 0], [5, 0, 0, 0], [0, 0, 0, 0]]),  # the last: all rows empty
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"{c[0]}x{c[1]}-h{c[2]}-{len(c[4])}rows")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_with_sinks_match_reference(device, nan_poison, case, dtype):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 inputs are CPU only")
    sq, sk, h, hkv, rows = case
    q, k, v, alpha, delta, dout = _inputs(2, sq, sk, h, hkv, 16, dtype, device)
    w = _windows(rows, device)
    out, lse, grads = _run(q, k, v, dout, windows=w)
    _check(q, k, v, dout, out, lse, grads, windows=w, context=str(case))
    # with the gate on top
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), windows=w)
    _check(q, k, v, dout, out, lse, grads, gate=(alpha, delta), windows=w, context=f"gated {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_windows_on_the_native_path(head_dim):
    """Windows with sinks that differ between heads (the native path, not the parts) in
    deterministic mode: on Hopper the warp-specialized backward without dQ (its bands leave the
    adds no order) and the query-major dQ kernel. Against the reference, and bitwise equal on a
    second run."""
    q, k, v, _, _, dout = _inputs(2, 300, 330, 4, 2, head_dim, torch.bfloat16, "cuda")
    w = _windows([[7, 40, 60, 50], [0, 100, 0, 0]], "cuda")
    first = _run(q, k, v, dout, windows=w, deterministic=True)
    _check(q, k, v, dout, *first, windows=w, context=f"deterministic D={head_dim}")
    again = _run(q, k, v, dout, windows=w, deterministic=True)
    for name in first[2]:
        assert torch.equal(first[2][name], again[2][name]), f"d{name}: not bitwise reproducible"


# Windows with sinks by parts (window_parts.py: up to three sliding-window calls merged by their
# lse), the CUDA path wherever every head has the same row: against the float64 reference, and
# on the CPU in float64 against the per-element native path (which it must equal to rounding).
PARTS_ROWS = [(5, 9, 7, 13), (0, 9, 7, 13), (5, 0, 3, 13), (5, 9, 7, 0), (200, 9, 7, 13), (3, 1, 0, 1),
              (0, 4, 100, 20), (0, 0, 0, 0)]


@pytest.mark.parametrize("row", PARTS_ROWS, ids=lambda r: "-".join(map(str, r)))
@pytest.mark.parametrize("shape", [(70, 90), (90, 70), (1, 90)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_windows_by_parts_equal_the_native_path(monkeypatch, row, shape):
    sq, sk = shape
    q, k, v, alpha, delta, dout = _inputs(2, sq, sk, 4, 2, 16, torch.float64, "cpu")
    bias = torch.randn(2, 4, 1, sk, dtype=torch.float64)
    w = _windows([row], "cpu")
    results = []
    for mode in ("0", "1"):
        monkeypatch.setenv("DMATTN_WINDOW_PARTS", mode)
        results.append(_run(q, k, v, dout, gate=(alpha, delta), bias=bias, windows=w))
    (out0, lse0, g0), (out1, lse1, g1) = results
    torch.testing.assert_close(out1, out0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse1, lse0, rtol=1e-12, atol=1e-12)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-12, atol=1e-12, msg=lambda m: f"d{name}: {m}")


def test_windows_by_parts_take_the_native_path_elsewhere(monkeypatch):
    """Rows that differ between heads, a mask, another window or torch.compile: the native path."""
    from dmattn import window_parts
    monkeypatch.setenv("DMATTN_WINDOW_PARTS", "1")
    q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
    same, mixed = _windows([[1, 2, 0, 3]] * 2, "cpu"), _windows([[1, 2, 0, 3], [0, 2, 0, 3]], "cpu")
    assert window_parts.use_parts(q, k, v, None, None, same, (-1, -1)) == (1, 2, 0, 3)
    assert window_parts.use_parts(q, k, v, None, None, mixed, (-1, -1)) is None
    assert window_parts.use_parts(q, k, v, torch.ones(1, 1, 8, 8, dtype=torch.bool), None, same, (-1, -1)) is None
    assert window_parts.use_parts(q, k, v, None, None, same, (3, 0)) is None
    assert window_parts.use_parts(q, k, v, None, None, _windows([[1, -2, 0, 3]], "cpu"), (-1, -1)) is None
    monkeypatch.setenv("DMATTN_WINDOW_PARTS", "0")
    assert window_parts.use_parts(q, k, v, None, None, same, (-1, -1)) is None


@pytest.mark.parametrize("row", [(128, 300, 200, 250), (3, 64, 0, 64), (0, 1, 5, 700)],
                         ids=lambda r: "-".join(map(str, r)))
def test_windows_by_parts_match_reference(device, nan_poison, monkeypatch, row):
    monkeypatch.setenv("DMATTN_WINDOW_PARTS", "1")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, alpha, delta, dout = _inputs(2, 700, 900, 4, 2, 64, dtype, device)
    w = _windows([row], device)
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), windows=w)
    _check(q, k, v, dout, out, lse, grads, gate=(alpha, delta), windows=w, context=f"row {row}")


# Windows on the warp-specialized Hopper kernels (head dims 64 and 128; elsewhere the sm80-class
# kernels): each query tile walks the key blocks of its sinks and bands, each key block the query
# blocks it meets, with gaps between the runs at these lengths. Rows per KV head; a packed batch;
# the mode by parts is not taken there. With the gate: by parts where every head has the same
# row, else the sm80-class kernels; a key-side bias likewise.
HOPPER_WINDOW_CASES = [
    # (Sq, Sk, D, rows [sink, near, gap, far] per (1 | Hkv))
    (1000, 1000, 64, [[64, 128, 256, 128]]),                    # block-aligned runs, two gaps
    (700, 900, 128, [[128, 300, 200, 250], [0, 129, 0, 0]]),    # three runs / one band
    (900, 700, 64, [[1000, 50, 60, 70], [3, 0, 400, 90]]),      # sink > Sk (causal); near = 0
    (257, 1100, 128, [[5, 1, 700, 64], [0, 0, 0, 0]]),          # the second: every row empty
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HOPPER_WINDOW_CASES, ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-{len(c[3])}rows")
@pytest.mark.parametrize("terms", ["plain", "gate", "key_bias"])
def test_windows_on_long_sequences_match_reference(nan_poison, case, terms):
    from dmattn import window_parts
    sq, sk, d, rows = case
    q, k, v, alpha, delta, dout = _inputs(2, sq, sk, 4, 2, d, torch.bfloat16, "cuda", seed=sq)
    w = _windows(rows, "cuda")
    gate = (alpha, delta) if terms == "gate" else None
    bias = torch.randn(2, 4, 1, sk).to(torch.bfloat16).cuda() if terms == "key_bias" else None
    switched_off = any(os.environ.get(n, "").startswith("0") for n in ("DMATTN_FWD_SM90", "DMATTN_BWD_SM90_WS"))
    if window_parts._runs_hopper_kernels(q.device.index or 0) and not switched_off and len(rows) == 1:
        # (the native walk on the Hopper kernels, not parts; with the gate or a bias, parts)
        row = window_parts.use_parts(q, k, v, None, bias, w, (-1, -1), gated=gate is not None)
        assert row == (None if terms == "plain" else tuple(rows[0]))
    out, lse, grads = _run(q, k, v, dout, gate=gate, bias=bias, windows=w)
    _check(q, k, v, dout, out, lse, grads, gate=gate, bias=bias, windows=w, context=f"{case[:3]} {terms}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_packed_windows_on_long_sequences_match_reference_per_sequence(nan_poison, d):
    lens_q, lens_k = [300, 0, 517, 64], [450, 200, 517, 1]
    h, hkv = 4, 2
    g = torch.Generator().manual_seed(d)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).cuda()  # noqa: E731
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v, dout = mk(sum(lens_q), h, d), mk(sum(lens_k), hkv, d), mk(sum(lens_k), hkv, d), mk(sum(lens_q), h, d)
    w = _windows([[16, 100, 150, 90], [0, 200, 0, 0]], "cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dmattn.attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), windows=w)
    out.backward(dout)
    for bi in range(len(lens_q)):
        rq, rk = slice(int(cu_q[bi]), int(cu_q[bi + 1])), slice(int(cu_k[bi]), int(cu_k[bi + 1]))
        if lens_q[bi] == 0:
            assert (leaves[1].grad[rk] == 0).all() and (leaves[2].grad[rk] == 0).all()
            continue
        sub = [t[None, r].cpu() for t, r in zip((q, k, v), (rq, rk, rk))]
        args = dict(windows=w.cpu(), dout=dout[None, rq].cpu())
        ref = run_reference(*sub, None, None, upcast=True, **args)
        low = run_reference(*sub, None, None, upcast=False, **args)
        context = f"d={d} sequence {bi}"
        check_close("out", out[None, rq], ref.out, low.out, FWD_FACTOR, context=context)
        for name, leaf, r in zip("qkv", leaves, (rq, rk, rk)):
            check_close(f"d{name}", leaf.grad[r][None], ref.grads[name], low.grads.get(name), BWD_FACTOR,
                        context=context)


def test_windows_intersect_with_window_and_causal():
    q, k, v, _, _, dout = _inputs(1, 48, 48, 2, 1, 8, torch.float32, "cpu")
    w = _windows([[2, 4, 4, 30]], "cpu")
    out, lse, grads = _run(q, k, v, dout, windows=w, window=(20, -1), causal=True)
    _check(q, k, v, dout, out, lse, grads, windows=w, window=(20, -1), causal=True)


def test_empty_row_gradients_are_zero():
    """All four window entries 0: every row is empty -> out 0, lse -inf, gradients exactly 0."""
    q, k, v, alpha, delta, dout = _inputs(1, 8, 8, 1, 1, 8, torch.float32, "cpu")
    out, lse, grads = _run(q, k, v, dout, gate=(alpha, delta), windows=_windows([[0, 0, 0, 0]], "cpu"))
    assert (out == 0).all() and (lse == float("-inf")).all()
    for name, g in grads.items():
        assert (g == 0).all(), name


@pytest.mark.parametrize("gate_fn", GATE_FNS)
def test_varlen_gate_and_windows_match_each_sequence(device, gate_fn):
    """A packed batch equals its sequences run one by one (bit for bit on the CPU; on CUDA, where
    the two take differently tiled kernels, to float32 rounding of the same bf16 inputs)."""
    torch.manual_seed(1)
    lens_q, lens_k = [5, 0, 17, 9, 70], [7, 3, 17, 0, 130]
    h, hkv, d = 4, 2, 16
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=device)
    tq, tk = sum(lens_q), sum(lens_k)
    mk = lambda *shape, s=1.0: (torch.randn(*shape) * s).to(dtype).to(device)  # noqa: E731
    q, k, v = mk(tq, h, d), mk(tk, hkv, d), mk(tk, hkv, d)
    alpha, delta = mk(tq, h, s=3.0), mk(tk, hkv, s=3.0)
    w = _windows([[1, 3, 2, 4], [0, 5, 0, 0]], device)
    dout = mk(tq, h, d)
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha, delta)]
    out = dmattn.attention_varlen(*leaves[:3], cu_q, cu_k, max(lens_q), max(lens_k), gate=leaves[3:],
                                  gate_fn=gate_fn, windows=w, causal=True)
    out.backward(dout)
    for bi in range(len(lens_q)):
        rq, rk = slice(int(cu_q[bi]), int(cu_q[bi + 1])), slice(int(cu_k[bi]), int(cu_k[bi + 1]))
        if lens_q[bi] == 0:
            continue
        sub = [t[None, r].clone().requires_grad_() for t, r in zip((q, k, v, alpha, delta), (rq, rk, rk, rq, rk))]
        ref = dmattn.attention(*sub[:3], gate=(sub[3], sub[4]), gate_fn=gate_fn, windows=w, causal=True)
        ref.backward(dout[None, rq])
        torch.testing.assert_close(out[rq], ref[0], **tol)
        for leaf, s_, r in zip(leaves, sub, (rq, rk, rk, rq, rk)):
            torch.testing.assert_close(leaf.grad[r], s_.grad[0], **tol)
    # the keys of a sequence without queries get a zero ddelta
    assert (leaves[4].grad[int(cu_k[1]):int(cu_k[2])] == 0).all()


def test_deterministic_gate_gradients_are_bitwise_reproducible(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, alpha, delta, dout = _inputs(2, 200, 300, 4, 2, 64, dtype, device)
    runs = []
    for _ in range(3):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, alpha, delta)]
        out = dmattn.attention(*leaves[:3], gate=(leaves[3], leaves[4]), causal=True, deterministic=True)
        out.backward(dout)
        runs.append([t.grad for t in leaves])
    for later in runs[1:]:
        for name, a_, b_ in zip(["dq", "dk", "dv", "dalpha", "ddelta"], runs[0], later):
            assert torch.equal(a_, b_), f"{name}: not bitwise reproducible with deterministic=True"
    ref = run_reference(q.cpu(), k.cpu(), v.cpu(), gate=(alpha.cpu(), delta.cpu()), causal=True, dout=dout.cpu())
    low = run_reference(q.cpu(), k.cpu(), v.cpu(), gate=(alpha.cpu(), delta.cpu()), causal=True, dout=dout.cpu(),
                        upcast=False)
    for name, grad in zip(["alpha", "delta"], runs[0][3:]):
        check_close(f"d{name}", grad, ref.grads[name], low.grads[name], BWD_FACTOR)


def test_nan_in_alpha_reaches_its_row_only():
    q, k, v, alpha, delta, _ = _inputs(1, 12, 12, 2, 2, 8, torch.float32, "cpu")
    alpha[0, 4, 1] = float("nan")
    out, lse = dmattn.attention(q, k, v, gate=(alpha, delta), causal=True, return_lse=True)
    assert torch.isnan(out[0, 4, 1]).all() and torch.isnan(lse[0, 1, 4])
    rest = torch.ones_like(lse, dtype=torch.bool)
    rest[0, 1, 4] = False
    assert torch.isfinite(lse[rest]).all()


def test_nan_in_delta_reaches_the_rows_that_see_the_key():
    q, k, v, alpha, delta, _ = _inputs(1, 12, 12, 1, 1, 8, torch.float32, "cpu")
    delta[0, 6, 0] = float("nan")
    out, lse = dmattn.attention(q, k, v, gate=(alpha, delta), causal=True, return_lse=True)
    assert torch.isfinite(lse[0, 0, :6]).all(), "rows before key 6 do not see it"
    assert torch.isnan(lse[0, 0, 6:]).all()


def test_errors_name_the_argument():
    q, k, v, alpha, delta, _ = _inputs(2, 8, 10, 4, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="alpha"):
        dmattn.attention(q, k, v, gate=(alpha[:, :5], delta))
    with pytest.raises(ValueError, match="delta"):
        dmattn.attention(q, k, v, gate=(alpha, delta.expand(2, 10, 2)[:, :9]))
    with pytest.raises(ValueError, match="delta"):
        dmattn.attention(q, k, v, gate=(alpha, torch.randn(2, 10, 4)))
    with pytest.raises(TypeError, match="alpha"):
        dmattn.attention(q, k, v, gate=(alpha.double(), delta))
    with pytest.raises(TypeError, match="gate"):
        dmattn.attention(q, k, v, gate=alpha)
    with pytest.raises(ValueError, match="gate_fn"):
        dmattn.attention(q, k, v, gate=(alpha, delta), gate_fn="sigmoid")
    with pytest.raises(TypeError, match="windows"):
        dmattn.attention(q, k, v, windows=torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="windows"):
        dmattn.attention(q, k, v, windows=torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="windows.*near = -1"):
        dmattn.attention(q, k, v, windows=torch.tensor([[0, -1, 0, 0]], dtype=torch.int32))
    with pytest.raises(ValueError, match="windows"):
        dmattn.attention(q, k, v, windows=torch.zeros(1, 5, dtype=torch.int32))


def test_gate_under_torch_compile():
    q, k, v, alpha, delta, dout = _inputs(1, 16, 16, 2, 2, 8, torch.float32, "cpu")
    eager = dmattn.attention(q, k, v, gate=(alpha, delta), causal=True)
    compiled = torch.compile(lambda *t: dmattn.attention(*t[:3], gate=t[3:], causal=True), fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, alpha, delta), eager)
