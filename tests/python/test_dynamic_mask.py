"""dmattn.dynamic_mask and dmattn.attention_topk (docs/semantics.md, "Dynamic masks (top-k)").

* the selection against a brute-force per-row reference: ties (lower key index first),
  masked keys never selected, rows with fewer allowed keys than keep, -inf / finfo.min biases;
* result shapes (the broadcast shape of bias and mask; no (B, H, Sq, Sk) tensor for inputs
  without a query dimension), the bias untouched, keep >= Sk, keep = 1, errors;
* attention_topk against the float64 reference with the brute-force mask (forward and the
  gradients of q, k, v and the bias), causal rows that keep nothing, GQA.
"""

import pytest
import torch

import dmattn
from reference import check_against_reference


def _dtypes(device):
    return [torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32, torch.bfloat16,
                                                                      torch.float64]


def brute_force_selection(bias, keep, mask=None):
    """Row by row in Python: the allowed keys sorted by (bias descending, index ascending)."""
    shape = bias.shape if mask is None else torch.broadcast_shapes(bias.shape, mask.shape)
    values = bias.detach().cpu().double().expand(shape).reshape(-1, shape[-1])
    allowed = (torch.ones(shape, dtype=torch.bool) if mask is None
               else mask.cpu().expand(shape)).reshape(-1, shape[-1])
    out = torch.zeros(values.shape, dtype=torch.bool)
    for r in range(values.shape[0]):
        keys = [j for j in range(shape[-1]) if allowed[r, j]]
        keys.sort(key=lambda j: (-float(values[r, j]), j))
        out[r, keys[:keep]] = True
    return out.reshape(shape)


def _tied_bias(shape, dtype, device, gen, special=True):
    """Few distinct values (many ties), plus -inf and finfo.min entries."""
    bias = torch.randint(0, 4, shape, generator=gen).to(torch.float32) * 0.5
    if special:
        u = torch.rand(shape, generator=gen)
        bias = bias.to(dtype).masked_fill(u < 0.1, float("-inf"))
        bias = bias.masked_fill(u > 0.9, torch.finfo(dtype).min)
    return bias.to(dtype).to(device)


# (bias shape, mask shape or None); B=2, H=3, Sq=5, Sk=11
SHAPES = [
    ((2, 3, 1, 11), None),
    ((2, 3, 1, 11), (2, 1, 1, 11)),
    ((2, 3, 1, 11), (2, 1, 5, 11)),
    ((2, 3, 5, 11), (5, 11)),
    ((11,), (2, 1, 1, 11)),
    ((3, 1, 11), (2, 3, 5, 11)),
    ((2, 3, 1, 1), (2, 1, 1, 11)),  # a bias with key dim 1: all tied
]


@pytest.mark.parametrize("bias_shape,mask_shape", SHAPES, ids=str)
@pytest.mark.parametrize("keep", [1, 3, 7, 11, 20])
def test_selection_matches_brute_force(device, bias_shape, mask_shape, keep):
    gen = torch.Generator().manual_seed(keep * 31 + len(bias_shape))
    for dtype in _dtypes(device):
        bias = _tied_bias(bias_shape, dtype, device, gen)
        mask = None
        if mask_shape is not None:
            mask = (torch.rand(mask_shape, generator=gen) < 0.6).to(device)
        got = dmattn.dynamic_mask(bias, keep, mask)
        expected = brute_force_selection(bias, keep, mask)
        assert got.dtype == torch.bool and got.device.type == device
        assert tuple(got.shape) == tuple(expected.shape)
        assert torch.equal(got.cpu(), expected), f"dtype={dtype} keep={keep}"


@pytest.mark.parametrize("keep", [1, 2, 17, 36])
def test_selection_many_rows(device, keep):
    # 200 rows of 37 keys: ties straddling the threshold, sparse and dense masks, -inf rows.
    gen = torch.Generator().manual_seed(keep)
    for dtype in _dtypes(device)[:2]:
        bias = _tied_bias((8, 25, 37), dtype, device, gen)
        bias[0, 0] = float("-inf")
        density = torch.rand(8, 25, 1, generator=gen)
        mask = (torch.rand(8, 25, 37, generator=gen) < density).to(device)
        got = dmattn.dynamic_mask(bias, keep, mask)
        assert torch.equal(got.cpu(), brute_force_selection(bias, keep, mask)), f"dtype={dtype}"


def test_ties_go_to_lower_key_index(device):
    bias = torch.tensor([-0.0, 2.0, 1.0, 2.0, 2.0, 0.0, 1.0], device=device)  # -0.0 == 0.0
    for keep, kept in [(1, [1]), (2, [1, 3]), (4, [1, 2, 3, 4]), (6, [0, 1, 2, 3, 4, 6])]:
        got = dmattn.dynamic_mask(bias, keep)
        assert got.nonzero().flatten().tolist() == kept, f"keep={keep}"
    # Long rows of equal values (where torch.topk's order is unspecified).
    flat = torch.zeros(4, 1000, device=device)
    assert torch.equal(dmattn.dynamic_mask(flat, 37).cpu(),
                       (torch.arange(1000) < 37).expand(4, 1000))


