"""The gather path (dmattn/gather.py; docs/semantics.md, "Gather path").

* dmattn.attention with a mask without a query dimension, forced onto the gather path, equals
  the dense masked path: out, lse, dq, dk, dv, dbias, over GQA, Sq != Sk, causal, window,
  softcap, every per-key bias shape and mask head count;
  dmattn.attention_topk likewise (keep = 1, small, >= Sk; with and without a padding mask);
* causal rows whose kept keys all lie in their future: out 0, lse -inf, zero gradients; key
  sets that keep nothing at all;
* low precision against the float64 reference, NaN-poisoned outputs, determinism;
* several key blocks per (batch, head) (the kernels' binary searches, block skipping and
  blocks without the per-element test), both CUDA backward paths (exact 3-pass and atomic) and
  deterministic mode at the op level, against the CPU backend on the same positions;
* the automatic choice, the extended custom ops (opcheck), torch.compile of attention_topk,
  and the errors for malformed key_positions.

Every test with the ``device`` fixture also runs on CUDA (gpu marker) when a GPU is visible.
"""

import contextlib
import math

import pytest
import torch

import dmattn
from dmattn import decode_kernel, gather
from dmattn.ops import supports_key_positions
from reference import check_against_reference

B, H, HKV = 2, 4, 2


def _dtypes(device):
    return [torch.bfloat16, torch.float16] if device == "cuda" else [torch.float64, torch.float32]


def _qkv(b, sq, sk, h, hkv, d, dtype, device, gen):
    q = torch.randn(b, sq, h, d, generator=gen).to(dtype).to(device)
    k = torch.randn(b, sk, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(b, sk, hkv, d, generator=gen).to(dtype).to(device)
    dout = torch.randn(b, sq, h, d, generator=gen).to(dtype).to(device)
    return q, k, v, dout


def _run(path, fn, q, k, v, bias, dout, args, **options):
    """out, lse and every gradient of fn(q, k, v, *args(bias leaf)) on the forced path."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    leaf = None
    if bias is not None:
        leaf = bias.detach().requires_grad_()
    with gather.force_path(path):
        out, lse = fn(q, k, v, *args(leaf), return_lse=True, **options)
    out.backward(dout)
    result = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if leaf is not None:
        result["dbias"] = leaf.grad
    return result


def _attention(path, q, k, v, mask, bias, dout, **options):
    return _run(path, dmattn.attention, q, k, v, bias, dout, lambda leaf: (mask, leaf), **options)


def _topk(path, q, k, v, bias, keep, mask, dout, **options):
    return _run(path, dmattn.attention_topk, q, k, v, bias, dout,
                lambda leaf: (leaf, keep), mask=mask, **options)


def _assert_same(gathered, dense, dtype, context, rel=None):
    """Equal up to the order of floating-point summation (different tilings of the keys):
    -inf at the same places, finite values within a few units of fp32 (fp64) accumulation
    relative to each tensor's largest magnitude."""
    if rel is None:
        rel = {torch.float64: 1e-11, torch.float32: 2e-5}.get(dtype, 2 ** -7)
    assert gathered.keys() == dense.keys()
    for name, got in gathered.items():
        expected = dense[name]
        assert got is not None and expected is not None, f"{name}: missing {context}"
        assert got.shape == expected.shape and got.dtype == expected.dtype, f"{name} {context}"
        got, expected = got.detach().cpu().double(), expected.detach().cpu().double()
        inf = torch.isinf(expected)
        assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], expected[inf]), (
            f"{name}: -inf pattern differs {context}")
        assert not torch.isnan(got).any(), f"{name}: NaN {context}"
        fin = ~inf
        scale = max(1.0, float(expected[fin].abs().max())) if fin.any() else 1.0
        err = float((got[fin] - expected[fin]).abs().max()) if fin.any() else 0.0
        assert err <= rel * scale, f"{name}: max difference {err:.3e} > {rel * scale:.3e} {context}"


