"""GPU-time breakdown of one per-query causal top-k step (attention_topk(causal=True,
per_query=True), forward + backward, selection included) by kernel, with torch.profiler;
--hf: of one training step of the transformers Doge model of dmattn.bench_doge instead.

    python benchmarks/profiling/per_query_profile.py [--seq 8192] [--batch 2] [--segments 512,1024] [--hf]
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import dmattn
from dmattn import per_query_path

ap = argparse.ArgumentParser()
ap.add_argument("--seq", type=int, default=8192)
ap.add_argument("--batch", type=int, default=2)
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--keep", type=int, default=2048)
ap.add_argument("--segments", default="1024")
ap.add_argument("--rows", type=int, default=18)
ap.add_argument("--hf", action="store_true")
args = ap.parse_args()


def report(title, prof, steps=3):
    print(f"\n=== {title}: GPU time per step by kernel ({steps} steps averaged)")
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / steps / 1e3
    print(f"total {total:.2f} ms")
    for e in events[: args.rows]:
        print(f"{e.device_time_total / steps / 1e3:8.3f} ms  {e.count // steps:4d}x  {e.key[:110]}")


def host_and_wall(step, steps=10):
    """(host ms, wall ms) per step: the time to enqueue a step's work without waiting for the GPU,
    and the time per step with the GPU's work included. Host close to wall: the GPU waits for
    launches (the gaps between kernels are host time)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    host = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        host += time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return host / steps * 1e3, wall / steps * 1e3


def profile_steps(step, title):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host, wall = host_and_wall(step)
    print(f"\n{title}: host {host:.2f} ms per step to enqueue, wall {wall:.2f} ms per step")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    report(title, prof)


if args.hf:
    from transformers import DogeForCausalLM

    from dmattn.bench_doge import _doge_config
    from dmattn.integrations.transformers import register

    register()
    for seg in (int(s) for s in args.segments.split(",")):
        per_query_path.SEGMENT_LEN = seg
        config = _doge_config(args.seq)
        config._attn_implementation = "dmattn"
        model = DogeForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.A.normal_()
        ids = torch.randint(0, config.vocab_size, (1, args.seq), device="cuda")

        def hf_step():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        profile_steps(hf_step, f"Doge step S={args.seq}, segment {seg}")
    raise SystemExit(0)

gen = torch.Generator(device="cuda").manual_seed(0)
shape = (args.batch, args.seq, args.heads, 128)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(3))
bias = torch.randn(args.batch, args.heads, 1, args.seq, device="cuda", dtype=torch.bfloat16,
                   generator=gen).requires_grad_()
dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)


def step():
    out = dmattn.attention_topk(q, k, v, bias, args.keep, causal=True, per_query=True)
    torch.autograd.grad(out, (q, k, v, bias), dout)


for seg in (int(s) for s in args.segments.split(",")):
    per_query_path.SEGMENT_LEN = seg
    profile_steps(step, f"segment {seg}")
