"""Edge cases of the contract and regressions for the first bug reports ("seed 000" to "seed 003"):

* rows with no allowed key: out 0, lse -inf, every gradient contribution exactly 0;
* fully masked blocks, -inf and finfo.min biases, Sk = 0, Sq = 0, B = 0;
* seed 000/004: bf16 + window (as a mask, and HF-style as a 4-D learnable bias filled with
  finfo(bf16).min outside the window): finite gradients in the first step;
* seed 001: dense causal bf16 D=64: dV finite and within tolerance;
* seed 002: top-k mask built from a per-key learnable bias: finite dbias;
* seed 003: NaN-poisoned output/scratch buffers change nothing (ops allocate with torch.empty;
  the native layer is also called directly with NaN-filled destination buffers);
* saturation: a finite fp32 result beyond the fp16 range is stored as +-finfo.max, not Inf.
Everything runs at CPU scale here; the full-scale versions are marked ``gpu``.
"""

import math

import pytest
import torch

import dmattn
from cases import leaf_grads as _grads, run_attention_backward as _run
from reference import (allowed_window, assert_finite, check_against_reference, run_reference)

LOW = [torch.bfloat16, torch.float16, torch.float32]


def _dtypes(device):
    return [torch.bfloat16, torch.float16] if device == "cuda" else LOW + [torch.float64]


def _qkv(b, sq, sk, h, hkv, d, dtype, device, grad=True, scale=1.0):
    q = (torch.randn(b, sq, h, d) * scale).to(dtype).to(device).requires_grad_(grad)
    k = (torch.randn(b, sk, hkv, d) * scale).to(dtype).to(device).requires_grad_(grad)
    v = torch.randn(b, sk, hkv, d).to(dtype).to(device).requires_grad_(grad)
    return q, k, v


# --------------------------------------------------------------------------- empty rows


@pytest.mark.parametrize("dtype", LOW + [torch.float64], ids=str)
def test_fully_masked_rows(device, dtype, nan_poison):
    if dtype not in _dtypes(device):
        pytest.skip("dtype not supported on this device")
    b, s, h, hkv, d = 2, 37, 4, 2, 32
    q, k, v = _qkv(b, s, s, h, hkv, d, dtype, device)
    mask = torch.rand(b, h, s, s) < 0.7
    empty_rows = [(0, 0, 0), (0, 1, 5), (1, 3, 36), (1, 2, 17)]
    for bb, hh, ii in empty_rows:
        mask[bb, hh, ii] = False
    mask = mask.to(device)
    bias = torch.randn(b, h, s, s).to(dtype).to(device).requires_grad_()
    out, lse, dout = _run(q, k, v, mask, bias)
    for bb, hh, ii in empty_rows:
        assert torch.all(out[bb, ii, hh] == 0), "out of an empty row must be exactly 0"
        assert lse[bb, hh, ii] == float("-inf"), "lse of an empty row must be -inf"
        assert torch.all(q.grad[bb, ii, hh] == 0), "dq of an empty row must be exactly 0"
        assert torch.all(bias.grad[bb, hh, ii] == 0), "dbias of an empty row must be exactly 0"
    assert int((lse == float("-inf")).sum()) == len(empty_rows)
    check_against_reference(q, k, v, mask, bias, out, lse, _grads(q, k, v, bias), dout=dout)


def test_all_rows_masked(device, nan_poison):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # CUDA takes fp16/bf16 only
    q, k, v = _qkv(1, 9, 11, 2, 1, 16, dtype, device)
    mask = torch.zeros(1, 1, 9, 11, dtype=torch.bool, device=device)
    out, lse, _ = _run(q, k, v, mask)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    for t in (q, k, v):
        assert torch.all(t.grad == 0)