# (Sq, Sk, H, Hkv, mask shape, bias shape or None, causal, window, density, softcap)
CASES = [
    (7, 40, H, HKV, (B, H, 1, 40), (B, H, 1, 40), False, (-1, -1), 0.3, 0.0),
    (7, 40, H, HKV, (B, 1, 1, 40), (B, 1, 1, 40), True, (-1, -1), 0.3, 0.0),
    (40, 40, H, HKV, (B, HKV, 1, 40), (1, H, 1, 40), True, (-1, -1), 0.2, 0.0),
    (33, 70, H, HKV, (B, 1, 1, 70), (HKV, 1, 70), False, (5, 3), 0.4, 0.0),
    (70, 33, H, 1, (B, H, 1, 33), (B, H, 1, 1), True, (10, -1), 0.5, 5.0),
    (9, 150, H, H, (150,), None, False, (-1, 20), 0.1, 0.0),
    (12, 12, H, HKV, (B, H, 1, 12), (B, H, 1, 12), False, (-1, -1), 1.0, 0.0),   # keeps all
    (12, 50, H, HKV, (B, 1, 1, 50), (B, 1, 1, 50), True, (-1, -1), 0.02, 0.0),   # ~1 key
    (1, 64, 3, 1, (B, 3, 1, 64), (B, 3, 1, 64), True, (-1, -1), 0.25, 0.0),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"case{i}")
def test_attention_gather_matches_dense(device, case):
    sq, sk, h, hkv, mask_shape, bias_shape, causal, window, density, softcap = CASES[case]
    gen = torch.Generator().manual_seed(case)
    for dtype in _dtypes(device):
        q, k, v, dout = _qkv(B, sq, sk, h, hkv, 16, dtype, device, gen)
        mask = (torch.rand(mask_shape, generator=gen) < density).to(device)
        bias = None
        if bias_shape is not None:
            bias = torch.randn(bias_shape, generator=gen).to(dtype).to(device)
            bias = bias.masked_fill((torch.rand(bias_shape, generator=gen) < 0.1).to(device), float("-inf"))
        options = dict(causal=causal, window=window, softcap=softcap)
        gathered = _attention("gather", q, k, v, mask, bias, dout, **options)
        dense = _attention("dense", q, k, v, mask, bias, dout, **options)
        # A key set per query head under GQA gathers K/V per query head: dk, dv come out of
        # the kernel rounded per head, then summed over the group (the dense kernel sums the
        # group in fp32 and rounds once): up to a few more units in the last 16-bit place.
        key_set_heads = mask_shape[-3] if len(mask_shape) >= 3 else 1
        rel = 2 ** -6 if dtype.itemsize == 2 and key_set_heads == h != hkv else None
        _assert_same(gathered, dense, dtype, f"[case {case} {dtype}]", rel=rel)


@pytest.mark.parametrize("keep", [1, 3, 17, 40, 100])
@pytest.mark.parametrize("with_mask", [False, True])
def test_topk_gather_matches_dense(device, keep, with_mask):
    gen = torch.Generator().manual_seed(keep)
    for dtype in _dtypes(device):
        q, k, v, dout = _qkv(B, 25, 40, H, HKV, 16, dtype, device, gen)
        bias = torch.randn(B, HKV, 1, 40, generator=gen).to(dtype).to(device)
        mask = (torch.rand(B, 1, 1, 40, generator=gen) < 0.6).to(device) if with_mask else None
        for causal in (False, True):
            options = dict(causal=causal)
            gathered = _topk("gather", q, k, v, bias, keep, mask, dout, **options)
            dense = _topk("dense", q, k, v, bias, keep, mask, dout, **options)
            _assert_same(gathered, dense, dtype, f"[keep {keep} causal {causal} {dtype}]")


