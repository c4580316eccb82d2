"""Figures: docs/design.md, "CUDA forward": persistent CTAs against one tile a CTA.

The warp-specialized Hopper forward with its persistent CTAs (DMATTN_FWD_PERSISTENT=1) against
one tile per CTA (=0), paired in one process: the two alternate, five rounds of a median of
CUDA-event timings each, and the medians of the rounds are reported. bf16, B=2, H=16, S=8192,
D=128 unless a row says otherwise.
    python benchmarks/profiling/fwd_schedule_timing.py [--rounds 5] [--iters 10]
"""

import argparse
import os
import statistics

import torch

import dmattn
from dmattn.bench import time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    B, H, S, D = 2, 16, 8192, 128
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g) for _ in range(3))
    bias = torch.randn(B, H, S, S, device=dev, dtype=dt, generator=g)
    key_bias = torch.randn(B, H, 1, S, device=dev, dtype=dt, generator=g)
    idx = torch.rand(B, H, 1, S, device=dev, generator=g).topk(2048, dim=-1).indices
    key_mask = torch.zeros(B, H, 1, S, device=dev, dtype=torch.bool).scatter_(-1, idx, True)
    nseq, sl = 4, S // 2
    qp, kp, vp = (t.reshape(nseq * sl, H, D) for t in (q, k, v))
    cu = torch.arange(0, nseq * sl + 1, sl, device=dev, dtype=torch.int32)
    d64 = [torch.randn(B, S, 16, 64, device=dev, dtype=dt, generator=g) for _ in range(3)]
    d256 = [torch.randn(B, S, 8, 256, device=dev, dtype=dt, generator=g) for _ in range(3)]
    cases = [
        ("dense", lambda: dmattn.attention(q, k, v)),
        ("causal", lambda: dmattn.attention(q, k, v, causal=True)),
        ("packed 4 x 4096", lambda: dmattn.attention_varlen(qp, kp, vp, cu, cu, sl, sl)),
        ("packed 4 x 4096 causal", lambda: dmattn.attention_varlen(qp, kp, vp, cu, cu, sl, sl, causal=True)),
        ("D=64 causal", lambda: dmattn.attention(*d64, causal=True)),
        ("D=256 (H=8) causal", lambda: dmattn.attention(*d256, causal=True)),
        ("bias (B,H,S,S)", lambda: dmattn.attention(q, k, v, bias=bias)),
        ("bias (B,H,S,S) causal", lambda: dmattn.attention(q, k, v, bias=bias, causal=True)),
        ("per-key bias + mask causal", lambda: dmattn.attention(q, k, v, key_mask, key_bias, causal=True)),
        ("attention_topk(2048) causal", lambda: dmattn.attention_topk(q, k, v, key_bias, 2048, causal=True)),
    ]
    print(f"{'case':<32} {'persistent':>10} {'one tile/CTA':>12}  ms")
    for name, fn in cases:
        times = {"1": [], "0": []}
        for _ in range(args.rounds):
            for mode in ("1", "0"):
                os.environ["DMATTN_FWD_PERSISTENT"] = mode
                times[mode].append(time_ms(fn, "cuda", 2, args.iters))
        print(f"{name:<32} {statistics.median(times['1']):10.3f} {statistics.median(times['0']):12.3f}", flush=True)
    os.environ.pop("DMATTN_FWD_PERSISTENT")


if __name__ == "__main__":
    main()