def test_causal_sq_greater_than_sk_rows_empty(device, nan_poison):
    """Bottom-right causal with Sq > Sk: the first Sq - Sk queries see no key."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = _qkv(2, 20, 7, 2, 2, 16, dtype, device)
    out, lse, dout = _run(q, k, v, causal=True)
    assert torch.all(lse[:, :, :13] == float("-inf")) and torch.isfinite(lse[:, :, 13:]).all()
    assert torch.all(out[:, :13] == 0) and torch.all(q.grad[:, :13] == 0)
    check_against_reference(q, k, v, None, None, out, lse, _grads(q, k, v), causal=True, dout=dout)


def test_window_bottom_right_alignment(device):
    """A picture of the contract: Sq=3, Sk=5, causal -> query i sees keys j <= i + 2."""
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed_window(3, 5, True, (-1, -1)), expected)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = _qkv(1, 3, 5, 1, 1, 8, dtype, device, grad=False)
    out_c = dmattn.attention(q, k, v, causal=True)
    out_m = dmattn.attention(q, k, v, mask=expected.to(device))
    torch.testing.assert_close(out_c, out_m, rtol=0, atol=0)
    out_w = dmattn.attention(q, k, v, window=(-1, 0))
    torch.testing.assert_close(out_c, out_w, rtol=0, atol=0)
    # causal + window: min of the right bounds.
    out_cw = dmattn.attention(q, k, v, causal=True, window=(1, 2))
    out_m2 = dmattn.attention(q, k, v, mask=allowed_window(3, 5, False, (1, 0)).to(device))
    torch.testing.assert_close(out_cw, out_m2, rtol=0, atol=0)


@pytest.mark.parametrize("window", [(2**63 - 1, 2**63 - 1), (2**70, 2**64), (2**32 + 3, 2**31), (70, 9)])
def test_window_reaching_every_key_is_unbounded(device, window):
    """Window bounds that reach every position -- up to int64's largest and past it, where the
    kernels' position arithmetic on them would overflow (and an int32 copy wrap) -- give the
    unbounded answers, with causal and in a packed batch too; one short of reaching, they do not."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = _qkv(2, 9, 71, 2, 1, 16, dtype, device, grad=False)
    # Bounds at or past the keys / queries are unbounded, the same call bit for bit; (70, 9) runs
    # the window's tests (on CUDA possibly another rounding of the same values).
    tol = dict(rtol=0, atol=0) if window[0] >= 71 or device == "cpu" else {}
    for causal in (False, True):
        got = dmattn.attention(q, k, v, window=window, causal=causal)
        torch.testing.assert_close(got, dmattn.attention(q, k, v, causal=causal), **tol)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 71, 142], dtype=torch.int32, device=device)
    packed = (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu_k, 9, 71)
    got = dmattn.attention_varlen(*packed, window=window)
    torch.testing.assert_close(got, dmattn.attention_varlen(*packed), **tol)
    # (the left bound reaches every key at 70 here: key 0 from the last query; 69 leaves it out)
    short = dmattn.attention(q, k, v, window=(69, 8))
    assert not torch.equal(short, dmattn.attention(q, k, v)), "a window one short of every key must bound"


