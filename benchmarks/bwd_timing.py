"""Median CUDA-event times of dmattn fwd and fwd+bwd next to SDPA (flash) in the same process.

    python benchmarks/bwd_timing.py [--b 2 --h 16 --s 8192 --d 128 --reps 10]
"""

import argparse

import torch
import torch.nn.functional as F

import dmattn
from dmattn.bench import time_ms as bench_time_ms


def bench(fn, warmup=2, reps=10):
    return bench_time_ms(fn, "cuda", warmup, reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--s", type=int, default=8192)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", default="")
    ap.add_argument("--exp-sweep", default="", help="comma list of DMATTN_BWD_EXP flag values (profiling)")
    args = ap.parse_args()
    b, h, s, d = args.b, args.h, args.s, args.d
    dt = torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(b, s, h, d, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(b, s, h, d, device="cuda", dtype=dt, requires_grad=True)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=dt)
    rows = []
    if args.exp_sweep:
        import os
        for causal in (False, True):
            for fl in args.exp_sweep.split(","):
                os.environ["DMATTN_BWD_EXP"] = fl
                def fb():
                    out = dmattn.attention(q, k, v, causal=causal)
                    torch.autograd.grad(out, (q, k, v), dout)
                print(f"exp {fl:>3s} causal={causal}: fwd+bwd {bench(fb, reps=args.reps):8.3f} ms", flush=True)
        os.environ.pop("DMATTN_BWD_EXP")
        return

    def run(name, fwd, inputs):
        if args.only and args.only not in name:
            return
        def f():
            with torch.no_grad():
                fwd()
        def fb():
            out = fwd()
            torch.autograd.grad(out, inputs, dout)
        tf = bench(f, reps=args.reps)
        tfb = bench(fb, reps=args.reps)
        rows.append((name, tf, tfb, tfb - tf))
        print(f"{name:34s} fwd {tf:8.3f} ms   fwd+bwd {tfb:8.3f} ms   bwd {tfb - tf:8.3f} ms", flush=True)

    for causal in (False, True):
        tag = "causal" if causal else "dense"
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        doutt = dout.transpose(1, 2).contiguous()

        def sdpa():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        if not args.only or "sdpa" in args.only:
            def f():
                with torch.no_grad():
                    sdpa()
            def fb():
                out = sdpa()
                torch.autograd.grad(out, (qt, kt, vt), doutt)
            tf, tfb = bench(f, reps=args.reps), bench(fb, reps=args.reps)
            print(f"{'sdpa flash ' + tag:34s} fwd {tf:8.3f} ms   fwd+bwd {tfb:8.3f} ms   bwd {tfb - tf:8.3f} ms", flush=True)
        run(f"dmattn {tag} no bias", lambda: dmattn.attention(q, k, v, causal=causal), (q, k, v))
        run(f"dmattn {tag} no bias determ.", lambda: dmattn.attention(q, k, v, causal=causal, deterministic=True), (q, k, v))
        if not args.only or "bias" in args.only:
            bias = torch.randn(b, h, s, s, device="cuda", dtype=dt, requires_grad=True)
            run(f"dmattn {tag} (B,H,S,S) bias grad", lambda: dmattn.attention(q, k, v, None, bias, causal=causal), (q, k, v, bias))
            del bias
            pk = torch.randn(b, h, 1, s, device="cuda", dtype=dt, requires_grad=True)
            run(f"dmattn {tag} (B,H,1,S) bias grad", lambda: dmattn.attention(q, k, v, None, pk, causal=causal), (q, k, v, pk))
            del pk
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
