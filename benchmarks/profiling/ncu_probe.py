"""One forward + backward step of a chosen case, for Nsight Compute (ncu) on a GPU machine.

    ncu --clock-control none --set full -k regex:sm90 -c 2 -o OUT/case \
        python3 benchmarks/profiling/ncu_probe.py CASE [--s 4096 --b 1]

CASE: plain (no mask / bias), bias (dense (B,H,S,S) bf16 bias with gradient), topk
(attention_topk, per-key bias with gradient, keep = S / 4, causal), perquery (the same with
per_query=True: Doge's per-query causal top-k). bf16, H=16, D=128 unless told (--h, --d);
--fwd profiles the forward alone. Random
inputs; one warm-up step (so that ncu's first captured launches are not the first ever), then
the profiled step.
"""

import argparse

import torch

import dmattn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["plain", "bias", "topk", "perquery"])
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--fwd", action="store_true", help="the forward alone (no gradients)")
    args = ap.parse_args()
    B, S, H, D = args.b, args.s, args.h, args.d
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g) for _ in range(4))
    bias = None
    if args.case == "bias":
        bias = torch.randn(B, H, S, S, device=dev, dtype=dt, generator=g)
    elif args.case in ("topk", "perquery"):
        bias = torch.randn(B, H, 1, S, device=dev, dtype=dt, generator=g)
    leaves = [t.requires_grad_(not args.fwd) for t in (q, k, v) + ((bias,) if bias is not None else ())]

    def step():
        if args.case in ("topk", "perquery"):
            out = dmattn.attention_topk(q, k, v, bias, S // 4, causal=True, per_query=args.case == "perquery")
        else:
            out = dmattn.attention(q, k, v, bias=bias, causal=args.causal)
        if not args.fwd:
            torch.autograd.grad(out, leaves, dout)

    step()
    torch.cuda.synchronize()
    step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