def test_fully_masked_blocks(device, nan_poison):
    """Whole 64x64 tiles (and more) masked out, on sizes that do not divide the tiles."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    s = 200
    q, k, v = _qkv(1, s, s, 2, 1, 64, dtype, device)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool)
    mask[..., 0:64, 64:128] = False
    mask[..., 64:128, :] = False       # a whole block-row empty
    mask[..., :, 128:192] = False      # a whole block-column
    mask[..., 150:, :100] = False
    mask = mask.to(device)
    bias = torch.randn(1, 2, 1, s).to(dtype).to(device).requires_grad_()
    out, lse, dout = _run(q, k, v, mask, bias, causal=True)
    assert torch.all(k.grad[:, 128:192] == 0) and torch.all(v.grad[:, 128:192] == 0)
    assert torch.all(bias.grad[..., 128:192] == 0)
    check_against_reference(q, k, v, mask, bias, out, lse, _grads(q, k, v, bias), causal=True, dout=dout)


# --------------------------------------------------------------------------- bias values


@pytest.mark.parametrize("fill", ["-inf", "finfo.min", "-1e4"])
def test_disallowed_positions_ignore_bias_value(device, fill, nan_poison):
    """What the bias holds at a masked position never matters (finite, finfo.min, -inf)."""
    for dtype in _dtypes(device):
        torch.manual_seed(1)
        q, k, v = _qkv(2, 33, 45, 4, 2, 16, dtype, device)
        mask = (torch.rand(2, 1, 33, 45) < 0.6).to(device)
        base = torch.randn(2, 4, 33, 45).to(dtype)
        val = {"-inf": float("-inf"), "finfo.min": torch.finfo(dtype).min, "-1e4": -1e4}[fill]
        b1 = base.clone().to(device).requires_grad_()
        b2 = base.masked_fill(~mask.cpu(), val).to(device).detach().requires_grad_()
        out1, lse1, dout = _run(q, k, v, mask, b1)
        g1 = {n: t.grad.clone() for n, t in (("q", q), ("k", k), ("v", v), ("bias", b1))}
        for t in (q, k, v):
            t.grad = None
        out2, lse2, _ = _run(q, k, v, mask, b2, dout=dout)
        torch.testing.assert_close(out1, out2, rtol=0, atol=0)
        torch.testing.assert_close(lse1, lse2, rtol=0, atol=0)
        for n, t in (("q", q), ("k", k), ("v", v)):
            torch.testing.assert_close(g1[n], t.grad, rtol=0, atol=0, msg=f"d{n} ({dtype})")
        assert_finite("dbias", b2.grad)
        assert torch.all(b2.grad[~mask.expand(2, 4, 33, 45)] == 0)
        torch.testing.assert_close(g1["bias"], b2.grad, rtol=0, atol=0)


def test_neg_inf_bias_acts_as_mask(device, nan_poison):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = _qkv(1, 24, 24, 2, 2, 32, dtype, device)
    keep = torch.rand(1, 2, 24, 24) < 0.5
    keep[0, 1, 3] = False                               # an empty row made of -inf only
    bias = torch.zeros(1, 2, 24, 24).masked_fill(~keep, float("-inf")).to(dtype).to(device)
    bias.requires_grad_()
    out, lse, dout = _run(q, k, v, None, bias)
    assert lse[0, 1, 3] == float("-inf") and torch.all(out[0, 3, 1] == 0)
    assert torch.all(bias.grad[~keep.to(device)] == 0)
    out_m = dmattn.attention(q.detach(), k.detach(), v.detach(), keep.to(device))
    torch.testing.assert_close(out, out_m, rtol=0, atol=0)
    check_against_reference(q, k, v, None, bias, out, lse, _grads(q, k, v, bias), dout=dout)


def test_all_allowed_keys_at_finfo_min_row(device, nan_poison):
    """A row whose every allowed key carries bias finfo(bf16).min (HF's fully padded query row).

    Mathematically softmax(x + c) = softmax(x); in floating point c + x_j rounds to c, so every
    implementation (and the float64 reference) sees a uniform distribution over the row's keys.
    The backward must then use P = 1/n, consistently with the forward (recomputing
    P = exp(s - lse) with lse = c + log n absorbed into c gives P = 1 and n-times too large
    gradients)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    s = 16
    q, k, v = _qkv(1, s, s, 1, 1, 16, dtype, device)
    bias = torch.randn(1, 1, s, s)
    bias[0, 0, 4, :] = torch.finfo(torch.bfloat16).min
    bias = bias.to(dtype).to(device).requires_grad_()
    out, lse, dout = _run(q, k, v, None, bias)
    assert_finite("out", out)
    torch.testing.assert_close(out[0, 4, 0].float(), v.detach()[0, :, 0].float().mean(0),
                               rtol=1e-2, atol=1e-2)
    check_against_reference(q, k, v, None, bias, out, lse, _grads(q, k, v, bias), dout=dout)


def test_saturation_fp16_no_inf(device, nan_poison):
    """A finite fp32 gradient beyond fp16's range is stored as +-65504, never Inf."""
    torch.manual_seed(3)
    q = (torch.randn(1, 8, 1, 16) * 0.0005).half().to(device).requires_grad_()
    k = (torch.randn(1, 8, 1, 16) * 1000).half().to(device).requires_grad_()
    v = (torch.randn(1, 8, 1, 16) * 200).half().to(device).requires_grad_()
    dout = (torch.randn(1, 8, 1, 16) * 200).half().to(device)
    out, lse, _ = _run(q, k, v, dout=dout, scale=1.0)
    ref = run_reference(q.cpu(), k.cpu(), v.cpu(), dout=dout.cpu(), scale=1.0)
    big = (ref.grads["q"].abs() > 65504).to(device)
    assert big.any(), "test set-up: expected a reference dq beyond the fp16 range"
    for n, t in (("q", q), ("k", k), ("v", v)):
        assert_finite(f"d{n}", t.grad)
    assert torch.all(q.grad[big].abs() == 65504), "must saturate to +-finfo(fp16).max"
    assert torch.equal(q.grad[big].sign().double().cpu(), ref.grads["q"][big.cpu()].sign())


# --------------------------------------------------------------------------- empty sizes


@pytest.mark.parametrize("d", [16, 128])
@pytest.mark.parametrize("b,sq,sk", [(2, 5, 0), (2, 0, 5), (0, 5, 5), (2, 0, 0), (0, 0, 0)])
def test_empty_dims(device, b, sq, sk, d, nan_poison):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    h, hkv = 4, 2
    q, k, v = _qkv(b, sq, sk, h, hkv, d, dtype, device)
    mask = torch.ones(b, 1, sq, sk, dtype=torch.bool, device=device)
    bias = torch.randn(b, h, 1, sk).to(dtype).to(device).requires_grad_()
    out, lse = dmattn.attention(q, k, v, mask, bias, causal=True, return_lse=True)
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)
    assert lse.dtype == torch.float32
    assert torch.all(out == 0)
    assert torch.all(lse == float("-inf"))
    out.backward(torch.randn_like(out))
    for n, t in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        assert t.grad is not None and t.grad.shape == t.shape, n
        assert torch.all(t.grad == 0), f"d{n} must be zero-filled (all rows empty / no rows)"


