"""Where the host time of one dmattn.attention_topk step goes (the gather path's Python glue,
the dispatcher, the native calls), measured while a sleep kernel keeps the GPU busy so that no
call waits on the device.

    PYTHONPATH=python python3 benchmarks/profiling/topk_host_profile.py [--batch 2] [--seqlen 8192]
        [--forward]

Prints the host enqueue time of a forward and of a forward+backward (best of 10), then
cProfile's functions by total (self) time and by cumulative time for 20 forward+backward steps
(--forward: 200 forwards without gradients), and the ATen ops of one step by self CPU time
(torch.profiler).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

import dmattn
from topk_gather_timing import KEEP, host_enqueue_ms, make  # (this script's folder is on sys.path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=35)
    ap.add_argument("--forward", action="store_true", help="profile the forward without gradients")
    args = ap.parse_args()
    q, k, v, bias, dout = make(args.batch, args.seqlen)

    def fwd():
        with torch.no_grad():
            return dmattn.attention_topk(q, k, v, bias, KEEP, causal=True)

    def fwd_bwd():
        out = dmattn.attention_topk(q, k, v, bias, KEEP, causal=True)
        return torch.autograd.grad(out, (q, k, v, bias), dout)

    for _ in range(3):
        fwd_bwd()
    print(f"host enqueue (GPU kept busy): fwd {host_enqueue_ms(fwd):.3f} ms, fwd+bwd {host_enqueue_ms(fwd_bwd):.3f} ms")

    step, steps = (fwd, 200) if args.forward else (fwd_bwd, 20)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(args.rows)
    st.sort_stats("cumulative").print_stats(args.rows)

    from torch.profiler import ProfilerActivity, profile
    torch.cuda._sleep(200_000_000)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        step()
    torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=50))


if __name__ == "__main__":
    main()
