"""CUDA backward pass: seed regressions at GPU scale, numerics, every dbias reduction path,
determinism and the backend's own argument checks. All tests need a CUDA device.

Reference: tests/python/reference.py (float64 ground truth; tolerance = 3x PyTorch's own
same-dtype error + floor for gradients). Large configurations that a float64 reference cannot
afford compare against an fp32 reference computed on the GPU instead (relative norm).
"""

import math

import pytest
import torch

import dmattn
from cases import Case, check_case, leaf_grads as _grads, run_attention_backward as _run
from reference import assert_finite, check_against_reference, reference_attention

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _qkv(b, sq, sk, h, hkv, d, dtype, scale=1.0):
    q = (torch.randn(b, sq, h, d, device=DEV) * scale).to(dtype).requires_grad_()
    k = (torch.randn(b, sk, hkv, d, device=DEV) * scale).to(dtype).requires_grad_()
    v = torch.randn(b, sk, hkv, d, device=DEV).to(dtype).requires_grad_()
    return q, k, v


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _fp32_gpu_grads(q, k, v, mask, bias, dout, **kw):
    """fp32 reference on the GPU (for sizes a float64 CPU reference cannot afford)."""
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    br = bias.detach().float().requires_grad_() if bias is not None else None
    out, _ = reference_attention(qr, kr, vr, mask, br, upcast=False, **kw)
    ins = [qr, kr, vr] + ([br] if br is not None else [])
    gs = torch.autograd.grad(out, ins, dout.float())
    names = ["q", "k", "v", "bias"]
    return out.detach(), dict(zip(names, gs))


# --------------------------------------------------------------------------- seed regressions


def test_seed_000_004_bf16_s4096_window_mask_hf_bias(nan_poison):
    """bf16, S=4096, window 2048 as a bool mask + 4-D learnable bias with finfo.min where masked:
    every gradient finite in the first step (seed 000 / 004), dbias 0 outside the window."""
    torch.manual_seed(0)
    b, h, s, d, window = 1, 2, 4096, 128, 2048
    q, k, v = _qkv(b, s, s, h, h, d, torch.bfloat16)
    i = torch.arange(s, device=DEV).view(-1, 1)
    j = torch.arange(s, device=DEV).view(1, -1)
    wm = (j >= i - window) & (j <= i)
    mask = wm.expand(b, h, s, s)
    bias = torch.randn(b, h, s, s, device=DEV).masked_fill(~wm, torch.finfo(torch.bfloat16).min)
    bias = bias.to(torch.bfloat16).requires_grad_()
    out = dmattn.flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias)
    dout = torch.randn_like(out)
    out.backward(dout)
    for n, t in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        assert_finite(f"d{n}", t.grad)
    assert torch.all(bias.grad[..., ~wm] == 0)
    ref_out, ref = _fp32_gpu_grads(q, k, v, mask, bias, dout)
    assert _rel(out, ref_out) < 1e-2
    for n, t in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        assert _rel(t.grad, ref[n]) < 2e-2, n


@pytest.mark.parametrize("dout_kind", ["randn", "ones"])
def test_seed_001_dense_causal_256_d64_dv(dout_kind, nan_poison):
    """Dense causal 256x256, D=64, bf16 (seed 001): dV finite and within tolerance."""
    torch.manual_seed(42)
    q, k, v = _qkv(1, 256, 256, 1, 1, 64, torch.bfloat16)
    dout = None if dout_kind == "randn" else torch.ones(1, 256, 1, 64, dtype=torch.bfloat16, device=DEV)
    out, lse, dout = _run(q, k, v, causal=True, dout=dout)
    for n, t in (("q", q), ("k", k), ("v", v)):
        assert_finite(f"d{n}", t.grad)
    check_against_reference(q, k, v, None, None, out, lse, _grads(q, k, v), causal=True, dout=dout)


