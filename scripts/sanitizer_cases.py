"""A small set of CUDA calls for compute-sanitizer (memcheck / racecheck), run by
scripts/gpu_cycle.sh with the step `sanitize`. Tails, broadcast mask/bias, GQA, causal and
window, the gate and windows with sinks, forward and backward; each call is checked for
finiteness so a failing launch shows.

    python3 scripts/sanitizer_cases.py [REGEX]

REGEX (optional): only the calls whose announced line (name, arguments, keywords) it matches
(re.search), e.g. "gate_case" or "bfloat16": racecheck over every case takes longer than one
command may (its slowest, the D=256 bias + mask case, alone takes minutes)."""

import functools
import os
import re
import sys
import time

import torch

import dmattn


_ONLY = re.compile(sys.argv[1]) if len(sys.argv) > 1 else None


def announced(fn):
    """Prints each call as it starts and its time as it ends (flushed): under a sanitizer, the
    case that fails or hangs is the last one named."""

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        line = f"{fn.__name__}{args} {kw or ''}"
        if _ONLY is not None and not _ONLY.search(line):
            return
        t0 = time.perf_counter()
        print(line, end=" ", flush=True)
        fn(*args, **kw)
        print(f"{time.perf_counter() - t0:.1f} s", flush=True)

    return wrapper


@announced
def case(b, sq, sk, h, hkv, d, dtype, mask_shape=None, bias_shape=None, bias_dtype=None, **kw):
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    dev = "cuda"
    q = torch.randn(b, sq, h, d, generator=g).to(dev, dtype).requires_grad_()
    k = torch.randn(b, sk, hkv, d, generator=g).to(dev, dtype).requires_grad_()
    v = torch.randn(b, sk, hkv, d, generator=g).to(dev, dtype).requires_grad_()
    mask = (torch.rand(mask_shape, generator=g) > 0.3).to(dev) if mask_shape else None
    bias = torch.randn(bias_shape, generator=g).to(dev, bias_dtype or dtype).requires_grad_() if bias_shape else None
    out = dmattn.attention(q, k, v, mask, bias, **kw)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    for t in (out, q.grad, k.grad, v.grad) + ((bias.grad,) if bias is not None else ()):
        assert torch.isfinite(t).all(), "non-finite value"


@announced
def topk_case(b, s, h, hkv, d, dtype, keep, bias_heads=None, **kw):
    """dmattn.attention_topk with a per-key bias (B, bias_heads (default H), 1, S): the gather
    path; bias_heads 1 or Hkv: its training form (one key set per kv head, the full-size
    gradients written by the scatter kernel)."""
    g = torch.Generator().manual_seed(s * 7 + keep)
    dev = "cuda"
    q = torch.randn(b, s, h, d, generator=g).to(dev, dtype).requires_grad_()
    k = torch.randn(b, s, hkv, d, generator=g).to(dev, dtype).requires_grad_()
    v = torch.randn(b, s, hkv, d, generator=g).to(dev, dtype).requires_grad_()
    bias = torch.randn(b, h if bias_heads is None else bias_heads, 1, s, generator=g).to(dev, dtype).requires_grad_()
    out = dmattn.attention_topk(q, k, v, bias, keep, **kw)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    for t in (out, q.grad, k.grad, v.grad, bias.grad):
        assert torch.isfinite(t).all(), "non-finite value"


@announced
def varlen_case(lens, h, hkv, d, dtype, key_bias=False, **kw):
    """dmattn.attention_varlen forward + backward on ragged sequences (a key-side bias with its
    gradient when key_bias)."""
    g = torch.Generator().manual_seed(sum(lens))
    dev = "cuda"
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    total = sum(lens)
    q = torch.randn(total, h, d, generator=g).to(dev, dtype).requires_grad_()
    k = torch.randn(total, hkv, d, generator=g).to(dev, dtype).requires_grad_()
    v = torch.randn(total, hkv, d, generator=g).to(dev, dtype).requires_grad_()
    bias = torch.randn(h, total, generator=g).to(dev, dtype).requires_grad_() if key_bias else None
    out = dmattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), bias=bias, **kw)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    for t in (out, q.grad, k.grad, v.grad) + ((bias.grad,) if bias is not None else ()):
        assert torch.isfinite(t).all(), "non-finite value"


