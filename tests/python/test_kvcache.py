"""dmattn.attention_with_kvcache (docs/semantics.md, "KV cache") against the float64 reference:
ragged cache lengths (0 and 1 included), appends that cross page boundaries, contiguous and
paged caches, GQA / MQA, mask, bias, softcap, window, NaN-poisoned unused cache slots; errors
that name the argument; torch.compile. The CUDA variants run the split-KV decode kernel
(rows <= KVCACHE_MAX_ROWS) or the composed path above it."""

from __future__ import annotations

import pytest
import torch

import dmattn
from dmattn.decode_kernel import AUTO_MAX_ROWS, KVCACHE_MAX_ROWS
from reference import check_against_reference

NAN = float("nan")


def _make_case(device, dtype, *, batch, seqlen_q, heads, heads_kv, head_dim, capacity, lens, new,
               page_size=None, mask_shape=None, bias_shape=None, bias_dtype=None, generator_seed=0):
    """Inputs of one cache call, its logical keys per row (for the reference) and the cache
    with every slot past the pre-append length poisoned with NaN."""
    g = torch.Generator().manual_seed(generator_seed)
    rnd = lambda *s, dt=dtype: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    q = rnd(batch, seqlen_q, heads, head_dim)
    k_log = rnd(batch, capacity, heads_kv, head_dim)  # the logical keys of every row
    v_log = rnd(batch, capacity, heads_kv, head_dim)
    lens = torch.tensor(lens, dtype=torch.int32)
    k_new = v_new = None
    if new:
        k_new = rnd(batch, new, heads_kv, head_dim)
        v_new = rnd(batch, new, heads_kv, head_dim)
        for b in range(batch):
            k_log[b, lens[b]:lens[b] + new] = k_new[b]
            v_log[b, lens[b]:lens[b] + new] = v_new[b]
    poisoned = lambda t: t.clone()  # noqa: E731
    k_cache, v_cache = poisoned(k_log), poisoned(v_log)
    for b in range(batch):
        k_cache[b, lens[b]:] = NAN
        v_cache[b, lens[b]:] = NAN
    block_table = None
    if page_size is not None:
        blocks = capacity // page_size
        num_pages = batch * blocks + 3
        perm = torch.randperm(num_pages, generator=g)[: batch * blocks].view(batch, blocks)
        pages_k = torch.full((num_pages, page_size, heads_kv, head_dim), NAN).to(dtype)
        pages_v = pages_k.clone()
        for b in range(batch):
            for p in range(blocks):
                pages_k[perm[b, p]] = k_cache[b, p * page_size:(p + 1) * page_size]
                pages_v[perm[b, p]] = v_cache[b, p * page_size:(p + 1) * page_size]
        block_table = perm.to(torch.int32)
        # Blocks wholly behind a row's final length are never read: they may hold anything.
        for b in range(batch):
            first_unused = (int(lens[b]) + new + page_size - 1) // page_size
            block_table[b, first_unused:] = -1
        k_cache, v_cache = pages_k, pages_v
    mask = bias = None
    if mask_shape is not None:
        mask = torch.rand(*mask_shape, generator=g) > 0.3
    if bias_shape is not None:
        bias = torch.randn(*bias_shape, generator=g).to(bias_dtype or dtype)
        bias[..., int(max(lens)) + new:] = NAN  # behind every row's length
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(q=to(q), k_cache=to(k_cache), v_cache=to(v_cache), k=to(k_new), v=to(v_new),
                cache_seqlens=to(lens), block_table=to(block_table), mask=to(mask), bias=to(bias),
                k_log=k_log, v_log=v_log, lens=lens, new=new)


def _run(case, **kw):
    return dmattn.attention_with_kvcache(
        case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"], cache_seqlens=case["cache_seqlens"],
        block_table=case["block_table"], mask=case["mask"], bias=case["bias"], return_lse=True, **kw)


def _check(case, out, lse, *, causal=True, window=(-1, -1), softcap=0.0, scale=None):
    """Row by row against the reference on the row's own keys (length after the append)."""
    assert out.shape == case["q"].shape and lse.shape == (out.shape[0], out.shape[2], out.shape[1])
    for b in range(out.shape[0]):
        length = int(case["lens"][b]) + case["new"]
        cut = lambda t: None if t is None else (t[b:b + 1] if t.dim() == 4 and t.shape[0] > 1 else t)[..., :length]  # noqa: E731
        check_against_reference(case["q"][b:b + 1].cpu(), case["k_log"][b:b + 1, :length],
                                case["v_log"][b:b + 1, :length], cut(case["mask"]),
                                cut(case["bias"]), out[b:b + 1], lse[b:b + 1], causal=causal, window=window,
                                softcap=softcap, scale=scale, context=f"(row {b}, length {length})")


def _dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


