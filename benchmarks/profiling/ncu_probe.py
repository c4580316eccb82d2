"""Figures: the Nsight Compute counts of docs/perf.md, "Biased and masked forward".

One forward + backward step of a chosen case, for Nsight Compute (ncu) on a GPU machine.

    ncu --clock-control none --set full -k regex:sm90 -c 2 -o OUT/case \
        python3 benchmarks/profiling/ncu_probe.py CASE [--s 4096 --b 1]

CASE: plain (no mask / bias), bias (dense (B,H,S,S) bf16 bias with gradient), topk
(attention_topk, per-key bias with gradient, keep = S / 4, causal), perquery (the same with
per_query=True: Doge's per-query causal top-k), gate (gated attention, logsigmoid, alpha and delta
(B,S,H) with gradients; docs/design.md's figures: --b 2 --s 8192 --causal, with ncu's
`--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats`
`-k regex:ws_kernel`). bf16, H=16, D=128 unless told (--h, --d);
--fwd profiles the forward alone; with the bias case, --bias-fp32 keeps the bias in fp32 and
--key-padding adds a key padding mask (B,1,1,S; the second sequence's last S / 5 keys); --window N
keeps each query's last N keys (window (N - 1, 0): the short rows whose query tiles' fixed cost
docs/design.md measures in "Windows with sinks in the warp-specialized kernels"). Random
inputs; one warm-up step (so that ncu's first captured launches are not the first ever), then
the profiled step.
"""

import argparse

import torch

import dmattn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["plain", "bias", "topk", "perquery", "gate"])
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--fwd", action="store_true", help="the forward alone (no gradients)")
    ap.add_argument("--bias-fp32", action="store_true", help="bias case: the bias in fp32")
    ap.add_argument("--key-padding", action="store_true", help="bias case: with a key padding mask")
    ap.add_argument("--window", type=int, default=0, help="each query's last N keys (with --causal)")
    args = ap.parse_args()
    B, S, H, D = args.b, args.s, args.h, args.d
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g) for _ in range(4))
    bias = None
    if args.case == "bias":
        bias = torch.randn(B, H, S, S, device=dev, dtype=torch.float32 if args.bias_fp32 else dt, generator=g)
    elif args.case in ("topk", "perquery"):
        bias = torch.randn(B, H, 1, S, device=dev, dtype=dt, generator=g)
    gate = None
    if args.case == "gate":
        gate = tuple(torch.randn(B, S, H, device=dev, dtype=dt, generator=g) for _ in range(2))
    mask = None
    if args.key_padding:
        lens = torch.tensor([S, S - S // 5] * B, device=dev)[:B]
        mask = (torch.arange(S, device=dev) < lens[:, None]).view(B, 1, 1, S)
    leaves = [t.requires_grad_(not args.fwd) for t in (q, k, v) + ((bias,) if bias is not None else ()) + (gate or ())]

    def step():
        if args.case in ("topk", "perquery"):
            out = dmattn.attention_topk(q, k, v, bias, S // 4, causal=True, per_query=args.case == "perquery")
        else:
            window = (args.window - 1, 0) if args.window > 0 else (-1, -1)
            out = dmattn.attention(q, k, v, mask, bias, causal=args.causal, gate=gate, window=window)
        if not args.fwd:
            torch.autograd.grad(out, leaves, dout)

    step()
    torch.cuda.synchronize()
    step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
