"""The gather path's native CUDA glue (ops.select_topk_positions, ops.gather_key_rows,
ops.scatter_key_rows) against the torch composition it replaces: the same positions bit for bit
(ties, -0.0 == 0.0, -inf, NaN, strided and broadcast rows), the same gathered rows, the same
scattered gradients, clear errors."""

import pytest
import torch

import dmattn
from dmattn import gather, ops, topk
from dmattn.masks import selection_key

pytestmark = pytest.mark.gpu


def _reference_positions(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """gather.topk_key_set's torch selection: top-k of the integer selection key, sorted."""
    key = selection_key(scores, None)
    return key.topk(keep, dim=-1, sorted=False).indices.sort(dim=-1).values.int()


def _scores(kind: str, shape, dtype):
    g = torch.Generator().manual_seed(hash(kind) % 1000)
    if kind == "random":
        x = torch.randn(*shape, generator=g)
    elif kind == "ties":  # few distinct values: the lower index decides most of the selection
        x = torch.randint(-2, 3, shape, generator=g).float()
    else:  # special values: signed zeros, infinities, NaN, finfo extremes
        pool = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0,
                             torch.finfo(dtype).max, torch.finfo(dtype).min])
        x = pool[torch.randint(0, len(pool), shape, generator=g)]
    return x.to(device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["random", "ties", "special"])
# (rows up to 32768 keys stay in registers, loaded 16 bytes at a time where the row allows:
# 20001 keys do not; longer rows are read again at each pass)
@pytest.mark.parametrize("num_keys,keep", [(1, 1), (100, 1), (1000, 37), (1000, 999), (1000, 1000), (8192, 2048),
                                           (20001, 3000), (32768, 2048), (32769, 100), (40000, 5000)])
def test_select_topk_positions_matches_torch(dtype, kind, num_keys, keep):
    scores = _scores(kind, (2, 3, num_keys), dtype)
    got = ops.select_topk_positions(scores, keep)
    torch.testing.assert_close(got, _reference_positions(scores, keep), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["random", "special"])
def test_select_topk_values_are_the_scores_at_the_positions(dtype, kind):
    """The optional values output: the scores at the selected keys, bit for bit (NaN, -0.0 and
    infinities included), from a (rows_b, rows_h, Sk) view or the (rows_b, rows_h, 1, Sk) bias."""
    bias = _scores(kind, (2, 3, 1, 1000), dtype)
    for scores, values_shape in ((bias[:, :, 0], (2, 3, 37)), (bias, (2, 3, 1, 37))):
        values = torch.full(values_shape, 7.0, device="cuda", dtype=dtype)
        positions = ops.select_topk_positions(scores, 37, values=values)
        torch.testing.assert_close(positions, _reference_positions(bias[:, :, 0], 37), rtol=0, atol=0)
        want = torch.gather(bias[:, :, 0], -1, positions.long())
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(values.reshape(want.shape).view(bits), want.view(bits))