def test_mask_respected_and_short_rows(device):
    bias = torch.tensor([[5.0, 4.0, 3.0, 2.0, float("-inf"), 1.0]] * 3, device=device)
    mask = torch.tensor([[False, True, False, True, True, False],   # 3 allowed, keep 4
                         [True, True, True, True, True, True],
                         [False] * 6], device=device)
    got = dmattn.dynamic_mask(bias, 4, mask).cpu()
    # Short row: exactly its allowed keys, the -inf one included. Empty row: nothing.
    assert got[0].tolist() == [False, True, False, True, True, False]
    assert got[1].tolist() == [True, True, True, True, False, False]
    assert not got[2].any()


def test_keep_at_least_num_keys(device):
    bias = torch.randn(2, 3, 1, 6, device=device)
    assert torch.equal(dmattn.dynamic_mask(bias, 6), torch.ones(2, 3, 1, 6, dtype=torch.bool, device=device))
    mask = torch.rand(2, 1, 4, 6, device=device) < 0.5
    got = dmattn.dynamic_mask(bias, 100, mask)
    assert tuple(got.shape) == (2, 3, 4, 6)
    assert torch.equal(got, mask.expand(2, 3, 4, 6))
    got[0, 0, 0, 0] = not bool(got[0, 0, 0, 0])  # a new tensor, not a view of the mask
    assert torch.equal(dmattn.dynamic_mask(bias, 100, mask), mask.expand(2, 3, 4, 6))
    empty = dmattn.dynamic_mask(torch.randn(2, 3, 1, 0, device=device), 4)
    assert tuple(empty.shape) == (2, 3, 1, 0)


def test_shapes_and_bias_untouched(device):
    b, h, sq, sk = 2, 4, 9, 16
    bias = torch.randn(b, h, 1, sk, device=device, requires_grad=True)
    before = bias.detach().clone()
    key_mask = torch.rand(b, 1, 1, sk, device=device) < 0.8
    # Neither input has a query dimension: one key set per (batch, head), no (B, H, Sq, Sk).
    assert tuple(dmattn.dynamic_mask(bias, 5).shape) == (b, h, 1, sk)
    assert tuple(dmattn.dynamic_mask(bias, 5, key_mask).shape) == (b, h, 1, sk)
    assert tuple(dmattn.dynamic_mask(bias[0, 0, 0], 5, key_mask).shape) == (b, 1, 1, sk)
    # A mask with a query dimension: the broadcast shape of the two.
    full = dmattn.dynamic_mask(bias, 5, torch.rand(b, 1, sq, sk, device=device) < 0.8)
    assert tuple(full.shape) == (b, h, sq, sk)
    assert not full.requires_grad and full.grad_fn is None
    assert torch.equal(bias.detach(), before) and tuple(bias.shape) == (b, h, 1, sk)
    assert bias.grad is None