# --------------------------------------------------------------------------- seed scenarios


def _window_mask(s, window):
    """The seed's loop: key j allowed for query i iff i - window <= j <= i."""
    i = torch.arange(s).view(-1, 1)
    j = torch.arange(s).view(1, -1)
    return (j >= i - window) & (j <= i)


def _seed_000_004(device, s, window, h, d, variant, dtype=torch.bfloat16):
    torch.manual_seed(0)
    b = 1
    q, k, v = _qkv(b, s, s, h, h, d, dtype, device)
    wm = _window_mask(s, window)
    if variant == "mask":            # window expressed as a bool mask + a 4-D learnable bias
        mask = wm.expand(b, h, s, s).to(device)
        bias = torch.randn(b, h, s, s).to(dtype).to(device).requires_grad_()
    elif variant == "hf_bias":       # HF-style: finfo.min outside the window, no mask
        mask = None
        bias = torch.randn(b, h, s, s).masked_fill(~wm, torch.finfo(dtype).min)
        bias = bias.to(dtype).to(device).requires_grad_()
    else:                            # both
        mask = wm.expand(b, h, s, s).to(device)
        bias = torch.randn(b, h, s, s).masked_fill(~wm, torch.finfo(dtype).min)
        bias = bias.to(dtype).to(device).requires_grad_()
    out = dmattn.flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias)
    dout = torch.randn_like(out)
    out.backward(dout)
    for n, t in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        assert_finite(f"d{n}", t.grad)
    _, lse = dmattn.attention(q.detach(), k.detach(), v.detach(), mask, bias.detach(), return_lse=True)
    check_against_reference(q, k, v, mask, bias, out.detach(), lse, _grads(q, k, v, bias), dout=dout)
    assert torch.all(bias.grad[..., ~wm.to(device)] == 0)


