"""The torch.library integration: opcheck of dmattn::fwd / dmattn::bwd, torch.compile with
fullgraph=True (forward and backward, no graph break), and flash_dmattn_func's mapping of
flash-dmattn's arguments onto dmattn.attention."""

import pytest
import torch

import dmattn
from reference import check_against_reference


def _inputs(device, dtype=None, b=2, sq=9, sk=12, h=4, hkv=2, d=16, mask=True, bias_shape=(2, 4, 9, 12),
            grad=False):
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype).to(device).requires_grad_(grad)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype).to(device).requires_grad_(grad)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype).to(device).requires_grad_(grad)
    m = (torch.rand(b, 1, sq, sk, generator=g) < 0.8).to(device) if mask else None
    bias = None
    if bias_shape is not None:
        bias = torch.randn(bias_shape, generator=g).to(dtype).to(device).requires_grad_(grad)
    return q, k, v, m, bias


OPCHECK_VARIANTS = [
    dict(mask=True, bias_shape=(2, 4, 9, 12), causal=False, window=(-1, -1), scale=None, softcap=0.0),
    dict(mask=False, bias_shape=None, causal=True, window=(-1, -1), scale=0.3, softcap=0.0),
    dict(mask=True, bias_shape=(4, 1, 12), causal=False, window=(2, 1), scale=None, softcap=5.0),
    dict(mask=False, bias_shape=(2, 1, 9, 1), causal=True, window=(3, -1), scale=None, softcap=0.0),
]


@pytest.mark.parametrize("var", range(len(OPCHECK_VARIANTS)), ids=lambda i: f"v{i}")
def test_opcheck_fwd(device, var):
    o = OPCHECK_VARIANTS[var]
    q, k, v, m, bias = _inputs(device, mask=o["mask"], bias_shape=o["bias_shape"], grad=True)
    args = (q, k, v, m, bias, o["causal"], o["window"][0], o["window"][1], o["scale"], o["softcap"], False)
    torch.library.opcheck(torch.ops.dmattn.fwd.default, args)