def test_causal_early_queries_keep_nothing(device):
    # Kept keys only among the last 10 of 30; causal with Sq = Sk: queries 0..19 keep nothing.
    gen = torch.Generator().manual_seed(5)
    dtype = _dtypes(device)[0]
    q, k, v, dout = _qkv(B, 30, 30, H, HKV, 16, dtype, device, gen)
    bias = torch.randn(B, H, 1, 30, generator=gen).to(dtype).to(device)
    bias[..., :20] = -5.0  # never among the top 4
    got = _topk("gather", q, k, v, bias, 4, None, dout, causal=True)
    assert torch.isinf(got["lse"][:, :, :20]).all() and (got["lse"][:, :, :20] < 0).all()
    assert torch.isfinite(got["lse"][:, :, 29]).all()
    assert (got["out"][:, :20] == 0).all() and (got["dq"][:, :20] == 0).all()
    assert (got["dk"][:, :20] == 0).all() and (got["dv"][:, :20] == 0).all()
    assert (got["dbias"][..., :20] == 0).all()
    dense = _topk("dense", q, k, v, bias, 4, None, dout, causal=True)
    _assert_same(got, dense, dtype, "[early queries]")


@pytest.mark.parametrize("seed", range(4))
def test_gather_against_reference_low_precision(device, seed):
    """bf16/fp16 (where rounding of the gathered gradients' scatter differs from the dense
    path's) against the float64 reference with the dense path's tolerance rule."""
    gen = torch.Generator().manual_seed(100 + seed)
    dtype = [torch.bfloat16, torch.float16][seed % 2]
    sq, sk = [(9, 48), (48, 48), (20, 7), (1, 33)][seed]
    q, k, v, dout = _qkv(B, sq, sk, H, HKV, 32, dtype, device, gen)
    mask = (torch.rand(B, [1, HKV, H, 1][seed], 1, sk, generator=gen) < 0.4).to(device)
    bias = (torch.randn(B, H, 1, sk, generator=gen) * 2).to(dtype).to(device).requires_grad_()
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    options = dict(causal=seed % 2 == 1, window=(-1, -1), softcap=0.0)
    with gather.force_path("gather"):
        out, lse = dmattn.attention(qg, kg, vg, mask, bias, return_lse=True, **options)
    out.backward(dout)
    grads = {"q": qg.grad, "k": kg.grad, "v": vg.grad, "bias": bias.grad}
    check_against_reference(q, k, v, mask, bias, out.detach(), lse, grads, scale=None,
                            dout=dout, context=f"[gather seed {seed}]", **options)


def test_gather_outputs_fully_written(device, nan_poison):
    gen = torch.Generator().manual_seed(9)
    dtype = _dtypes(device)[-1]
    q, k, v, dout = _qkv(B, 21, 70, H, HKV, 16, dtype, device, gen)
    mask = (torch.rand(B, H, 1, 70, generator=gen) < 0.2).to(device)
    mask[0, 0] = False  # a (batch, head) that keeps nothing: padding rows only
    bias = torch.randn(1, H, 1, 70, generator=gen).to(dtype).to(device)
    got = _attention("gather", q, k, v, mask, bias, dout, causal=True)
    for name, t in got.items():
        finite = torch.isfinite(t) | (t == float("-inf")) if name == "lse" else torch.isfinite(t)
        assert finite.all(), f"{name}: NaN or inf left"
    assert (got["out"][0, :, 0] == 0).all() and torch.isinf(got["lse"][0, 0]).all()


def test_nothing_kept(device):
    """Key sets that are empty everywhere: K = 0 gathered rows."""
    gen = torch.Generator().manual_seed(8)
    dtype = _dtypes(device)[-1]
    q, k, v, dout = _qkv(B, 6, 30, H, HKV, 16, dtype, device, gen)
    mask = torch.zeros(B, 1, 1, 30, dtype=torch.bool, device=device)
    bias = torch.randn(B, H, 1, 30, generator=gen).to(dtype).to(device)
    got = _attention("gather", q, k, v, mask, bias, dout, causal=True)
    assert torch.isinf(got["lse"]).all()
    for name in ("out", "dq", "dk", "dv", "dbias"):
        assert (got[name] == 0).all(), name


