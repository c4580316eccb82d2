"""A small Doge-style attention layer on dmattn, and a tiny training loop.

Doge ("dynamic mask attention") computes a per-key bias from the values, keeps only the
`keep` keys with the largest bias (one shared key set per batch and head), and adds the same
bias to the scores, so the bias is learned through the attention's gradient while the
selection itself stays non-differentiable:

    bias = A * softplus(dt_proj(v))          (B, H, 1, S), learnable A and dt_proj
    mask = dmattn.dynamic_mask(bias, keep)   (B, H, 1, S), no (B, H, S, S) tensor
    out  = dmattn.attention(q, k, v, mask, bias, causal=True)

Run it: python examples/doge_attention.py  (CPU, fp32, a few seconds).
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

import dmattn


class DogeAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, keep: int):
        super().__init__()
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise ValueError("hidden_size % num_heads and num_heads % num_kv_heads must be 0")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.keep = keep
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        # The dynamic bias: one value per (query head, key), from that key's values.
        self.dt_proj = nn.Linear(num_kv_heads * self.head_dim, num_heads)
        # Doge's reference code uses exp(A * softplus(.)) with A = 0 at init; a linear A = 1
        # keeps the bias O(1) and lets dt_proj learn from the first step.
        self.A = nn.Parameter(torch.ones(num_heads))

    def dynamic_bias(self, v: torch.Tensor) -> torch.Tensor:
        """v (B, S, Hkv, D) -> bias (B, H, 1, S)."""
        dt = self.dt_proj(v.flatten(2))                      # (B, S, H)
        bias = self.A * F.softplus(dt)
        return bias.transpose(1, 2).unsqueeze(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        bias = self.dynamic_bias(v)
        mask = dmattn.dynamic_mask(bias, self.keep)
        # Causal applies after the selection: a query whose kept keys all lie in its future
        # attends to nothing and outputs 0 (dmattn's empty-row rule), as in Doge.
        out = dmattn.attention(q, k, v, mask, bias, causal=True)
        return self.o_proj(out.reshape(b, s, -1))


def causal_mean_task(batch: int, seq: int, hidden: int, generator: torch.Generator):
    """Inputs and targets of a toy sequence task: y_t = mean of x_0..x_t (needs attention)."""
    x = torch.randn(batch, seq, hidden, generator=generator)
    y = x.cumsum(1) / torch.arange(1, seq + 1).view(1, seq, 1)
    return x, y


def train(model: nn.Module, steps: int = 20, batch: int = 4, seq: int = 32, lr: float = 1e-2,
          seed: int = 0) -> List[float]:
    """Adam on one fixed batch of causal_mean_task (so the loss curve is not dominated by
    batch-to-batch noise), on the model's device and dtype; returns every step's loss."""
    gen = torch.Generator().manual_seed(seed)
    weight = model.q_proj.weight
    x, y = (t.to(weight) for t in causal_mean_task(batch, seq, model.q_proj.in_features, gen))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    torch.manual_seed(0)
    layer = DogeAttention(hidden_size=64, num_heads=4, num_kv_heads=2, keep=16)
    losses = train(layer, steps=50, seq=64)
    print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