def test_seed_002_topk_per_key_bias(nan_poison):
    """Per-key learnable bias (B, H, 1, S) + a top-k bool mask built from it: finite dbias."""
    torch.manual_seed(2)
    b, h, hkv, s, d, keep = 2, 4, 2, 512, 64, 64
    q, k, v = _qkv(b, s, s, h, hkv, d, torch.bfloat16)
    bias = torch.randn(b, h, 1, s, device=DEV).to(torch.bfloat16).requires_grad_()
    idx = bias.detach().topk(keep, dim=-1).indices
    mask = torch.zeros(b, h, 1, s, dtype=torch.bool, device=DEV).scatter_(-1, idx, True)
    out, lse, dout = _run(q, k, v, mask, bias, causal=True)
    assert_finite("dbias", bias.grad)
    assert torch.all(bias.grad[~mask] == 0)
    check_against_reference(q, k, v, mask, bias, out, lse, _grads(q, k, v, bias), causal=True, dout=dout)


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("s", [1, 17, 127, 1000, 4097])
def test_tail_lengths(s, nan_poison):
    torch.manual_seed(s)
    d = 64
    sk = s if s < 4097 else 300
    q, k, v = _qkv(1, s, sk, 2, 1, d, torch.bfloat16)
    out, lse, dout = _run(q, k, v, causal=s % 2 == 1)
    check_against_reference(q, k, v, None, None, out, lse, _grads(q, k, v), causal=s % 2 == 1, dout=dout)


