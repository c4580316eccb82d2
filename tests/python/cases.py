"""Random problem generation shared by the tests (a case = inputs + options of one call)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
from torch import Tensor

import dmattn
from reference import allowed_window, check_against_reference, expand_operand

CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
GPU_DTYPES = [torch.float16, torch.bfloat16]


def seq_tensor(shape, dtype, device, gen: torch.Generator, layout: str = "contiguous") -> Tensor:
    """A (B, S, H, D) tensor, randn, with the requested memory layout.

    contiguous | bhsd (a (B, H, S, D) buffer transposed) | padded (head_dim padded, sliced)
    | strided_last (last dim stride 2: the API must copy it) | expanded_batch (batch stride 0)
    """
    b, s, h, d = shape
    if layout == "bhsd":
        x = torch.randn(b, h, s, d, generator=gen, dtype=torch.float32).to(dtype).transpose(1, 2)
    elif layout == "padded":
        x = torch.randn(b, s, h, d + 3, generator=gen, dtype=torch.float32).to(dtype)[..., 1:d + 1]
    elif layout == "strided_last":
        x = torch.randn(b, s, h, 2 * d, generator=gen, dtype=torch.float32).to(dtype)[..., ::2]
    elif layout == "expanded_batch":
        x = torch.randn(1, s, h, d, generator=gen, dtype=torch.float32).to(dtype).expand(b, s, h, d)
    else:
        x = torch.randn(b, s, h, d, generator=gen, dtype=torch.float32).to(dtype)
    x = x.to(device)
    assert tuple(x.shape) == (b, s, h, d)
    return x


def broadcast_shape(rng: random.Random, b, h, hkv, sq, sk, *, key_one_ok=True) -> Tuple[int, ...]:
    """A random shape obeying the mask/bias rule, rank 2, 3 or 4 (right-aligned)."""
    dims = [rng.choice([1, b]), rng.choice([1, hkv, h]), rng.choice([1, sq]),
            rng.choice([1, sk] if key_one_ok else [sk, sk, sk, 1])]
    rank = rng.choice([2, 3, 4, 4])
    # Leading dims dropped by a lower rank must be 1.
    for i in range(4 - rank):
        dims[i] = 1
    return tuple(dims[4 - rank:])


@dataclass
class Case:
    dtype: torch.dtype
    b: int
    sq: int
    sk: int
    h: int
    hkv: int
    d: int
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    scale: Optional[float] = None
    softcap: float = 0.0
    mask_shape: Optional[Tuple[int, ...]] = None
    mask_density: float = 0.8
    bias_shape: Optional[Tuple[int, ...]] = None
    bias_dtype: Optional[torch.dtype] = None
    bias_scale: float = 1.0
    bias_neg_inf: float = 0.0      # fraction of bias entries set to -inf
    bias_finfo_min: float = 0.0    # fraction set to finfo(bias dtype).min
    bias_grad: bool = False
    bias_layout: str = "contiguous"  # contiguous | expanded | transposed
    layouts: Tuple[str, str, str] = ("contiguous", "contiguous", "contiguous")
    seed: int = 0
    notes: dict = field(default_factory=dict)

    def short(self) -> str:
        s = (f"dtype={str(self.dtype).replace('torch.', '')} B={self.b} Sq={self.sq} Sk={self.sk} "
             f"H={self.h} Hkv={self.hkv} D={self.d} causal={self.causal} window={self.window} "
             f"scale={self.scale} softcap={self.softcap}")
        if self.mask_shape is not None:
            s += f" mask={self.mask_shape}@{self.mask_density:.2f}"
        if self.bias_shape is not None:
            s += (f" bias={self.bias_shape}:{str(self.bias_dtype).replace('torch.', '')}"
                  f" x{self.bias_scale:.2f} grad={self.bias_grad} layout={self.bias_layout}"
                  f" -inf={self.bias_neg_inf:.2f} min={self.bias_finfo_min:.2f}")
        if any(lay != "contiguous" for lay in self.layouts):
            s += f" layouts={self.layouts}"
        if self.notes:
            s += f" notes={self.notes}"
        return s + f" seed={self.seed}"


def random_case(seed: int, device: str = "cpu") -> Case:
    rng = random.Random(seed)
    dtype = rng.choice(CPU_DTYPES if device == "cpu" else GPU_DTYPES)
    sizes = [0, 1, 1, 2, 3, 5, 7, 8, 9, 13, 16, 17, 24, 31, 32, 33, 47, 64, 65, 80]
    sq, sk = rng.choice(sizes), rng.choice(sizes)
    if rng.random() < 0.35:
        sk = sq
    b = rng.choice([1, 1, 2, 2, 3]) if rng.random() > 0.02 else 0
    hkv = rng.choice([1, 1, 2, 3])
    h = hkv * rng.choice([1, 1, 2, 3, 4])
    if device == "cpu":
        d = rng.choice([1, 3, 5, 8, 12, 16, 24, 31, 32, 33, 40, 64, 72, 80, 96, 128, 160, 256])
    else:
        d = rng.choice([8, 16, 32, 40, 64, 72, 80, 96, 128, 160, 192, 256])
    if d >= 160 and sq * sk > 1024:  # keep the suite fast
        sq, sk = min(sq, 24), min(sk, 24)
    c = Case(dtype, b, sq, sk, h, hkv, d, seed=seed)
    c.causal = rng.random() < 0.3
    if rng.random() < 0.3:
        c.window = (rng.choice([-1, 0, 1, 2, 5, 16]), rng.choice([-1, 0, 1, 3, 8]))
    if rng.random() < 0.3:
        c.scale = rng.choice([0.05, 0.1, 0.3, 0.7, 1.0, 2.0])
    if rng.random() < 0.2:
        c.softcap = rng.choice([1.0, 5.0, 20.0, 50.0])
    if rng.random() < 0.55:
        c.mask_shape = broadcast_shape(rng, b, h, hkv, sq, sk)
        c.mask_density = rng.choice([0.1, 0.5, 0.8, 0.95, 1.0])
    if rng.random() < 0.6:
        c.bias_shape = broadcast_shape(rng, b, h, hkv, sq, sk)
        c.bias_dtype = rng.choice([dtype, torch.float32])
        c.bias_scale = rng.choice([0.5, 1.0, 3.0])
        c.bias_grad = rng.random() < 0.7
        c.bias_layout = rng.choice(["contiguous"] * 4 + ["expanded", "transposed"])
        if rng.random() < 0.15:
            c.bias_neg_inf = rng.choice([0.1, 0.5])
        if rng.random() < 0.1:
            c.bias_finfo_min = rng.choice([0.1, 0.5])
    if rng.random() < 0.3:
        c.layouts = tuple(rng.choice(["contiguous", "bhsd", "padded", "strided_last", "expanded_batch"])
                          for _ in range(3))
    return c


@dataclass
class Inputs:
    q: Tensor
    k: Tensor
    v: Tensor
    mask: Optional[Tensor]
    bias_leaf: Optional[Tensor]   # what the reference sees and what receives .grad
    bias_arg: Optional[Tensor]    # what dmattn sees (may be a view of bias_leaf)
    dout: Tensor


def make_inputs(c: Case, device: str) -> Inputs:
    gen = torch.Generator().manual_seed(c.seed * 7919 + 1)
    q = seq_tensor((c.b, c.sq, c.h, c.d), c.dtype, device, gen, c.layouts[0])
    k = seq_tensor((c.b, c.sk, c.hkv, c.d), c.dtype, device, gen, c.layouts[1])
    v = seq_tensor((c.b, c.sk, c.hkv, c.d), c.dtype, device, gen, c.layouts[2])
    mask = None
    if c.mask_shape is not None:
        mask = (torch.rand(c.mask_shape, generator=gen) < c.mask_density).to(device)
    bias_leaf = bias_arg = None
    if c.bias_shape is not None:
        shape = c.bias_shape
        bd = c.bias_dtype
        if c.bias_layout == "expanded":
            small = tuple(1 if i % 2 == 0 else s for i, s in enumerate(shape))
            base = torch.randn(small, generator=gen) * c.bias_scale
        else:
            base = torch.randn(shape, generator=gen) * c.bias_scale
        u = torch.rand(base.shape, generator=gen)
        base = base.to(bd)
        if c.bias_neg_inf:
            base = base.masked_fill(u < c.bias_neg_inf, float("-inf"))
        if c.bias_finfo_min:
            base = base.masked_fill((u >= 1 - c.bias_finfo_min), torch.finfo(bd).min)
        if c.bias_layout == "transposed" and len(shape) >= 2:
            base = base.transpose(-1, -2).contiguous().transpose(-1, -2)
        bias_leaf = base.to(device).requires_grad_(c.bias_grad)
        bias_arg = bias_leaf.expand(shape) if c.bias_layout == "expanded" else bias_leaf
    if bias_leaf is not None and c.bias_finfo_min:
        bias_leaf, bias_arg = _avoid_all_min_rows(c, mask, bias_leaf, bias_arg)
    dout = torch.randn(c.b, c.sq, c.h, c.d, generator=gen).to(c.dtype).to(device)
    return Inputs(q, k, v, mask, bias_leaf, bias_arg, dout)


def _avoid_all_min_rows(c: Case, mask, bias_leaf, bias_arg):
    """A row whose every allowed key has a bias of ~finfo.min is ill-conditioned in any floating
    point format (c + x_j rounds to c, the x_j are lost), so the random cases avoid it: when
    one occurs, the finfo.min entries become -inf instead. test_edge_cases covers such rows."""
    big = torch.finfo(c.bias_dtype).min / 2
    bias4 = expand_operand(bias_arg.detach().cpu(), c.b, c.h, c.hkv, c.sq, c.sk)
    allowed = allowed_window(c.sq, c.sk, c.causal, c.window).expand(c.b, c.h, c.sq, c.sk)
    if mask is not None:
        allowed = allowed & expand_operand(mask.cpu(), c.b, c.h, c.hkv, c.sq, c.sk)
    allowed = allowed & (bias4 != float("-inf"))
    normal = allowed & (bias4 > big)
    if not (allowed.any(-1) & ~normal.any(-1)).any():
        return bias_leaf, bias_arg
    c.notes["finfo_min_to_neg_inf"] = True
    with torch.no_grad():
        fixed = bias_leaf.detach().masked_fill(bias_leaf.detach() <= big, float("-inf"))
    leaf = fixed.requires_grad_(c.bias_grad)
    return leaf, (leaf.expand(bias_arg.shape) if c.bias_layout == "expanded" else leaf)


def run_dmattn(c: Case, x: Inputs, backward: bool = True, deterministic: bool = False):
    """dmattn.attention on the inputs; returns (out, lse, grads or None)."""
    q = x.q.detach().requires_grad_(backward)
    k = x.k.detach().requires_grad_(backward)
    v = x.v.detach().requires_grad_(backward)
    if x.bias_leaf is not None and x.bias_leaf.grad is not None:
        x.bias_leaf.grad = None
    out, lse = dmattn.attention(q, k, v, x.mask, x.bias_arg, causal=c.causal, window=c.window,
                                scale=c.scale, softcap=c.softcap, deterministic=deterministic,
                                return_lse=True)
    grads = None
    if backward:
        out.backward(x.dout)
        grads = {"q": q.grad, "k": k.grad, "v": v.grad}
        if c.bias_grad and x.bias_leaf is not None:
            grads["bias"] = x.bias_leaf.grad
    return out.detach(), lse.detach(), grads


def check_case(c: Case, device: str, backward: bool = True, deterministic: bool = False) -> None:
    x = make_inputs(c, device)
    out, lse, grads = run_dmattn(c, x, backward, deterministic)
    if grads is not None:
        for n in ("q", "k", "v"):
            if grads[n] is None:  # autograd gives None only when nothing flows (empty out)
                src = getattr(x, n)
                assert out.numel() == 0, f"d{n} is None for {c.short()}"
                grads[n] = torch.zeros_like(src)
        if "bias" in grads and grads["bias"] is None:
            assert out.numel() == 0, f"dbias is None for {c.short()}"
            grads["bias"] = torch.zeros_like(x.bias_leaf)
    check_against_reference(x.q, x.k, x.v, x.mask, x.bias_leaf, out, lse, grads,
                            causal=c.causal, window=c.window, scale=c.scale, softcap=c.softcap,
                            dout=x.dout, context=f"[{c.short()}]")


def run_attention_backward(q, k, v, mask=None, bias=None, dout=None, **kw):
    """dmattn.attention forward + backward with `dout` (random if None); returns detached
    (out, lse, dout). Gradients land in the leaves' .grad (see leaf_grads)."""
    out, lse = dmattn.attention(q, k, v, mask, bias, return_lse=True, **kw)
    if dout is None:
        dout = torch.randn_like(out)
    out.backward(dout)
    return out.detach(), lse.detach(), dout


def leaf_grads(q, k, v, bias=None):
    """The .grad of q, k, v (and of bias when it requires grad), by name."""
    g = {"q": q.grad, "k": k.grad, "v": v.grad}
    if bias is not None and bias.requires_grad:
        g["bias"] = bias.grad
    return g
