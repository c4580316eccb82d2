"""Figures: docs/perf.md, "Forward + backward" and "Backward (Hopper, warp-specialized kernel)".

Forward + backward timings of dmattn (CUDA) against SDPA cuDNN and SDPA flash (FA2) in one
process, on the rows of the Hopper backward: dense and causal, a per-key bias (B, H, 1, S) with
its gradient, attention_topk's shared key set and Doge's per-query selection (selection
included), GQA, a full bias (B, H, S, S) with its gradient (and GQA 32 / 8 with one, with the
step's memory), head dims 64 (H=16) and 256 (H=8), causal.

bf16, B=2, H=16, S=8192, D=128; every gradient (q, k, v and the bias's); median of CUDA-event
timings after warm-up; random (never zero) inputs. TFLOP/s with FlashAttention's convention
(4*B*H*S*S*D x 3.5, halved when causal; the top-k rows count the kept pairs). The backward kernel
is the one dmattn picks (DMATTN_BWD_SM90_WS=0: the general Hopper kernel instead, for a
comparison in a second process). Ends with a check of dmattn's dense gradients against SDPA's.
--rounds N (N > 1): the rows with peers (dense, causal, head dims 64 and 256) are timed N times
with the peers alternated, each row's figure the median of its rounds, and a line per problem
gives the range of the per-round dmattn / cuDNN time ratios (the peers' times move with the GPU's
state from one round to the next, as dmattn's do).
    python benchmarks/profiling/bwd_timing.py [--iters 10] [-S 8192] [--rounds 1]
"""

import argparse
import statistics

import torch

