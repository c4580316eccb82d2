"""Figures: docs/perf.md, "Gated attention and windows with sinks" (the gate's forward and
backward alone, dmattn only; the peers' rows come from `python -m dmattn.bench --suite fsa`).

Forward and forward + backward timings of gated attention (logsigmoid, causal and not; linear,
causal) beside dense causal attention of the same shape, so that the gate's own cost reads
directly; and the gate's gradients against the float64 CPU backend on a slice of the problem
(the run's check that a build's gate math is right before its times count).

bf16, B=2, H=16, S=8192, D=128 unless told; alpha (B, S, H) and delta (B, S, H) random with
|alpha * delta| up to ~8 (both saturated and linear parts of logsigmoid); every gradient (q, k, v,
alpha, delta); median of CUDA-event timings after warm-up. The last row asks for gate skipping
at flash-sparse-attn's default threshold (1 / S), which these gates meet nowhere: nothing is
skipped, so it reads what skipping costs beside exact mode.
    python benchmarks/profiling/gate_timing.py [--iters 10] [-S 8192] [--d 128]
"""

import argparse

import torch

import dmattn
from dmattn.bench import time_ms as bench_time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("-S", type=int, default=8192)
    ap.add_argument("--d", type=int, default=128)
    args = ap.parse_args()
    B, H, S, D = 2, 16, args.S, args.d
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, dtype=dt, generator=g) * scale).requires_grad_()

    q, k, v = leaf(B, S, H, D), leaf(B, S, H, D), leaf(B, S, H, D)
    alpha, delta = leaf(B, S, H, scale=2.0), leaf(B, S, H, scale=2.0)
    dout = torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g)
    flop_fwd = 4 * B * H * S * S * D

    rows = [
        ("dense causal", dict(causal=True), (q, k, v), 0.5),
        ("gated logsigmoid causal", dict(causal=True, gate=(alpha, delta)), (q, k, v, alpha, delta), 0.5),
        ("gated logsigmoid", dict(gate=(alpha, delta)), (q, k, v, alpha, delta), 1.0),
        ("gated linear causal", dict(causal=True, gate=(alpha, delta), gate_fn="linear"), (q, k, v, alpha, delta), 0.5),
        # Gate skipping at flash-sparse-attn's default threshold on these gates, which close no
        # cell: what skipping costs where it skips nothing (the cells' kernel, the variants).
        ("gated causal, 1/S threshold", dict(causal=True, gate=(alpha, delta), gate_threshold=1.0 / S),
         (q, k, v, alpha, delta), 0.5),
    ]
    print(f"bf16 B={B} H={H} S={S} D={D}; {torch.cuda.get_device_name()}")
    print(f"{'row':<28} {'fwd ms':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for name, kw, leaves, frac in rows:
        fwd = bench_time_ms(lambda: dmattn.attention(q, k, v, **kw), "cuda", 3, args.iters)
        step = bench_time_ms(lambda: torch.autograd.grad(dmattn.attention(q, k, v, **kw), leaves, dout), "cuda", 3,
                             args.iters)
        print(f"{name:<28} {fwd:8.3f} {step:11.3f} {3.5 * flop_fwd * frac / step / 1e9:8.1f}", flush=True)

    # The gate's gradients against the float64 CPU backend (itself tested against the float64
    # reference) on the first 1024 positions of one batch element and two heads.
    n = 1024
    part = [t.detach()[0:1, :n, 0:2] for t in (q, k, v, alpha, delta, dout)]
    cpu = [t.double().cpu().requires_grad_() for t in part[:5]]
    ref = torch.autograd.grad(dmattn.attention(*cpu[:3], causal=True, gate=(cpu[3], cpu[4])), cpu[3:],
                              part[5].double().cpu())
    gpu = [t.clone().requires_grad_() for t in part[:5]]
    got = torch.autograd.grad(dmattn.attention(*gpu[:3], causal=True, gate=(gpu[3], gpu[4])), gpu[3:], part[5])
    for name, r, x in zip(("dalpha", "ddelta"), ref, got):
        err = (x.double().cpu() - r).abs().max().item()
        print(f"{name}: max |err| {err:.3e} (max |ref| {r.abs().max().item():.3e})")


if __name__ == "__main__":
    main()