@pytest.mark.parametrize("d", [40, 72, 80, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_head_dims(d, dtype, nan_poison):
    torch.manual_seed(d)
    q, k, v = _qkv(2, 150, 190, 4, 2, d, dtype)
    bias = torch.randn(2, 4, 150, 190, device=DEV).to(dtype).requires_grad_()
    out, lse, dout = _run(q, k, v, None, bias, window=(40, 7))
    check_against_reference(q, k, v, None, bias, out, lse, _grads(q, k, v, bias), window=(40, 7), dout=dout)


@pytest.mark.parametrize("d", [160, 256])
@pytest.mark.parametrize("exact", ["0", "1"])
def test_head_dims_256_instantiation(d, exact, monkeypatch, nan_poison):
    """hd256 tile (64 keys per block, one Q / dO buffer); needs the forward's hd256 too."""
    monkeypatch.setenv("DMATTN_BWD_EXACT", exact)
    torch.manual_seed(d)
    q, k, v = _qkv(2, 150, 190, 4, 2, d, torch.bfloat16)
    bias = torch.randn(2, 4, 150, 190, device=DEV).to(torch.bfloat16).requires_grad_()
    try:
        out, lse, dout = _run(q, k, v, None, bias, causal=True)
    except ValueError as e:
        if "head_dim" in str(e) and "backward" not in str(e):
            pytest.skip(f"forward has no instantiation for D={d}: {e}")
        raise
    check_against_reference(q, k, v, None, bias, out, lse, _grads(q, k, v, bias), causal=True, dout=dout)


def test_empty_rows_zero_gradients(nan_poison):
    torch.manual_seed(5)
    b, s, h, d = 2, 130, 2, 64
    q, k, v = _qkv(b, s, s, h, h, d, torch.bfloat16)
    mask = torch.rand(b, h, s, s, device=DEV) < 0.5
    mask[:, :, 3] = False
    mask[:, :, 70:75] = False
    bias = torch.randn(b, h, s, s, device=DEV).to(torch.bfloat16).requires_grad_()
    out, lse, dout = _run(q, k, v, mask, bias)
    assert torch.all(lse[:, :, 3] == float("-inf"))
    assert torch.all(q.grad[:, 3] == 0) and torch.all(q.grad[:, 70:75] == 0)
    assert torch.all(bias.grad[:, :, 3] == 0)
    check_against_reference(q, k, v, mask, bias, out, lse, _grads(q, k, v, bias), dout=dout)


def test_finfo_min_bias_on_allowed_keys_no_overflow(nan_poison):
    """finfo(bf16).min bias on some allowed keys (next to normal ones): the exp argument is
    formed as (s - lse) first, so nothing overflows."""
    torch.manual_seed(6)
    q, k, v = _qkv(1, 200, 200, 2, 2, 64, torch.bfloat16)
    bias = torch.randn(1, 2, 200, 200, device=DEV)
    bias[torch.rand_like(bias) < 0.3] = torch.finfo(torch.bfloat16).min
    bias[:, :, :, 0] = 0.0  # every row keeps a normal key
    bias = bias.to(torch.bfloat16).requires_grad_()
    out, lse, dout = _run(q, k, v, None, bias)
    check_against_reference(q, k, v, None, bias, out, lse, _grads(q, k, v, bias), dout=dout)


def test_saturation_no_inf_bf16_fp16():
    torch.manual_seed(3)
    q = (torch.randn(1, 8, 1, 16) * 0.0005).half().to(DEV).requires_grad_()
    k = (torch.randn(1, 8, 1, 16) * 1000).half().to(DEV).requires_grad_()
    v = (torch.randn(1, 8, 1, 16) * 200).half().to(DEV).requires_grad_()
    dout = (torch.randn(1, 8, 1, 16) * 200).half().to(DEV)
    _run(q, k, v, dout=dout, scale=1.0)
    for n, t in (("q", q), ("k", k), ("v", v)):
        assert_finite(f"d{n}", t.grad)


def test_poisoned_scratch_changes_nothing():
    """The native layer with NaN-filled dq/dk/dv/dbias/Delta/dq_accum/dbias_accum."""
    from dmattn._lib import lib

    torch.manual_seed(7)
    b, sq, sk, h, hkv, d = 2, 300, 260, 4, 2, 64
    q, k, v = (t.detach() for t in _qkv(b, sq, sk, h, hkv, d, torch.bfloat16))
    mask = torch.rand(b, 1, sq, sk, device=DEV) < 0.8
    dout = torch.randn(b, sq, h, d, device=DEV).to(torch.bfloat16)
    for bias_shape in [(1, h, sq, sk), (b, hkv, sq, sk), (b, h, 1, sk), (1, 1, 1, sk), (b, h, sq, 1)]:
        bias = torch.randn(bias_shape, device=DEV).to(torch.bfloat16)
        out = torch.empty(b, sq, h, d, dtype=torch.bfloat16, device=DEV)
        lse = torch.empty(b, h, sq, device=DEV)
        lib().forward(q, k, v, out, lse, mask, bias, True, 100, -1, 1 / math.sqrt(d), 0.0, None, 0, None, None,
                      None, None, 0, None, None)
        results = []
        for fill in (0.0, float("nan"), float("nan")):
            dq, dk, dv = (torch.full_like(t, fill) for t in (q, k, v))
            dbias = torch.full_like(bias, fill)
            delta = torch.full((b, h, sq), fill, device=DEV)
            dq_acc = torch.full((b, sq, h, d), fill, device=DEV)
            dbias_acc = torch.full(bias.shape, fill, device=DEV)
            lib().backward(q, k, v, out, lse, mask, bias, dout, dq, dk, dv, dbias, delta, dq_acc,
                           dbias_acc, True, 100, -1, 1 / math.sqrt(d), 0.0, True, None, 0, None, False, None,
                           None, None, 0, None, None, None, None, None)
            for name, t in zip(["dq", "dk", "dv", "dbias"], [dq, dk, dv, dbias]):
                assert not torch.isnan(t).any(), f"{name} {bias_shape}: NaN left from the poisoned buffer"
            results.append([dq, dk, dv, dbias])
        for r in results[1:]:
            for name, x, y in zip(["dq", "dk", "dv", "dbias"], results[0], r):
                assert torch.equal(x, y), f"{name} {bias_shape}: depends on the buffer's contents"


# --------------------------------------------------------------------------- dbias paths

BIAS_SHAPES = [
    (2, 6, 200, 230),   # direct
    (1, 6, 200, 230),   # batch broadcast: cross-CTA accumulation
    (2, 2, 200, 230),   # one bias head per GQA group: summed in the CTA
    (2, 1, 200, 230),   # head broadcast over several kv heads: cross-CTA
    (2, 6, 1, 230),     # query broadcast, per head: column sums
    (2, 2, 1, 230),     # query broadcast, per group
    (1, 1, 1, 230),     # query + head + batch broadcast
    (2, 6, 200, 1),     # key broadcast: exactly zero
    (230,),             # rank 1
]


# d = 128 runs the Hopper kernel on compute capability 9.0 (sm90/bwd_kernel_sm90.h): column sums in
# shared memory, mask / bias tiles double buffered (16-bit bias) or single (fp32 bias).
@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias_dtype", ["same", "fp32"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_dbias_reductions(shape, bias_dtype, deterministic, d, nan_poison):
    _dbias_case(shape, bias_dtype, deterministic, d, 230)


def _dbias_case(shape, bias_dtype, deterministic, d, sk):
    torch.manual_seed(11)
    dtype = torch.bfloat16
    q, k, v = _qkv(2, 200, sk, 6, 2, d, dtype)
    bdt = dtype if bias_dtype == "same" else torch.float32
    bias = torch.randn(shape, device=DEV).to(bdt).requires_grad_()
    mask = torch.rand(2, 1, 200, sk, device=DEV) < 0.9
    out, lse, dout = _run(q, k, v, mask, bias, causal=True, deterministic=deterministic)
    if shape[-1] == 1:
        assert torch.all(bias.grad == 0)
    check_against_reference(q, k, v, mask, bias, out, lse, _grads(q, k, v, bias), causal=True, dout=dout)


# Sk = 256: 16-byte aligned mask / bias rows, so that the tiles take the cp.async path (Sk = 230
# above loads them element by element); at head dim 128 the Hopper kernel double buffers them.
@pytest.mark.parametrize("shape", [(2, 6, 200, 256), (1, 6, 200, 256), (2, 2, 200, 256), (2, 6, 1, 256),
                                   (2, 2, 1, 256)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias_dtype", ["same", "fp32"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_dbias_reductions_aligned_d128(shape, bias_dtype, deterministic, nan_poison):
    _dbias_case(shape, bias_dtype, deterministic, 128, 256)


@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap_with_bias_grad(softcap, nan_poison):
    torch.manual_seed(12)
    q, k, v = _qkv(1, 140, 140, 4, 2, 128, torch.bfloat16, scale=2.0)
    bias = torch.randn(1, 4, 140, 140, device=DEV).to(torch.bfloat16).requires_grad_()
    out, lse, dout = _run(q, k, v, None, bias, softcap=softcap, causal=True)
    check_against_reference(q, k, v, None, bias, out, lse, _grads(q, k, v, bias), softcap=softcap,
                            causal=True, dout=dout)


@pytest.mark.parametrize("seed", range(40))
def test_random_cases_gpu(seed, nan_poison):
    from cases import random_case
    c = random_case(50_000 + seed, DEV)
    check_case(c, DEV)


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("shape", [(2, 8, 512, 700), (1, 8, 512, 700), (2, 1, 512, 700), (1, 1, 1, 700)],
                         ids=lambda s: "x".join(map(str, s)))
def test_deterministic_bitwise(shape):
    torch.manual_seed(13)
    b, h, hkv, sq, sk, d = 2, 8, 2, 512, 700, 128
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(b, sq, h, d, device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, device=DEV, generator=g).to(torch.bfloat16)
    v = torch.randn(b, sk, hkv, d, device=DEV, generator=g).to(torch.bfloat16)
    bias0 = torch.randn(shape, device=DEV, generator=g).to(torch.bfloat16)
    dout = torch.randn(b, sq, h, d, device=DEV, generator=g).to(torch.bfloat16)
    res = None
    for _ in range(3):
        qq, kk, vv, bb = (t.clone().requires_grad_() for t in (q, k, v, bias0))
        out = dmattn.attention(qq, kk, vv, None, bb, causal=True, deterministic=True)
        out.backward(dout)
        cur = [qq.grad, kk.grad, vv.grad, bb.grad]
        if res is None:
            res = cur
        else:
            for name, x, y in zip(["dq", "dk", "dv", "dbias"], res, cur):
                assert torch.equal(x, y), name


# --------------------------------------------------------------------------- argument checks


def test_misaligned_dout_is_a_clear_error():
    from dmattn._lib import lib

    b, s, h, d = 1, 16, 2, 64
    q, k, v = (t.detach() for t in _qkv(b, s, s, h, h, d, torch.bfloat16))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device=DEV)
    lib().forward(q, k, v, out, lse, None, None, False, -1, -1, 0.125, 0.0, None, 0, None, None,
                  None, None, 0, None, None)
    raw = torch.randn(b * s * h * d + 1, device=DEV).to(torch.bfloat16)
    dout = raw[1:].view(b, s, h, d)  # 2-byte offset: not 16-byte aligned
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty(b, h, s, device=DEV)
    dq_acc = torch.empty(b, s, h, d, device=DEV)
    with pytest.raises(ValueError, match="dout"):
        lib().backward(q, k, v, out, lse, None, None, dout, dq, dk, dv, None, delta, dq_acc, None,
                       False, -1, -1, 0.125, 0.0, False, None, 0, None, False, None,
                       None, None, 0, None, None, None, None, None)


# --------------------------------------------------------------------------- FlashAttention-2 path
# Problems above 2^28 score elements use Delta = rowsum(dO * O) and P = exp(s - lse) with fp32
# atomics for dQ; DMATTN_BWD_EXACT=0 forces that path on test-sized problems. Cases are chosen
# well-conditioned (many keys per row, no bias reduced over keys), where the rounding of the
# stored O does not dominate the gradients.

FA2_CASES = [
    # B, Sq, Sk, H, Hkv, D, causal, window, bias shape, bias dtype
    (2, 300, 333, 4, 2, 128, False, (-1, -1), None, None),
    (1, 257, 513, 6, 2, 64, True, (-1, -1), (1, 6, 257, 513), "same"),
    (2, 200, 700, 4, 1, 72, False, (300, 64), (2, 1, 200, 700), "fp32"),   # head broadcast, MQA
    (2, 256, 384, 4, 2, 128, True, (-1, -1), (1, 4, 256, 384), "same"),    # batch broadcast: atomics
    (2, 256, 384, 4, 2, 128, False, (-1, -1), (2, 4, 1, 384), "same"),     # query broadcast
    (2, 256, 384, 4, 2, 40, False, (-1, -1), (1, 1, 1, 384), "fp32"),      # colsum across CTAs
]


@pytest.mark.parametrize("idx", range(len(FA2_CASES)), ids=lambda i: f"fa2_{i}")
@pytest.mark.parametrize("deterministic", [False, True])
def test_fa2_path(idx, deterministic, monkeypatch, nan_poison):
    monkeypatch.setenv("DMATTN_BWD_EXACT", "0")
    b, sq, sk, h, hkv, d, causal, window, bshape, bdt = FA2_CASES[idx]
    torch.manual_seed(100 + idx)
    q, k, v = _qkv(b, sq, sk, h, hkv, d, torch.bfloat16)
    bias = None
    if bshape is not None:
        dt = torch.bfloat16 if bdt == "same" else torch.float32
        bias = torch.randn(bshape, device=DEV).to(dt).requires_grad_()
    out, lse, dout = _run(q, k, v, None, bias, causal=causal, window=window, deterministic=deterministic)
    check_against_reference(q, k, v, None, bias, out, lse, _grads(q, k, v, bias), causal=causal,
                            window=window, dout=dout)


def test_fa2_path_large_vs_fp32(monkeypatch):
    """B=1, H=4, S=4096, D=128 with a dense learnable bias on the atomics path vs an fp32 GPU
    reference (relative norm)."""
    monkeypatch.setenv("DMATTN_BWD_EXACT", "0")
    torch.manual_seed(21)
    q, k, v = _qkv(1, 4096, 4096, 4, 2, 128, torch.bfloat16)
    bias = torch.randn(1, 4, 4096, 4096, device=DEV).to(torch.bfloat16).requires_grad_()
    out = dmattn.attention(q, k, v, None, bias, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out, ref = _fp32_gpu_grads(q, k, v, None, bias, dout, causal=True)
    assert _rel(out, ref_out) < 1e-2
    for n, t in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        assert_finite(f"d{n}", t.grad)
        assert _rel(t.grad, ref[n]) < 2e-2, n
