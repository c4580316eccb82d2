"""Figures: docs/perf.md, "Gated attention and windows with sinks" (the closed-block row's
gradients against float64).

Gated attention (logsigmoid, causal) whose gates close about half of the key blocks of 128
(delta lowered by 300 there, as the benchmark's `closing_gates`): every gradient of dmattn, of
flash-sparse-attn when it is importable (CUDA) and of PyTorch's own eager computation in bf16,
each against float64 autograd of the same formula on the same bf16 inputs (max error over
max |reference|), and dalpha's error on the first query block apart. --first-closed closes key
block 0, so that the first query block sees closed keys only: there dalpha's terms cancel
(sum_j dS_ij = 0 with delta near -300), and the rounding of the output in D = rowsum(dO * O)
is amplified.

    PYTHONPATH=python python3 benchmarks/profiling/closed_gate_grads.py [--device cuda] \
        [--seqlen 1024,2048] [--first-closed]
"""

import argparse
import math

import torch

import dmattn

NAMES = ("out", "dq", "dk", "dv", "dalpha", "ddelta")


def inputs(batch: int, seqlen: int, heads: int, head_dim: int, first_closed: bool):
    gen = torch.Generator().manual_seed(7)
    alpha = torch.rand(batch, seqlen, heads, generator=gen) * 2 + 0.5
    closed = torch.rand(batch, -(-seqlen // 128), heads, generator=gen) < 0.5
    if first_closed:
        closed[:, 0] = True
    closed = closed.repeat_interleave(128, 1)[:, :seqlen]
    delta = torch.randn(batch, seqlen, heads, generator=gen) - 300.0 * closed
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, generator=gen) for _ in range(4))
    return (q, k, v, alpha, delta), dout


def eager(x, dout, dtype):
    """The formula in PyTorch ops, in `dtype`: out and the gradients of q, k, v, alpha, delta."""
    leaves = [t.to(dtype).requires_grad_() for t in x]
    q, k, v, alpha, delta = leaves
    seqlen, head_dim = q.shape[1], q.shape[3]
    gate = torch.nn.functional.logsigmoid(alpha.permute(0, 2, 1)[..., :, None] * delta.permute(0, 2, 1)[..., None, :])
    s = (torch.einsum("bihd,bjhd->bhij", q, k) + gate) / math.sqrt(head_dim)
    hidden = torch.ones(seqlen, seqlen, dtype=torch.bool, device=q.device).triu(1)
    out = torch.einsum("bhij,bjhd->bihd", s.masked_fill(hidden, float("-inf")).softmax(-1), v)
    out.backward(dout.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


def called(fn, x, dout):
    leaves = [t.clone().requires_grad_() for t in x]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seqlen", default="1024,2048")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--first-closed", action="store_true")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # (the CPU backend takes float32)
    runs = {"dmattn": lambda q, k, v, a, d: dmattn.attention(q, k, v, causal=True, gate=(a, d))}
    if dev == "cuda":
        try:
            import flash_sparse_attn as peer  # type: ignore

            runs["flash-sparse-attn"] = lambda q, k, v, a, d: peer.flash_gated_attn_func(
                q, k, v, a, d, is_causal=True, softmax_threshold=0.0, gate_threshold=0.0, is_autotune=False,
                tile_mn=(128, 64))
        except Exception:
            pass
    print(f"dmattn {dmattn.__version__} on {dev}, {dtype}; logsigmoid gate, causal, B=1 H={args.heads} "
          f"D={args.head_dim}, closed blocks: delta - 300" + (", key block 0 closed" if args.first_closed else ""))
    print("| S | implementation | " + " | ".join(NAMES) + " | dalpha, first query block |")
    print("|---|---|" + "---|" * (len(NAMES) + 1))
    for seqlen in (int(s) for s in args.seqlen.split(",")):
        x, dout = inputs(1, seqlen, args.heads, args.head_dim, args.first_closed)
        # (every computation from the same bf16 inputs: delta near -300 moves by up to 1 when rounded)
        x, dout = [t.to(dev, torch.bfloat16) for t in x], dout.to(dev, torch.bfloat16)
        ref = [t.double() for t in eager(x, dout, torch.float64)]
        results = {name: called(fn, [t.to(dtype) for t in x], dout.to(dtype)) for name, fn in runs.items()}
        results["PyTorch eager, bfloat16"] = eager(x, dout, torch.bfloat16)
        for name, got in results.items():
            errs = [float((g.double() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref)]
            first = float((got[4][:, :128].double() - ref[4][:, :128]).abs().max() / ref[4].abs().max())
            print(f"| {seqlen} | {name} | " + " | ".join(f"{e:.1e}" for e in errs) + f" | {first:.1e} |")


if __name__ == "__main__":
    main()
