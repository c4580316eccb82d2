"""Gate skipping (``gate_threshold=``, docs/semantics.md "Gate skipping"): the rule's cells
against a brute-force float64 derivation, and attention with skipping against the float64
reference with the skipped cells as a mask (forward and every gradient); packed batches
against their sequences; the drop-in's defaults; errors."""

from __future__ import annotations

import math

import pytest
import torch

import dmattn
from dmattn import flash_sparse_attn as fsa
from dmattn import gate_skip
from reference import BWD_FACTOR, FWD_FACTOR, check_close, run_reference

CELL = gate_skip.CELL


def _brute_force_cells(alpha, delta, *, scale, gate_fn, threshold, causal, window=(-1, -1), adaptive=False):
    """The rule of gate_skip.py written out cell by cell in float64 from its definition."""
    b, sq, h = alpha.shape
    sk, hkv = delta.shape[1], delta.shape[2]
    m_blocks, n_blocks = -(-sq // CELL), -(-sk // CELL)
    g = (lambda x: -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))) if gate_fn == "logsigmoid" \
        else (lambda x: x)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    keep = torch.ones(b, h, m_blocks, n_blocks, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            for m in range(m_blocks):
                rows = range(m * CELL, min(sq, (m + 1) * CELL))
                a = alpha[bi, m * CELL:(m + 1) * CELL, hi].double()
                ubs, vis = [], []
                for n in range(n_blocks):
                    cols = range(n * CELL, min(sk, (n + 1) * CELL))
                    d = delta[bi, n * CELL:(n + 1) * CELL, hi // (h // hkv)].double()
                    seen = any((right < 0 or j <= i + sk - sq + right) and (left < 0 or j >= i + sk - sq - left)
                               for i in rows for j in cols)
                    corners = [x * y for x in (a.max().item(), a.min().item()) for y in (d.max().item(), d.min().item())]
                    ubs.append(float("nan") if any(c != c for c in corners) else max(corners))
                    vis.append(seen)
                visible_ubs = [u for u, s in zip(ubs, vis) if s]
                if not visible_ubs:
                    continue
                r = float("nan") if any(u != u for u in visible_ubs) else max(visible_ubs)
                t = threshold
                if adaptive and causal:
                    t = threshold * min(max(m * CELL + sk - sq + 1, 0), sk) / sk
                for n in range(n_blocks):
                    if vis[n] and ubs[n] < r and t > 0 and scale * (g(ubs[n]) - g(r)) < math.log(t):
                        keep[bi, hi, m, n] = False
    return keep


def _gates(b, sq, sk, h, hkv, seed, spread=60.0):
    """alpha > 0 and delta with blocks of very negative values: products far apart by block."""
    g = torch.Generator().manual_seed(seed)
    alpha = torch.rand(b, sq, h, generator=g) * 2 + 0.5
    delta = torch.randn(b, sk, hkv, generator=g)
    blocks = -(-sk // CELL)
    drop = (torch.rand(b, blocks, hkv, generator=g) < 0.5) * spread
    delta = delta - drop.repeat_interleave(CELL, 1)[:, :sk]
    return alpha, delta


@pytest.mark.parametrize("gate_fn", ["logsigmoid", "linear"])
@pytest.mark.parametrize("causal,window,adaptive", [(True, (-1, -1), False), (False, (-1, -1), False),
                                                    (True, (-1, -1), True), (False, (200, 50), False)])
@pytest.mark.parametrize("shape", [(1, 300, 300, 2, 1), (2, 130, 517, 2, 2), (1, 517, 200, 4, 2)])
def test_cells_follow_the_rule(gate_fn, causal, window, adaptive, shape):
    b, sq, sk, h, hkv = shape
    alpha, delta = _gates(b, sq, sk, h, hkv, seed=sq + sk)
    if gate_fn == "linear":
        alpha = alpha * 0.2  # (products of a linear gate within a scale the threshold can reach)
    kw = dict(scale=0.125, gate_fn=gate_fn, threshold=0.5, causal=causal, window=window, adaptive=adaptive)
    got = gate_skip.gate_keep_cells(alpha.to(torch.bfloat16), delta.to(torch.bfloat16), **kw)
    want = _brute_force_cells(alpha.to(torch.bfloat16).float(), delta.to(torch.bfloat16).float(), **kw)
    assert got.dtype == torch.bool and got.is_contiguous()
    assert torch.equal(got, want), (got.int(), want.int())
    if gate_fn == "logsigmoid" and causal and not adaptive:
        assert not got.all(), "the inputs are meant to skip some cells"


@pytest.mark.gpu
@pytest.mark.parametrize("gate_fn", ["logsigmoid", "linear"])
@pytest.mark.parametrize("causal,window,adaptive", [(True, (-1, -1), False), (False, (-1, -1), False),
                                                    (True, (-1, -1), True), (False, (300, 100), False),
                                                    (False, (2**40, 2**33), False)])
def test_cuda_cells_equal_the_framework_rule(gate_fn, causal, window, adaptive):
    """The CUDA kernel's cells against the framework ops' (the same rule, both in float32), dense
    and packed (an empty sequence; NaN in a key cell), GQA; a window past every position (its
    bounds past int32: unbounded, not wrapped)."""
    b, sq, sk, h, hkv = 2, 700, 1000, 4, 2
    alpha, delta = (t.cuda() for t in _gates(b, sq, sk, h, hkv, seed=11))
    if gate_fn == "linear":
        alpha = alpha * 0.2
    delta[1, 400, 0] = float("nan")
    kw = dict(scale=0.125, gate_fn=gate_fn, threshold=0.5, causal=causal, window=window, adaptive=adaptive)
    for dtype in (torch.float32, torch.bfloat16):
        a, d = alpha.to(dtype), delta.to(dtype)
        got = gate_skip.gate_keep_cells(a, d, **kw)
        assert torch.equal(got, gate_skip.gate_keep_cells(a, d, native=False, **kw)), dtype
        assert not got.all()
    lens_q, lens_k = [300, 0, 517], [450, 200, 1000]
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,  # noqa: E731
                                   device="cuda")
    ap = torch.cat([alpha[0, :300], alpha[1, :517]]).to(torch.bfloat16)
    dp = torch.cat([delta[0, :450], delta[0, :200], delta[1]]).to(torch.bfloat16)
    args = (ap, dp, cu(lens_q), cu(lens_k), 517, 1000)
    got = gate_skip.gate_keep_cells_varlen(*args, **kw)
    assert torch.equal(got, gate_skip.gate_keep_cells_varlen(*args, native=False, **kw))


def test_cells_keep_nan_and_the_largest_bound():
    alpha, delta = _gates(1, 256, 512, 1, 1, seed=3)
    keep = gate_skip.gate_keep_cells(alpha, delta, scale=0.125, gate_fn="logsigmoid", threshold=0.5, causal=False)
    assert (keep.sum(-1) >= 1).all()  # the block with the largest bound stays
    delta_nan = delta.clone()
    delta_nan[0, 300, 0] = float("nan")  # key block 2
    keep_nan = gate_skip.gate_keep_cells(alpha, delta_nan, scale=0.125, gate_fn="logsigmoid", threshold=0.5,
                                         causal=False)
    assert keep_nan.all(), "a NaN bound keeps its cell and, as the row block's largest, every other"
    # a threshold above 1 keeps only the cells at the largest bound
    keep_all = gate_skip.gate_keep_cells(alpha, delta, scale=0.125, gate_fn="linear", threshold=2.0, causal=False)
    assert (keep_all.sum(-1) >= 1).all()


def _mask_of(keep, sq, sk):
    i = torch.arange(sq) // CELL
    j = torch.arange(sk) // CELL
    return keep[:, :, i][:, :, :, j]


def _cuda_case(b, sq, sk, h, hkv, d, seed):
    """Random bf16 q, k, v, dout and _gates' alpha, delta on the GPU."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(*s, generator=g).to(torch.bfloat16).cuda()
                     for s in ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d)))
    alpha, delta = (t.to(torch.bfloat16).cuda() for t in _gates(b, sq, sk, h, hkv, seed=seed))
    return q, k, v, dout, alpha, delta


def _run(q, k, v, dout, alpha, delta, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, alpha, delta)]
    out, lse = dmattn.attention(*leaves[:3], gate=(leaves[3], leaves[4]), return_lse=True, **kw)
    out.backward(dout)
    return out, lse, dict(zip(["q", "k", "v", "alpha", "delta"], (t.grad for t in leaves)))


def _check_against_masked_reference(q, k, v, dout, alpha, delta, out, lse, grads, keep, *, gate_fn, context,
                                    **kw):
    cpu = lambda t: t.detach().cpu()  # noqa: E731
    mask = _mask_of(keep.cpu(), q.shape[1], k.shape[1])
    args = dict(gate=(cpu(alpha), cpu(delta)), gate_fn=gate_fn, dout=cpu(dout), **kw)
    ref = run_reference(cpu(q), cpu(k), cpu(v), mask, None, upcast=True, **args)
    low = run_reference(cpu(q), cpu(k), cpu(v), mask, None, upcast=False, **args)
    check_close("out", out, ref.out, low.out, FWD_FACTOR, context=context)
    check_close("lse", lse, ref.lse, low.lse, FWD_FACTOR, context=context)
    for name, grad in grads.items():
        check_close(f"d{name}", grad, ref.grads[name], low.grads.get(name), BWD_FACTOR, context=context)


@pytest.mark.parametrize("gate_fn", ["logsigmoid", "linear"])
@pytest.mark.parametrize("causal", [False, True])
def test_skipping_matches_the_masked_reference(device, nan_poison, gate_fn, causal):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    b, sq, sk, h, hkv, d = 2, 300, 420, 4, 2, 32
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(*s, generator=g).to(dtype).to(device)
                     for s in ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d)))
    alpha, delta = (t.to(dtype).to(device) for t in _gates(b, sq, sk, h, hkv, seed=2))
    threshold = 0.5  # (a skipped key would carry a few % of its row's weight: a test that can fail)
    out, lse, grads = _run(q, k, v, dout, alpha, delta, causal=causal, gate_fn=gate_fn, gate_threshold=threshold)
    keep = gate_skip.gate_keep_cells(alpha, delta, scale=d ** -0.5, gate_fn=gate_fn, threshold=threshold,
                                     causal=causal)
    if gate_fn == "logsigmoid":
        assert not keep.all()
    _check_against_masked_reference(q, k, v, dout, alpha, delta, out, lse, grads, keep, gate_fn=gate_fn,
                                    causal=causal, context=f"{gate_fn} causal={causal}")


# The CUDA kernels: the warp-specialized Hopper ones at head dims 64 and 128 (the forward's
# skipped blocks run no product, the backward's no S or dP product), the sm80-class ones
# elsewhere; several cells along both axes, GQA, deterministic mode.
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_skipping_on_long_sequences_matches_the_masked_reference(nan_poison, d, causal, deterministic):
    if d == 256 and deterministic:
        pytest.skip("one deterministic head dim suffices at 256")
    b, sq, sk, h, hkv = 2, 1000, 1100, 4, 2
    q, k, v, dout, alpha, delta = _cuda_case(b, sq, sk, h, hkv, d, seed=d)
    out, lse, grads = _run(q, k, v, dout, alpha, delta, causal=causal, gate_threshold=0.5,
                           deterministic=deterministic)
    keep = gate_skip.gate_keep_cells(alpha, delta, scale=d ** -0.5, gate_fn="logsigmoid", threshold=0.5,
                                     causal=causal)
    assert 0.2 < keep.float().mean() < 0.9
    _check_against_masked_reference(q, k, v, dout, alpha, delta, out, lse, grads, keep, gate_fn="logsigmoid",
                                    causal=causal, context=f"d={d} causal={causal} det={deterministic}")


# The Hopper forward walks a tile's kept key blocks, which its scheduler warp lists 32 blocks at a
# time into the tile's slot: rows of many blocks, tiles of a window whose every block is skipped
# (an empty walk), and sequences of more blocks than a slot holds (2048: the sm80-class kernels).
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_skipping_walks_rows_of_many_key_blocks(nan_poison, causal):
    b, sq, sk, h, hkv, d = 1, 300, 4500, 2, 1, 128
    q, k, v, dout, alpha, delta = _cuda_case(b, sq, sk, h, hkv, d, seed=7)
    out, lse, grads = _run(q, k, v, dout, alpha, delta, causal=causal, gate_threshold=0.5)
    keep = gate_skip.gate_keep_cells(alpha, delta, scale=d ** -0.5, gate_fn="logsigmoid", threshold=0.5,
                                     causal=causal)
    assert keep.shape[-1] > 32 and 0.2 < keep.float().mean() < 0.9
    _check_against_masked_reference(q, k, v, dout, alpha, delta, out, lse, grads, keep, gate_fn="logsigmoid",
                                    causal=causal, context=f"causal={causal}")


@pytest.mark.gpu
def test_cuda_tiles_whose_blocks_are_all_skipped_are_empty(nan_poison):
    sq = sk = 384
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, sq, 1, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(4))
    alpha = torch.ones(1, sq, 1, dtype=torch.bfloat16, device="cuda")
    delta = torch.zeros(1, sk, 1, dtype=torch.bfloat16, device="cuda")
    delta[0, 128:256] = -500.0  # key block 1: far below block 0's gates
    out, lse, grads = _run(q, k, v, dout, alpha, delta, causal=True, window=(20, 0), gate_threshold=1e-2)
    rows = slice(148, 256)  # window [i - 20, i] inside key block 1, which block 0 outranks
    assert (out[0, rows] == 0).all() and torch.isneginf(lse[0, 0, rows]).all()
    keep = gate_skip.gate_keep_cells(alpha, delta, scale=64 ** -0.5, gate_fn="logsigmoid", threshold=1e-2,
                                     causal=True, window=(20, 0))
    _check_against_masked_reference(q, k, v, dout, alpha, delta, out, lse, grads, keep, gate_fn="logsigmoid",
                                    causal=True, window=(20, 0), context="window (20, 0)")


@pytest.mark.gpu
def test_skipping_on_more_key_blocks_than_a_walk_holds(nan_poison):
    b, sq, sk, h, hkv, d = 1, 64, 2048 * 128 + 64, 1, 1, 64
    q, k, v, dout, alpha, delta = _cuda_case(b, sq, sk, h, hkv, d, seed=8)
    out, lse, grads = _run(q, k, v, dout, alpha, delta, gate_threshold=0.5)
    keep = gate_skip.gate_keep_cells(alpha, delta, scale=d ** -0.5, gate_fn="logsigmoid", threshold=0.5,
                                     causal=False)
    assert 0.2 < keep.float().mean() < 0.9
    _check_against_masked_reference(q, k, v, dout, alpha, delta, out, lse, grads, keep, gate_fn="logsigmoid",
                                    causal=False, context="2049 key blocks")


def test_varlen_skipping_equals_each_sequence(device):
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    lens_q, lens_k = [300, 0, 260, 64], [450, 200, 260, 1]
    h, hkv, d = 2, 1, 32
    g = torch.Generator().manual_seed(5)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,  # noqa: E731
                                   device=device)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(dtype).to(device)
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype).to(device) for _ in range(2))
    alpha = (torch.rand(sum(lens_q), h, generator=g) * 2 + 0.5).to(dtype).to(device)
    delta = torch.randn(sum(lens_k), hkv, generator=g)
    delta[torch.arange(sum(lens_k)) % 256 >= 128] -= 80.0
    delta = delta.to(dtype).to(device)
    out = dmattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, gate=(alpha, delta),
                                  gate_threshold=0.5)
    for bi in range(len(lens_q)):
        rq, rk = slice(int(cu_q[bi]), int(cu_q[bi + 1])), slice(int(cu_k[bi]), int(cu_k[bi + 1]))
        one = dmattn.attention(q[None, rq], k[None, rk], v[None, rk], causal=True,
                               gate=(alpha[None, rq], delta[None, rk]), gate_threshold=0.5)
        torch.testing.assert_close(out[rq], one[0], rtol=0, atol=0, msg=lambda m: f"sequence {bi}: {m}")


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_gate_gradients_without_queries_are_zeros(device, nan_poison, threshold):
    """No query (an empty alpha, whose data pointer is null): the keys' gradients are zeros; no
    key: the queries' are."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    for sq, sk in ((0, 200), (150, 0)):
        q = torch.randn(1, sq, 4, 32, generator=g).to(dtype).to(device)
        k, v = (torch.randn(1, sk, 2, 32, generator=g).to(dtype).to(device) for _ in range(2))
        alpha = torch.rand(1, sq, 4, generator=g).to(dtype).to(device)
        delta = torch.randn(1, sk, 2, generator=g).to(dtype).to(device)
        dout = torch.randn(1, sq, 4, 32, generator=g).to(dtype).to(device)
        out, lse, grads = _run(q, k, v, dout, alpha, delta, causal=True, gate_threshold=threshold)
        assert out.shape == q.shape and grads["alpha"].shape == alpha.shape and grads["delta"].shape == delta.shape
        for name, grad in grads.items():
            assert torch.equal(grad, torch.zeros_like(grad)), f"Sq={sq} Sk={sk}: d{name}"


# The packed backward with skipping (the Hopper kernels' packed variant at head dims 64 and 128):
# each sequence's gradients as its own call gives them, empty and one-key sequences included.
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_skipping_gradients_equal_each_sequence(nan_poison, d):
    lens_q, lens_k = [700, 0, 390, 64], [900, 200, 390, 1]
    h, hkv = 4, 2
    g = torch.Generator().manual_seed(d + 7)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,  # noqa: E731
                                   device="cuda")
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    q, dout = (torch.randn(sum(lens_q), h, d, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
    alpha = (torch.rand(sum(lens_q), h, generator=g) * 2 + 0.5).to(torch.bfloat16).cuda()
    delta = torch.randn(sum(lens_k), hkv, generator=g)
    delta[torch.arange(sum(lens_k)) % 256 >= 128] -= 80.0
    delta = delta.to(torch.bfloat16).cuda()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha, delta)]
    out = dmattn.attention_varlen(*leaves[:3], cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                  gate=(leaves[3], leaves[4]), gate_threshold=0.5)
    out.backward(dout)
    for bi in range(len(lens_q)):
        rq, rk = slice(int(cu_q[bi]), int(cu_q[bi + 1])), slice(int(cu_k[bi]), int(cu_k[bi + 1]))
        one = [t[None, r].detach().clone().requires_grad_()
               for t, r in zip((q, k, v, alpha, delta), (rq, rk, rk, rq, rk))]
        o = dmattn.attention(*one[:3], causal=True, gate=(one[3], one[4]), gate_threshold=0.5)
        o.backward(dout[None, rq])
        for name, packed, single, r in zip("q k v alpha delta".split(), leaves, one, (rq, rk, rk, rq, rk)):
            want = single.grad[0] if single.grad is not None else torch.zeros_like(single[0])
            torch.testing.assert_close(packed.grad[r], want, rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"sequence {bi}, d{name}: {m}")


def test_a_row_whose_keys_are_all_skipped_is_empty():
    """A sliding window whose rows see only skipped cells: out 0, lse -inf, finite gradients."""
    sq = sk = 384
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, sq, 1, 16, generator=g, dtype=torch.float64) for _ in range(4))
    alpha = torch.ones(1, sq, 1, dtype=torch.float64)
    delta = torch.zeros(1, sk, 1, dtype=torch.float64)
    delta[0, 128:256] = -500.0  # key block 1: far below block 0's gates
    out, lse, grads = _run(q, k, v, dout, alpha, delta, causal=True, window=(20, 0), gate_threshold=1e-2)
    rows = slice(148, 256)  # window [i - 20, i] inside key block 1, which block 0 outranks
    assert (out[0, rows] == 0).all() and torch.isneginf(lse[0, 0, rows]).all()
    assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in grads.values())


