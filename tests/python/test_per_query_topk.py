"""Per-query causal top-k: dmattn.attention_topk(..., causal=True, per_query=True)
(dmattn/per_query.py, per_query_path.py; docs/semantics.md, "Per-query causal top-k").

* the interval ends (prefix thresholds, binary search) against the dense per-query selection,
  on random scores with ties, padding masks, keep = 1, small, >= the visible keys;
* out, lse, dq, dk, dv, dbias against the float64 reference of the same selection (the dense
  mask of per_query_mask), over GQA, bias heads 1 / Hkv / H, Sq < Sk, padding, one and many
  segments, non-contiguous q / k / v;
* the interval path against the dense path at float64 (same function, other summation order);
* every output written and finite (NaN-poisoned buffers), fully padded batches, errors, and
  torch.compile without graph breaks.
Every test with the ``device`` fixture also runs on CUDA (gpu marker) when a GPU is visible.
"""

import pytest
import torch

import dmattn
from dmattn import per_query_path
from dmattn.per_query import interval_ends, per_query_mask
from reference import check_against_reference


@pytest.fixture
def segment_len():
    """Sets per_query_path.SEGMENT_LEN for one test."""
    saved = per_query_path.SEGMENT_LEN

    def set_len(n):
        per_query_path.SEGMENT_LEN = n

    yield set_len
    per_query_path.SEGMENT_LEN = saved


def _dtypes(device):
    return [torch.bfloat16, torch.float16] if device == "cuda" else [torch.float64, torch.float32]