def test_gather_is_deterministic_on_cpu():
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = _qkv(B, 30, 90, H, HKV, 16, torch.float32, "cpu", gen)
    mask = torch.rand(B, 1, 1, 90, generator=gen) < 0.3
    bias = torch.randn(B, H, 1, 90, generator=gen)
    first = _attention("gather", q, k, v, mask, bias, dout, deterministic=True)
    second = _attention("gather", q, k, v, mask, bias, dout, deterministic=True)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_automatic_choice(device):
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = _qkv(B, 8, 256, H, HKV, 16, _dtypes(device)[-1], device, gen)
    sparse = (torch.rand(B, H, 1, 256, generator=gen) < 0.2).to(device)
    dense_mask = torch.ones(B, H, 1, 256, dtype=torch.bool, device=device)
    per_query = sparse.expand(B, H, 8, 256)
    key_bias = torch.randn(B, H, 1, 256, generator=gen).to(device)
    gathers = supports_key_positions(device)
    assert gathers  # both backends read key positions
    # An inference call that the decode kernel takes reads the mask in place and never gathers
    # (no host synchronization on a decoding step); the choice below is a training call's.
    decodes = decode_kernel.fwd_decode_splits(q, k) > 0
    with torch.no_grad():
        assert (gather.mask_key_set(q, k, sparse, key_bias, False) is not None) == (gathers and not decodes)
    q = q.detach().requires_grad_()

    key_set = gather.mask_key_set(q, k, sparse, key_bias, False)
    assert (key_set is not None) == gathers
    if key_set is not None:
        assert key_set.width == int(sparse.sum(-1).max())
    assert gather.mask_key_set(q, k, dense_mask, None, False) is None  # nothing to skip
    assert gather.mask_key_set(q, k, per_query, None, False) is None  # query dimension
    assert gather.mask_key_set(q, k, sparse, key_bias.expand(B, H, 8, 256), False) is None
    assert gather.mask_key_set(q[:, :, :, :], k[:, :100], sparse[..., :100], None, False) is None
    with gather.force_path("dense"):
        assert gather.mask_key_set(q, k, sparse, None, False) is None
    with gather.force_path("gather"):  # any kept fraction, but still only where allowed
        assert (gather.mask_key_set(q, k, dense_mask, None, False) is not None) == gathers
        assert gather.mask_key_set(q, k, per_query, None, False) is None
    if device == "cuda":  # gathering's backward is a scatter-add (atomics) on CUDA
        assert gather.mask_key_set(q, k, sparse, None, True) is None
    # The automatic choice gives the dense path's results.
    auto = _attention(None, q, k, v, sparse, key_bias, dout, causal=True)
    dense = _attention("dense", q, k, v, sparse, key_bias, dout, causal=True)
    _assert_same(auto, dense, q.dtype, "[auto]")


def test_force_path_rejects_unknown_paths():
    with pytest.raises(ValueError, match="path: expected 'gather', 'dense' or None"):
        with gather.force_path("sparse"):
            pass


def test_compact_positions():
    kept = torch.tensor([[True, False, True, True, False], [False] * 5, [True] * 5])
    assert gather.compact_positions(kept, 3).tolist() == [[0, 2, 3], [-1, -1, -1], [0, 1, 2]]
    assert gather.compact_positions(kept, 6).tolist()[0] == [0, 2, 3, -1, -1, -1]


# ---- The extended custom ops: opcheck and errors.


