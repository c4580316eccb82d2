"""Figures: docs/perf.md, "Context parallelism at one rank" (and docs/design.md's).

What dmattn.distributed.ring_attention costs over dmattn.attention when there is nothing to
communicate: a process group of one rank (file:// rendezvous in a temporary folder; NCCL on CUDA,
gloo on the CPU), forward and forward + backward, median of CUDA events (dmattn.bench.time_ms).

    PYTHONPATH=python python3 benchmarks/profiling/ring_overhead.py [--seqlen 32768 --heads 16
        --heads-kv 16 --head-dim 128 --batch 1 --iters 10 --no-bias --device cuda]

Rows: dmattn.attention; ring_attention with the ring exchange in each layout (one rank: the op
itself, so this is the Python glue); the same with the ring pass's general path forced (fp32
output / lse accumulators and merge, the backward with the given statistics (forward_stats) and
fp32 gradient accumulators: what every rank pays per step beyond the op calls when W > 1); and
the all-gather exchange. Default problem: B=1, H=16, S=32768, D=128, bf16, causal, a learnable
per-key bias (B, H, 1, S).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

import dmattn
import dmattn.distributed as dd
from dmattn.bench import time_ms
from dmattn.distributed import ring


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--heads-kv", type=int, default=0, help="0: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--no-bias", action="store_true", help="no per-key bias")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    return parser.parse_args()


def main():
    args = parse_args()
    device, dtype = args.device, getattr(torch, args.dtype)
    if device == "cpu" and dtype != torch.float32:
        dtype = torch.float32  # the CPU backend's fast type
    heads_kv = args.heads_kv or args.heads
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method="file://" + os.path.join(tmp, "init"), rank=0, world_size=1)
        try:
            run(args, device, dtype, heads_kv, backend)
        finally:
            dist.destroy_process_group()


def run(args, device, dtype, heads_kv, backend):
    gen = torch.Generator(device=device).manual_seed(0)
    b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q, k, v, dout = randn(b, s, h, d), randn(b, s, heads_kv, d), randn(b, s, heads_kv, d), randn(b, s, h, d)
    bias = None if args.no_bias else randn(b, h, 1, s)
    leaves = [t.requires_grad_() for t in (q, k, v) + ((bias,) if bias is not None else ())]
    causal = not args.no_causal

    def plain():
        return dmattn.attention(q, k, v, None, bias, causal=causal)

    def ring_call(layout, kv_exchange):
        return lambda: dd.ring_attention(q, k, v, None, bias, causal=causal, layout=layout, kv_exchange=kv_exchange)

    class general_path:  # the ring pass's general code at one rank
        def __enter__(self):
            self.saved = ring._single_call
            ring._single_call = lambda spec: False

        def __exit__(self, *exc):
            ring._single_call = self.saved

    rows = [("dmattn.attention", plain, None),
            ("ring, zigzag", ring_call("zigzag", "ring"), None),
            ("ring, contiguous", ring_call("contiguous", "ring"), None),
            ("ring, zigzag, general path", ring_call("zigzag", "ring"), general_path),
            ("allgather, zigzag", ring_call("zigzag", "allgather"), None)]

    with torch.no_grad():
        reference = plain()
    print(f"# one rank ({backend}), {device}, {args.dtype if device == 'cuda' else 'float32'}, B={b} S={s} "
          f"H={h} Hkv={heads_kv} D={d}, causal={causal}, per-key bias={bias is not None}; "
          f"median of {args.iters} ({args.warmup} warm-up)")
    print(f"| {'variant':<28} | {'fwd ms':>9} | {'fwd+bwd ms':>10} | {'fwd x':>6} | {'fwd+bwd x':>9} | max |out - attention| |")
    print(f"|{'-' * 30}|{'-' * 11}|{'-' * 12}|{'-' * 8}|{'-' * 11}|{'-' * 24}|")
    base = None
    for name, fn, context in rows:
        ctx = context() if context is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            with torch.no_grad():
                err = (fn().float() - reference.float()).abs().max().item()
                fwd = time_ms(fn, device, args.warmup, args.iters)

            def step():
                return torch.autograd.grad(fn(), leaves, dout)

            fwd_bwd = time_ms(step, device, args.warmup, args.iters)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        base = base or (fwd, fwd_bwd)
        print(f"| {name:<28} | {fwd:9.3f} | {fwd_bwd:10.3f} | {fwd / base[0]:6.3f} | {fwd_bwd / base[1]:9.3f} "
              f"| {err:22.3g} |")


if __name__ == "__main__":
    main()