import dmattn
from dmattn.bench import time_ms as bench_time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("-S", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=1, help="alternations of the rows with peers")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    B, H, S, D, KEEP = 2, 16, args.S, 128, 2048
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g).requires_grad_()

    q, k, v = leaf(B, S, H, D), leaf(B, S, H, D), leaf(B, S, H, D)
    key_bias = leaf(B, H, 1, S)
    dout = torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g)
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    doutt = dout.transpose(1, 2)

    rows = []

    def time_row(name, fn, leaves, d_out):
        def step():
            return torch.autograd.grad(fn(), leaves, d_out)
        try:
            return bench_time_ms(step, "cuda", 3, args.iters)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            return float("nan")

    def record(name, ms, flop):
        rows.append((name, ms, flop / ms / 1e9))
        print(f"{rows[-1][0]:<62} {rows[-1][1]:8.3f} ms {rows[-1][2]:7.1f} TFLOP/s", flush=True)

    def add(name, fn, leaves, d_out, flop):
        record(name, time_row(name, fn, leaves, d_out), flop)

    def add_with_peers(entries, flop):
        """entries: (name, fn, leaves, d_out), dmattn's first and cuDNN's second, timed in turn
        for args.rounds rounds; each row gets the median of its rounds."""
        times = [[] for _ in entries]
        for _ in range(args.rounds):
            for i, entry in enumerate(entries):
                times[i].append(time_row(*entry))
        for entry, t in zip(entries, times):
            record(entry[0], statistics.median(t), flop)
        if args.rounds > 1:
            ratios = [a / c for a, c in zip(times[0], times[1])]
            print(f"{entries[0][0]}: dmattn / cuDNN per round {min(ratios):.3f}-{max(ratios):.3f} "
                  f"over {args.rounds} rounds", flush=True)

    def dense_flop(causal, h=H, s=S, b=B):
        return 4 * b * h * s * s * D * 3.5 * (0.5 if causal else 1.0)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional

    def sdpa(causal, backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return run

    for causal in (False, True):
        kind = "causal" if causal else "dense"
        add_with_peers([(f"dmattn {kind}", lambda causal=causal: dmattn.attention(q, k, v, causal=causal), [q, k, v],
                         dout),
                        (f"sdpa cudnn {kind}", sdpa(causal, SDPBackend.CUDNN_ATTENTION), [qt, kt, vt], doutt),
                        (f"sdpa flash (FA2) {kind}", sdpa(causal, SDPBackend.FLASH_ATTENTION), [qt, kt, vt], doutt)],
                       dense_flop(causal))
    for causal in (False, True):
        add(f"dmattn per-key bias (B,H,1,S) + dbias{' causal' if causal else ''}",
            lambda: dmattn.attention(q, k, v, bias=key_bias, causal=causal), [q, k, v, key_bias], dout,
            dense_flop(causal))
    # attention_topk: the shared key set (query i keeps the selected keys j <= i under causal) and
    # Doge's per-query selection (query i keeps min(keep, i + 1) keys).
    sel = key_bias.detach().float().topk(KEEP, dim=-1).indices
    shared_causal = 4 * D * float((S - sel.float()).sum()) * 3.5
    add("dmattn attention_topk(2048) causal, with the selection",
        lambda: dmattn.attention_topk(q, k, v, key_bias, KEEP, causal=True), [q, k, v, key_bias], dout, shared_causal)
    add("dmattn attention_topk(2048), with the selection",
        lambda: dmattn.attention_topk(q, k, v, key_bias, KEEP), [q, k, v, key_bias], dout,
        4 * D * B * H * KEEP * S * 3.5)
    per_query = 4 * D * B * H * sum(min(KEEP, i + 1) for i in range(S)) * 3.5
    add("dmattn attention_topk(2048) causal per query, with the selection",
        lambda: dmattn.attention_topk(q, k, v, key_bias, KEEP, causal=True, per_query=True), [q, k, v, key_bias],
        dout, per_query)
    # GQA 32 / 8 heads, causal, B=1.
    qg = leaf(1, S, 32, D)
    kg, vg = leaf(1, S, 8, D), leaf(1, S, 8, D)
    add("dmattn GQA 32/8 causal (B=1)", lambda: dmattn.attention(qg, kg, vg, causal=True), [qg, kg, vg],
        torch.randn(1, S, 32, D, device=dev, dtype=dt, generator=g), dense_flop(True, h=32, b=1))

    # A full learnable bias (B, H, S, S) with its gradient, and GQA 32 / 8 with a bias per query
    # head (1, 32, S, S), B=1: with the memory the call takes beyond its inputs (peak during the
    # step, less what was allocated before it), beside dbias's own size.
    full_bias = leaf(B, H, S, S)
    for causal in (False, True):
        add(f"dmattn bias (B,H,S,S) + dbias{' causal' if causal else ''}",
            lambda: dmattn.attention(q, k, v, bias=full_bias, causal=causal), [q, k, v, full_bias], dout,
            dense_flop(causal))
    del full_bias
    gqa_bias = leaf(1, 32, S, S)
    dout_g = torch.randn(1, S, 32, D, device=dev, dtype=dt, generator=g)
    add("dmattn GQA 32/8 bias (1,32,S,S) + dbias (B=1)",
        lambda: dmattn.attention(qg, kg, vg, bias=gqa_bias), [qg, kg, vg, gqa_bias], dout_g,
        dense_flop(False, h=32, b=1))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.autograd.grad(dmattn.attention(qg, kg, vg, bias=gqa_bias), [qg, kg, vg, gqa_bias], dout_g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    dbias_bytes = gqa_bias.numel() * gqa_bias.element_size()
    print(f"GQA bias step: peak {peak / 2**30:.2f} GiB beyond the inputs, dbias {dbias_bytes / 2**30:.2f} GiB, "
          f"the rest {(peak - dbias_bytes) / 2**30:.2f} GiB", flush=True)
    del gqa_bias

    # Head dims 64 (H=16) and 256 (H=8), causal.
    for d, h in ((64, H), (256, H // 2)):
        qd, kd, vd = leaf(B, S, h, d), leaf(B, S, h, d), leaf(B, S, h, d)
        doutd = torch.randn(B, S, h, d, device=dev, dtype=dt, generator=g)
        qdt, kdt, vdt = (t.detach().transpose(1, 2).requires_grad_() for t in (qd, kd, vd))
        flopd = dense_flop(True, h=h) * d / D
        entries = [(f"dmattn causal D={d}", lambda: dmattn.attention(qd, kd, vd, causal=True), [qd, kd, vd], doutd)]
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash (FA2)", SDPBackend.FLASH_ATTENTION)):
            def run_d(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qdt, kdt, vdt, is_causal=True)
            entries.append((f"sdpa {name} causal D={d}", run_d, [qdt, kdt, vdt], doutd.transpose(1, 2)))
        add_with_peers(entries, flopd)
        del qd, kd, vd, qdt, kdt, vdt, doutd, entries

    # Gradient check of the dense causal case against SDPA flash (same inputs, fp32 norms).
    out = dmattn.attention(q, k, v, causal=True)
    mine = torch.autograd.grad(out, [q, k, v], dout)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), [qt, kt, vt], doutt)
    for name, a, r in zip("qkv", mine, ref):
        r = r.transpose(1, 2)
        rel = ((a.float() - r.float()).norm() / r.float().norm()).item()
        print(f"d{name} (causal) vs SDPA flash: rel err {rel:.2e}, finite {bool(torch.isfinite(a).all())}")
    print("\nTABLE")
    for name, ms, tf in rows:
        print(f"| {name} | {ms:.3f} | {tf:.1f} |")


if __name__ == "__main__":
    main()
