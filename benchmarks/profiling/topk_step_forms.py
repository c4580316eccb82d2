"""Figures: docs/perf.md, "The top-k step's forms"; docs/design.md, "Gather path" (its gaps).

attention_topk's training step (per-key bias, top-2048, forward + backward with every gradient)
in its forms, on CUDA: eager as a user calls it (the training form where the call has its form),
eager through the general path (gather.force_path("gather"): the same kernels, more host layers),
and replayed from a CUDA graph (the GPU's time alone; the difference to eager is the time the GPU
waits for the host). bf16, B=2, H=16, S=8192, D=128, keep 2048; median of --rounds medians of
--iters CUDA-event timings, the forms alternated. --profile: the kernels of one eager step and
the GPU's idle gaps between them (torch.profiler; the eager call's host checks are told to ignore
the profiler, which would otherwise send it to the general path).

    python benchmarks/profiling/topk_step_forms.py [--forms eager,general,graph] [--rounds 5] [--iters 15] [--profile]
"""

import argparse
import json
import os
import statistics
import tempfile

import torch

import dmattn
from dmattn import gather, topk
from dmattn.bench import cuda_graph_of, time_ms
from topk_gather_timing import KEEP, make


def step_of(q, k, v, bias, dout, causal, path):
    def step():
        with gather.force_path(path):
            out = dmattn.attention_topk(q, k, v, bias, KEEP, causal=causal)
        return torch.autograd.grad(out, (q, k, v, bias), dout)
    return step


def profile_step(step, causal):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.cuda.synchronize()
            with torch.profiler.record_function("STEP"):
                step()
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    steps = sorted((e for e in events if e.get("name") == "STEP" and e.get("ph") == "X"), key=lambda e: e["ts"])
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                 key=lambda e: e["ts"])
    last = steps[-1]
    t0, t1 = last["ts"], last["ts"] + last["dur"]
    ops = [e for e in gpu if t0 <= e["ts"] <= t1 + 5000]
    print(f"causal={causal}: the last profiled step, µs from its start (gap: the GPU idle before the op)")
    end = t0
    for e in ops:
        print(f"  +{e['ts'] - t0:7.0f}  gap {e['ts'] - end:5.0f}  {e['dur']:6.0f}  {e['name'][:90]}")
        end = max(end, e["ts"] + e["dur"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--forms", default="eager,general,graph")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    forms = args.forms.split(",")
    q, k, v, bias, dout = make(2, 8192)
    for causal in (False, True):
        fns = {}
        for form in forms:
            if form == "eager":
                fns[form] = step_of(q, k, v, bias, dout, causal, None)
            elif form == "general":
                fns[form] = step_of(q, k, v, bias, dout, causal, "gather")
            elif form == "graph":
                fns[form] = cuda_graph_of(step_of(q, k, v, bias, dout, causal, None))
            else:
                ap.error(f"--forms: unknown form {form!r}")
        times = {form: [] for form in fns}
        for _ in range(args.rounds):
            for form, fn in fns.items():
                times[form].append(time_ms(fn, "cuda", 3, args.iters))
        print(f"causal={causal}: " + ", ".join(
            f"{form} {statistics.median(t):.3f} ms ({min(t):.3f}-{max(t):.3f})" for form, t in times.items()),
            flush=True)
    if args.profile:
        topk._plain_eager = lambda tensors: True  # (see the module's docstring)
        for causal in (False, True):
            profile_step(step_of(q, k, v, bias, dout, causal, None), causal)


if __name__ == "__main__":
    main()