@announced
def gate_case(lens, h, hkv, d, dtype, windows=None, gated=True, **kw):
    """Gated attention (alpha, delta with gradients), dense (lens: (B, Sq, Sk)) or packed (lens: a
    list of sequence lengths, attention_varlen), optionally with windows with sinks (a row
    [sink, near, gap, far] for every head); gated=False: the windows alone."""
    g = torch.Generator().manual_seed(d * 31 + h)
    dev = "cuda"

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype).requires_grad_()

    w = torch.tensor([windows], dtype=torch.int32, device=dev) if windows is not None else None
    if isinstance(lens, list):
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        total = sum(lens)
        q, k, v = leaf(total, h, d), leaf(total, hkv, d), leaf(total, hkv, d)
        alpha, delta = leaf(total, h), leaf(total, hkv)
        gate = (alpha, delta) if gated else None
        out = dmattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), gate=gate, windows=w, **kw)
    else:
        b, sq, sk = lens
        q, k, v = leaf(b, sq, h, d), leaf(b, sk, hkv, d), leaf(b, sk, hkv, d)
        alpha, delta = leaf(b, sq, h), leaf(b, sk, hkv)
        gate = (alpha, delta) if gated else None
        out = dmattn.attention(q, k, v, gate=gate, windows=w, **kw)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    for t in (out, q.grad, k.grad, v.grad) + ((alpha.grad, delta.grad) if gated else ()):
        assert torch.isfinite(t).all(), "non-finite value"