@pytest.mark.parametrize("new", [0, 1, 3])
def test_contiguous_ragged(device, new):
    case = _make_case(device, _dtype(device), batch=4, seqlen_q=max(new, 1), heads=8, heads_kv=2, head_dim=64,
                      capacity=80, lens=[0, 1, 37, 80 - max(new, 1)], new=new)
    out, lse = _run(case)
    _check(case, out, lse)
    if new == 0:  # the row without keys: out 0, lse -inf
        assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_append_crosses_pages(device, page_size):
    new = 3
    lens = [page_size - 1, 0, 2 * page_size - 2, 1]  # rows 0 and 2 append across a page boundary
    case = _make_case(device, _dtype(device), batch=4, seqlen_q=new, heads=4, heads_kv=4, head_dim=32,
                      capacity=4 * page_size, lens=lens, new=new, page_size=page_size)
    out, lse = _run(case)
    _check(case, out, lse)
    # The new keys landed in the pages the table names for them.
    bt, kc = case["block_table"].cpu(), case["k_cache"].cpu()
    for b, start in enumerate(lens):
        for t in range(new):
            pos = start + t
            torch.testing.assert_close(kc[bt[b, pos // page_size], pos % page_size], case["k"][b, t].cpu())


@pytest.mark.parametrize("heads_kv", [1, 2, 8])
@pytest.mark.parametrize("operands", ["mask", "key_bias", "query_bias", "fp32_bias", "both"])
def test_mask_bias_gqa(device, heads_kv, operands):
    batch, sq, heads, cap = 3, 2, 8, 48
    shapes = {"mask": dict(mask_shape=(batch, 1, 1, cap)),
              "key_bias": dict(bias_shape=(batch, heads, 1, cap)),
              "query_bias": dict(bias_shape=(1, heads_kv, sq, cap)),
              "fp32_bias": dict(bias_shape=(batch, 1, 1, cap), bias_dtype=torch.float32),
              "both": dict(mask_shape=(1, heads, sq, cap), bias_shape=(batch, heads, 1, cap))}[operands]
    case = _make_case(device, _dtype(device), batch=batch, seqlen_q=sq, heads=heads, heads_kv=heads_kv,
                      head_dim=64, capacity=cap, lens=[5, 0, 30], new=sq, **shapes)
    out, lse = _run(case)
    _check(case, out, lse)


@pytest.mark.parametrize("opts", [dict(softcap=5.0), dict(window=(4, -1)), dict(causal=False),
                                  dict(causal=False, window=(3, 1)), dict(scale=0.3)])
def test_options(device, opts):
    case = _make_case(device, _dtype(device), batch=3, seqlen_q=4, heads=4, heads_kv=2, head_dim=64,
                      capacity=64, lens=[0, 9, 60], new=4, page_size=16, bias_shape=(3, 4, 1, 64))
    out, lse = _run(case, **opts)
    _check(case, out, lse, **{"causal": True, **opts})


@pytest.mark.parametrize("window", [(2**63 - 1, 2**63 - 1), (2**70, 2**64), (64, 4)])
def test_window_reaching_every_key_is_unbounded(device, window):
    """Window bounds past every cached key and query (up to int64's largest and past it) bound
    nothing: the same answers as no window, causal or not."""
    case = _make_case(device, _dtype(device), batch=3, seqlen_q=4, heads=4, heads_kv=2, head_dim=64,
                      capacity=64, lens=[0, 9, 56], new=4, page_size=16)
    for causal in (True, False):
        cached = {key: case[key].clone() for key in ("k_cache", "v_cache")}
        got = _run(case, window=window, causal=causal)
        case.update(cached)  # (the append, again on the same cache)
        want = _run(case, causal=causal)
        case.update({key: t.clone() for key, t in cached.items()})
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_op_without_lengths_reads_every_key(device):
    """The cache op with seqlens None (decode_step's and gathered_decode's calls): every key of
    every row, as with lengths equal to the cache's capacity (paged and contiguous)."""
    from dmattn.decode import kvcache_forward

    for page_size in (None, 16):
        case = _make_case(device, _dtype(device), batch=2, seqlen_q=2, heads=4, heads_kv=2, head_dim=32,
                          capacity=48, lens=[48, 48], new=0, page_size=page_size, bias_shape=(2, 4, 1, 48))
        args = (case["q"], case["k_cache"], case["v_cache"])
        rest = (case["block_table"], None, case["bias"], True, -1, -1, None, 0.0)
        with torch.no_grad():
            out, lse = kvcache_forward(*args, None, *rest)
            ref_out, ref_lse = kvcache_forward(*args, case["cache_seqlens"], *rest)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


def test_int_seqlens_and_no_lse(device):
    case = _make_case(device, _dtype(device), batch=2, seqlen_q=1, heads=4, heads_kv=1, head_dim=32, capacity=20,
                      lens=[7, 7], new=1)
    out = dmattn.attention_with_kvcache(case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"],
                                        cache_seqlens=7)
    ref, _ = _run(_make_case(device, _dtype(device), batch=2, seqlen_q=1, heads=4, heads_kv=1, head_dim=32,
                             capacity=20, lens=[7, 7], new=1))
    torch.testing.assert_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 72])
def test_gpu_long_cache_splits(dtype, head_dim):
    """Enough keys for several key splits; head dims of every bucket and one that fills none."""
    case = _make_case("cuda", dtype, batch=2, seqlen_q=1, heads=8, heads_kv=2, head_dim=head_dim, capacity=4096,
                      lens=[4000, 1], new=1, page_size=256, bias_shape=(2, 8, 1, 4096))
    out, lse = _run(case)
    _check(case, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seqlen_q,head_dim,page_size,operands", [
    (8, 1, 128, None, None), (8, 1, 128, 64, "bias"), (4, 1, 64, None, "mask"), (16, 4, 128, 16, "both"),
    (8, 2, 256, None, "bias"), (4, 3, 128, None, "softcap"), (8, 1, 128, None, "window")])