@pytest.mark.parametrize("variant", ["mask", "hf_bias", "both"])
def test_seed_000_004_bf16_window_first_step(device, variant, nan_poison):
    _seed_000_004(device, s=256, window=128, h=2, d=64, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["mask", "hf_bias"])
def test_seed_000_004_full_scale_gpu(variant, nan_poison):
    _seed_000_004("cuda", s=4096, window=2048, h=8, d=128, variant=variant)


def _seed_001(device, s, d):
    torch.manual_seed(42)
    q, k, v = _qkv(1, s, s, 1, 1, d, torch.bfloat16, device)
    out, lse, dout = _run(q, k, v, causal=True, dout=None)
    for n, t in (("q", q), ("k", k), ("v", v)):
        assert_finite(f"d{n}", t.grad)
    check_against_reference(q, k, v, None, None, out, lse, _grads(q, k, v), causal=True, dout=dout)


def test_seed_001_dense_causal_bf16_dv(device, nan_poison):
    _seed_001(device, s=256, d=64)


def test_seed_001_sum_loss(device, nan_poison):
    """The report's exact loss (out.sum()): dout of ones."""
    torch.manual_seed(42)
    q, k, v = _qkv(1, 256, 256, 1, 1, 64, torch.bfloat16, device)
    out, lse, dout = _run(q, k, v, causal=True, dout=torch.ones(1, 256, 1, 64, dtype=torch.bfloat16, device=device))
    assert_finite("dv", v.grad)
    check_against_reference(q, k, v, None, None, out, lse, _grads(q, k, v), causal=True, dout=dout)


@pytest.mark.gpu
@pytest.mark.parametrize("s,d", [(256, 64), (1024, 128), (4096, 64)])
def test_seed_001_gpu(s, d, nan_poison):
    _seed_001("cuda", s, d)


