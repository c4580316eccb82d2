"""Figures: docs/perf.md, the backward's other modes (deterministic, packed, long top-k).

Forward + backward times of the backward's other modes, on one CUDA GPU: deterministic mode
against the default one (dense, causal, full bias (B, H, S, S) with its gradient; and whether
deterministic gradients are bitwise equal over repeated runs), a packed batch of 4 x 4096
tokens with a key bias (H, total_k) and its gradient against the same tokens as a dense batch
with a bias (B, H, 1, S), and attention_topk at B=1, S=32768 (causal, top-2048 of a per-key bias,
selection included).

bf16, B=2, H=16, S=8192, D=128 unless named; every gradient; median of CUDA-event timings after
warm-up.
    python benchmarks/profiling/bwd_modes_timing.py [--iters 10] [--repeats 10]
"""

import argparse

import torch

import dmattn
from dmattn.bench import time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=10, help="deterministic runs compared bitwise")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    B, H, S, D = 2, 16, 8192, 128

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g).requires_grad_()

    def timed(fn):
        return time_ms(fn, "cuda", 3, args.iters)

    q, k, v = leaf(B, S, H, D), leaf(B, S, H, D), leaf(B, S, H, D)
    dout = torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g)
    full_bias = leaf(B, H, S, S)
    rows = [("dense", lambda det: dmattn.attention(q, k, v, deterministic=det), [q, k, v]),
            ("causal", lambda det: dmattn.attention(q, k, v, causal=True, deterministic=det), [q, k, v]),
            ("full bias + dbias", lambda det: dmattn.attention(q, k, v, bias=full_bias, deterministic=det),
             [q, k, v, full_bias])]
    for name, call, leaves in rows:
        t = [timed(lambda det=det: torch.autograd.grad(call(det), leaves, dout)) for det in (False, True)]
        print(f"{name}: default {t[0]:.3f} ms, deterministic {t[1]:.3f} ms ({t[1] / t[0]:.2f}x)", flush=True)
    first = torch.autograd.grad(dmattn.attention(q, k, v, causal=True, deterministic=True), [q, k, v], dout)
    same = all(all(torch.equal(a, b) for a, b in zip(first, torch.autograd.grad(
        dmattn.attention(q, k, v, causal=True, deterministic=True), [q, k, v], dout))) for _ in range(args.repeats))
    print(f"deterministic causal gradients bitwise equal over {args.repeats} runs: {same}", flush=True)
    del full_bias

    n, L = 4, 4096
    qp, kp, vp = leaf(n * L, H, D), leaf(n * L, H, D), leaf(n * L, H, D)
    key_bias = leaf(H, n * L)
    cu = torch.arange(0, (n + 1) * L, L, device=dev, dtype=torch.int32)
    dout_p = torch.randn(n * L, H, D, device=dev, dtype=dt, generator=g)
    t_packed = timed(lambda: torch.autograd.grad(dmattn.attention_varlen(qp, kp, vp, cu, cu, L, L, bias=key_bias),
                                                 [qp, kp, vp, key_bias], dout_p))
    qd, kd, vd = (x.detach().view(n, L, H, D).requires_grad_() for x in (qp, kp, vp))
    bias_d = key_bias.detach().view(H, n, L).permute(1, 0, 2).unsqueeze(2).contiguous().requires_grad_()
    t_dense = timed(lambda: torch.autograd.grad(dmattn.attention(qd, kd, vd, bias=bias_d), [qd, kd, vd, bias_d],
                                                dout_p.view(n, L, H, D)))
    print(f"packed {n} x {L}, key bias (H, total_k) + dbias: {t_packed:.3f} ms; the dense batch with a bias "
          f"(B, H, 1, S): {t_dense:.3f} ms ({t_packed / t_dense:.2f}x)", flush=True)

    S2 = 32768
    q2, k2, v2 = leaf(1, S2, H, D), leaf(1, S2, H, D), leaf(1, S2, H, D)
    bias2 = leaf(1, H, 1, S2)
    dout2 = torch.randn(1, S2, H, D, device=dev, dtype=dt, generator=g)
    t2 = timed(lambda: torch.autograd.grad(dmattn.attention_topk(q2, k2, v2, bias2, 2048, causal=True),
                                           [q2, k2, v2, bias2], dout2))
    print(f"attention_topk 2048, B=1, S={S2}, causal, with the selection: {t2:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
