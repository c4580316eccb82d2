"""The kept-key problem of keep_kernels_timing.py and step_ab_timing.py: bf16, B=2, H=16, S=8192,
D=128, a per-key bias (B, H, 1, S), and the first KEEP = 2048 keys taken directly (contiguous
copies of k, v and the bias). Random inputs from one seeded CPU generator, so that every script
and build times the same values."""

import torch

B, H, S, D, KEEP = 2, 16, 8192, 128, 2048


def keep_inputs(device: str = "cuda"):
    """(q, k, v, dout, bias, k2, v2, bias2): q, k, v, dout (B, S, H, D), bias (B, H, 1, S), and
    k2, v2, bias2 their first KEEP keys; none requires grad (each script picks its leaves)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, torch.bfloat16)

    q, k, v, dout = (randn(B, S, H, D) for _ in range(4))
    bias = randn(B, H, 1, S)
    k2, v2, bias2 = k[:, :KEEP].contiguous(), v[:, :KEEP].contiguous(), bias[..., :KEEP].contiguous()
    return q, k, v, dout, bias, k2, v2, bias2