def test_gpu_few_splits(batch, seqlen_q, head_dim, page_size, operands):
    """2 to 8 key splits of up to 16 rows (the decoding batches of serving: B=4 to 16 with 8 kv
    heads): ragged lengths (a row whose keys end inside the first split, so that later splits
    are empty), pages, a mask and bias, softcap, a left window; out and lse against float64."""
    from dmattn.decode_kernel import KVCACHE_MAX_ROWS, _decode_splits

    heads_kv = 8
    lens = [4096 - 3 * seqlen_q - 7 * b for b in range(batch)]
    lens[1] = 300
    bias_shape = (batch, 4 * heads_kv, 1, 4096) if operands in ("bias", "both") else None
    mask_shape = (batch, 1, 1, 4096) if operands in ("mask", "both") else None
    case = _make_case("cuda", torch.bfloat16, batch=batch, seqlen_q=seqlen_q, heads=4 * heads_kv, heads_kv=heads_kv,
                      head_dim=head_dim, capacity=4096, lens=lens, new=seqlen_q, page_size=page_size,
                      bias_shape=bias_shape, mask_shape=mask_shape)
    splits = _decode_splits(case["q"], heads_kv, 4096, KVCACHE_MAX_ROWS)
    assert 2 <= splits <= 8, splits
    kw = dict(softcap=20.0) if operands == "softcap" else dict(window=(900, -1)) if operands == "window" else {}
    out, lse = _run(case, **kw)
    _check(case, out, lse, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q", [1, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [(-1, -1), (15000, -1)])
def test_gpu_many_splits(seqlen_q, head_dim, window):
    """One (batch, kv head) against a long cache: over 100 key splits (every lane of the combine
    kernel's lse loads, its columns split over several thread groups); one query and a 64-row
    chunk, causal with and without a left window (tiles wholly inside the window skip the
    per-key tests; those across its edge or the diagonal keep them)."""
    case = _make_case("cuda", torch.bfloat16, batch=1, seqlen_q=seqlen_q, heads=8, heads_kv=1, head_dim=head_dim,
                      capacity=40000, lens=[39990 - seqlen_q], new=seqlen_q)
    out, lse = _run(case, window=window)
    _check(case, out, lse, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("seqlen_q,page_size", [(4, None), (4, 8), (3, 64), (16, None), (16, 8), (5, None),
                                               (20, 256), (1, 64)])
def test_gpu_full_row_tiles(seqlen_q, page_size, bias):
    """Speculative-decoding lengths: a full 16-row tile (Sq=4, 4 heads a kv head), a partial one,
    a full 64-row chunk (Sq=16), one with warps past its rows (Sq=5: 20 rows), two chunks
    (Sq=20), pages smaller than a key tile and pages a stage crosses; long ragged caches (every
    warp, several tiles and key splits), causal; with a per-key bias and without (on Hopper the
    wgmma kernel, its padding rows included, where the keys come a stage at a time: contiguous,
    pages of 64 and 256; with the bias, the product up to 16 rows and each thread's entries loaded
    in 32-bit pairs above; elsewhere the mma.sync kernels)."""
    case = _make_case("cuda", torch.bfloat16, batch=3, seqlen_q=seqlen_q, heads=8, heads_kv=2, head_dim=128,
                      capacity=2048, lens=[2000, 700, 5], new=seqlen_q, page_size=page_size,
                      bias_shape=(3, 8, 1, 2048) if bias else None)
    out, lse = _run(case)
    _check(case, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q,heads,heads_kv", [(1, 8, 1), (1, 4, 4), (2, 8, 2), (1, 6, 2), (3, 4, 2),
                                                     (1, 32, 8)])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("opts", [dict(), dict(window=(700, -1)), dict(softcap=20.0), dict(causal=False)])
@pytest.mark.parametrize("page_size", [None, 64])
def test_gpu_narrow_rows(seqlen_q, heads, heads_kv, head_dim, opts, page_size):
    """Up to 8 packed rows a kv head (on Hopper the narrow kernel: rows on wgmma's N): groups of
    8, 1, 4, 3 and 2 query heads, one to three queries, head dims of both buckets (96 zero-fills
    the last columns), causal with and without a left window, softcap, non-causal; ragged caches
    from empty to several key splits (a last partial stage, splits left empty by a short row),
    contiguous and paged; NaN in every slot past a row's length. out and lse against float64."""
    case = _make_case("cuda", torch.bfloat16, batch=4, seqlen_q=seqlen_q, heads=heads, heads_kv=heads_kv,
                      head_dim=head_dim, capacity=4096, lens=[4000, 0, 1337, 63], new=seqlen_q, page_size=page_size)
    out, lse = _run(case, **opts)
    _check(case, out, lse, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 7, 8, 64])
