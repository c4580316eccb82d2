"""torch.autograd.gradcheck of dmattn.attention in float64 (CPU): the analytic backward of the
native kernel against finite differences of its own forward, on small configurations with a
mask and a learnable bias (+ softcap, causal, window, GQA/MQA, Sq != Sk, broadcast biases)."""

import pytest
import torch

import dmattn

CONFIGS = [
    # (B, Sq, Sk, H, Hkv, D, causal, window, softcap, scale, mask_shape, bias_shape)
    (1, 4, 4, 2, 2, 3, False, (-1, -1), 0.0, None, None, (1, 2, 4, 4)),
    (2, 5, 6, 4, 2, 3, True, (-1, -1), 0.0, None, (2, 1, 5, 6), (2, 4, 5, 6)),
    (1, 6, 5, 3, 1, 4, True, (-1, -1), 2.0, 0.7, (1, 3, 6, 5), (3, 1, 5)),
    (1, 5, 7, 4, 2, 2, False, (2, 1), 5.0, None, (5, 7), (2, 5, 7)),          # head dim = Hkv
    (2, 3, 8, 2, 1, 5, True, (3, -1), 0.0, 1.3, (2, 1, 1, 8), (2, 2, 1, 8)),  # per-key bias
    (1, 7, 7, 2, 2, 3, False, (-1, -1), 1.0, None, None, (7, 1)),             # key dim 1
    (1, 4, 6, 2, 1, 8, False, (-1, -1), 0.0, None, (1, 2, 4, 6), (6,)),       # rank-1 bias
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"cfg{i}" for i in range(len(CONFIGS))])
def test_gradcheck(cfg):
    b, sq, sk, h, hkv, d, causal, window, softcap, scale, mshape, bshape = cfg
    g = torch.Generator().manual_seed(CONFIGS.index(cfg))
    dt = torch.float64
    q = torch.randn(b, sq, h, d, dtype=dt, generator=g, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, dtype=dt, generator=g, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, dtype=dt, generator=g, requires_grad=True)
    mask = None
    if mshape is not None:
        mask = torch.rand(mshape, generator=g) < 0.75
    bias = torch.randn(bshape, dtype=dt, generator=g)
    # A few -inf entries: they must behave as masked and receive zero gradient.
    if bias.numel() > 4:
        bias.view(-1)[1] = float("-inf")
    bias.requires_grad_(True)

    def f(q, k, v, bias):
        out, lse = dmattn.attention(q, k, v, mask, bias, causal=causal, window=window,
                                    scale=scale, softcap=softcap, return_lse=True)
        return out

    assert torch.autograd.gradcheck(f, (q, k, v, bias), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_gradcheck_no_bias_no_mask_gqa():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 5, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 7, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 7, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    f = lambda q, k, v: dmattn.attention(q, k, v, causal=True, softcap=3.0)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_gradcheck_fp32_bias_with_fp64_inputs():
    """bias may be fp32 with fp64 q: dbias must come back as fp32 of the bias's shape."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 5, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 5, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(2, 1, 5, generator=g, requires_grad=True)
    out = dmattn.attention(q, k, v, bias=bias)
    out.sum().backward()
    assert bias.grad is not None and bias.grad.shape == bias.shape and bias.grad.dtype == torch.float32
    assert torch.isfinite(bias.grad).all()