@pytest.mark.parametrize("var", range(len(OPCHECK_VARIANTS)), ids=lambda i: f"v{i}")
def test_opcheck_bwd(device, var):
    o = OPCHECK_VARIANTS[var]
    q, k, v, m, bias = _inputs(device, mask=o["mask"], bias_shape=o["bias_shape"])
    opts = (o["causal"], o["window"][0], o["window"][1], o["scale"], o["softcap"])
    out, lse = torch.ops.dmattn.fwd(q, k, v, m, bias, *opts, False)
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, m, bias, bias is not None) + opts + (True,)
    torch.library.opcheck(torch.ops.dmattn.bwd.default, args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_forward_backward(device, backend):
    torch._dynamo.reset()
    q, k, v, m, bias = _inputs(device, grad=True, bias_shape=(2, 1, 1, 12))

    def f(q, k, v, m, bias):
        out, lse = dmattn.attention(q, k, v, m, bias, causal=True, window=(4, -1), softcap=3.0,
                                    return_lse=True)
        return (out.float() * 2).sum() + torch.where(torch.isinf(lse), 0, lse).sum().detach()

    cf = torch.compile(f, fullgraph=True, backend=backend)
    loss_c = cf(q, k, v, m, bias)
    grads_c = torch.autograd.grad(loss_c, (q, k, v, bias))
    loss_e = f(q, k, v, m, bias)
    grads_e = torch.autograd.grad(loss_e, (q, k, v, bias))
    torch.testing.assert_close(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge, rtol=0, atol=0)


def test_compile_no_graph_break_explain(device):
    torch._dynamo.reset()
    q, k, v, m, bias = _inputs(device)

    def f(q, k, v, m, bias):
        return dmattn.flash_dmattn_func(q, k, v, attn_mask=m, attn_bias=bias, is_causal=True) * 2

    ex = torch._dynamo.explain(f)(q, k, v, m, bias)
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1


def test_compile_dynamic_shapes(device):
    torch._dynamo.reset()
    cf = torch.compile(lambda q, k, v: dmattn.attention(q, k, v, causal=True), fullgraph=True,
                       backend="aot_eager", dynamic=True)
    for sq, sk in [(5, 7), (9, 11), (16, 3)]:
        q, k, v, _, _ = _inputs(device, sq=sq, sk=sk, mask=False, bias_shape=None)
        torch.testing.assert_close(cf(q, k, v), dmattn.attention(q, k, v, causal=True), rtol=0, atol=0)


def test_return_types(device):
    q, k, v, m, bias = _inputs(device)
    out = dmattn.attention(q, k, v, m, bias)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
    out2, lse = dmattn.attention(q, k, v, m, bias, return_lse=True)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


def test_lse_float64_for_float64_inputs():
    q, k, v, m, bias = _inputs("cpu", dtype=torch.float64)
    out, lse = dmattn.attention(q, k, v, m, bias, return_lse=True)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    check_against_reference(q, k, v, m, bias, out, lse)


def test_lse_is_not_differentiable_and_dbias_only_when_required(device):
    q, k, v, m, bias = _inputs(device, grad=True)
    bias.requires_grad_(False)
    out, lse = dmattn.attention(q, k, v, m, bias, return_lse=True)
    assert not lse.requires_grad
    out.sum().backward()
    assert bias.grad is None and q.grad is not None


# --------------------------------------------------------------------------- flash_dmattn_func


@pytest.mark.parametrize("is_causal", [None, False, True])
@pytest.mark.parametrize("softcap", [None, 0.0, 4.0])
def test_flash_dmattn_func_mapping(device, is_causal, softcap):
    q, k, v, m, bias = _inputs(device)
    out_f = dmattn.flash_dmattn_func(q, k, v, attn_mask=m, attn_bias=bias, softmax_scale=0.2,
                                     is_causal=is_causal, softcap=softcap)
    out_a = dmattn.attention(q, k, v, m, bias, causal=bool(is_causal), scale=0.2,
                             softcap=softcap or 0.0)
    torch.testing.assert_close(out_f, out_a, rtol=0, atol=0)


def test_flash_dmattn_func_positional_and_defaults(device):
    q, k, v, m, bias = _inputs(device)
    # positional order: query, key, value, attn_mask, attn_bias, softmax_scale, is_causal
    out_p = dmattn.flash_dmattn_func(q, k, v, m, bias, 0.5, True)
    out_a = dmattn.attention(q, k, v, m, bias, causal=True, scale=0.5)
    torch.testing.assert_close(out_p, out_a, rtol=0, atol=0)
    out_d = dmattn.flash_dmattn_func(q, k, v)
    torch.testing.assert_close(out_d, dmattn.attention(q, k, v), rtol=0, atol=0)
    assert not isinstance(dmattn.flash_dmattn_func(q, k, v, return_attn_probs=False), tuple)
    assert not isinstance(dmattn.flash_dmattn_func(q, k, v, return_attn_probs=None), tuple)


def test_flash_dmattn_func_return_attn_probs(device):
    q, k, v, m, bias = _inputs(device)
    res = dmattn.flash_dmattn_func(q, k, v, m, bias, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    out, lse, probs = res
    assert probs is None
    out_a, lse_a = dmattn.attention(q, k, v, m, bias, return_lse=True)
    torch.testing.assert_close(out, out_a, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_a, rtol=0, atol=0)


def test_flash_dmattn_func_deterministic_and_grads(device):
    q, k, v, m, bias = _inputs(device, grad=True)
    out = dmattn.flash_dmattn_func(q, k, v, m, bias, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = {"q": q.grad, "k": k.grad, "v": v.grad, "bias": bias.grad}
    _, lse = dmattn.attention(q.detach(), k.detach(), v.detach(), m, bias.detach(), return_lse=True)
    check_against_reference(q, k, v, m, bias, out.detach(), lse, grads, dout=dout)


def test_compile_fullgraph_varying_scale_and_softcap(device):
    """A compiled training step whose scale/softcap change between calls: dynamo turns the float
    into a SymFloat on the second call (automatic dynamic); the Python-side argument checks
    must stay traceable (no graph break under fullgraph=True)."""
    torch._dynamo.reset()
    q, k, v, m, bias = _inputs(device, mask=False, bias_shape=None)
    cf = torch.compile(lambda q, k, v, s: dmattn.attention(q, k, v, scale=s, softcap=4 * s),
                       fullgraph=True, backend="aot_eager")
    for s in (0.3, 0.5, 0.7):
        torch.testing.assert_close(cf(q, k, v, s), dmattn.attention(q, k, v, scale=s, softcap=4 * s),
                                   rtol=0, atol=0)