def _op_inputs(device, bias_heads=H):
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, _ = _qkv(B, 9, 6, H, HKV, 16, dtype, device, gen)
    # 6 gathered rows out of 20 keys; (batch 1, Hkv heads): one set per GQA group.
    positions = torch.tensor([[[1, 4, 5, 11, 19, -1], [0, 2, 3, -1, -1, -1]]], dtype=torch.int32)
    bias = torch.randn(B, bias_heads, 1, 6, generator=gen).to(dtype).to(device)
    return q, k, v, bias, positions.to(device)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (4, 2))])
def test_opcheck_with_key_positions(causal, window):
    q, k, v, bias, positions = _op_inputs("cpu")
    for t in (q, k, v, bias):
        t.requires_grad_()
    opts = (causal, window[0], window[1], None, 0.0, False)
    torch.library.opcheck(torch.ops.dmattn.fwd.default,
                          (q, k, v, None, bias) + opts + (positions, 20))
    out, lse = torch.ops.dmattn.fwd(q, k, v, None, bias, *opts, positions, 20)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, None,
            bias.detach(), True) + opts + (positions, 20)
    torch.library.opcheck(torch.ops.dmattn.bwd.default, args)


def _forward_error(device, edit):
    q, k, v, bias, positions = _op_inputs(device)
    positions, seqlen_k_original = edit(positions)
    torch.ops.dmattn.fwd(q, k, v, None, bias, False, -1, -1, None, 0.0, False, positions,
                         seqlen_k_original)


@pytest.mark.parametrize("edit,error,message", [
    (lambda p: (p.long(), 20), TypeError, "key_positions: expected dtype int32"),
    (lambda p: (p[0], 20), ValueError, "key_positions: expected a 3-D tensor"),
    (lambda p: (p[:, :, :5], 20), ValueError, r"key_positions: expected shape \(1 or 2, 1, 2 or 4, 6"),
    (lambda p: (p.expand(3, 2, 6), 20), ValueError, "key_positions: expected shape"),
    (lambda p: (p.flip(-1).contiguous(), 20), ValueError, "key_positions: .*padding"),
    (lambda p: (p[..., [1, 0, 2, 3, 4, 5]], 20), ValueError, "strictly increasing"),
    (lambda p: (p.transpose(1, 2).contiguous().transpose(1, 2), 20), ValueError,
     "key_positions: expected a contiguous last dimension"),
    (lambda p: (p, -2), ValueError, "seqlen_k_original: expected >= 0"),
])
def test_malformed_key_positions(edit, error, message):
    with pytest.raises(error, match=message):
        _forward_error("cpu", edit)


