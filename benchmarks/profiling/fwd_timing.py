"""Figures: docs/perf.md, "Forward" (H200) and "Forward (Hopper, warp-specialized kernel)".

Forward timings of dmattn (CUDA) against SDPA cuDNN, SDPA flash (FA2) and FlexAttention in one
process.

bf16, B=2, H=16, S=8192, D=128 unless told otherwise (--head-dims adds rows at other head dims,
dense, full bias and the Doge step's key mask and bias: H=16 up to 128, H=8 above); the full
bias with a key padding mask; a full boolean mask against SDPA given the same attn_mask. Median
of CUDA-event timings after warm-up; random (never zero) inputs. TFLOP/s with FlashAttention's
convention (4*B*H*S*S*D, halved when causal). The packed batch and the dense batch of the same
shape are timed in alternation (--rounds).
    python benchmarks/profiling/fwd_timing.py [--flex] [--iters 20] [--rounds 5] [--head-dims 64,256]
"""

import argparse
import statistics

import torch

import dmattn
from dmattn.bench import cuda_graph_of, time_ms as bench_time_ms


def time_ms(fn, warmup=3, iters=20):
    return bench_time_ms(fn, "cuda", warmup, iters)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention (compiles)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the packed / dense pair")
    ap.add_argument("-S", type=int, default=8192)
    ap.add_argument("--head-dims", default="", help="comma-separated extra head dims for the dense rows")
    args = ap.parse_args()
    B, H, S, D = 2, 16, args.S, 128
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g) for _ in range(3))
    dense_bias = torch.randn(B, H, S, S, device=dev, dtype=dt, generator=g)
    key_bias = torch.randn(B, H, 1, S, device=dev, dtype=dt, generator=g)
    idx = torch.rand(B, H, 1, S, device=dev, generator=g).topk(2048, dim=-1).indices
    key_mask = torch.zeros(B, H, 1, S, device=dev, dtype=torch.bool).scatter_(-1, idx, True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    # Clocks settle before the first row: about a second of bf16 GEMMs (a GPU just out of idle,
    # or of another job, ran its first rows several percent slower).
    warm_a = torch.randn(8192, 8192, device=dev, dtype=dt, generator=g)
    for _ in range(700):
        warm_a @ warm_a
    torch.cuda.synchronize()
    del warm_a

    def flops(causal, h=H, d=D, b=B, s=S):
        return 4 * b * h * s * s * d * (0.5 if causal else 1.0)

    rows = []

    def record(name, ms, causal, h=H, d=D, b=B, s=S, flop=None):
        rows.append((name, ms, (flop if flop is not None else flops(causal, h, d, b, s)) / ms / 1e9))
        print(f"{name:<58} {ms:8.3f} ms {rows[-1][2]:7.1f} TFLOP/s", flush=True)

    def add(name, fn, causal, h=H, d=D, b=B, s=S, flop=None):
        try:
            ms = time_ms(fn, iters=args.iters)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            ms = float("nan")
        record(name, ms, causal, h, d, b, s, flop)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional

    def sdpa(causal, backend=SDPBackend.FLASH_ATTENTION, tensors=(qt, kt, vt)):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*tensors, is_causal=causal)
        return run

    for causal in (False, True):
        kind = "causal" if causal else "dense"
        add(f"dmattn {kind}", lambda: dmattn.attention(q, k, v, causal=causal), causal)
        add(f"sdpa cudnn {kind}", sdpa(causal, SDPBackend.CUDNN_ATTENTION), causal)
        add(f"sdpa flash (FA2) {kind}", sdpa(causal), causal)
    # Top-2048 of a per-key bias, causal: TFLOP/s over the (query, key) pairs the key set keeps
    # (query i keeps the selected keys j <= i: sum over them of S - j).
    def causal_pairs(keys):
        return float((S - keys.float()).sum())

    if args.flex:  # (one compiled FlexAttention for every row that times it)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        # Each row's score_mod / mask_mod and shape compiles a variant of its own: past dynamo's
        # default limit of 8 the later rows would run FlexAttention uncompiled (scores
        # materialized, ~100x slower).
        torch._dynamo.config.recompile_limit = 64
        flex = torch.compile(flex_attention, dynamic=False)

    def flex_bias(tensors, bias, causal, key_mask=None):
        """FlexAttention with `bias` as its score_mod; causal and / or a key mask (B,1,1,S) by a
        block mask built here, outside the timed call."""
        def bias_mod(score, b, h, qi, ki):
            return score + bias[b, h, qi, ki]

        if key_mask is not None:
            def key_mm(b, h, qi, ki):
                return key_mask[b, 0, 0, ki] & (qi >= ki) if causal else key_mask[b, 0, 0, ki]

            bm = create_block_mask(key_mm, B, 1, S, S, device=dev)
        else:
            bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, B, bias.shape[1], S, S, device=dev) if causal else None
        return lambda: flex(*tensors, score_mod=bias_mod, block_mask=bm)

    # A packed batch of 4 sequences of S/2 against the dense batch of the same shape.
    nseq, sl = 4, S // 2
    qp, kp, vp = (torch.randn(nseq * sl, H, D, device=dev, dtype=dt, generator=g) for _ in range(3))
    cu = torch.arange(0, nseq * sl + 1, sl, device=dev, dtype=torch.int32)
    qb, kb, vb = (t.view(nseq, sl, H, D) for t in (qp, kp, vp))
    # The two differ by a few percent at most, less than the drift of clocks over a few rows: they
    # are timed in alternation (args.rounds rounds of each, the median of the rounds' medians),
    # as eager calls and as CUDA graph replays (the kernels alone).
    for causal in (False, True):
        kind = f"{nseq} x {sl}{' causal' if causal else ''}"
        pair = {f"dmattn dense batch {kind}": lambda: dmattn.attention(qb, kb, vb, causal=causal),
                f"dmattn packed {kind}": lambda: dmattn.attention_varlen(qp, kp, vp, cu, cu, sl, sl, causal=causal)}
        for graph in (False, True):
            fns = {name + (", CUDA graph" if graph else ""): cuda_graph_of(fn) if graph else fn
                   for name, fn in pair.items()}
            rounds = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    rounds[name].append(time_ms(fn, iters=args.iters))
            for name in fns:
                record(name, statistics.median(rounds[name]), causal, b=nseq, s=sl)
    del qp, kp, vp, qb, kb, vb

    for d in (int(x) for x in args.head_dims.split(",") if x):
        h = 16 if d <= 128 else 8
        qd, kd, vd = (torch.randn(B, S, h, d, device=dev, dtype=dt, generator=g) for _ in range(3))
        tens = tuple(t.transpose(1, 2) for t in (qd, kd, vd))
        for causal in (False, True):
            kind = f"{'causal' if causal else 'dense'} D={d} H={h}"
            add(f"dmattn {kind}", lambda: dmattn.attention(qd, kd, vd, causal=causal), causal, h, d)
            add(f"sdpa cudnn {kind}", sdpa(causal, SDPBackend.CUDNN_ATTENTION, tens), causal, h, d)
            add(f"sdpa flash (FA2) {kind}", sdpa(causal, tensors=tens), causal, h, d)
        # The biased forwards at this head dim: a full bias, and the Doge step's key mask and bias.
        bias_d = torch.randn(B, h, S, S, device=dev, dtype=dt, generator=g)
        for causal in (False, True):
            kind = f"bias (B,H,S,S){' causal' if causal else ''} D={d} H={h}"
            add(f"dmattn {kind}", lambda: dmattn.attention(qd, kd, vd, bias=bias_d, causal=causal), causal, h, d)
            if args.flex:
                add(f"flex {kind}", flex_bias(tens, bias_d, causal), causal, h, d)
        add(f"dmattn Doge per-key bias+mask(2048) causal D={d} H={h}",
            lambda: dmattn.attention(qd, kd, vd, key_mask[:, :h], key_bias[:, :h], causal=True), True, h, d,
            flop=4 * d * causal_pairs(idx[:, :h]))
        del qd, kd, vd, tens, bias_d
    add("dmattn dense bias (B,H,S,S) bf16", lambda: dmattn.attention(q, k, v, bias=dense_bias), False)
    add("dmattn dense bias causal", lambda: dmattn.attention(q, k, v, bias=dense_bias, causal=True), True)
    # The full bias with a key padding mask (B,1,1,S): the second sequence's last 1536 keys padding.
    key_padding = (torch.arange(S, device=dev) < torch.tensor([S, S - 1536], device=dev)[:, None]).view(B, 1, 1, S)
    add("dmattn dense bias + key padding", lambda: dmattn.attention(q, k, v, key_padding, dense_bias), False)
    add("dmattn dense bias + key padding causal",
        lambda: dmattn.attention(q, k, v, key_padding, dense_bias, causal=True), True)
    add("dmattn Doge per-key bias+mask(2048) causal",
        lambda: dmattn.attention(q, k, v, key_mask, key_bias, causal=True), True)
    # A full boolean mask (B,H,S,S), half of it true at random; SDPA takes it as attn_mask.
    # (SDPA takes no attn_mask with is_causal: for it the causal bound folded into a second mask)
    full_mask = torch.randint(0, 2, (B, H, S, S), device=dev, dtype=torch.uint8, generator=g).bool()
    sdpa_masks = {False: full_mask, True: full_mask.tril()}
    for causal in (False, True):
        kind = f"full mask (B,H,S,S){' causal' if causal else ''}"
        add(f"dmattn {kind}", lambda: dmattn.attention(q, k, v, full_mask, causal=causal), causal)
        for backend, label in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.EFFICIENT_ATTENTION, "mem-efficient")):
            def sdpa_masked(backend=backend, m=sdpa_masks[causal]):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m)
            add(f"sdpa {label} {kind}", sdpa_masked, causal)
    del sdpa_masks

    topk_flop = 4 * D * causal_pairs(key_bias.float().topk(2048, dim=-1).indices)
    per_query_flop = 4 * D * B * H * sum(min(2048, i + 1) for i in range(S))
    topk = lambda: dmattn.attention_topk(q, k, v, key_bias, 2048, causal=True)
    topk_per_query = lambda: dmattn.attention_topk(q, k, v, key_bias, 2048, causal=True, per_query=True)
    add("dmattn attention_topk(2048) causal, with the selection", topk, True, flop=topk_flop)
    add("dmattn attention_topk(2048) causal per query, with the selection", topk_per_query, True,
        flop=per_query_flop)
    # The same calls replayed from a CUDA graph: the GPU's time without the host's launches.
    for name, fn, flop in (("dmattn attention_topk(2048) causal, with the selection, CUDA graph", topk, topk_flop),
                           ("dmattn attention_topk(2048) causal per query, with the selection, CUDA graph",
                            topk_per_query, per_query_flop)):
        try:
            replay = cuda_graph_of(fn)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: capture failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        add(name, replay, True, flop=flop)

    if args.flex:
        def key_mod(score, b, h, qi, ki):
            return score + key_bias[b, h, 0, ki]

        def doge_mm(b, h, qi, ki):
            return (qi >= ki) & key_mask[b, h, 0, ki]

        def full_mm(b, h, qi, ki):
            return full_mask[b, h, qi, ki]

        def full_causal_mm(b, h, qi, ki):
            return full_mask[b, h, qi, ki] & (qi >= ki)

        bm_doge = create_block_mask(doge_mm, B, H, S, S, device=dev)
        bm_full = create_block_mask(full_mm, B, H, S, S, device=dev)
        bm_full_causal = create_block_mask(full_causal_mm, B, H, S, S, device=dev)
        add("flex full mask", lambda: flex(qt, kt, vt, block_mask=bm_full), False)
        add("flex full mask causal", lambda: flex(qt, kt, vt, block_mask=bm_full_causal), True)
        add("flex dense bias", flex_bias((qt, kt, vt), dense_bias, False), False)
        add("flex dense bias causal", flex_bias((qt, kt, vt), dense_bias, True), True)
        for causal in (False, True):
            add(f"flex dense bias + key padding{' causal' if causal else ''}",
                flex_bias((qt, kt, vt), dense_bias, causal, key_padding), causal)
        add("flex Doge causal", lambda: flex(qt, kt, vt, score_mod=key_mod, block_mask=bm_doge), True,
            flop=4 * D * causal_pairs(idx))

    # correctness spot check of the dense case against SDPA (same inputs)
    o1 = dmattn.attention(q, k, v)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o2 = F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
    rel = ((o1.float() - o2.float()).norm() / o2.float().norm()).item()
    print(f"dense out vs SDPA flash: rel err {rel:.2e}, finite {bool(torch.isfinite(o1).all())}")
    # The matmul ceiling of this GPU in this process: a bf16 GEMM of 8192^3 (2*M*N*K FLOP), the
    # figure the attention rows are a fraction of.
    a_mm, b_mm = (torch.randn(8192, 8192, device=dev, dtype=dt, generator=g) for _ in range(2))
    ms = time_ms(lambda: a_mm @ b_mm, iters=args.iters)
    rows.append(("torch.mm bf16 8192^3 (matmul ceiling)", ms, 2 * 8192**3 / ms / 1e9))
    print("\nTABLE")
    for name, ms, tf in rows:
        print(f"| {name} | {ms:.3f} | {tf:.1f} |")


if __name__ == "__main__":
    main()
