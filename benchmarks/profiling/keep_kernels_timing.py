"""Figures: docs/perf.md, "The top-k step beside the same keys taken directly"; design.md.

attention_topk's cost beside the same work without the top-k path and beside cuDNN: how much
of a step is the kept-key count itself and how much the gather, the per-key bias and the glue.

bf16, B=2, H=16, Sq=8192, D=128, keep 2048: the top-k call (per-key bias (B, H, 1, S), S=8192)
against dmattn on 2048 keys directly (plain scores, and a (B, H, 1, 2048) bias with its
gradient) and SDPA cuDNN on the same 2048 keys, forward alone and forward + backward with every
gradient. Per row: eager and CUDA-graph medians (dmattn.bench.time_ms, --rounds medians of
--iters timings), then with --kernels each row's CUDA kernels (torch.profiler, median µs).

    PYTHONPATH=python python3 benchmarks/profiling/keep_kernels_timing.py [--rounds 3] [--iters 10] [--kernels]
"""

import argparse
import json
import os
import statistics
import tempfile

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dmattn
from dmattn.bench import cuda_graph_of, time_ms
from keep_problem import KEEP, keep_inputs


def kernel_times(fn, steps=5):
    """Median µs and count of each CUDA kernel of `steps` calls of fn."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    by_name = {}
    for e in json.load(open(path))["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"):
            by_name.setdefault(e["name"][:80], []).append(e["dur"])
    return sorted(((statistics.median(d), len(d), n) for n, d in by_name.items()), reverse=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kernels", action="store_true")
    args = ap.parse_args()
    q, k, v, dout, bias, k2, v2, bias2 = keep_inputs()
    for t in (q, k, v, bias, k2, v2, bias2):
        t.requires_grad_(True)
    qt, kt, vt, dt = (x.detach().transpose(1, 2).contiguous() for x in (q, k2, v2, dout))
    for t in (qt, kt, vt):
        t.requires_grad_(True)

    def no_grad(f):
        def run():
            with torch.no_grad():
                return f()
        return run

    def step(f, leaves, grad_out=dout):
        return lambda: torch.autograd.grad(f(), leaves, grad_out)

    def cudnn(q_, k_, v_):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q_, k_, v_)

    rows = [
        ("fwd, 2048 keys, plain", no_grad(lambda: dmattn.attention(q, k2, v2))),
        ("fwd, 2048 keys, per-key bias", no_grad(lambda: dmattn.attention(q, k2, v2, bias=bias2))),
        ("fwd, attention_topk 2048 of 8192", no_grad(lambda: dmattn.attention_topk(q, k, v, bias, KEEP))),
        ("fwd, 2048 keys, SDPA cuDNN", no_grad(lambda: cudnn(qt, kt, vt))),
        ("fwd+bwd, 2048 keys, plain", step(lambda: dmattn.attention(q, k2, v2), (q, k2, v2))),
        ("fwd+bwd, 2048 keys, per-key bias + dbias",
         step(lambda: dmattn.attention(q, k2, v2, bias=bias2), (q, k2, v2, bias2))),
        ("fwd+bwd, attention_topk 2048 of 8192",
         step(lambda: dmattn.attention_topk(q, k, v, bias, KEEP), (q, k, v, bias))),
        ("fwd+bwd, 2048 keys, SDPA cuDNN", step(lambda: cudnn(qt, kt, vt), (qt, kt, vt), dt)),
    ]
    for name, fn in rows:
        eager = statistics.median(time_ms(fn, "cuda", 3, args.iters) for _ in range(args.rounds))
        replay = cuda_graph_of(fn)
        graph = statistics.median(time_ms(replay, "cuda", 3, args.iters) for _ in range(args.rounds))
        print(f"{name:44s} eager {eager:.3f} ms  CUDA graph {graph:.3f} ms", flush=True)
    if args.kernels:
        for name, fn in rows:
            print(f"--- {name}: kernels (median µs, count)")
            for us, count, kernel in kernel_times(fn):
                print(f"   {us:8.1f}  x{count:2d}  {kernel}")


if __name__ == "__main__":
    main()