@pytest.mark.gpu
def test_cuda_key_positions_device_and_refusal():
    with pytest.raises(ValueError, match="key_positions: expected a tensor on the same device as q"):
        _forward_error("cuda", lambda p: (p.cpu(), 20))
    assert supports_key_positions("cuda")
    _forward_error("cuda", lambda p: (p, 20))  # accepted
    # One positions row per query head while k/v hold Hkv < H heads: the key-major backward
    # kernel shares one row per kv head, so CUDA refuses it (dmattn.gather gathers per query
    # head instead).
    per_query_head = lambda p: (p.repeat_interleave(H // HKV, dim=1).contiguous(), 20)
    with pytest.raises(NotImplementedError, match="key_positions: one row per query head with GQA"):
        _forward_error("cuda", per_query_head)


# ---- Several key blocks per (batch, head), the backward paths and deterministic mode.

# (Sq, Sk, keep, Hkv, bias heads, causal, window): K = keep gathered rows span several of the
# CUDA kernels' key blocks (64 / 128 rows), Sq several query blocks.
MULTI_BLOCK_CASES = [
    (300, 1000, 400, HKV, H, True, (-1, -1)),
    (257, 700, 300, HKV, HKV, True, (-1, -1)),
    (200, 900, 350, 1, 1, False, (150, 40)),
    (513, 513, 200, H, H, True, (-1, 64)),
    (129, 2000, 600, HKV, H, False, (-1, -1)),
]


@pytest.mark.parametrize("case", range(len(MULTI_BLOCK_CASES)), ids=lambda i: f"case{i}")
def test_topk_gather_multi_block(device, case):
    sq, sk, keep, hkv, bias_heads, causal, window = MULTI_BLOCK_CASES[case]
    gen = torch.Generator().manual_seed(200 + case)
    dtype = _dtypes(device)[case % len(_dtypes(device))]
    q, k, v, dout = _qkv(B, sq, sk, H, hkv, 64, dtype, device, gen)
    bias = torch.randn(B, bias_heads, 1, sk, generator=gen).to(dtype).to(device)
    options = dict(causal=causal, window=window)
    gathered = _topk("gather", q, k, v, bias, keep, None, dout, **options)
    dense = _topk("dense", q, k, v, bias, keep, None, dout, **options)
    _assert_same(gathered, dense, dtype, f"[multi-block case {case} {dtype}]")


def _op_grads(device, dtype, deterministic, inputs, causal, window):
    """out, lse and (dq, dk, dv, dbias) of the raw ops on the gathered rows ``inputs``."""
    q, k, v, bias, positions, dout, num_keys = (
        t.to(device=device, dtype=dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
        else (t.to(device) if isinstance(t, torch.Tensor) else t) for t in inputs)
    opts = (causal, window[0], window[1], None, 0.0, deterministic)
    out, lse = torch.ops.dmattn.fwd(q, k, v, None, bias, *opts, positions, num_keys)
    grads = torch.ops.dmattn.bwd(dout, q, k, v, out, lse, None, bias, True, *opts, positions, num_keys)
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2], "dbias": grads[3]}


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bias_batch", [1, B])
@pytest.mark.parametrize("exact", ["0", "1"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_positions_backward_paths(monkeypatch, exact, deterministic, bias_batch, head_dim):
    """The raw ops with key_positions on CUDA, through the exact (3-pass) or the atomic
    backward (DMATTN_BWD_EXACT) and deterministic mode (a bias shared over the batch: the
    folded dbias reduction; a bias per batch element: on Hopper the warp-specialized kernel
    without dQ, then the query-major dQ kernel), equal the CPU backend on the same positions
    and rows; padding rows (including whole padding key blocks) get zero gradients."""
    monkeypatch.setenv("DMATTN_BWD_EXACT", exact)
    gen = torch.Generator().manual_seed(31)
    sq, num_keys, width = 200, 900, 300
    # (B, Hkv, K) positions: sorted random subsets of different sizes, then -1 padding; one
    # (batch, head) keeps nothing.
    positions = torch.full((B, HKV, width), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(HKV):
            count = [width, 170, 0, 41][b * HKV + h]
            positions[b, h, :count] = torch.randperm(num_keys, generator=gen)[:count].sort().values
    q, k, v, dout = _qkv(B, sq, width, H, HKV, head_dim, torch.bfloat16, "cpu", gen)
    bias = torch.randn(bias_batch, HKV, 1, width, generator=gen).to(torch.bfloat16)
    q, k, v, dout, bias = (t.float() for t in (q, k, v, dout, bias))  # bf16 values, fp32 on the CPU
    inputs = (q, k, v, bias, positions, dout, num_keys)
    for causal, window in ((True, (-1, -1)), (False, (100, 20))):
        expected = _op_grads("cpu", torch.float32, False, inputs, causal, window)
        got = _op_grads("cuda", torch.bfloat16, deterministic, inputs, causal, window)
        padding = (positions.unsqueeze(-1) < 0).cuda()  # (B, Hkv, K, 1)
        for name in ("dk", "dv"):
            rows = got[name].transpose(1, 2)  # (B, Hkv, K, D)
            assert (rows.masked_select(padding) == 0).all(), f"{name} of padding rows"
        hidden = positions.cuda().lt(0)  # (B, Hkv, K): padding key rows
        assert (got["dbias"][:, :, 0].masked_select(hidden.all(0) if bias_batch == 1 else hidden) == 0).all()
        expected = {n: t.to(torch.bfloat16) if n != "lse" else t for n, t in expected.items()}
        # CUDA rounds P and dS to bf16 for its products, the CPU does not: a looser bound.
        _assert_same(got, expected, torch.bfloat16, f"[exact {exact} det {deterministic} causal {causal}]",
                     rel=2 ** -6)
        if deterministic:
            again = _op_grads("cuda", torch.bfloat16, True, inputs, causal, window)
            for name in got:
                assert torch.equal(got[name], again[name]), f"{name}: not deterministic"


@pytest.mark.parametrize("dtype,with_mask", [(torch.float32, False), (torch.bfloat16, True),
                                             (torch.float64, True)])
def test_compile_topk_gather_fullgraph(dtype, with_mask):
    # The selection key's bit views (fp32, bf16) and the float64 mask compaction both trace.
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    q, k, v, _ = _qkv(B, 10, 40, H, HKV, 16, dtype, "cpu", gen)
    bias = torch.randn(B, H, 1, 40, generator=gen).to(dtype)
    mask = torch.rand(B, 1, 1, 40, generator=gen) < 0.5 if with_mask else None
    inputs = [t.requires_grad_() for t in (q, k, v, bias)]

    def f(q, k, v, bias):
        return dmattn.attention_topk(q, k, v, bias, 5, mask=mask, causal=True).float().square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss_c = compiled(*inputs)
    grads_c = torch.autograd.grad(loss_c, inputs)
    loss_e = f(*inputs)
    grads_e = torch.autograd.grad(loss_e, inputs)
    assert torch.equal(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        assert torch.equal(gc, ge)
    assert math.isfinite(float(loss_c.detach()))


def _assert_graph_replays_match(draw, call, eager=contextlib.nullcontext):
    """call(draw()) captured in a CUDA graph (after two warm-up calls on a side stream): replays on
    new inputs copied into the captured tensors give exactly what eager calls on those inputs give
    (made inside eager(), a context manager)."""
    captured = draw()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            call(captured)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = call(captured)
    for _ in range(2):
        fresh = draw()
        for dst, src in zip(captured, fresh):
            dst.copy_(src)
        graph.replay()
        with torch.no_grad(), eager():
            want = call(fresh)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("per_query", [False, True])
def test_attention_topk_cuda_graph(per_query):
    """attention_topk, selection included, captured in a CUDA graph (no host synchronization, no
    state kept on the host): replays on new inputs copied into the captured tensors give what
    eager calls on those inputs give."""
    g = torch.Generator().manual_seed(5)

    def draw():
        q, k, v = (torch.randn(2, 1000, 4, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
        return q, k, v, torch.randn(2, 4, 1, 1000, generator=g).to("cuda", torch.bfloat16)

    _assert_graph_replays_match(
        draw, lambda x: dmattn.attention_topk(*x[:3], x[3], 300, causal=True, per_query=per_query))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_attention_key_mask_cuda_graph():
    """dmattn.attention with a sparse key mask (eagerly: the gather path, whose choice
    synchronizes with the host) captured in a CUDA graph: the capture takes the dense path, and
    replays on new inputs copied into the captured tensors give what eager dense calls give."""
    g = torch.Generator().manual_seed(6)

    def draw():
        q, k, v = (torch.randn(2, 700, 4, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
        mask = (torch.rand(2, 4, 1, 700, generator=g) < 0.2).to("cuda")
        return q, k, v, mask, torch.randn(2, 4, 1, 700, generator=g).to("cuda", torch.bfloat16)

    first = draw()  # (the choice, eagerly: the gather path)
    assert gather.mask_key_set(*first[:2], first[3], first[4], False) is not None
    _assert_graph_replays_match(draw, lambda x: dmattn.attention(*x[:3], mask=x[3], bias=x[4], causal=True),
                                eager=lambda: gather.force_path("dense"))