def test_errors():
    bias = torch.randn(2, 3, 1, 8)
    with pytest.raises(ValueError, match="keep: .*got 0"):
        dmattn.dynamic_mask(bias, 0)
    with pytest.raises(ValueError, match="keep: "):
        dmattn.dynamic_mask(bias, -3)
    for bad in (2.0, True, None, torch.tensor(2)):
        with pytest.raises(TypeError, match="keep: "):
            dmattn.dynamic_mask(bias, bad)
    with pytest.raises(TypeError, match="bias: .*floating-point.*int64"):
        dmattn.dynamic_mask(torch.arange(8), 2)
    with pytest.raises(TypeError, match="bias: "):
        dmattn.dynamic_mask([1.0, 2.0], 1)
    with pytest.raises(ValueError, match="bias: .*rank"):
        dmattn.dynamic_mask(torch.tensor(1.0), 1)
    with pytest.raises(ValueError, match="bias: .*rank"):
        dmattn.dynamic_mask(torch.randn(1, 2, 3, 1, 8), 1)
    with pytest.raises(TypeError, match="mask: .*bool"):
        dmattn.dynamic_mask(bias, 2, torch.ones(2, 1, 1, 8))
    with pytest.raises(TypeError, match="mask: "):
        dmattn.dynamic_mask(bias, 2, "all")
    with pytest.raises(ValueError, match="mask: shape .* does not broadcast"):
        dmattn.dynamic_mask(bias, 2, torch.ones(3, 1, 1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask: .*rank"):
        dmattn.dynamic_mask(bias, 2, torch.ones(1, 2, 3, 1, 8, dtype=torch.bool))


# --------------------------------------------------------------------------- attention_topk


def _qkv(b, sq, sk, h, hkv, d, dtype, device):
    q = torch.randn(b, sq, h, d).to(dtype).to(device).requires_grad_()
    k = torch.randn(b, sk, hkv, d).to(dtype).to(device).requires_grad_()
    v = torch.randn(b, sk, hkv, d).to(dtype).to(device).requires_grad_()
    return q, k, v


def _topk_and_check(q, k, v, bias, keep, mask=None, **kw):
    out, lse = dmattn.attention_topk(q, k, v, bias, keep, mask=mask, return_lse=True, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    sk = k.shape[1]
    sel_bias = bias.detach().expand(*bias.shape[:-1], sk) if bias.shape[-1] == 1 else bias
    selected = brute_force_selection(sel_bias, keep, None if mask is None else mask.cpu())
    grads = {"q": q.grad, "k": k.grad, "v": v.grad, "bias": bias.grad}
    check_against_reference(q, k, v, selected, bias, out.detach(), lse.detach(), grads,
                            dout=dout, **kw)
    return out.detach(), lse.detach(), selected


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_heads,with_mask", [(4, False), (4, True), (2, True)],
                         ids=["H", "H+padding", "Hkv+padding"])
def test_attention_topk_matches_masked_reference(device, causal, bias_heads, with_mask):
    b, s, h, hkv, d, keep = 2, 23, 4, 2, 16, 6
    for dtype in _dtypes(device)[:2]:
        q, k, v = _qkv(b, s, s, h, hkv, d, dtype, device)
        bias_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        bias = torch.randn(b, bias_heads, 1, s).to(bias_dtype).to(device).requires_grad_()
        mask = (torch.rand(b, 1, 1, s) < 0.8).to(device) if with_mask else None
        _topk_and_check(q, k, v, bias, keep, mask, causal=causal)


def test_attention_topk_query_dependent_gqa_window(device):
    b, sq, sk, h, hkv, d, keep = 1, 7, 19, 6, 2, 8, 4
    dtype = _dtypes(device)[0]
    q, k, v = _qkv(b, sq, sk, h, hkv, d, dtype, device)
    bias = torch.randn(1, h, sq, sk).to(dtype).to(device).requires_grad_()
    mask = (torch.rand(sq, sk) < 0.7).to(device)
    _topk_and_check(q, k, v, bias, keep, mask, window=(8, 0), softcap=5.0, scale=0.3)


def test_attention_topk_causal_early_queries_keep_nothing(device):
    b, s, h, d, keep = 1, 12, 2, 16, 3
    dtype = _dtypes(device)[0]
    q, k, v = _qkv(b, s, s, h, h, d, dtype, device)
    # Increasing bias: the kept keys are the last three, in the future of queries 0..8.
    bias = torch.arange(s, dtype=torch.float32).expand(b, h, 1, s).contiguous().to(device).requires_grad_()
    out, lse, _ = _topk_and_check(q, k, v, bias, keep, causal=True)
    early = s - keep
    assert torch.all(out[:, :early] == 0)
    assert torch.all(lse[:, :, :early] == float("-inf"))
    assert torch.all(q.grad[:, :early] == 0)
    assert torch.isfinite(lse[:, :, early:]).all()


def test_attention_topk_key_broadcast_bias_keeps_first_keys(device):
    dtype = _dtypes(device)[0]
    q, k, v = _qkv(2, 5, 9, 2, 1, 8, dtype, device)
    bias = torch.zeros(2, 2, 1, 1, dtype=dtype, device=device)  # no preference: all tied
    out = dmattn.attention_topk(q, k, v, bias, 3)
    first = (torch.arange(9, device=device) < 3).expand(2, 2, 1, 9)
    assert torch.equal(out, dmattn.attention(q, k, v, first, bias))


def test_attention_topk_keep_all_keys_is_plain_attention(device):
    dtype = _dtypes(device)[0]
    q, k, v = _qkv(2, 5, 9, 2, 1, 8, dtype, device)
    bias = torch.randn(2, 2, 1, 9, dtype=dtype, device=device)
    mask = torch.rand(2, 1, 5, 9, device=device) < 0.7
    for keep in (9, 50):
        out = dmattn.attention_topk(q, k, v, bias, keep, mask=mask, causal=True)
        assert torch.equal(out, dmattn.attention(q, k, v, mask, bias, causal=True))


def test_attention_topk_errors():
    q, k, v = _qkv(1, 4, 4, 2, 2, 8, torch.float32, "cpu")
    with pytest.raises(TypeError, match="bias: "):
        dmattn.attention_topk(q, k, v, None, 2)
    with pytest.raises(ValueError, match="keep: "):
        dmattn.attention_topk(q, k, v, torch.randn(1, 2, 1, 4), 0)
    with pytest.raises(ValueError, match="k: .*rank 4"):
        dmattn.attention_topk(q, k[0], v, torch.randn(1, 2, 1, 4), 2)
