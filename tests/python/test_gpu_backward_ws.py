"""The warp-specialized Hopper backward (src/cuda/sm90/bwd_ws_kernel_sm90.h) on the problems it takes
(head dims up to 128, and up to 256 with plain scores: plain scores, per-key rows with a query-broadcast
bias and its column-sum gradient, a query-broadcast mask, gathered keys with key ends; a full bias
with its gradient stored from the dS tiles; deterministic mode, its dQ adds ordered; packed batches
with a key-side bias), against the float64 reference and against the general Hopper kernel
(DMATTN_BWD_SM90_WS=0) on the top-k paths, the full bias and packed batches (whose reference tests
are test_varlen.py's).
Both backward paths (DMATTN_BWD_EXACT=0 / 1; the exact path's main pass runs it without dQ). On
GPUs other than compute capability 9.0 the same tests run the sm80-class kernels.
"""

import os

import pytest
import torch

import dmattn
from cases import Case, check_case
from dmattn import _lib

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16


def _hopper_kernels_run():
    """Whether the Hopper backward runs here: the GPU runs the build's sm_90a code (not the
    compute_80 PTX, e.g. under CUDA_FORCE_PTX_JIT=1) and DMATTN_BWD_SM90=0 does not turn it off."""
    return (_lib.device_kernel_path(torch.cuda.current_device()) == "native sm_90a"
            and os.environ.get("DMATTN_BWD_SM90", "1") != "0")


@pytest.fixture(params=["0", "1"], ids=["fa2_bwd", "exact_bwd"])
def bwd_path(request, monkeypatch):
    monkeypatch.setenv("DMATTN_BWD_EXACT", request.param)
    return request.param