def test_gpu_narrow_forced_splits(splits, nan_poison):
    """The narrow kernel (up to 8 rows on Hopper) at forced split counts, one to 64 (each of its
    CTAs reads two of them: one to 32 partial rows a row): every count gives the float64 answer
    with NaN-poisoned outputs and workspace, including the empty splits of a short row and of an
    empty one (their partial rows 0 with lse -inf for the merge)."""
    from dmattn.decode_kernel import _run_decode

    case = _make_case("cuda", torch.bfloat16, batch=3, seqlen_q=1, heads=8, heads_kv=2, head_dim=128,
                      capacity=4096, lens=[4095, 100, 0], new=1)
    k, v = case["k_log"].cuda(), case["v_log"].cuda()
    lens = (case["lens"] + 1).to(torch.int32).cuda()
    out, lse = _run_decode(case["q"], k, v, None, None, True, -1, -1, 128 ** -0.5, 0.0, lens, None, splits)
    case = dict(case, new=1)
    _check(case, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [True, False])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_gpu_row_chunks_head_dims(head_dim, mask):
    """More rows than one tile at every head-dim bucket (64-row chunks up to 128, 16-row chunks
    at 256; 96 zero-fills the bucket's last columns), with a window and a softcap, with a key
    mask and without (on Hopper the wgmma kernel up to 128)."""
    case = _make_case("cuda", torch.bfloat16, batch=2, seqlen_q=8, heads=8, heads_kv=2, head_dim=head_dim,
                      capacity=1100, lens=[1090, 333], new=8, mask_shape=(2, 1, 1, 1100) if mask else None)
    out, lse = _run(case, window=(300, -1), softcap=15.0)
    _check(case, out, lse, window=(300, -1), softcap=15.0)


@pytest.mark.gpu
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_gpu_unaligned_operands(bias_dtype):
    """A bias and a mask that start at an odd element (views into larger tensors), with a window
    that starts inside one of the kernel's 16-key tiles."""
    case = _make_case("cuda", torch.bfloat16, batch=2, seqlen_q=2, heads=8, heads_kv=2, head_dim=64,
                      capacity=600, lens=[590, 301], new=2)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(2, 8, 1, 601, generator=g).to(bias_dtype)
    bias[..., 1 + 592:] = NAN  # behind every row's length
    case["bias"] = bias.cuda()[..., 1:]
    case["mask"] = (torch.rand(2, 1, 1, 601, generator=g) > 0.3).cuda()[..., 1:]
    out, lse = _run(case, window=(37, -1))
    _check(case, out, lse, window=(37, -1))


def _entries_case(head_dim, seqlen_q, heads, heads_kv, operands, page_size):
    """A mask and / or bias (operands: "bias", "fp32 bias", "query bias", "mask", "both", "both
    strided") against ragged lengths that end inside a tile and split, a left window that starts
    inside one, finfo.min and -inf bias entries, a (batch, head) whose keys are all masked (out 0,
    lse -inf); contiguous or paged."""
    batch, cap = 3, 3072
    lens = [3000 - seqlen_q, 1000 - seqlen_q, 41]
    g = torch.Generator().manual_seed(seqlen_q * 1000 + heads * 10 + head_dim)
    case = _make_case("cuda", torch.bfloat16, batch=batch, seqlen_q=seqlen_q, heads=heads, heads_kv=heads_kv,
                      head_dim=head_dim, capacity=cap, lens=lens, new=seqlen_q, page_size=page_size,
                      generator_seed=seqlen_q + head_dim)
    wide = 2 if operands == "both strided" else 1  # strided: every other element of a wider tensor
    if operands != "mask":
        shape = (1, heads, seqlen_q, cap * wide) if operands == "query bias" else (batch, heads, 1, cap * wide)
        bias = torch.randn(*shape, generator=g).to(torch.float32 if operands == "fp32 bias" else torch.bfloat16)
        bias[..., 5 * wide] = torch.finfo(bias.dtype).min
        bias[..., 9 * wide] = float("-inf")
        case["bias"] = bias.cuda()[..., ::wide]
    masked = operands in ("mask", "both", "both strided", "query mask")
    if masked:
        rows = seqlen_q if operands == "query mask" else 1
        mask = torch.rand(batch, heads, rows, cap * wide, generator=g) > 0.25
        mask[2, 1] = False  # every key of (batch 2, head 1) masked
        case["mask"] = mask.cuda()[..., ::wide]
    out, lse = _run(case, window=(700, -1))
    _check(case, out, lse, window=(700, -1))
    if masked:
        assert torch.all(out[2, :, 1] == 0) and torch.all(lse[2, 1] == float("-inf"))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q,heads,heads_kv", [(1, 32, 8), (1, 8, 1), (2, 8, 2), (3, 4, 2), (3, 8, 2),
                                                     (4, 8, 2), (2, 16, 2)])