def test_select_topk_positions_strided_and_broadcast_rows():
    base = _scores("ties", (3, 2, 500), torch.bfloat16)
    for scores in (base.transpose(0, 1), base[:, :1].expand(3, 4, 500), base[..., ::2], base[:1, :1, :1].expand(2, 2, 300)):
        got = ops.select_topk_positions(scores, 50)
        torch.testing.assert_close(got, _reference_positions(scores, 50), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pos_shape", [(2, 3), (1, 3), (2, 1), (1, 1)])
@pytest.mark.parametrize("dim", [40, 36, 256])  # 16-byte chunks (bf16 36: element by element), a long row
def test_gather_key_rows_matches_indexing(dtype, pos_shape, dim):
    batch, num_keys, heads, width = 2, 300, 3, 17
    g = torch.Generator().manual_seed(1)
    k = torch.randn(batch, num_keys, heads, dim, generator=g).to("cuda", dtype)
    v = torch.randn(batch, num_keys, heads * 2, dim, generator=g).to("cuda", dtype)[:, :, ::2]  # strided heads
    bias = torch.randn(*pos_shape, num_keys, generator=g).to("cuda", dtype)
    positions = torch.stack([torch.randperm(num_keys, generator=g)[:width].sort().values
                             for _ in range(pos_shape[0] * pos_shape[1])]).view(*pos_shape, width).int()
    positions[..., -1] = -1  # padding: zero rows
    positions = positions.to("cuda")
    k_rows, v_rows, bias_rows = ops.gather_key_rows(k, v, positions, bias)
    idx = positions.long().clamp_min(0).expand(batch, heads, width)
    valid = (positions >= 0).expand(batch, heads, width).transpose(1, 2).unsqueeze(-1)
    for x, rows in ((k, k_rows), (v, v_rows)):
        want = torch.gather(x, 1, idx.transpose(1, 2).unsqueeze(-1).expand(batch, width, heads, dim))
        torch.testing.assert_close(rows, torch.where(valid, want, 0), rtol=0, atol=0)
    want_bias = torch.where(positions >= 0, torch.gather(bias, -1, positions.long().clamp_min(0)), 0)
    torch.testing.assert_close(bias_rows[:, :, 0], want_bias, rtol=0, atol=0)


def _scatter_inputs(dtype, batch, num_keys, heads, dim, width, pos_shape, padding, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(batch, width, heads, dim, generator=g).to("cuda", dtype) for _ in range(2)]
    positions = torch.stack([torch.randperm(num_keys, generator=g)[:width].sort().values
                             for _ in range(pos_shape[0] * pos_shape[1])]).view(*pos_shape, width).int()
    if padding:
        positions[..., width - padding:] = -1
    dbias_rows = torch.randn(*pos_shape, 1, width, generator=g).to("cuda", dtype)
    return rows, positions.to("cuda"), dbias_rows


def _scatter_reference(rows, positions, num_keys, pos_shape):
    """zeros, then each gathered row copied to its position (padding rows dropped): the torch
    composition the kernel replaces."""
    batch, width, heads, dim = rows.shape
    full = torch.zeros(batch, num_keys + 1, heads, dim, dtype=rows.dtype, device=rows.device)
    index = positions.long().masked_fill(positions < 0, num_keys).expand(batch, heads, width)
    full.scatter_(1, index.transpose(1, 2).unsqueeze(-1).expand(batch, width, heads, dim), rows)
    return full[:, :num_keys]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pos_shape", [(2, 3), (1, 3), (2, 1), (1, 1)])
@pytest.mark.parametrize("dim,num_keys,width,padding", [(128, 1000, 300, 0), (64, 257, 257, 0), (36, 700, 41, 5),
                                                        (256, 513, 100, 1), (96, 9000, 2048, 0)])
def test_scatter_key_rows_matches_the_torch_scatter(dtype, pos_shape, dim, num_keys, width, padding, nan_poison):
    """dk, dv and dbias at full size, bit for bit: the gathered rows at their positions, zeros
    at every other key (outputs start as NaN: every element must be written); head dims with
    16-byte rows and without (36 x 2 bytes), key counts across the kernel's 256-key slices,
    positions broadcast over batch and heads, padding."""
    batch, heads = 2, 3
    (dk_rows, dv_rows), positions, dbias_rows = _scatter_inputs(dtype, batch, num_keys, heads, dim, width, pos_shape,
                                                                padding)
    dk, dv, dbias = ops.scatter_key_rows(dk_rows, dv_rows, positions, (batch, num_keys, heads, dim), dbias_rows,
                                         (*pos_shape, 1, num_keys))
    assert torch.equal(dk, _scatter_reference(dk_rows, positions, num_keys, pos_shape))
    assert torch.equal(dv, _scatter_reference(dv_rows, positions, num_keys, pos_shape))
    want_bias = torch.zeros(*pos_shape, num_keys + 1, dtype=dtype, device="cuda")
    want_bias.scatter_(-1, positions.long().masked_fill(positions < 0, num_keys), dbias_rows[:, :, 0])
    assert torch.equal(dbias[:, :, 0], want_bias[..., :num_keys])
    dk2, dv2, none = ops.scatter_key_rows(dk_rows, dv_rows, positions, (batch, num_keys, heads, dim))
    assert none is None and torch.equal(dk2, dk) and torch.equal(dv2, dv)


def test_scatter_key_rows_unaligned_rows():
    """Rows that start 8 bytes past a 16-byte boundary take the element-wise copy."""
    (dk_rows, dv_rows), positions, _ = _scatter_inputs(torch.bfloat16, 1, 300, 2, 64, 50, (1, 2), 0)
    shifted = torch.empty(dk_rows.numel() + 4, dtype=dk_rows.dtype, device="cuda")[4:].view(dk_rows.shape)
    shifted.copy_(dk_rows)
    assert shifted.data_ptr() % 16 == 8
    dk, dv, _ = ops.scatter_key_rows(shifted, dv_rows, positions, (1, 300, 2, 64))
    assert torch.equal(dk, _scatter_reference(dk_rows, positions, 300, (1, 2)))
    assert torch.equal(dv, _scatter_reference(dv_rows, positions, 300, (1, 2)))


def test_glue_errors_name_the_argument():
    scores = torch.randn(2, 3, 100, device="cuda")
    with pytest.raises(ValueError, match="keep"):
        ops.select_topk_positions(scores, 101)
    with pytest.raises(TypeError, match="bias"):
        ops.select_topk_positions(scores.double(), 10)
    with pytest.raises(ValueError, match="bias"):  # rank 4 needs a query dim of 1
        ops.select_topk_positions(scores.view(2, 3, 2, 50), 10)
    with pytest.raises(TypeError, match="values"):
        ops.select_topk_positions(scores, 10, values=torch.empty(2, 3, 10, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="values"):
        ops.select_topk_positions(scores, 10, values=torch.empty(2, 3, 11, device="cuda"))
    k = torch.randn(1, 50, 2, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="v"):
        ops.gather_key_rows(k, k.float(), torch.zeros(1, 2, 5, dtype=torch.int32, device="cuda"), None)
    with pytest.raises(ValueError, match="positions"):
        ops.gather_key_rows(k, k, torch.zeros(1, 3, 5, dtype=torch.int32, device="cuda"), None)
    rows = torch.zeros(1, 5, 2, 16, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(5, dtype=torch.int32, device="cuda").view(1, 1, 5)
    with pytest.raises(ValueError, match="dk_rows"):  # 5 rows, 6 positions
        ops.scatter_key_rows(rows, rows, torch.arange(6, dtype=torch.int32, device="cuda").view(1, 1, 6), k.shape)
    with pytest.raises(TypeError, match="dv_rows"):
        ops.scatter_key_rows(rows, rows.float(), positions, k.shape)
    with pytest.raises(ValueError, match="positions"):
        ops.scatter_key_rows(rows, rows, positions.view(1, 5, 1), k.shape)
    with pytest.raises(TypeError, match="positions"):
        ops.scatter_key_rows(rows, rows, positions.long(), k.shape)
    with pytest.raises(ValueError, match="dbias"):  # a bias's rows need the positions' leading dims
        ops.scatter_key_rows(rows, rows, positions, k.shape, torch.zeros(1, 2, 1, 5, device="cuda"), (1, 2, 1, 50))


@pytest.mark.parametrize("indexed", [True, False])
def test_attention_topk_takes_the_native_glue(monkeypatch, indexed):
    """attention_topk (no mask, CUDA) selects with the native kernel, which also writes the bias
    at the kept keys; the kernels then read the kept K / V rows in place (indexed keys) or from
    a native gather (DMATTN_INDEXED_KEYS=0). The output equals the torch composition's (the glue
    off) exactly, the gradients up to dQ's atomic summation order; no gradient to compute takes
    no autograd node and gives the same output."""
    monkeypatch.setattr(topk, "_training_forward", lambda *a, **kw: None)  # (the general path's glue)
    calls = []
    for name in ("select_topk_positions", "gather_key_rows"):
        fn = getattr(gather, name)
        monkeypatch.setattr(gather, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw))
    monkeypatch.setattr(gather, "INDEXED_KEYS", indexed)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, 512, 4, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    bias = torch.randn(2, 4, 1, 512, generator=g).to("cuda", torch.bfloat16)
    results = []
    for native in (True, False):
        monkeypatch.setattr(gather, "native_glue_available", lambda _n=native: _n)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, bias)]
        out = dmattn.attention_topk(*leaves[:3], leaves[3], 100, causal=True)
        results.append((out, *torch.autograd.grad(out, leaves, dout)))
    assert calls == (["select_topk_positions"] if indexed else ["select_topk_positions", "gather_key_rows"])
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)  # same kernel inputs
    for a, b in zip(results[0][1:], results[1][1:]):  # (dq sums with atomics: its order may differ)
        torch.testing.assert_close(a, b)
    monkeypatch.setattr(gather, "native_glue_available", lambda: True)
    with torch.no_grad():
        out = dmattn.attention_topk(q, k, v, bias, 100, causal=True)
    assert out.grad_fn is None
    torch.testing.assert_close(out, results[0][0], rtol=0, atol=0)