@pytest.mark.parametrize("num_keys", [1, 7, 50, 130, 700])
@pytest.mark.parametrize("keep", [1, 3, 17, 200, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_interval_ends_match_dense_selection(device, num_keys, keep, dtype):
    gen = torch.Generator().manual_seed(num_keys * 1000 + keep)
    # Rounded scores: many ties (the lower index wins), -inf and finfo.min among them.
    scores = (torch.randn(2, 3, num_keys, generator=gen) * 2).round().to(dtype)
    scores[0, 0, ::5] = float("-inf")
    scores[1, 2, ::3] = torch.finfo(dtype).min
    allowed = torch.rand(2, 3, num_keys, generator=gen) > 0.25
    allowed[1, 1] = False  # a row with nothing selectable
    scores, allowed = scores.to(device), allowed.to(device)
    for mask in (None, allowed):
        ends = interval_ends(scores, mask, keep)
        assert ends.dtype == torch.int32 and ends.shape == scores.shape
        dense = per_query_mask(scores[:, :, None, :], keep, None if mask is None else mask[:, :, None, :], num_keys)
        i = torch.arange(num_keys, device=device).view(-1, 1)
        j = torch.arange(num_keys, device=device)
        from_ends = (i >= j) & (i < ends[:, :, None, :])
        assert torch.equal(from_ends, dense), f"keep {keep}, mask {mask is not None}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_keys", [300, (1 << 16) + 3])
def test_native_selection_key_equals_torch(dtype, num_keys):
    """The CUDA glue's key (one kernel) is the torch composition's, bit for bit: NaN of either
    sign, -0.0 and 0.0, infinities, excluded keys; int32 keys up to 2^16 keys of 16-bit scores."""
    from dmattn.masks import selection_key
    from dmattn.ops import native_selection_key
    gen = torch.Generator().manual_seed(num_keys)
    scores = (torch.randn(3, num_keys, generator=gen) * 3).round().to(dtype)
    scores[0, ::7] = float("nan")
    scores[0, 1::7] = -float("nan")
    scores[1, ::5] = -0.0
    scores[1, 1::5] = float("-inf")
    scores[2, ::9] = torch.finfo(dtype).min
    allowed = torch.rand(3, num_keys, generator=gen) > 0.2
    scores, allowed = scores.cuda(), allowed.cuda()
    for mask in (None, allowed):
        expected = selection_key(scores, mask)
        got = native_selection_key(scores, mask)
        assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_keys,keep,seg_len", [(3000, 700, 256), (1000, 37, 100), (513, 512, 64)])
def test_glue_cuda_equals_cpu(num_keys, keep, seg_len):
    """The CUDA glue (several 256-key chunks per row, segments not aligned to them) against the
    sequential CPU form, on every output, slots included."""
    from dmattn.ops import prefix_thresholds, segment_candidates
    from dmattn.per_query import selection_ranks

    gen = torch.Generator().manual_seed(num_keys + keep)
    scores = (torch.randn(2, 3, num_keys, generator=gen) * 3).round()
    allowed = torch.rand(2, 3, num_keys, generator=gen) > 0.2
    results = {}
    for device in ("cpu", "cuda"):
        ranks, order = selection_ranks(scores.to(device), allowed.to(device))
        thresholds = prefix_thresholds(ranks.reshape(-1, num_keys), order.reshape(-1, num_keys), keep)
        ends = interval_ends(scores.to(device), allowed.to(device), keep)
        offset = 37
        segments = -(-(num_keys - offset) // seg_len)
        outputs = segment_candidates(ends, offset, seg_len, segments, min(keep + seg_len, num_keys))
        results[device] = [t.cpu() for t in (thresholds, ends, *outputs)]
    for name, a, b in zip(["thresholds", "ends", "positions", "key_ends", "index", "slots"], results["cpu"],
                          results["cuda"]):
        assert torch.equal(a, b), name


def _segment_candidates_reference(ends, offset, seg_len, num_segments, width):
    """dmattn/api.h's segment_candidates written out: a segment's keys before it by increasing
    end bucket (index order inside one), then its own keys; positions increasing."""
    rows_b, rows_h, num_keys = ends.shape
    original = num_segments * seg_len + offset
    span = 64 * max(1, -(-seg_len // (64 * 255)))
    positions = torch.full((rows_b * num_segments, rows_h, width), -1, dtype=torch.int32)
    key_ends = torch.zeros_like(positions)
    index = torch.full_like(positions, -1)
    slots = torch.full((rows_b, num_segments, rows_h, num_keys), -1, dtype=torch.int32)
    for b in range(rows_b):
        for h in range(rows_h):
            e = ends[b, h].tolist()
            for s in range(num_segments):
                first = s * seg_len + offset
                stop = min(num_keys, first + seg_len)
                before = [j for j in range(min(first, stop)) if e[j] > first]
                before.sort(key=lambda j: (-(-min(e[j] - first, seg_len) // span), j))
                own = [j for j in range(first, stop) if e[j] > j]
                row = b * num_segments + s
                for n, j in enumerate((before + own)[:width]):
                    own_pos = j - first + original - seg_len
                    positions[row, h, n] = original - seg_len - len(before) + n if n < len(before) else own_pos
                    key_ends[row, h, n] = e[j] - first
                    index[row, h, n] = j
                    slots[b, s, h, j] = n
    return positions, key_ends, index, slots


@pytest.mark.parametrize("num_keys,keep,seg_len,offset", [(700, 150, 128, 0), (1000, 37, 100, 37),
                                                          (513, 512, 64, 5), (16700, 300, 16400, 11)])
def test_segment_candidates_order(device, num_keys, keep, seg_len, offset):
    """The candidate lists against the contract written out: the keys before a segment grouped
    by how long they stay kept (the backward stops a key block's query loop at its largest end),
    positions strictly increasing with the ones before the segment visible to all its queries."""
    from dmattn.ops import segment_candidates

    gen = torch.Generator().manual_seed(num_keys + seg_len)
    scores = (torch.randn(2, 3, num_keys, generator=gen) * 3).round()
    allowed = torch.rand(2, 3, num_keys, generator=gen) > 0.2
    ends = interval_ends(scores.to(device), allowed.to(device), keep)
    num_segments = -(-(num_keys - offset) // seg_len)
    width = min(keep + seg_len, num_keys)
    got = segment_candidates(ends, offset, seg_len, num_segments, width)
    expected = _segment_candidates_reference(ends.cpu(), offset, seg_len, num_segments, width)
    for name, a, b in zip(["positions", "key_ends", "index", "slots"], expected, got):
        assert torch.equal(a, b.cpu()), name
    valid = expected[0] >= 0
    steps = expected[0][..., 1:] - expected[0][..., :-1]
    assert bool((steps[valid[..., 1:]] > 0).all())


def _per_query_case(device, dtype, gen, *, b, sq, sk, h, hkv, d, bias_heads, padding, layout="contiguous"):
    def make(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    if layout == "hf":  # HF's (B, H, S, D) tensors transposed: non-contiguous (B, S, H, D) views
        q = make(b, h, sq, d).transpose(1, 2)
        k, v = make(b, hkv, sk, d).transpose(1, 2), make(b, hkv, sk, d).transpose(1, 2)
    else:
        q, k, v = make(b, sq, h, d), make(b, sk, hkv, d), make(b, sk, hkv, d)
    dout = make(b, sq, h, d)
    heads = {"1": 1, "hkv": hkv, "h": h}[bias_heads]
    # Bias values on a coarse grid: ties in the selection.
    bias = (torch.randn(b, heads, 1, sk, generator=gen) * 4).round().div(4).to(dtype).to(device)
    mask = None
    if padding:
        mask = torch.ones(b, 1, 1, sk, dtype=torch.bool)
        mask[0, ..., : sk // 3] = False  # left padding of the first sequence
        mask[-1, ..., sk // 2] = False
        mask = mask.to(device)
    return q, k, v, dout, bias, mask


def _run_per_query(q, k, v, bias, mask, keep, dout, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    leaf = bias.detach().requires_grad_()
    out, lse = dmattn.attention_topk(q, k, v, leaf, keep, mask=mask, causal=True, per_query=True,
                                     return_lse=True, **kw)
    out.backward(dout)
    return out.detach(), lse, {"q": q.grad, "k": k.grad, "v": v.grad, "bias": leaf.grad}


CASES = [
    # b, sq, sk, h, hkv, d, keep, bias heads, padding, segment length, layout
    (2, 70, 70, 4, 2, 16, 9, "hkv", True, 16, "contiguous"),
    (2, 70, 70, 4, 2, 16, 9, "hkv", False, 512, "hf"),
    (1, 45, 80, 4, 4, 32, 12, "h", True, 8, "contiguous"),
    (2, 33, 33, 4, 1, 16, 1, "1", True, 16, "contiguous"),
    (2, 40, 40, 2, 2, 64, 100, "h", True, 16, "hf"),
    (1, 200, 200, 2, 1, 64, 40, "hkv", True, 64, "contiguous"),
    # One query (a decoding step): the shared key set of the gather path.
    (2, 1, 70, 4, 2, 16, 9, "hkv", True, 16, "contiguous"),
    (2, 1, 40, 4, 4, 32, 100, "h", True, 16, "hf"),
    # Segments of several 128-query blocks with several key blocks of candidates from before
    # them: the Hopper forward skips the blocks whose rows all stopped being kept.
    (1, 1536, 1536, 2, 1, 64, 300, "hkv", False, 512, "contiguous"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_per_query_matches_reference(device, case, segment_len, nan_poison):
    b, sq, sk, h, hkv, d, keep, bias_heads, padding, seg, layout = case
    segment_len(seg)
    for dtype in _dtypes(device):
        gen = torch.Generator().manual_seed(sq * 31 + keep)
        q, k, v, dout, bias, mask = _per_query_case(device, dtype, gen, b=b, sq=sq, sk=sk, h=h, hkv=hkv, d=d,
                                                    bias_heads=bias_heads, padding=padding, layout=layout)
        out, lse, grads = _run_per_query(q, k, v, bias, mask, keep, dout)
        for name, t in [("out", out), *grads.items()]:
            assert torch.isfinite(t).all(), f"{name}: non-finite values ({dtype})"
        selected = per_query_mask(bias, keep, mask, sq)
        check_against_reference(q, k, v, selected, bias, out, lse, grads, causal=True, dout=dout,
                                context=f"[per-query {case} {dtype}]")


def test_interval_path_equals_dense_path(segment_len):
    """Same function on both paths; at float64 the results agree to rounding."""
    gen = torch.Generator().manual_seed(5)
    for seg in (8, 512):
        segment_len(seg)
        q, k, v, dout, bias, mask = _per_query_case("cpu", torch.float64, gen, b=2, sq=37, sk=50, h=4, hkv=2, d=8,
                                                    bias_heads="h", padding=True)
        results = []
        for dense in (True, False):
            per_query_path._forced_dense = dense
            try:
                results.append(_run_per_query(q, k, v, bias, mask, 6, dout))
            finally:
                per_query_path._forced_dense = False
        (o0, l0, g0), (o1, l1, g1) = results
        torch.testing.assert_close(o1, o0, rtol=0, atol=1e-12)
        torch.testing.assert_close(l1, l0, rtol=0, atol=1e-12)
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-12, msg=f"d{name}")


def test_fully_padded_batch(device):
    gen = torch.Generator().manual_seed(3)
    dtype = _dtypes(device)[0]
    q, k, v, dout, bias, _ = _per_query_case(device, dtype, gen, b=2, sq=20, sk=20, h=2, hkv=2, d=16,
                                             bias_heads="hkv", padding=False)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool, device=device)
    mask[1] = False
    out, lse, grads = _run_per_query(q, k, v, bias, mask, 4, dout)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
    assert torch.all(grads["q"][1] == 0) and torch.all(grads["k"][1] == 0) and torch.all(grads["bias"][1] == 0)
    assert torch.isfinite(out).all() and torch.isfinite(lse[0]).all()


def test_per_query_without_causal_is_the_shared_key_set(device):
    gen = torch.Generator().manual_seed(4)
    dtype = _dtypes(device)[0]
    q, k, v, _, bias, _ = _per_query_case(device, dtype, gen, b=1, sq=16, sk=30, h=2, hkv=2, d=16,
                                          bias_heads="h", padding=False)
    a = dmattn.attention_topk(q, k, v, bias, 5, per_query=True)
    b = dmattn.attention_topk(q, k, v, bias, 5)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_per_query_errors():
    q = torch.randn(1, 8, 2, 16)
    k = v = torch.randn(1, 8, 2, 16)
    bias = torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match="window"):
        dmattn.attention_topk(q, k, v, bias, 2, causal=True, per_query=True, window=(4, 0))
    with pytest.raises(ValueError, match="window"):  # one query too (it runs on the shared key set)
        dmattn.attention_topk(q[:, :1], k, v, bias, 2, causal=True, per_query=True, window=(4, 0))
    with pytest.raises(ValueError, match="bias"):
        dmattn.attention_topk(q, k, v, torch.randn(1, 2, 8, 8), 2, causal=True, per_query=True)
    with pytest.raises(ValueError, match="mask"):
        dmattn.attention_topk(q, k, v, bias, 2, causal=True, per_query=True, mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        dmattn.attention_topk(q, k, v, bias, 2, causal=True, per_query=True, mask=torch.ones(1, 1, 1, 8))
    with pytest.raises(ValueError, match="keep"):
        dmattn.attention_topk(q, k, v, bias, 0, causal=True, per_query=True)


def test_per_query_compiles_without_graph_breaks():
    gen = torch.Generator().manual_seed(6)
    q, k, v, _, bias, mask = _per_query_case("cpu", torch.float32, gen, b=1, sq=24, sk=24, h=2, hkv=1, d=16,
                                             bias_heads="hkv", padding=True)

    def f(q, k, v, bias, mask):
        return dmattn.attention_topk(q, k, v, bias, 5, mask=mask, causal=True, per_query=True)

    explanation = torch._dynamo.explain(f)(q, k, v, bias, mask)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, bias, mask), f(q, k, v, bias, mask))


def test_key_ends_and_glue_errors_name_the_argument():
    from dmattn._lib import lib
    from dmattn.ops import prefix_thresholds, segment_candidates

    q = torch.randn(1, 4, 2, 8)
    k = v = torch.randn(1, 6, 2, 8)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 4)
    positions = torch.arange(6, dtype=torch.int32).view(1, 1, 6)
    ends = torch.full((1, 1, 6), 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="key_ends"):  # without key_positions
        lib().forward(q, k, v, out, lse, None, None, True, -1, -1, 0.5, 0.0, None, 0, ends, None, None, None, 0, None, None)
    with pytest.raises(ValueError, match="key_ends"):  # not key_positions' shape
        lib().forward(q, k, v, out, lse, None, None, True, -1, -1, 0.5, 0.0, positions, 6, ends[..., :5], None,
                      None, None, 0, None, None)
    with pytest.raises(TypeError, match="key_ends"):
        lib().forward(q, k, v, out, lse, None, None, True, -1, -1, 0.5, 0.0, positions, 6, ends.float(), None,
                      None, None, 0, None, None)
    ranks = torch.zeros(2, 5, dtype=torch.int32)
    with pytest.raises(TypeError, match="order"):
        prefix_thresholds(ranks, ranks.long(), 3)
    with pytest.raises(ValueError, match="keep"):
        prefix_thresholds(ranks, ranks, 0)
    with pytest.raises(ValueError, match="offset"):
        segment_candidates(torch.zeros(1, 1, 5, dtype=torch.int32), -1, 2, 3, 4)
    from dmattn.ops import interval_ends_of_sorted, native_selection_key
    with pytest.raises(NotImplementedError, match="scores"):  # CUDA only
        native_selection_key(torch.zeros(2, 5), None)
    with pytest.raises(NotImplementedError, match="sorted"):  # CUDA only: the CPU composes torch ops
        interval_ends_of_sorted(torch.zeros(2, 5, dtype=torch.int64), None, 3)
    if torch.cuda.is_available():
        with pytest.raises(TypeError, match="scores"):  # float64 has no native key
            native_selection_key(torch.zeros(2, 5, dtype=torch.float64, device="cuda"), None)
        with pytest.raises(TypeError, match="allowed"):
            native_selection_key(torch.zeros(2, 5, device="cuda"), torch.zeros(2, 5, dtype=torch.int32, device="cuda"))
        with pytest.raises(TypeError, match="sorted"):
            interval_ends_of_sorted(torch.zeros(2, 5, dtype=torch.int32, device="cuda"), None, 3)
        with pytest.raises(ValueError, match="keep"):
            interval_ends_of_sorted(torch.zeros(2, 5, dtype=torch.int64, device="cuda"), None, 0)