CASES = {
    # plain scores: tails in both lengths, causal bottom-right with Sq != Sk, GQA
    "plain": Case(BF16, 2, 333, 333, 4, 4, 128),
    "plain_causal_fp16": Case(torch.float16, 1, 300, 517, 4, 2, 128, causal=True),
    "plain_gqa_causal": Case(BF16, 1, 257, 257, 8, 2, 128, causal=True),
    # key blocks that no query reaches (n_iter == 0: dK = dV = 0 there)
    "window_empty_key_blocks": Case(BF16, 1, 96, 1024, 2, 2, 128, window=(32, 0)),
    # per-key bias with its gradient: per head, per kv head (summed over the group), over batch
    # and heads (added by several CTAs), fp32, with -inf and finfo.min entries
    "key_bias": Case(BF16, 2, 200, 300, 4, 4, 128, causal=True, bias_shape=(2, 4, 1, 300), bias_grad=True),
    "key_bias_gqa_per_head": Case(BF16, 1, 190, 190, 6, 2, 128, bias_shape=(1, 6, 1, 190), bias_grad=True),
    "key_bias_per_kv_head": Case(BF16, 2, 130, 257, 4, 2, 128, causal=True, bias_shape=(2, 2, 1, 257),
                                 bias_grad=True),
    "key_bias_shared": Case(BF16, 2, 150, 150, 4, 2, 128, bias_shape=(1, 1, 1, 150), bias_grad=True),
    "key_bias_fp32_inf": Case(BF16, 1, 160, 160, 2, 2, 128, causal=True, bias_shape=(1, 2, 1, 160),
                              bias_dtype=torch.float32, bias_grad=True, bias_neg_inf=0.1, bias_finfo_min=0.1),
    # an fp32 key bias constant over its keys, reduced over batch: its gradient's terms cancel
    # (softmax is invariant to a row's constant; below the small cases of the exact path)
    "key_bias_fp32_const_over_keys_many": Case(BF16, 2, 300, 260, 4, 2, 128, causal=True,
                                               bias_shape=(4, 1, 260), bias_dtype=torch.float32,
                                               bias_grad=True, bias_layout="expanded"),
    # a query-broadcast mask, alone and with a key bias without its gradient
    "key_mask": Case(BF16, 2, 129, 300, 4, 4, 128, mask_shape=(2, 1, 1, 300), mask_density=0.5),
    "key_mask_bias_no_grad": Case(BF16, 1, 257, 257, 4, 4, 128, causal=True, mask_shape=(1, 4, 1, 257),
                                  mask_density=0.3, bias_shape=(1, 4, 1, 257)),
    # full bias (B, H, Sq, Sk) (keys a multiple of 8: TMA tiles) with its gradient: query and key
    # tails; causal bottom-right with Sq != Sk under GQA, B=1 (dbias's rows of the query blocks
    # that do not reach a key block are zeros); -inf and finfo.min entries; a window that leaves
    # whole key blocks unreached; a bias per kv head without a gradient (tiles indexed by h / group)
    "full_bias": Case(BF16, 2, 333, 336, 4, 4, 128, bias_shape=(2, 4, 333, 336), bias_grad=True),
    "full_bias_gqa_causal_fp16": Case(torch.float16, 1, 300, 520, 4, 2, 128, causal=True,
                                      bias_shape=(1, 4, 300, 520), bias_grad=True),
    "full_bias_inf": Case(BF16, 1, 257, 264, 8, 2, 128, causal=True, bias_shape=(1, 8, 257, 264), bias_dtype=BF16,
                          bias_grad=True, bias_neg_inf=0.1, bias_finfo_min=0.1),
    "full_bias_window_empty_key_blocks": Case(BF16, 1, 96, 1024, 2, 2, 128, window=(32, 0),
                                              bias_shape=(1, 2, 96, 1024), bias_grad=True),
    "full_bias_per_kv_head_no_grad": Case(BF16, 2, 200, 304, 4, 2, 128, causal=True, bias_shape=(2, 2, 200, 304)),
    # the same at head dim 64 (both consumers' dS halves in two buffers there too)
    "d64_full_bias_gqa_causal_fp16": Case(torch.float16, 1, 300, 520, 4, 2, 64, causal=True,
                                          bias_shape=(1, 4, 300, 520), bias_grad=True),
    "d64_full_bias": Case(BF16, 2, 333, 336, 4, 4, 64, bias_shape=(2, 4, 333, 336), bias_grad=True,
                          bias_neg_inf=0.05, bias_dtype=BF16),
    # head dim 64 (one consumer computes a query block's dQ, by the block's parity: odd and even
    # counts of query blocks, and a single one, where the second consumer computes none)
    "d64_plain": Case(BF16, 2, 333, 333, 4, 4, 64),
    "d64_one_query_block": Case(BF16, 2, 50, 300, 2, 2, 64),
    "d64_gqa_causal_fp16": Case(torch.float16, 1, 300, 517, 6, 2, 64, causal=True),
    "d64_key_bias_mask": Case(BF16, 2, 200, 300, 4, 2, 64, causal=True, mask_shape=(2, 1, 1, 300),
                              bias_shape=(2, 4, 1, 300), bias_grad=True),
    # head dim 256 (key blocks of 64; dK, dV and dQ split along the head dim, the consumers' dQ
    # columns staged in turns)
    "d256_plain": Case(BF16, 2, 333, 333, 4, 4, 256),
    "d256_gqa_causal_fp16": Case(torch.float16, 1, 300, 517, 6, 2, 256, causal=True),
    "d256_window_empty_key_blocks": Case(BF16, 1, 96, 1024, 2, 2, 256, window=(32, 0)),
    # head dims between the instantiations (each runs on the next one up: the columns past the
    # head dim are zeros in shared memory and never stored)
    "d96_plain_gqa_causal": Case(BF16, 2, 333, 333, 4, 2, 96, causal=True),
    "d80_key_bias": Case(BF16, 2, 200, 300, 4, 4, 80, causal=True, bias_shape=(2, 4, 1, 300), bias_grad=True),
    "d112_full_bias": Case(BF16, 1, 257, 264, 4, 2, 112, bias_shape=(1, 4, 257, 264), bias_dtype=BF16,
                           bias_grad=True),
    "d72_gqa_causal_fp16": Case(torch.float16, 1, 300, 517, 6, 2, 72, causal=True),
    "d32_plain": Case(BF16, 2, 129, 300, 4, 4, 32),
    "d160_gqa_causal": Case(BF16, 1, 300, 517, 4, 2, 160, causal=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_reference(name, bwd_path, nan_poison):
    check_case(CASES[name], DEV)


# An fp32 key bias constant over its keys (one element expanded; rows with no key too): its
# gradient's terms cancel to 0, which the column sums keep only when taken from dS in fp32. Small
# problems like these take the exact path (Delta recomputed in fp32); FlashAttention-2's
# rowsum(dO * O), from the stored 16-bit O, leaves each row's terms a rounding of O apart, which
# no column sum can cancel (a relative 2^-9 of the row's terms, here ~2e-2 against a 0).
EXACT_PATH_CASES = {
    "key_bias_fp32_const_over_keys": Case(BF16, 1, 24, 5, 1, 1, 128, window=(2, 3), bias_shape=(1, 1, 5),
                                          bias_dtype=torch.float32, bias_grad=True, bias_layout="expanded"),
    "d72_key_bias_fp32_const_over_keys": Case(BF16, 1, 24, 5, 1, 1, 72, window=(2, 3), bias_shape=(1, 1, 5),
                                              bias_dtype=torch.float32, bias_grad=True, bias_layout="expanded"),
}


@pytest.mark.parametrize("name", sorted(EXACT_PATH_CASES))
def test_exact_path_against_reference(name, nan_poison, monkeypatch):
    monkeypatch.setenv("DMATTN_BWD_EXACT", "1")
    check_case(EXACT_PATH_CASES[name], DEV)


# Deterministic mode: the same kernel, its dQ adds in key block order (ordered_adds_sm90.h).
DETERMINISTIC_CASES = ["plain", "plain_gqa_causal", "window_empty_key_blocks", "key_bias_gqa_per_head",
                       "key_bias_per_kv_head", "key_bias_shared", "full_bias_gqa_causal_fp16", "d64_plain",
                       "d64_gqa_causal_fp16", "d64_full_bias", "d256_plain", "d256_gqa_causal_fp16",
                       "d96_plain_gqa_causal", "d80_key_bias", "d160_gqa_causal"]


@pytest.mark.parametrize("name", DETERMINISTIC_CASES)
def test_deterministic_against_reference(name, nan_poison):
    check_case(CASES[name], DEV, deterministic=True)


@pytest.mark.parametrize("name", ["plain_gqa_causal", "key_bias_per_kv_head", "d64_gqa_causal_fp16",
                                  "d256_gqa_causal_fp16"])
def test_deterministic_bitwise(name):
    from cases import make_inputs, run_dmattn
    c = CASES[name]
    x = make_inputs(c, DEV)
    first = run_dmattn(c, x, deterministic=True)[2]
    for _ in range(3):
        again = run_dmattn(c, x, deterministic=True)[2]
        for n in first:
            assert torch.equal(first[n], again[n]), n


@pytest.mark.parametrize("name", ["d96_plain_gqa_causal", "d80_key_bias", "d112_full_bias", "d32_plain",
                                  "d160_gqa_causal"])
def test_head_dims_between_instantiations_run_here(name):
    """A head dim between the instantiations takes the warp-specialized kernel of the next one up
    (Hopper), not the general kernels."""
    from torch.profiler import ProfilerActivity, profile
    from cases import make_inputs, run_dmattn
    c = CASES[name]
    x = make_inputs(c, DEV)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_dmattn(c, x)
        torch.cuda.synchronize()
    if not _hopper_kernels_run():
        pytest.skip("the Hopper kernels do not run here")
    names = [e.key for e in prof.key_averages()]
    assert any("bwd_ws_kernel_sm90" in n for n in names), names
    assert not any("bwd_kernel_sm90" in n or "bwd_kernel<" in n for n in names), names


def _long_grads(causal, d, window, bias, deterministic):
    """Every gradient of a problem whose query blocks meet up to 16 key blocks (16 CTAs add into
    each dQ row), 8 (kv head, batch) pairs."""
    g = torch.Generator(device=DEV).manual_seed(7)
    b, s, h, hkv = 2, 2048, 8, 4
    q = torch.randn(b, s, h, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    k = torch.randn(b, s, hkv, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    v = torch.randn(b, s, hkv, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    leaves = [q, k, v]
    kw = {}
    if bias:
        kw["bias"] = torch.randn(b, h, s, s, device=DEV, dtype=BF16, generator=g).requires_grad_()
        leaves.append(kw["bias"])
    dout = torch.randn(b, s, h, d, device=DEV, dtype=BF16, generator=g)
    out = dmattn.attention(q, k, v, causal=causal, window=window, deterministic=deterministic, **kw)
    return (out,) + torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("causal,d,window,bias", [(False, 128, (-1, -1), False), (True, 128, (-1, -1), False),
                                                  (True, 64, (-1, -1), False), (True, 256, (-1, -1), False),
                                                  (False, 128, (700, 300), False), (True, 128, (-1, -1), True)],
                         ids=["dense", "causal", "causal_d64", "causal_d256", "window", "causal_full_bias"])
def test_deterministic_ordered_dq(causal, d, window, bias):
    """Deterministic mode with many key blocks per query block: the warp-specialized kernel runs
    (Hopper), with no query-major dQ kernel, and its gradients are bitwise equal over runs and
    match the default mode's within the summation orders."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        first = _long_grads(causal, d, window, bias, True)
        torch.cuda.synchronize()
    if _hopper_kernels_run():
        names = [e.key for e in prof.key_averages()]
        assert any("bwd_ws_kernel_sm90" in n for n in names), names
        assert not any("bwd_dq_kernel" in n for n in names), names
    for _ in range(4):
        for a, r in zip(first, _long_grads(causal, d, window, bias, True)):
            assert torch.equal(a, r)
    _assert_close_to_general(first, _long_grads(causal, d, window, bias, False))


def _assert_close_to_general(ws, general):
    """(out, dq, dk, dv, dbias) of the warp-specialized kernel against the general kernels': finite,
    and within 1e-2 in relative norm (their summation orders differ)."""
    for name, a, r in zip(["out", "dq", "dk", "dv", "dbias"], ws, general):
        assert torch.isfinite(a).all(), name
        rel = ((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
        assert rel < 1e-2, f"{name}: relative difference {rel:.3e}"


def _assert_ws_kernel_matches_general(grads, monkeypatch):
    """grads() with the warp-specialized kernel, which must be the one that runs (Hopper), then
    with the general kernels (DMATTN_BWD_SM90_WS=0): close within their summation orders."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ws = grads()
        torch.cuda.synchronize()
    if _hopper_kernels_run():
        names = [e.key for e in prof.key_averages()]
        assert any("bwd_ws_kernel_sm90" in n for n in names), names
    monkeypatch.setenv("DMATTN_BWD_SM90_WS", "0")
    _assert_close_to_general(ws, grads())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_256_matches_general_kernel(causal, monkeypatch):
    """Head dim 256, many query blocks per key block and many key blocks adding into each dQ row
    (by reductions), GQA: the warp-specialized kernel runs (Hopper) and gives the general kernels'
    gradients within their summation orders."""
    _assert_ws_kernel_matches_general(lambda: _long_grads(causal, 256, (-1, -1), False, False), monkeypatch)


def _topk_grads(per_query, causal, seed, d=128):
    g = torch.Generator(device=DEV).manual_seed(seed)
    b, s, h, hkv, keep = 2, 700, 4, 2, 200
    q = torch.randn(b, s, h, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    k = torch.randn(b, s, hkv, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    v = torch.randn(b, s, hkv, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    bias = torch.randn(b, hkv, 1, s, device=DEV, dtype=BF16, generator=g).requires_grad_()
    dout = torch.randn(b, s, h, d, device=DEV, dtype=BF16, generator=g)
    out = dmattn.attention_topk(q, k, v, bias, keep, causal=causal, per_query=per_query)
    grads = torch.autograd.grad(out, [q, k, v, bias], dout)
    return (out,) + grads


@pytest.mark.parametrize("per_query,causal,d", [(False, False, 128), (False, True, 128), (True, True, 128),
                                                 (True, True, 64)],
                         ids=["shared", "shared_causal", "per_query", "per_query_d64"])
def test_topk_paths_match_general_kernel(per_query, causal, d, monkeypatch):
    """Gathered keys (key ends on the per-query path), per-key bias gradient: the same gradients
    as the general kernels (DMATTN_BWD_SM90_WS=0), within their different summation orders."""
    ws = _topk_grads(per_query, causal, 3, d)
    monkeypatch.setenv("DMATTN_BWD_SM90_WS", "0")
    _assert_close_to_general(ws, _topk_grads(per_query, causal, 3, d))


def _full_bias_grads(b, s, h, hkv, causal, d, seed=5):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, s, h, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    k = torch.randn(b, s, hkv, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    v = torch.randn(b, s, hkv, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    bias = torch.randn(b, h, s, s, device=DEV, dtype=BF16, generator=g).requires_grad_()
    dout = torch.randn(b, s, h, d, device=DEV, dtype=BF16, generator=g)
    out = dmattn.attention(q, k, v, bias=bias, causal=causal)
    return (out,) + torch.autograd.grad(out, [q, k, v, bias], dout)


@pytest.mark.parametrize("causal,d", [(False, 128), (True, 128), (True, 64)], ids=["full", "causal", "causal_d64"])
def test_full_bias_matches_general_kernel(causal, d, monkeypatch):
    """A full bias with its gradient, several key blocks and query blocks per CTA, GQA: the same
    gradients as the general kernels (the same transform; dbias is dS, the same bits where both
    round dS alike), and the warp-specialized kernel is the one that ran (Hopper)."""
    _assert_ws_kernel_matches_general(lambda: _full_bias_grads(2, 1000, 4, 2, causal, d), monkeypatch)


def _packed_grads(causal, d, deterministic=False, seed=9, bias=True):
    """A packed batch with ragged lengths (tails in both dims, a sequence shorter than a block),
    a key-side bias (H, total_k) with its gradient (or none), GQA."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    lens, h, hkv = [700, 130, 1000, 64, 3], 4, 2
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    total = sum(lens)
    q = torch.randn(total, h, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    k = torch.randn(total, hkv, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    v = torch.randn(total, hkv, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    leaves = [q, k, v]
    kw = {}
    if bias:
        kw["bias"] = torch.randn(h, total, device=DEV, dtype=BF16, generator=g).requires_grad_()
        leaves.append(kw["bias"])
    dout = torch.randn(total, h, d, device=DEV, dtype=BF16, generator=g)
    out = dmattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                  deterministic=deterministic, **kw)
    return (out,) + torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("causal,d,bias", [(False, 128, True), (True, 128, True), (True, 64, True),
                                           (False, 256, False), (True, 256, False)],
                         ids=["full", "causal", "causal_d64", "full_d256", "causal_d256"])
@pytest.mark.parametrize("exact", ["0", "1"], ids=["fa2_bwd", "exact_bwd"])
def test_packed_matches_general_kernel(causal, d, bias, exact, monkeypatch):
    """Packed batches (each sequence's rows from its first; the rows of its tiles past its end
    cleared, the dQ rows of its last query block past its end zeroed, or not added at head dim
    256): the same gradients as the general kernels, and the warp-specialized kernel is the one
    that ran (Hopper)."""
    monkeypatch.setenv("DMATTN_BWD_EXACT", exact)
    _assert_ws_kernel_matches_general(lambda: _packed_grads(causal, d, bias=bias), monkeypatch)


def test_packed_deterministic_bitwise():
    """Deterministic mode on a packed batch (ordered dQ adds; the tail blocks' zero rows added
    into the next sequence's rows in any order): the output and every gradient equal bit for bit
    over four runs."""
    first = _packed_grads(True, 128, deterministic=True)
    for _ in range(3):
        for a, r in zip(first, _packed_grads(True, 128, deterministic=True)):
            assert torch.equal(a, r)