def test_skipping_is_approximate_and_close_when_the_gates_are_far_apart():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 512, 2, 32, generator=g, dtype=torch.float64) for _ in range(3))
    alpha, delta = (t.double() for t in _gates(1, 512, 512, 2, 2, seed=4, spread=300.0))
    exact = dmattn.attention(q, k, v, causal=True, gate=(alpha, delta))
    skipped = dmattn.attention(q, k, v, causal=True, gate=(alpha, delta), gate_threshold=1e-4)
    err = (skipped - exact).abs().max().item()
    assert 0 < err < 1e-10, err  # the skipped keys' weights are below exp(-300 * scale) of the kept ones


def test_dropin_skips_by_default_as_dmattn_with_its_threshold():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 384, 2, 32, generator=g) for _ in range(3))
    alpha, delta = _gates(1, 384, 384, 2, 2, seed=6, spread=150.0)
    got = fsa.flash_gated_attn_func(q, k, v, alpha, delta, is_causal=True, softmax_threshold=0.0)
    # (flash-sparse-attn's defaults: gate_threshold 1 / Sk, is_adapt_gate)
    want = dmattn.attention(q, k, v, causal=True, gate=(alpha, delta), gate_threshold=1 / 384, gate_adaptive=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    exact = fsa.flash_gated_attn_func(q, k, v, alpha, delta, is_causal=True, softmax_threshold=0.0,
                                      gate_threshold=0.0)
    assert not torch.equal(got, exact)
    torch.testing.assert_close(got, exact, rtol=0, atol=1e-5)


def test_errors_name_the_argument():
    q = k = v = torch.randn(1, 8, 2, 8)
    alpha, delta = torch.randn(1, 8, 2), torch.randn(1, 8, 2)
    with pytest.raises(ValueError, match="gate_threshold: gate skipping needs a gate"):
        dmattn.attention(q, k, v, gate_threshold=0.1)
    with pytest.raises(NotImplementedError, match="gate_threshold: gate skipping does not take windows"):
        dmattn.attention(q, k, v, gate=(alpha, delta), gate_threshold=0.1,
                         windows=torch.tensor([[1, 2, 0, 0]], dtype=torch.int32))
    with pytest.raises(ValueError, match="gate_threshold: expected a finite value >= 0"):
        dmattn.attention(q, k, v, gate=(alpha, delta), gate_threshold=-1.0)
    with pytest.raises(TypeError, match="gate_threshold: expected a float or None"):
        dmattn.attention(q, k, v, gate=(alpha, delta), gate_threshold=True)
    # the gate's shapes against q and k, checked before the skipped cells are computed from them
    with pytest.raises(ValueError, match=r"alpha: expected shape \(1, 8, 2\), got \(1, 8, 3\)"):
        dmattn.attention(q, k, v, gate=(torch.randn(1, 8, 3), delta), gate_threshold=0.1)
    with pytest.raises(ValueError, match=r"delta: expected shape \(1, 8, 2\), got \(1, 7, 2\)"):
        dmattn.attention(q, k, v, gate=(alpha, torch.randn(1, 7, 2)), gate_threshold=0.1)
    with pytest.raises(ValueError, match=r"alpha: expected a 3-D tensor \(batch, seqlen_q, num_heads\)"):
        dmattn.attention(q, k, v, gate=(alpha[0], delta), gate_threshold=0.1)
    with pytest.raises(ValueError, match=r"q: expected a 4-D tensor \(batch, seqlen_q, num_heads, head_dim\)"):
        dmattn.attention(q[0], k, v, gate=(alpha, delta), gate_threshold=0.1)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"delta: expected shape \(8, 2\), got \(8, 1\)"):
        dmattn.attention_varlen(q[0], k[0], v[0], cu, cu, 5, 5, gate=(alpha[0], delta[0, :, :1]), gate_threshold=0.1)
    # 0 and None compute exactly, with or without a gate
    exact = dmattn.attention(q, k, v, gate=(alpha, delta))
    torch.testing.assert_close(dmattn.attention(q, k, v, gate=(alpha, delta), gate_threshold=0.0), exact,
                               rtol=0, atol=0)


def test_native_gate_keep_errors_name_the_argument():
    """The native operand (dmattn::fwd's gate_keep): shape, dtype, layout, and a gate to go with."""
    from dmattn.ops import attention_forward
    q = k = v = torch.randn(1, 200, 2, 8)
    alpha, delta = torch.randn(1, 200, 2), torch.randn(1, 200, 2)
    call = lambda keep, gate=True: attention_forward(  # noqa: E731
        q, k, v, None, None, False, -1, -1, None, 0.0, False, None, 0, None, None,
        alpha if gate else None, delta if gate else None, 0, None, keep)
    good = torch.ones(1, 2, 2, 2, dtype=torch.bool)
    torch.testing.assert_close(call(good)[0], call(None)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="gate_keep: expected shape"):
        call(torch.ones(1, 2, 2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="gate_keep: expected dtype bool"):
        call(torch.ones(1, 2, 2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="gate_keep"):
        call(torch.ones(1, 2, 2, 4, dtype=torch.bool)[..., ::2])
    with pytest.raises(ValueError, match="gate_keep: given without a gate"):
        call(good, gate=False)