@pytest.mark.parametrize("operands", ["bias", "fp32 bias", "query bias", "mask", "both", "both strided"])
@pytest.mark.parametrize("page_size", [None, 64])
def test_gpu_entries_few_rows(head_dim, seqlen_q, heads, heads_kv, operands, page_size):
    """Mask / bias entries with at most 16 query rows (Sq x H / Hkv = 4, 6 and 8: on Hopper the
    narrow kernel, each thread's entries loaded a stage ahead; 12 and 16: the one-tile kernel):
    contiguous 16-byte aligned rows (the one-tile kernel's operand ring), strided ones (entries
    loaded into registers a step ahead), a float32 bias, a bias per query row (_entries_case)."""
    _entries_case(head_dim, seqlen_q, heads, heads_kv, operands, page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q,heads,heads_kv", [(5, 8, 2), (16, 8, 2), (3, 16, 2), (20, 8, 2)])
@pytest.mark.parametrize("operands", ["mask", "query mask", "both", "both strided", "fp32 bias"])
@pytest.mark.parametrize("page_size", [None, 64])
def test_gpu_entries_many_rows(head_dim, seqlen_q, heads, heads_kv, operands, page_size):
    """Mask / bias entries with 20 to 80 query rows: on Hopper a bool mask along the keys (per key
    or per query row, with or without a 16-bit bias) on the wgmma kernel, each thread's entries
    loaded in pairs a stage ahead (two 64-row chunks at 80 rows); strided entries and a float32
    bias on the mma.sync 64-row kernel (_entries_case)."""
    _entries_case(head_dim, seqlen_q, heads, heads_kv, operands, page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,seqlen_q,page_size", [(128, 1, None), (64, 4, None), (128, 4, 64), (128, 2, 256),
                                                      (128, 8, None), (64, 16, 64), (128, 6, 256)])
def test_gpu_key_bias_special_entries(dtype, head_dim, seqlen_q, page_size):
    """A per-key bias of q's dtype with up to 16 rows (on Hopper added by the tensor cores, whose
    0 x inf across a key's rows the kernel undoes) and with 24 to 64 (on Hopper each thread's
    entries loaded into registers, here element by element): rows that start at odd elements (an odd
    capacity, a view one element in), finfo.min and -inf entries, a head whose every key is
    -inf (out 0, lse -inf), and a NaN entry at a visible key that makes its own row NaN and
    leaves every other row's bits as they are with a finite entry there."""
    batch, heads, heads_kv = 3, 16, 4
    cap = 2999 if page_size is None else 2999 // page_size * page_size  # (the bias rows' stride: cap + 1)
    lens = [cap - 9 - seqlen_q, 1001 - seqlen_q, 70]
    case = _make_case("cuda", dtype, batch=batch, seqlen_q=seqlen_q, heads=heads, heads_kv=heads_kv,
                      head_dim=head_dim, capacity=cap, lens=lens, new=seqlen_q, page_size=page_size,
                      generator_seed=seqlen_q * 10 + head_dim)
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(batch, heads, 1, cap + 1, generator=g).to(dtype)
    wide[..., 1 + 7] = torch.finfo(dtype).min
    wide[..., 1 + 11] = float("-inf")
    wide[1, 5, 0, 1 + 300: 1 + 900] = float("-inf")
    wide[2, 3] = float("-inf")  # (batch 2, head 3) sees no key
    case["bias"] = wide.cuda()[..., 1:]
    out, lse = _run(case)
    _check(case, out, lse)
    assert torch.all(out[2, :, 3] == 0) and torch.all(lse[2, 3] == float("-inf"))

    key = lens[0] - 5  # a cache key every query of batch 0 sees (causal)
    nan_bias = case["bias"].clone()
    nan_bias[0, 6, 0, key] = NAN
    out_nan, lse_nan = _run(dict(case, bias=nan_bias))
    assert torch.isnan(lse_nan[0, 6]).all() and torch.isnan(out_nan[0, :, 6]).any(-1).all()
    keep = torch.ones_like(lse, dtype=torch.bool)
    keep[0, 6] = False
    assert torch.equal(lse_nan[keep], lse[keep])
    assert torch.equal(out_nan.transpose(1, 2)[keep], out.transpose(1, 2)[keep])


@pytest.mark.gpu
def test_gpu_rows_above_kernel_limit():
    """More query rows than the decode kernel takes: the composed path, same contract."""
    sq = KVCACHE_MAX_ROWS // 4 + 2
    case = _make_case("cuda", torch.bfloat16, batch=2, seqlen_q=sq, heads=8, heads_kv=2, head_dim=64,
                      capacity=128, lens=[3, 40], new=sq, page_size=32, mask_shape=(2, 1, 1, 128))
    out, lse = _run(case)
    _check(case, out, lse)