def _seed_002(device, s, keep, h, hkv, d, dtype):
    torch.manual_seed(2)
    b = 2
    q, k, v = _qkv(b, s, s, h, hkv, d, dtype, device)
    bias = torch.randn(b, h, 1, s).to(dtype).to(device).requires_grad_()
    idx = bias.detach().topk(keep, dim=-1).indices
    mask = torch.zeros(b, h, 1, s, dtype=torch.bool, device=device).scatter_(-1, idx, True)
    out, lse, dout = _run(q, k, v, mask, bias, causal=True)
    assert bias.grad.shape == bias.shape and bias.grad.dtype == bias.dtype
    assert_finite("dbias", bias.grad)
    assert torch.all(bias.grad[~mask] == 0)
    check_against_reference(q, k, v, mask, bias, out, lse, _grads(q, k, v, bias), causal=True, dout=dout)
    # flash-dmattn's older variant: the non-top-k positions of the bias set to -inf (no mask).
    bias2 = bias.detach().masked_fill(~mask, float("-inf")).requires_grad_()
    for t in (q, k, v):
        t.grad = None
    out2, lse2, _ = _run(q, k, v, None, bias2, causal=True, dout=dout)
    assert_finite("dbias", bias2.grad)
    # Against the reference, not bitwise against `out`: the two calls may take different kernels
    # (on CUDA the mask + per-key bias call takes the gather path), whose sums run in another order.
    check_against_reference(q, k, v, None, bias2, out2, lse2, _grads(q, k, v, bias2), causal=True, dout=dout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_seed_002_topk_mask_from_per_key_bias(device, dtype, nan_poison):
    if dtype not in _dtypes(device):
        pytest.skip("dtype not supported on this device")
    _seed_002(device, s=96, keep=24, h=4, hkv=2, d=32, dtype=dtype)


@pytest.mark.gpu
def test_seed_002_gpu(nan_poison):
    _seed_002("cuda", s=2048, keep=256, h=16, hkv=4, d=128, dtype=torch.bfloat16)


# --------------------------------------------------------------------------- NaN-poisoned buffers


def _nan_like(t):
    return torch.full_like(t, float("nan"))


@pytest.mark.parametrize("shape", [(2, 37, 19, 4, 2, 24), (1, 70, 130, 2, 1, 64), (2, 0, 9, 2, 2, 8),
                                   (2, 9, 0, 2, 2, 8)])
def test_native_layer_nan_poisoned_destinations(device, shape):
    """Seed 003 at the destination-passing native layer: the same call with NaN-filled out /
    lse / dq / dk / dv / dbias (and CUDA scratch) gives bitwise the same results."""
    from dmattn._lib import lib

    b, sq, sk, h, hkv, d = shape
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    q, k, v = _qkv(b, sq, sk, h, hkv, d, dtype, device, grad=False)
    mask = (torch.rand(b, 1, sq, sk) < 0.8).to(device)
    if sq > 1:
        mask[:, :, 1] = False
    bias = torch.randn(1, h, sq, sk).to(dtype).to(device)
    dout = torch.randn(b, sq, h, d).to(dtype).to(device)
    scale = 1 / math.sqrt(d)
    results = []
    for fill in (0.0, float("nan"), 0.0, float("nan")):
        out = torch.full((b, sq, h, d), fill, dtype=dtype, device=device)
        lse = torch.full((b, h, sq), fill, dtype=torch.float32, device=device)
        lib().forward(q, k, v, out, lse, mask, bias, True, 7, -1, scale, 0.0, None, 0, None, None,
                      None, None, 0, None, None)
        dq, dk, dv = (torch.full_like(t, fill) for t in (q, k, v))
        dbias = torch.full_like(bias, fill)
        delta = dq_acc = dbias_acc = None
        if device == "cuda":
            delta = torch.full((b, h, sq), fill, dtype=torch.float32, device=device)
            dq_acc = torch.full((b, sq, h, d), fill, dtype=torch.float32, device=device)
            dbias_acc = torch.full(bias.shape, fill, dtype=torch.float32, device=device)
        lib().backward(q, k, v, out, lse, mask, bias, dout, dq, dk, dv, dbias, delta, dq_acc,
                       dbias_acc, True, 7, -1, scale, 0.0, True, None, 0, None, False, None,
                       None, None, 0, None, None, None, None, None)
        res = [out, lse, dq, dk, dv, dbias]
        for name, t in zip(["out", "lse", "dq", "dk", "dv", "dbias"], res):
            assert not torch.isnan(t).any(), f"{name}: NaN left from the poisoned buffer"
        results.append(res)
    for r in results[1:]:
        for name, a, b_ in zip(["out", "lse", "dq", "dk", "dv", "dbias"], results[0], r):
            assert torch.equal(a, b_), f"{name}: result depends on the destination's contents"


def test_op_level_after_freed_nan_tensors(device):
    """Op level: NaN-filled tensors of the outputs' sizes are freed right before each call (the
    allocator is likely to hand their memory back); results must not change."""
    q, k, v = _qkv(2, 45, 45, 4, 2, 32, torch.bfloat16, device)
    mask = (torch.rand(2, 1, 45, 45) < 0.7).to(device)
    bias = torch.randn(2, 4, 45, 45).to(torch.bfloat16).to(device).requires_grad_()
    dout = torch.randn(2, 45, 4, 32).to(torch.bfloat16).to(device)
    ref = None
    for _ in range(3):
        junk = [torch.full(t.shape, float("nan"), dtype=t.dtype, device=device) for t in (q, k, v, bias)]
        junk += [torch.full((2, 4, 45), float("nan"), device=device)]
        del junk
        for t in (q, k, v, bias):
            t.grad = None
        out, lse = torch.ops.dmattn.fwd(q, k, v, mask, bias, True, -1, -1, None, 0.0, False)
        out.backward(dout)
        res = [out.detach(), lse, q.grad, k.grad, v.grad, bias.grad]
        for t in res:
            assert not torch.isnan(t).any()
        if ref is None:
            ref = res
        else:
            for a, b_ in zip(ref, res):
                assert torch.equal(a, b_)