@announced
def gathered_full_case(b, sq, h, hkv, d, dtype, width, scores, indexed=False, ends=False, **kw):
    """The raw forward with gathered keys (key_positions, 2 * width original keys, half of each
    row padding) and a full bias and / or mask over the gathered rows (scores: "bias", "bias32",
    "mask"); the rows indexed in place (key_rows) or copied; key ends."""
    from dmattn.ops import attention_forward
    g = torch.Generator().manual_seed(width * 3 + d)
    dev = "cuda"
    q = torch.randn(b, sq, h, d, generator=g).to(dev, dtype)
    k, v = (torch.randn(b, width, hkv, d, generator=g).to(dev, dtype) for _ in range(2))
    positions = torch.full((b, hkv, width), -1, dtype=torch.int32)
    positions[..., : width // 2] = torch.arange(0, width, 2, dtype=torch.int32)
    index = torch.randint(0, width, (b, hkv, width), generator=g, dtype=torch.int32).to(dev) if indexed else None
    key_ends = torch.randint(0, sq + 1, (b, hkv, width), generator=g, dtype=torch.int32).to(dev) if ends else None
    bias = torch.randn(b, h, sq, width, generator=g).to(dev, torch.float32 if scores == "bias32" else dtype)
    mask = (torch.rand(b, h, sq, width, generator=g) > 0.3).to(dev)
    out, _ = attention_forward(q, k, v, mask if scores == "mask" else None, None if scores == "mask" else bias,
                               kw.get("causal", False), -1, -1, None, kw.get("softcap", 0.0), False, positions.to(dev),
                               2 * width, key_ends, *((index,) if indexed else ()))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "non-finite value"


@announced
def expanded_case(b, sq, sk, h, hkv, d, dtype, **kw):
    """dmattn.attention's forward with q expanded over the batch and k, v over the heads (stride 0)."""
    g = torch.Generator().manual_seed(sq + sk + d)
    dev = "cuda"
    q = torch.randn(1, sq, h, d, generator=g).to(dev, dtype).expand(b, sq, h, d)
    k, v = (torch.randn(b, sk, 1, d, generator=g).to(dev, dtype).expand(b, sk, hkv, d) for _ in range(2))
    out = dmattn.attention(q, k, v, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "non-finite value"


@announced
def kvcache_case(b, sq, h, hkv, d, dtype, capacity, page_size=None, bias=False, mask=False):
    """dmattn.attention_with_kvcache (the split-KV decode kernel and its combine kernel): ragged
    lengths, a partial last key tile, several warps and splits, optional pages (capacity a
    multiple of page_size) / per-key bias / mask."""
    g = torch.Generator().manual_seed(capacity + sq)
    dev = "cuda"
    q = torch.randn(b, sq, h, d, generator=g).to(dev, dtype)
    k = torch.randn(b, capacity, hkv, d, generator=g).to(dev, dtype)
    v = torch.randn(b, capacity, hkv, d, generator=g).to(dev, dtype)
    lens = torch.tensor([capacity - 3 - 5 * i for i in range(b)], dtype=torch.int32, device=dev)
    table = None
    if page_size:
        table = torch.randperm(b * capacity // page_size, generator=g).view(b, -1).to(dev, torch.int32)
        k = k.view(-1, page_size, hkv, d)[table.view(-1).long()].contiguous()
        v = v.view(-1, page_size, hkv, d)[table.view(-1).long()].contiguous()
    bias_t = torch.randn(b, h, 1, capacity, generator=g).to(dev, dtype) if bias else None
    mask_t = (torch.rand(b, 1, 1, capacity, generator=g) > 0.3).to(dev) if mask else None
    out = dmattn.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table, bias=bias_t, mask=mask_t)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "non-finite value"


@announced
def topk_decode_case(b, h, hkv, d, dtype, sk, keep, bias_rows):
    """attention_topk's decoding step (one query, no gradient): the kept rows read in place by
    the decode kernel (its indexed keys), a bias (bias_rows..., 1, Sk) over the kv heads."""
    g = torch.Generator().manual_seed(sk + keep)
    dev = "cuda"
    q = torch.randn(b, 1, h, d, generator=g).to(dev, dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dev, dtype)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dev, dtype)
    bias = torch.randn(*bias_rows, 1, sk, generator=g).to(dev, dtype)
    with torch.no_grad():
        out = dmattn.attention_topk(q, k, v, bias, keep, causal=True, per_query=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "non-finite value"


for dtype in (torch.bfloat16, torch.float16):
    topk_decode_case(2, 8, 2, 128, dtype, 3001, 700, (2, 2))  # 4 rows a kv head: the narrow kernel's indexed keys
    topk_decode_case(2, 8, 1, 64, dtype, 1500, 333, (1, 1))  # 8 rows, a last stage of 13 keys
    topk_decode_case(1, 4, 2, 256, dtype, 40000, 2048, (1, 2))  # many key splits (head dim 256: the one-tile kernel)
    kvcache_case(2, 1, 8, 2, 128, dtype, 3000, bias=True)
    kvcache_case(1, 4, 8, 2, 64, dtype, 2048, page_size=64, mask=True)
    kvcache_case(2, 3, 4, 4, 256, dtype, 1104, page_size=8, bias=True)
    kvcache_case(1, 2, 8, 2, 128, dtype, 1004, bias=True)  # rows of 1004: the register path
    kvcache_case(2, 4, 8, 2, 128, dtype, 2048, page_size=64, bias=True)  # 16 rows, pages: the bias product
    kvcache_case(2, 20, 8, 2, 128, dtype, 1504, page_size=8, bias=True)  # 80 rows: 64-row chunks
    kvcache_case(1, 5, 8, 2, 64, dtype, 700, mask=True)  # 20 rows: two warps without rows
    kvcache_case(2, 16, 8, 2, 128, dtype, 2100)  # 64 rows, no operands: the pipelined 32-key tiles
    kvcache_case(1, 9, 8, 2, 64, dtype, 896, page_size=16)  # 36 rows: pipelined, a warp without rows
    kvcache_case(1, 1, 8, 1, 128, dtype, 40000)  # over 100 key splits into the combine kernel
    kvcache_case(2, 2, 8, 2, 64, dtype, 2048, page_size=64, mask=True)  # 8 rows, pages, a mask: the narrow kernel's entries
    kvcache_case(2, 8, 8, 2, 128, dtype, 1501, bias=True)  # 32 rows, odd bias rows: the wgmma kernel's loaded entries
    kvcache_case(2, 16, 8, 2, 64, dtype, 2048, page_size=64, bias=True)  # 64 rows, pages, aligned pairs
    kvcache_case(2, 8, 8, 2, 128, dtype, 1501, bias=True, mask=True)  # 32 rows, a mask beside the bias: loaded entries
    case(1, 17, 33, 2, 1, 64, dtype, mask_shape=(1, 2, 17, 33), bias_shape=(1, 2, 17, 33))
    case(2, 130, 77, 4, 2, 128, dtype, bias_shape=(2, 1, 1, 77), causal=True)
    case(1, 64, 200, 2, 2, 72, dtype, mask_shape=(1, 1, 64, 200), window=(32, 8))
    case(1, 1, 1, 1, 1, 64, dtype)
    # Head dim 128 (the Hopper backward on cc 9.0): mask + 16-bit bias tiles double buffered
    # across several query blocks (rows 16-byte aligned: the cp.async path), then per-head column
    # sums in shared memory (GQA group 2).
    case(1, 200, 320, 4, 2, 128, dtype, mask_shape=(1, 1, 200, 320), bias_shape=(1, 4, 200, 320), causal=True)
    case(1, 150, 260, 4, 2, 128, dtype, bias_shape=(1, 4, 1, 260))
    # The Hopper forward's and backward's bias fast paths (16-bit bias alone): swizzled,
    # double-buffered bias tiles by cp.async (aligned rows; 200 queries: a partial second query
    # block; backward: dbias from the dS tile), and a query-broadcast row, causal (backward: the
    # column-sum variant, GQA group 2).
    # (the full-bias backward otherwise runs on the warp-specialized kernel, below)
    os.environ["DMATTN_BWD_SM90_WS"] = "0"
    case(1, 200, 320, 4, 2, 128, dtype, bias_shape=(1, 4, 200, 320))
    del os.environ["DMATTN_BWD_SM90_WS"]
    case(1, 130, 256, 2, 1, 128, dtype, bias_shape=(1, 2, 1, 256), causal=True)
    # The warp-specialized Hopper forward (TMA producer, pipelines, named barriers): plain and
    # full-bias variants, several key blocks and a partial one, every head-dim tile (three
    # consumers at 64, a key block of 80 at 256), GQA, causal with Sq < Sk.
    case(2, 300, 520, 4, 2, 64, dtype, causal=True)
    case(1, 200, 600, 2, 2, 96, dtype)
    case(1, 260, 390, 2, 1, 256, dtype, causal=True)
    case(2, 200, 456, 4, 2, 128, dtype, bias_shape=(2, 1, 200, 456), causal=True)
    case(1, 129, 304, 2, 2, 64, dtype, bias_shape=(1, 2, 129, 304))

    # The warp-specialized forward's per-key rows (loader warp, its pipeline): a query-broadcast
    # bias in q's dtype and in fp32, gathered keys with a per-key bias (one key set per head, and
    # per query: candidates with key ends), several key blocks and a partial one.
    case(2, 200, 456, 4, 2, 128, dtype, bias_shape=(2, 4, 1, 456), causal=True)
    case(1, 129, 304, 2, 2, 64, dtype, bias_shape=(1, 2, 1, 304))
    case(1, 150, 333, 2, 1, 128, dtype, bias_shape=(1, 1, 1, 333), bias_dtype=torch.float32)
    topk_case(2, 300, 4, 2, 128, dtype, keep=160, causal=True)
    topk_case(1, 520, 2, 2, 64, dtype, keep=200, causal=True, per_query=True)
    topk_case(1, 260, 2, 1, 128, dtype, keep=96, causal=False)
    topk_case(2, 600, 4, 2, 128, dtype, keep=300, bias_heads=2, causal=True)
    topk_case(1, 700, 2, 2, 64, dtype, keep=280, bias_heads=1, causal=False)
    # Both at head dim 256 (key blocks of 64): a full bias, a query-broadcast bias, gathered keys.
    case(1, 200, 456, 2, 1, 256, dtype, bias_shape=(1, 2, 200, 456), causal=True)
    case(1, 129, 304, 2, 2, 256, dtype, bias_shape=(1, 2, 1, 304))
    topk_case(1, 300, 2, 1, 256, dtype, keep=160, causal=True)
    # Full masks with 16-byte rows (their tiles by TMA): one per head, causal, a partial query
    # block; one for all heads at head dim 64.
    case(2, 200, 512, 4, 2, 128, dtype, mask_shape=(2, 4, 200, 512), causal=True)
    case(1, 129, 256, 2, 2, 64, dtype, mask_shape=(1, 1, 129, 256))
    # A full bias with a key mask and / or softcap (the bias tiles beside per-key rows).
    case(2, 200, 456, 4, 2, 128, dtype, mask_shape=(2, 1, 1, 456), bias_shape=(2, 4, 200, 456), causal=True)
    case(1, 129, 304, 2, 2, 64, dtype, mask_shape=(1, 2, 1, 304), bias_shape=(1, 2, 129, 304), softcap=20.0)
    case(1, 200, 456, 2, 1, 256, dtype, mask_shape=(1, 1, 1, 456), bias_shape=(1, 2, 200, 456), causal=True)
    # A full mask with a key bias and / or softcap (the mask tiles beside per-key rows).
    case(2, 200, 512, 4, 2, 128, dtype, mask_shape=(2, 4, 200, 512), bias_shape=(2, 1, 1, 512), causal=True)
    case(1, 129, 256, 2, 2, 64, dtype, mask_shape=(1, 1, 129, 256), softcap=20.0)
    # A full bias with a full mask (both tile streams; key blocks of 64 at head dim 128), fp32
    # full bias tiles alone, beside a key mask and beside a full mask, full masks at head dim 256
    # (key blocks of 64).
    case(2, 200, 512, 4, 2, 128, dtype, mask_shape=(2, 1, 200, 512), bias_shape=(2, 4, 200, 512), causal=True,
         softcap=20.0)
    case(1, 129, 256, 2, 2, 64, dtype, mask_shape=(1, 2, 129, 256), bias_shape=(1, 1, 129, 256))
    case(1, 200, 456, 4, 2, 128, dtype, bias_shape=(1, 4, 200, 456), bias_dtype=torch.float32, causal=True)
    case(1, 129, 304, 2, 2, 64, dtype, mask_shape=(1, 2, 1, 304), bias_shape=(1, 2, 129, 304),
         bias_dtype=torch.float32)
    case(1, 200, 320, 4, 2, 128, dtype, mask_shape=(1, 4, 200, 320), bias_shape=(1, 1, 200, 320),
         bias_dtype=torch.float32, causal=True)
    case(1, 200, 512, 2, 1, 256, dtype, mask_shape=(1, 2, 200, 512), causal=True)
    case(1, 200, 456, 2, 1, 256, dtype, mask_shape=(1, 1, 1, 456), bias_shape=(1, 2, 200, 456),
         bias_dtype=torch.float32, causal=True)
    # Rows that are not 16-byte multiples (1001 keys) and a key dimension of size 1: the padded
    # copies of the mask and the bias (src/cuda/host/aligned_operand.h).
    case(1, 130, 1001, 2, 2, 128, dtype, mask_shape=(1, 1, 130, 1001))
    case(1, 130, 1001, 2, 1, 64, dtype, bias_shape=(1, 2, 130, 1001), causal=True)
    case(1, 130, 300, 2, 1, 128, dtype, mask_shape=(1, 2, 130, 1), bias_shape=(1, 1, 130, 1))

    # The forward's persistent CTAs: more tiles than SMs (each CTA takes several, the pipelines
    # running on across them), for plain scores, a full bias and per-key rows; then a causal
    # sweep forced persistent, whose units pair two tiles.
    case(4, 600, 300, 8, 4, 128, dtype)
    case(4, 600, 300, 8, 4, 128, dtype, bias_shape=(4, 8, 600, 300))
    topk_case(4, 600, 8, 4, 128, dtype, keep=300, causal=False)
    os.environ["DMATTN_FWD_PERSISTENT"] = "1"
    case(4, 600, 600, 8, 4, 128, dtype, causal=True)
    del os.environ["DMATTN_FWD_PERSISTENT"]

    # The warp-specialized Hopper backward (head dim 128: TMA producer, row-statistics loader and
    # dQ writer warps, the named barriers of the dQ hand-over): plain scores with several query
    # blocks per key block and a partial one, key blocks no query reaches, per-key rows with the
    # column sums and a query-broadcast mask, gathered keys with key ends (per query).
    case(2, 300, 520, 4, 2, 128, dtype, causal=True)
    case(1, 96, 700, 2, 2, 128, dtype, window=(32, 0))
    case(1, 200, 333, 4, 2, 128, dtype, mask_shape=(1, 1, 1, 333), bias_shape=(1, 4, 1, 333), causal=True)
    topk_case(1, 520, 2, 2, 128, dtype, keep=200, causal=True, per_query=True)
    # Its full-bias variant: the bias tiles' single buffer (TMA, the consumers' release), dbias's
    # tiles stored from the dS buffers by the dQ writer, the zeroing warp (causal, GQA, Sq < Sk;
    # a window leaving key blocks unreached; head dim 64).
    case(2, 300, 520, 4, 2, 128, dtype, bias_shape=(2, 4, 300, 520), causal=True)
    case(1, 96, 704, 2, 2, 128, dtype, bias_shape=(1, 2, 96, 704), window=(32, 0))
    case(2, 300, 520, 4, 2, 64, dtype, bias_shape=(2, 4, 300, 520), causal=True)
    # Head dim 256 on it: key blocks of 64, P and dS in two buffers each read by both consumers,
    # dO in one stage, the consumers' dQ tiles in turns on one staging buffer (rows past the
    # queries left out; GQA, Sq < Sk; the FA2-style path, so that the kernel adds dQ).
    os.environ["DMATTN_BWD_EXACT"] = "0"
    case(2, 300, 520, 4, 2, 256, dtype, causal=True)
    del os.environ["DMATTN_BWD_EXACT"]
    # Deterministic mode on it: the dQ writer's ordered adds (flags in a stream-ordered buffer;
    # head dim 64: one consumer's tile a block, alternating), plain and with a full bias.
    case(2, 300, 520, 4, 2, 128, dtype, causal=True, deterministic=True)
    case(1, 333, 400, 4, 2, 64, dtype, deterministic=True)
    case(1, 200, 320, 4, 2, 128, dtype, bias_shape=(1, 4, 200, 320), deterministic=True)
    case(2, 300, 520, 4, 2, 256, dtype, causal=True, deterministic=True)
    # Packed batches on it: each sequence's tiles from its first row, the rows past its end
    # cleared in shared memory, its last query block's dQ rows past its end zeroed (the FA2-style path,
    # so that the main pass adds dQ), plain and with a key-side bias, deterministic too.
    os.environ["DMATTN_BWD_EXACT"] = "0"
    varlen_case([300, 70, 200, 1], 4, 2, 128, dtype, causal=True)
    varlen_case([130, 257, 64], 4, 2, 64, dtype, key_bias=True)
    varlen_case([300, 70, 200], 4, 2, 128, dtype, key_bias=True, deterministic=True)
    varlen_case([300, 70, 200, 1], 4, 2, 256, dtype, causal=True)
    del os.environ["DMATTN_BWD_EXACT"]
    # The query heads of a KV head packed into the forward's tiles, forced (short chunks, groups
    # of 4, 8 and 7; D 64 / 96 / 256; causal and window; a consumer without rows), several tiles
    # a CTA forced persistent, and a packed batch.
    os.environ["DMATTN_FWD_PACK_GQA"] = "1"
    case(2, 16, 700, 16, 4, 128, dtype, causal=True)
    case(1, 5, 1030, 16, 2, 64, dtype)
    case(1, 20, 333, 28, 4, 96, dtype, window=(40, 0))
    case(2, 12, 500, 8, 4, 256, dtype, causal=True)
    os.environ["DMATTN_FWD_PERSISTENT"] = "1"
    os.environ["DMATTN_FWD_PERSISTENT_CTAS"] = "2"
    case(2, 70, 600, 16, 4, 128, dtype, causal=True)
    del os.environ["DMATTN_FWD_PERSISTENT"], os.environ["DMATTN_FWD_PERSISTENT_CTAS"]
    varlen_case([7, 0, 130, 33], 8, 2, 128, dtype, causal=True)
    del os.environ["DMATTN_FWD_PACK_GQA"]
    # Gathered keys with a full bias or mask (the Hopper forward's tiles beside its key rows;
    # indexed rows: the bias / mask tiles by TMA, K and V by the gather warps), broadcast q, k, v.
    gathered_full_case(2, 200, 4, 2, 128, dtype, 304, "bias", indexed=True, ends=True, causal=True)
    gathered_full_case(1, 129, 2, 2, 64, dtype, 256, "mask", indexed=True, softcap=20.0)
    gathered_full_case(1, 200, 2, 1, 256, dtype, 320, "bias32", ends=True, causal=True)
    expanded_case(2, 200, 300, 4, 2, 128, dtype, causal=True)
    # Gated attention on the warp-specialized kernels (the alpha / delta rows in the key-row and
    # row-statistics stages, dalpha's slices, ddelta's column sums in shared memory): D 64 and
    # 128, causal with Sq < Sk, GQA, deterministic, a packed batch with an empty sequence, the
    # linear gate, gate skipping; gated windows with sinks on the sm80-class per-element test and
    # by parts; windows alone on the warp-specialized windows variant (on Hopper: dense with a
    # partial last key block, packed with an empty sequence).
    gate_case((2, 200, 333), 4, 2, 128, dtype, causal=True)
    gate_case((1, 130, 257), 4, 4, 64, dtype, deterministic=True)
    gate_case([130, 0, 257, 64], 4, 2, 128, dtype, causal=True, gate_fn="linear")
    # gate skipping (a threshold near 1: many cells skipped; the skip variants of both kernels)
    gate_case((2, 400, 520), 4, 2, 128, dtype, causal=True, gate_threshold=0.9)
    gate_case([130, 0, 300, 257], 4, 2, 64, dtype, causal=True, gate_threshold=0.9)
    os.environ["DMATTN_WINDOW_PARTS"] = "0"
    gate_case((1, 300, 300), 4, 2, 128, dtype, windows=[16, 64, 32, 64])
    os.environ["DMATTN_WINDOW_PARTS"] = "1"
    gate_case((1, 300, 300), 4, 2, 128, dtype, windows=[16, 64, 32, 64])
    del os.environ["DMATTN_WINDOW_PARTS"]
    gate_case((2, 300, 700), 4, 2, 128, dtype, windows=[16, 64, 32, 64], gated=False)
    gate_case([300, 0, 517, 64], 4, 2, 64, dtype, windows=[16, 100, 150, 90], gated=False)
    # A full bias with a full mask at head dim 256 (one stage of each tile stream, issued after
    # the next V), several tiles a CTA.
    os.environ["DMATTN_FWD_PERSISTENT"] = "1"
    os.environ["DMATTN_FWD_PERSISTENT_CTAS"] = "2"
    case(2, 300, 512, 4, 2, 256, dtype, mask_shape=(2, 4, 300, 512), bias_shape=(2, 4, 300, 512), causal=True)
    del os.environ["DMATTN_FWD_PERSISTENT"], os.environ["DMATTN_FWD_PERSISTENT_CTAS"]
print("sanitizer cases done")
