"""What one row of the benchmark is: its configuration (Config), its inputs (Inputs and
make_inputs: the same tensors for every provider) and its result (Row). The layer below the
suites, the providers and the runner, which all read these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..masks import dynamic_mask


@dataclass
class Config:
    name: str
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool = False
    bias: str = "none"        # "none" | "dense" (B,H,S,S) | "per_key" (B,H,1,S)
    keep: int = 0             # per_key only: top-k keys kept per (b, h), 0 = all
    heads_kv: int = 0         # 0 = heads
    dtype: str = "bfloat16"
    packed: bool = False      # dmattn only: the batch as one packed varlen batch (B sequences of S)
    variant: str = ""         # suite fsa: "gated" | "threshold" (flash-sparse-attn's sparse softmax)
                              # | "windows" (windows with sinks, fsa_window_sizes) | "gated_blocks"
                              # (gates that close blocks of keys, exact) | "gated_blocks_skip" (the
                              # same inputs, gate skipping at flash-sparse-attn's default threshold)
    suite: str = ""           # the --suite name that selects it
    series: str = ""          # configurations of one series are plotted as time vs seqlen

    @property
    def hkv(self) -> int:
        return self.heads_kv or self.heads

    def flops(self, backward: bool) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        f = f / 2 if self.causal else f
        return f * 3.5 if backward else f


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    dout: torch.Tensor
    alpha: Optional[torch.Tensor] = None    # variant "gated": (B, S, H) and (B, S, Hkv)
    delta: Optional[torch.Tensor] = None
    windows: Optional[torch.Tensor] = None  # variant "windows": dmattn's rows [sink, near, gap, far]

    def leaves(self) -> List[torch.Tensor]:
        """The tensors a step differentiates, in the order of its gradients."""
        return [t for t in (self.q, self.k, self.v, self.bias, self.alpha, self.delta) if t is not None]


@dataclass
class Row:
    config: str
    provider: str
    fwd_ms: float = math.nan
    fwdbwd_ms: float = math.nan
    fwd_b2b_ms: float = math.nan  # (calls issued back to back: the host's time hidden)
    fwdbwd_b2b_ms: float = math.nan
    fwd_tflops: float = math.nan
    fwdbwd_tflops: float = math.nan
    peak_mem_gib: float = math.nan
    check: str = ""
    note: str = ""


def closing_gates(cfg: Config, device: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """A logsigmoid gate that closes about half of the key blocks of 128 (per batch and kv head):
    alpha in [0.5, 2.5], delta ~ N(0, 1) lowered by 300 on the closed blocks, where the gate is
    then far below every open block's (products of -150 and less). Seeded: the same blocks in
    every row of the suite."""
    g = torch.Generator().manual_seed(7)
    dtype = getattr(torch, cfg.dtype)
    alpha = torch.rand(cfg.batch, cfg.seqlen, cfg.heads, generator=g) * 2 + 0.5
    blocks = -(-cfg.seqlen // 128)
    closed = (torch.rand(cfg.batch, blocks, cfg.hkv, generator=g) < 0.5).repeat_interleave(128, 1)[:, :cfg.seqlen]
    delta = torch.randn(cfg.batch, cfg.seqlen, cfg.hkv, generator=g) - 300.0 * closed
    return alpha.to(dtype).to(device), delta.to(dtype).to(device)


def fsa_window_sizes(seqlen: int) -> Tuple[int, int, int, int]:
    """The fsa suite's windows in flash-sparse-attn's convention (sink, left, right, near): at
    S=8192 sink 128, left 1024 (the distant band), right 2048 (the gap before it), near 1024;
    the same fractions of S at other lengths."""
    return seqlen // 64, seqlen // 8, seqlen // 4, seqlen // 8


def make_inputs(cfg: Config, device: str, seed: int = 0) -> Inputs:
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q = randn(cfg.batch, cfg.seqlen, cfg.heads, cfg.head_dim)
    k = randn(cfg.batch, cfg.seqlen, cfg.hkv, cfg.head_dim)
    v = randn(cfg.batch, cfg.seqlen, cfg.hkv, cfg.head_dim)
    dout = randn(cfg.batch, cfg.seqlen, cfg.heads, cfg.head_dim)
    mask = bias = None
    if cfg.bias == "dense":
        bias = randn(cfg.batch, cfg.heads, cfg.seqlen, cfg.seqlen)
    elif cfg.bias == "per_key":
        bias = randn(cfg.batch, cfg.heads, 1, cfg.seqlen)
        if 0 < cfg.keep < cfg.seqlen:
            # Doge-style selection: the top-`keep` keys by (detached) bias, one set per (b, h),
            # for the peers and the reference (dmattn's rows select inside the timed call, with
            # the same tie rule, so they attend to the same keys).
            mask = dynamic_mask(bias, cfg.keep)
    alpha = delta = windows = None
    if cfg.variant == "gated":
        alpha, delta = randn(cfg.batch, cfg.seqlen, cfg.heads), randn(cfg.batch, cfg.seqlen, cfg.hkv)
    elif cfg.variant.startswith("gated_blocks"):
        alpha, delta = closing_gates(cfg, device)
    elif cfg.variant == "windows":
        sink, left, right, near = fsa_window_sizes(cfg.seqlen)
        windows = torch.tensor([[sink, near, right, left]] * cfg.hkv, dtype=torch.int32, device=device)
    for t in (q, k, v, bias, alpha, delta):
        if t is not None:
            t.requires_grad_(True)
    return Inputs(q, k, v, mask, bias, dout, alpha, delta, windows)
