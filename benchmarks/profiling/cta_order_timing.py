"""Figures: docs/design.md, "CUDA backward", "CTA order".

The Hopper backward's CTA order (src/cuda/common/cta_order.h) timed in one process: fwd+bwd of a few
bf16 D=128 H=16 B=2 S=8192 rows for each DMATTN_BWD_CTA_GROUP value (1 = key block fastest; G =
(kv head, batch) pairs G at a time, key blocks slowest inside a group; 32 = all pairs here), in
interleaved rounds so that drift hits every order alike.

    PYTHONPATH=python python3 benchmarks/profiling/cta_order_timing.py [--groups d,1,4,8,32] [--rounds 3]

("d": the variable unset, i.e. run_bwd's default: grouped only under a causal / sliding window.)
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from dmattn.bench import Config, fwd_bwd, make_inputs, time_ms
from dmattn.bench.providers import _dmattn

ROWS = [
    Config("dense causal", 2, 8192, 16, 128, True),
    Config("dense", 2, 8192, 16, 128, False),
    Config("bias (B,H,S,S) causal", 2, 8192, 16, 128, True, bias="dense"),
    Config("bias (B,H,S,S)", 2, 8192, 16, 128, False, bias="dense"),
    Config("per-key top-2048 causal (attention_topk)", 2, 8192, 16, 128, True, bias="per_key", keep=2048),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", default="d,1,4,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    groups = args.groups.split(",")
    print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
    print("| config | " + " | ".join(("default" if g == "d" else f"G={g}") + " fwd+bwd ms" for g in groups) + " |")
    print("|---|" + "---|" * len(groups))
    for cfg in ROWS:
        x = make_inputs(cfg, "cuda")
        step = fwd_bwd(_dmattn(cfg, x), x)
        times = {g: [] for g in groups}
        for _ in range(args.rounds):
            for g in groups:
                if g == "d":
                    os.environ.pop("DMATTN_BWD_CTA_GROUP", None)
                else:
                    os.environ["DMATTN_BWD_CTA_GROUP"] = g
                times[g].append(time_ms(step, "cuda", 1, args.iters))
        cells = [f"{statistics.median(times[g]):.2f}" for g in groups]
        print(f"| {cfg.name} | " + " | ".join(cells) + " |", flush=True)
        del x, step
        torch.cuda.empty_cache()
    os.environ.pop("DMATTN_BWD_CTA_GROUP", None)


if __name__ == "__main__":
    main()
