"""Figures: docs/semantics.md, "Gate skipping" (the measured error table).

Gate skipping against exact mode on the same backend: the share of visible cells skipped, and
the largest error of out, lse and the gradients of q and alpha, each over the largest value
of exact mode's (lse: the largest absolute difference). Three kinds of gates (logsigmoid,
alpha in [0.5, 2.5], delta ~ N(0, 1) plus a shift per key block of 128):
  random   no shift: products close to one another;
  graded   key block n lowered by 20 (n mod 4): bounds a few units apart between blocks;
  closing  half of the key blocks lowered by 300 (the benchmark's closed blocks).
Runs on the CPU backend by default (the same cells as every kernel: the rule reads alpha and
delta alone); --device cuda for the GPU's kernels.

    PYTHONPATH=python python3 benchmarks/profiling/gate_skip_error.py [--device cpu] [--seqlen 2048]
"""

import argparse
import math

import torch

import dmattn
from dmattn.gate_skip import gate_keep_cells


def gates(kind: str, batch: int, seqlen: int, heads: int, gen: torch.Generator):
    alpha = torch.rand(batch, seqlen, heads, generator=gen) * 2 + 0.5
    delta = torch.randn(batch, seqlen, heads, generator=gen)
    block = torch.arange(seqlen) // 128
    if kind == "graded":
        delta = delta - 20.0 * (block % 4).to(delta.dtype)[None, :, None]
    elif kind == "closing":
        closed = torch.rand(batch, int(block[-1]) + 1, heads, generator=gen) < 0.5
        delta = delta - 300.0 * closed[:, block].to(delta.dtype)
    return alpha, delta


def step(q, k, v, alpha, delta, do, causal, threshold):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, alpha, delta)]
    out, lse = dmattn.attention(*leaves[:3], causal=causal, gate=tuple(leaves[3:]), gate_threshold=threshold,
                                return_lse=True)
    out.backward(do)
    return out.detach(), lse.detach(), leaves[0].grad, leaves[3].grad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=2)
    args = ap.parse_args()
    dev, S, D, H = args.device, args.seqlen, args.head_dim, args.heads
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    scale = 1 / math.sqrt(D)
    print(f"dmattn {dmattn.__version__} on {dev}, {dtype}, B=1 H={H} S={S} D={D}, logsigmoid gate")
    print("| gates | causal | threshold | cells skipped | out err | lse err | dq err | dalpha err |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("random", "graded", "closing"):
        gen = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, S, H, D, generator=gen) for _ in range(4))
        alpha, delta = gates(kind, 1, S, H, gen)
        q, k, v, do, alpha, delta = (t.to(dev, dtype) for t in (q, k, v, do, alpha, delta))
        for causal in (True, False):
            exact = step(q, k, v, alpha, delta, do, causal, None)
            cells = -(-S // 128)
            visible = torch.ones(cells, cells, dtype=torch.bool, device=dev)
            if causal:  # (Sq == Sk: key block n is visible to query block m iff n <= m)
                visible = visible.tril()
            for threshold in (1.0 / S, 0.01, 0.1, 0.5):
                kept = gate_keep_cells(alpha, delta, scale=scale, gate_fn="logsigmoid", threshold=threshold,
                                       causal=causal)
                skipped = (visible & ~kept).sum().item() / (visible.sum().item() * H)
                approx = step(q, k, v, alpha, delta, do, causal, threshold)
                errs = []
                for i, (a, e) in enumerate(zip(approx, exact)):
                    diff = (a.float() - e.float()).abs().max().item()
                    errs.append(diff if i == 1 else diff / e.float().abs().max().item())
                print(f"| {kind} | {causal} | {threshold:.3g} | {100 * skipped:.1f} % | "
                      + " | ".join(f"{x:.1e}" for x in errs) + " |")


if __name__ == "__main__":
    main()