def _run_graph(case):
    """(out, lse) of _run(case) captured in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(case)  # warm-up outside the capture (allocator, lazy initialization)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _run(case)
    graph.replay()
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    case = _make_case("cuda", torch.bfloat16, batch=2, seqlen_q=1, heads=8, heads_kv=2, head_dim=128,
                      capacity=2048, lens=[100, 1500], new=0, page_size=64)
    out_eager, _ = _run(case)
    out_graph, _ = _run_graph(case)
    torch.testing.assert_close(out_graph, out_eager, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["attention", "flash_dmattn_func"])
def test_gpu_sparse_key_mask_decodes_without_sync(entry):
    """A decoding step whose key mask keeps few of many keys (where a training-sized call
    gathers them after one host synchronization) runs on the decode kernel, the mask read in
    place: no synchronization (torch's sync debug mode raises on one), the reference's result."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 8, 128, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, 4096, 2, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    mask = (torch.rand(2, 1, 1, 4096, generator=g) > 0.9).to("cuda")
    bias = torch.randn(2, 8, 1, 4096, generator=g).to("cuda", torch.bfloat16)

    def call():
        if entry == "attention":
            return dmattn.attention(q, k, v, mask, bias, return_lse=True)
        return dmattn.flash_dmattn_func(q, k, v, mask, bias, return_attn_probs=True)[:2]

    call()  # (first call: the split count's query and the module's load, outside the check)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_against_reference(q, k, v, mask, bias, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q,heads_kv", [(1, 8), (1, 2), (4, 8), (2, 4), (16, 2)])
def test_gpu_attention_takes_decode_kernel(monkeypatch, seqlen_q, heads_kv):
    """dmattn.attention with a short Sq on CUDA (the decode kernels, the default) against the
    reference and the general kernels (DMATTN_DECODE=0)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, seqlen_q, 8, 128, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, 3000, heads_kv, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    bias = torch.randn(2, 8, 1, 3000, generator=g).to("cuda", torch.bfloat16)
    mask = torch.rand(2, 1, 1, 3000, generator=g).to("cuda") > 0.2
    for kw in (dict(), dict(causal=True, window=(500, -1)), dict(softcap=10.0)):
        monkeypatch.delenv("DMATTN_DECODE", raising=False)
        out, lse = dmattn.attention(q, k, v, mask=mask, bias=bias, return_lse=True, **kw)
        check_against_reference(q, k, v, mask, bias, out, lse, causal=kw.get("causal", False),
                                window=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0))
        monkeypatch.setenv("DMATTN_DECODE", "0")
        out_general, lse_general = dmattn.attention(q, k, v, mask=mask, bias=bias, return_lse=True, **kw)
        torch.testing.assert_close(out, out_general, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, lse_general, rtol=1e-4, atol=1e-4)


def test_compile_fullgraph():
    """torch.compile traces the call (append included) without graph breaks (fake impl)."""
    case = _make_case("cpu", torch.float32, batch=2, seqlen_q=1, heads=4, heads_kv=2, head_dim=32, capacity=32,
                      lens=[3, 10], new=1, page_size=16)
    eager_case = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in case.items()}
    out_eager, _ = _run(eager_case)

    def step(q, kc, vc, k, v, lens, bt):
        return dmattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=bt)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"], case["cache_seqlens"],
                   case["block_table"])
    torch.testing.assert_close(out, out_eager)
    torch.testing.assert_close(case["k_cache"], eager_case["k_cache"], equal_nan=True)


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    """On CUDA too, torch.compile traces the call without graph breaks (the direct route is
    eager only; traced, the op runs the decode kernel at run time), append included."""
    case = _make_case("cuda", torch.bfloat16, batch=2, seqlen_q=1, heads=8, heads_kv=2, head_dim=128,
                      capacity=2048, lens=[100, 1500], new=1, page_size=64)
    eager_case = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in case.items()}
    out_eager, _ = _run(eager_case)

    def step(q, kc, vc, k, v, lens, bt):
        return dmattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=bt)

    def direct(q, kc, vc, lens, bt):  # nothing to append: the eager call's direct route
        return dmattn.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=bt)

    out = torch.compile(step, fullgraph=True)(case["q"], case["k_cache"], case["v_cache"], case["k"], case["v"],
                                              case["cache_seqlens"], case["block_table"])
    torch.testing.assert_close(out, out_eager, rtol=0, atol=0)
    lens = case["cache_seqlens"] + 1
    out_direct = torch.compile(direct, fullgraph=True)(case["q"], case["k_cache"], case["v_cache"], lens,
                                                       case["block_table"])
    torch.testing.assert_close(out_direct, out_eager, rtol=0, atol=0)


def test_no_gradient_is_named():
    q = torch.randn(2, 1, 4, 16, requires_grad=True)
    kc = torch.randn(2, 10, 2, 16)
    out = dmattn.attention_with_kvcache(q, kc, kc.clone(), cache_seqlens=3)
    with pytest.raises(NotImplementedError, match="^attention_with_kvcache: inference only"):
        out.sum().backward()


def test_half_precision_cpu():
    case = _make_case("cpu", torch.bfloat16, batch=3, seqlen_q=2, heads=4, heads_kv=2, head_dim=32, capacity=48,
                      lens=[0, 1, 40], new=2, page_size=16, bias_shape=(3, 4, 1, 48))
    out, lse = _run(case)
    _check(case, out, lse)


def _good():
    q = torch.randn(2, 1, 4, 16)
    kc = torch.randn(2, 10, 2, 16)
    return dict(q=q, k_cache=kc, v_cache=kc.clone(), cache_seqlens=torch.tensor([1, 2], dtype=torch.int32))


_BAD_ARGUMENTS = [
    (dict(q=torch.randn(2, 4, 16)), ValueError, "q"),
    (dict(k_cache=torch.randn(2, 10, 3, 16)), ValueError, "v_cache"),
    (dict(k_cache=torch.randn(2, 10, 3, 16), v_cache=torch.randn(2, 10, 3, 16)), ValueError, "k_cache"),
    (dict(k_cache=torch.randn(2, 10, 2, 8), v_cache=torch.randn(2, 10, 2, 8)), ValueError, "k_cache"),
    (dict(v_cache=torch.randn(2, 10, 2, 16, dtype=torch.float64)), TypeError, "v_cache"),
    (dict(cache_seqlens=torch.tensor([1, 2])), TypeError, "cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=[1, 2]), TypeError, "cache_seqlens"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int64)), TypeError, "block_table"),
    (dict(block_table=torch.zeros(3, 1, dtype=torch.int32)), ValueError, "block_table"),
    (dict(mask=torch.ones(2, 1, 1, 9, dtype=torch.bool)), ValueError, "mask"),
    (dict(mask=torch.ones(2, 1, 1, 10)), TypeError, "mask"),
    (dict(bias=torch.zeros(3, 1, 1, 10)), ValueError, "bias"),
    (dict(window=(-2, 0)), ValueError, "window"),
    (dict(window=5), TypeError, "window"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(scale="1"), TypeError, "scale"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(k=torch.randn(2, 1, 2, 16)), ValueError, "k, v"),
    (dict(k=torch.randn(2, 1, 3, 16), v=torch.randn(2, 1, 3, 16)), ValueError, "k, v"),
]


def _call_with(args, change):
    args = {**args, **change}
    q, kc, vc = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    k, v = args.pop("k", None), args.pop("v", None)
    return dmattn.attention_with_kvcache(q, kc, vc, k, v, **args)


# Lengths beyond the cache: checked on the CPU only (reading them on CUDA would synchronize).
_BAD_LENGTHS = (dict(cache_seqlens=torch.tensor([1, 11], dtype=torch.int32)), ValueError, "cache_seqlens")


@pytest.mark.parametrize("change,exc,name", _BAD_ARGUMENTS + [_BAD_LENGTHS])
def test_errors_name_the_argument(change, exc, name):
    with pytest.raises(exc, match=rf"^{name}:"):
        _call_with(_good(), change)


@pytest.mark.parametrize("entry", [4, -1, 2**31 - 1])
def test_pages_outside_the_cache_are_named(entry):
    """A table entry outside k_cache's blocks for a page that a row reads or appends to: an error
    naming block_table on the CPU (checked with the lengths there); behind every row's pages such
    entries are never read."""
    q, kc = torch.randn(2, 1, 4, 16), torch.randn(4, 4, 2, 16)
    table = torch.tensor([[0, 1, entry], [2, 3, entry]], dtype=torch.int32)
    call = lambda lens, **kw: dmattn.attention_with_kvcache(  # noqa: E731
        q, kc, kc.clone(), cache_seqlens=torch.tensor(lens, dtype=torch.int32), block_table=table, **kw)
    assert torch.isfinite(call([5, 8])).all()  # (two pages a row: the third entries unread)
    with pytest.raises(ValueError, match=r"^block_table: .* \[0, 4\)"):
        call([9, 8])
    with pytest.raises(ValueError, match="^block_table:"):  # the append's page
        call([5, 8], k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16))


def _on_gpu(x):
    """x on CUDA, float32 tensors as bfloat16 (the kernels' dtypes; other dtypes kept)."""
    if isinstance(x, torch.Tensor):
        return x.to("cuda", torch.bfloat16 if x.dtype == torch.float32 else x.dtype)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("change,exc,name", _BAD_ARGUMENTS)
def test_gpu_errors_name_the_argument(change, exc, name):
    """On CUDA the usual call goes straight to the decode kernel, validated natively: the same
    errors, naming the same argument."""
    good = {n: _on_gpu(t) for n, t in _good().items()}
    with pytest.raises(exc, match=rf"^{name}:"):
        _call_with(good, {n: _on_gpu(t) for n, t in change.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_gpu_direct_route_equals_checked_route(monkeypatch, page_size):
    """The usual call (no append, no gradient) takes the direct route onto the decode kernel
    (outputs allocated by the native call); the checked route, and the outputs allocated in
    Python (a torch without tvm-ffi's environment allocator), give the same bits."""
    import dmattn.decode_kernel
    import dmattn.kvcache

    case = _make_case("cuda", torch.bfloat16, batch=3, seqlen_q=2, heads=8, heads_kv=2, head_dim=128,
                      capacity=4096, lens=[1, 700, 4000], new=0, page_size=page_size,
                      mask_shape=(3, 1, 1, 4096), bias_shape=(3, 8, 1, 4096))

    def refuse(*args, **kwargs):
        raise AssertionError("the checked route ran")

    with monkeypatch.context() as m:
        m.setattr(dmattn.kvcache, "cache_attention", refuse)
        out, lse = _run(case, softcap=20.0)
        out_only = dmattn.attention_with_kvcache(case["q"], case["k_cache"], case["v_cache"],
                                                 cache_seqlens=case["cache_seqlens"], block_table=case["block_table"],
                                                 mask=case["mask"], bias=case["bias"], softcap=20.0)
    _check(case, out, lse, softcap=20.0)
    torch.testing.assert_close(out_only, out, rtol=0, atol=0)
    monkeypatch.setattr(dmattn.kvcache, "_direct_decode", lambda *args: None)
    checked_out, checked_lse = _run(case, softcap=20.0)
    monkeypatch.setattr(dmattn.decode_kernel, "native_allocates", lambda: False)
    python_out, python_lse = _run(case, softcap=20.0)
    for o, l in ((checked_out, checked_lse), (python_out, python_lse)):
        torch.testing.assert_close(o, out, rtol=0, atol=0)
        torch.testing.assert_close(l, lse, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q,heads_kv", [(1, 8), (1, 2), (4, 8), (2, 4)])
def test_gpu_decode_step_equals_attention(seqlen_q, heads_kv):
    """decode.decode_step (the transformers integration's decoding step) on transformers'
    cache layout (B, Hkv, Sk, D) with its masks: a key padding mask, an additive float mask
    with -inf, none; causal bottom-right as dmattn.attention."""
    from dmattn.decode import decode_step

    g = torch.Generator().manual_seed(seqlen_q * 10 + heads_kv)
    q = torch.randn(2, seqlen_q, 8, 128, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, heads_kv, 2500, 128, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)
            for _ in range(2))
    keys = torch.rand(2, 1, 1, 2500, generator=g).to("cuda") > 0.3
    additive = torch.randn(2, 1, seqlen_q, 2500, generator=g).to("cuda").masked_fill(~keys, float("-inf"))
    for mask, bias, causal in ((None, None, True), (keys, None, True), (None, additive, False), (keys, None, False)):
        with torch.no_grad():
            out = decode_step(q, k, v, mask, bias, causal, None, 0.0)
        assert out is not None
        _, lse = dmattn.attention(q, k, v, mask=mask, bias=bias, causal=causal, return_lse=True)
        check_against_reference(q, k, v, mask, bias, out, lse, causal=causal)


@pytest.mark.gpu
def test_gpu_decode_step_declines():
    """Gradients to record, too many query rows, or CPU tensors: None (dmattn.attention runs)."""
    from dmattn.decode import decode_step

    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 300, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert decode_step(q, k, k, None, None, True, None, 0.0) is not None
    assert decode_step(q.clone().requires_grad_(), k, k, None, None, True, None, 0.0) is None
    assert decode_step(q.expand(1, AUTO_MAX_ROWS, 8, 64), k, k, None, None, True, None, 0.0) is None
    assert decode_step(q.cpu(), k.cpu(), k.cpu(), None, None, True, None, 0.0) is None


@pytest.mark.gpu
def test_gpu_decode_step_compiles_onto_the_decode_kernel(monkeypatch):
    """Under torch.compile(fullgraph=True) a decoding step (transformers' StaticCache layout
    (B, Hkv, Sk, D) with a key mask over the unused slots) traces without a graph break and
    runs on the decode kernel (the op's body picks the split count), equal to the reference."""
    from dmattn import decode

    runs = []
    run_decode = decode._run_decode
    monkeypatch.setattr(decode, "_run_decode", lambda *a, **kw: runs.append(1) or run_decode(*a, **kw))

    def step(q, k, v, mask):
        out = decode.decode_step(q, k, v, mask, None, True, None, 0.0)
        return dmattn.attention(q, k, v, mask, causal=True) if out is None else out

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 8, 64, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, 2, 700, 64, generator=g).to("cuda", torch.bfloat16).transpose(1, 2) for _ in range(2))
    mask = (torch.arange(700, device="cuda") < torch.tensor([[650], [123]], device="cuda")).view(2, 1, 1, 700)
    with torch.no_grad():
        compiled = torch.compile(step, backend="inductor", fullgraph=True)(q, k, v, mask)
    assert runs, "the compiled step did not run the decode kernel"
    _, lse = dmattn.attention(q, k, v, mask=mask, causal=True, return_lse=True)
    check_against_reference(q, k, v, mask, None, compiled, lse, causal=True)
