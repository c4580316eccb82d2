"""Indexed keys (key_rows of dmattn::fwd / dmattn::bwd): the kernels read the gathered K and V
rows in place from the source k, v instead of from a gathered copy. On CUDA every result equals
the same call on the copy bit for bit (the same kernel reads the same values), whichever kernel
runs: the warp-specialized Hopper kernels gather by cp.async, the others get a copy made by the
backend. On the CPU indexed keys are refused."""

import pytest
import torch

import dmattn
from dmattn import per_query_path
from dmattn.ops import attention_backward, attention_forward, forward_with_grad

CUDA = torch.cuda.is_available()


def _gathered(x, index, batch_div):
    """x (Bs, S, Hkv, D) at index (1 or B, 1 or Hkv, K) -> (B, K, Hkv, D); an index outside
    [0, S) gives a zero row."""
    batch = index.shape[0] if index.shape[0] > 1 else x.shape[0] * batch_div
    heads_kv, seq = x.shape[2], x.shape[1]
    idx = index.expand(batch, heads_kv, index.shape[-1]).long()
    valid = (idx >= 0) & (idx < seq)
    src = x[torch.arange(batch, device=x.device) // batch_div]  # (B, S, Hkv, D)
    rows = torch.gather(src.transpose(1, 2), 2, idx.clamp(0, seq - 1).unsqueeze(-1).expand(-1, -1, -1, x.shape[3]))
    return (rows * valid.unsqueeze(-1)).transpose(1, 2).contiguous()


def _case(dtype, *, d, batch_div, rows_heads, ends, gen):
    src_batch, seq, heads, heads_kv, sq, width = 2, 300, 4, 2, 96, 200
    batch = src_batch * batch_div
    original = 400
    dev = "cuda"
    q = torch.randn(batch, sq, heads, d, generator=gen).to(dtype).to(dev)
    k = torch.randn(src_batch, seq, heads_kv, d, generator=gen).to(dtype).to(dev)
    v = torch.randn(src_batch, seq, heads_kv, d, generator=gen).to(dtype).to(dev)
    hr = {"1": 1, "hkv": heads_kv}[rows_heads]
    # Positions: increasing valid ones, then padding; rows: any source row, repeats, and some
    # outside the source (zero rows).
    positions = torch.full((batch, hr, width), -1, dtype=torch.int32)
    for b in range(batch):
        for h in range(hr):
            n = int(torch.randint(width // 2, width + 1, (1,), generator=gen))
            positions[b, h, :n] = torch.randperm(original, generator=gen)[:n].sort().values.to(torch.int32)
    index = torch.randint(-5, seq + 5, (batch, hr, width), generator=gen, dtype=torch.int32)
    key_ends = torch.randint(0, sq + 4, (batch, hr, width), generator=gen, dtype=torch.int32) if ends else None
    bias = torch.randn(batch, hr, 1, width, generator=gen).float().to(dev)
    dout = torch.randn(batch, sq, heads, d, generator=gen).to(dtype).to(dev)
    return q, k, v, bias, dout, positions.to(dev), index.to(dev), None if key_ends is None else key_ends.to(dev), original


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("batch_div,rows_heads,ends", [(1, "hkv", True), (3, "1", False), (2, "hkv", False)])
@pytest.mark.parametrize("bwd_ws", ["1", "0"])
def test_indexed_keys_equal_the_gathered_copy(monkeypatch, d, batch_div, rows_heads, ends, bwd_ws, nan_poison):
    monkeypatch.setenv("DMATTN_BWD_SM90_WS", bwd_ws)  # "0": the backward's copy, general kernels
    gen = torch.Generator().manual_seed(d * 7 + batch_div)
    dtype = torch.bfloat16 if d != 96 else torch.float16
    q, k, v, bias, dout, positions, index, key_ends, original = _case(dtype, d=d, batch_div=batch_div,
                                                                      rows_heads=rows_heads, ends=ends, gen=gen)
    k_rows, v_rows = _gathered(k, index, batch_div), _gathered(v, index, batch_div)
    options = (True, -1, -1, None, 0.0, False, positions, original, key_ends)
    out0, lse0 = attention_forward(q, k_rows, v_rows, None, bias, *options)
    out1, lse1 = attention_forward(q, k, v, None, bias, *options, index)
    assert torch.isfinite(out1).all()
    assert torch.equal(out1, out0) and torch.equal(lse1, lse0), "forward: indexed keys differ from the copy"
    grads0 = attention_backward(dout, q, k_rows, v_rows, out0, lse0, None, bias, True, *options)
    grads1 = attention_backward(dout, q, k, v, out1, lse1, None, bias, True, *options, False, index)
    for name, g0, g1 in zip(["dq", "dk", "dv", "dbias"], grads0, grads1):
        assert g1.shape == g0.shape, name
        assert torch.equal(g1, g0), f"{name}: indexed keys differ from the copy"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_indexed_keys_autograd_sums_onto_the_source_rows():
    gen = torch.Generator().manual_seed(11)
    q, k, v, bias, dout, positions, index, key_ends, original = _case(torch.bfloat16, d=128, batch_div=2,
                                                                      rows_heads="hkv", ends=True, gen=gen)
    grads = []
    for indexed in (False, True):
        qq, kk, vv, bb = (t.detach().clone().requires_grad_() for t in (q, k, v, bias))
        if indexed:
            out, _ = forward_with_grad(qq, kk, vv, None, bb, True, -1, -1, None, 0.0, False, positions, original,
                                       key_ends, index)
        else:  # autograd of the gather: each source row's gradient is the sum of its rows'
            out, _ = forward_with_grad(qq, _gathered(kk, index, 2), _gathered(vv, index, 2), None, bb, True, -1, -1,
                                       None, 0.0, False, positions, original, key_ends)
        out.backward(dout)
        grads.append([out.detach(), qq.grad, kk.grad, vv.grad, bb.grad])
    for name, g0, g1 in zip(["out", "dq", "dk", "dv", "dbias"], *grads):
        assert torch.isfinite(g1).all(), name
        torch.testing.assert_close(g1.float(), g0.float(), rtol=1e-2, atol=1e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_per_query_path_indexed_equals_copy(monkeypatch):
    """attention_topk's per-query path with the candidates' rows read in place and with the
    gathered copies: the same bits."""
    gen = torch.Generator().manual_seed(12)
    b, s, h, hkv, d, keep = 2, 1100, 4, 2, 128, 300
    q = torch.randn(b, s, h, d, generator=gen).bfloat16().cuda()
    k = torch.randn(b, s, hkv, d, generator=gen).bfloat16().cuda()
    v = torch.randn(b, s, hkv, d, generator=gen).bfloat16().cuda()
    bias = torch.randn(b, hkv, 1, s, generator=gen).bfloat16().cuda()
    dout = torch.randn(b, s, h, d, generator=gen).bfloat16().cuda()
    results = []
    for indexed in (False, True):
        monkeypatch.setattr(per_query_path, "INDEXED_KEYS", indexed)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        out = dmattn.attention_topk(*leaves[:3], leaves[3], keep, causal=True, per_query=True)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, r0, r1 in zip(["out", "dq", "dk", "dv", "dbias"], *results):
        assert torch.isfinite(r1).all(), name
        assert torch.equal(r1, r0), f"{name}: the in-place rows differ from the gathered copy"


def test_indexed_keys_refused_on_cpu_and_checked():
    q = torch.randn(2, 4, 2, 8)
    k = v = torch.randn(1, 6, 2, 8)
    positions = torch.arange(5, dtype=torch.int32).view(1, 1, 5)
    rows = torch.arange(5, dtype=torch.int32).view(1, 1, 5)
    with pytest.raises(NotImplementedError, match="key_rows"):
        attention_forward(q, k, v, None, None, True, -1, -1, None, 0.0, False, positions, 6, None, rows)
    with pytest.raises(ValueError, match="key_rows"):  # without key_positions
        attention_forward(q, k, v, None, None, True, -1, -1, None, 0.0, False, None, 0, None, rows)
    with pytest.raises(ValueError, match="k:"):  # a source batch that does not divide q's
        attention_forward(q, torch.randn(3, 6, 2, 8), torch.randn(3, 6, 2, 8), None, None, True, -1, -1, None, 0.0,
                          False, positions, 6, None, rows)
    if CUDA:
        qc, kc, pc, rc = q.cuda().half(), k.cuda().half(), positions.cuda(), rows.cuda()
        with pytest.raises(TypeError, match="key_rows"):
            attention_forward(qc, kc, kc, None, None, True, -1, -1, None, 0.0, False, pc, 6, None, rc.long())
        with pytest.raises(ValueError, match="key_rows"):  # not key_positions' shape
            attention_forward(qc, kc, kc, None, None, True, -1, -1, None, 0.0, False, pc, 6, None, rc[..., :4])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("rows_heads", ["1", "hkv"])
@pytest.mark.parametrize("native_allocates", [True, False])
def test_decode_kernel_reads_indexed_rows_in_place(rows_heads, native_allocates, monkeypatch, nan_poison):
    """The decode kernel's indexed keys (attention_topk's decoding step): one query per row
    against source rows picked anywhere (unsorted, repeated), a row outside the source read as
    zeros, equal (float64 reference) to attention on the gathered copy with the kept bias; both
    native calls (decode_attention allocating its outputs, forward_decode given them)."""
    from dmattn import decode_kernel
    from reference import check_against_reference

    if native_allocates and not decode_kernel.native_allocates():
        pytest.skip("this torch lends no allocator to the native side")
    monkeypatch.setattr(decode_kernel, "native_allocates", lambda: native_allocates)
    gen = torch.Generator().manual_seed(11)
    batch, seq, heads, heads_kv, d, width = 2, 500, 8, 2, 128, 300
    hr = {"1": 1, "hkv": heads_kv}[rows_heads]
    q = torch.randn(batch, 1, heads, d, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(batch, seq, heads_kv, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    positions = torch.randint(0, seq, (batch, hr, width), generator=gen, dtype=torch.int32)
    positions[:, :, 5], positions[:, :, 17] = -1, seq  # outside the source: zero rows
    positions = positions.cuda()
    bias = torch.randn(batch, hr, 1, width, generator=gen).to("cuda", torch.bfloat16)
    splits = decode_kernel.gathered_decode_splits(q, k, width)
    assert splits > 0
    out, lse = decode_kernel.gathered_decode(q, k, v, positions, bias, None, 0.0, splits)
    check_against_reference(q, _gathered(k, positions, 1), _gathered(v, positions, 1), None, bias, out, lse,
                            context=f"rows_heads={rows_heads}")
    assert torch.isfinite(out).all()
