"""Figures: docs/design.md, builds against each other (the clamp; "CUDA backward").

Fwd+bwd times of the backward's headline rows, with SDPA cuDNN in the same process, for
comparing two builds of the library: run it once per build (each on its own PYTHONPATH), the
builds alternated, two rounds or more, on one GPU, one process after another.

    PYTHONPATH=/path/to/build_a/python python benchmarks/profiling/build_ab_timing.py a1
    PYTHONPATH=/path/to/build_b/python python benchmarks/profiling/build_ab_timing.py b1 [rows]

Rows (all, or the comma-separated names given): dense and causal at D=128 and D=64, dense and
causal at D=256 (H=8); bf16, B=2, H=16, S=8192;
gradients of q, k and v; median of CUDA-event timings (5 warm-up, 20 timed runs). One line per
row: the tag, dmattn's ms, cuDNN's ms and their ratio (cuDNN's time moves with the GPU's state as
dmattn's does, so the ratio is the figure to compare between processes).
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dmattn
from dmattn.bench import time_ms


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else "build"
    rows = (("dense", 128, 16, False), ("causal", 128, 16, True), ("dense_d64", 64, 16, False),
            ("causal_d64", 64, 16, True), ("dense_d256", 256, 8, False), ("causal_d256", 256, 8, True))
    if len(sys.argv) > 2:
        wanted = sys.argv[2].split(",")
        unknown = set(wanted) - {r[0] for r in rows}
        if unknown:
            sys.exit(f"unknown rows {sorted(unknown)}; rows: {', '.join(r[0] for r in rows)}")
        rows = tuple(r for r in rows if r[0] in wanted)
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    B, S = 2, 8192
    for name, D, H, causal in rows:
        q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g).requires_grad_() for _ in range(3))
        dout = torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g)
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))

        def step():
            return torch.autograd.grad(dmattn.attention(q, k, v, causal=causal), [q, k, v], dout)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return torch.autograd.grad(o, [qt, kt, vt], dout.transpose(1, 2))

        t, tc = time_ms(step, dev, 5, 20), time_ms(cudnn, dev, 5, 20)
        print(f"{tag} {name}: dmattn {t:.3f} cudnn {tc:.3f} ratio {t / tc:.3f}", flush=True)


if __name__ == "__main__":
    main()
