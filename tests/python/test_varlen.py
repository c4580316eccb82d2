"""Packed variable-length batches: dmattn.attention_varlen and the dmattn::fwd_varlen /
dmattn::bwd_varlen ops, on the CPU and (gpu marker) CUDA backends.

Every case is checked twice, forward and backward:
  * against dmattn.attention run sequence by sequence on the slices of the packed tensors
    (the key-side mask/bias of sequence b viewed as a (1, Hb, 1, len_k) dense operand). The
    CPU backend runs the very same dense code per sequence, so its results must be bitwise
    identical -- any offset, stride or padding mistake shows up exactly. The CUDA kernels run
    each sequence's tiles exactly as the dense launch does, so out and lse must be bitwise
    identical too; the gradients go through fp32 atomics (dq, a dbias shared by kv heads)
    whose order differs between the two launches, so they are compared with a tolerance;
  * against the float64 reference (reference.py), sequence by sequence, with the suite's
    tolerance rule.
Every output and scratch buffer the ops allocate is NaN-poisoned first (``nan_poison``).
On CUDA each functional case runs with both backward paths (DMATTN_BWD_EXACT=0: Delta from
rowsum(dO * O) and dq atomics; =1: the exact three-pass path), which the packed and the dense
calls then share. CUDA needs float16/bfloat16 and head dims that are multiples of 8:
``for_device`` maps the CPU cases onto that.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
from dataclasses import dataclass
from typing import List, Optional, Tuple

import pytest
import torch

import dmattn
from cases import CPU_DTYPES, GPU_DTYPES
from reference import assert_finite, check_against_reference


@pytest.fixture
def device(device_bwd_path):
    """This module's `device`: each CUDA backward path as its own variant (conftest.py). Forcing
    one makes the packed and the dense calls share it (the automatic choice looks at the problem
    size, which differs between them)."""
    return device_bwd_path


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


@dataclass
class VarlenCase:
    dtype: torch.dtype
    lens_q: List[int]
    lens_k: List[int]
    h: int
    hkv: int
    d: int
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    scale: Optional[float] = None
    softcap: float = 0.0
    mask_heads: Optional[int] = None  # Hb of the key-side mask; None = no mask
    bias_heads: Optional[int] = None  # Hb of the key-side bias; None = no bias
    bias_dtype: Optional[torch.dtype] = None
    bias_grad: bool = True
    max_slack: int = 0  # max_seqlen = longest sequence + max_slack
    deterministic: bool = False
    seed: int = 0
    # The key-side mask of padded sequences: false in the first and last eighth of each
    # sequence's keys (every third sequence: all false), random between (more than half of the
    # keys kept: the dense call of a sequence stays off the gather path).
    mask_padding: bool = False

    def short(self) -> str:
        return (f"dtype={str(self.dtype).replace('torch.', '')} lens_q={self.lens_q} "
                f"lens_k={self.lens_k} H={self.h} Hkv={self.hkv} D={self.d} causal={self.causal} "
                f"window={self.window} scale={self.scale} softcap={self.softcap} "
                f"mask_Hb={self.mask_heads} bias_Hb={self.bias_heads}:{self.bias_dtype} "
                f"grad={self.bias_grad} slack={self.max_slack} det={self.deterministic} "
                f"seed={self.seed} padding={self.mask_padding}")


def for_device(c: VarlenCase, device: str) -> VarlenCase:
    """The case itself on the CPU; on CUDA with what the kernels take: float16/bfloat16 (the
    float32/float64 inputs become bfloat16, a float64 bias float32) and a head dim rounded up
    to a multiple of 8."""
    if device != "cuda":
        return c
    dtype = c.dtype if c.dtype in GPU_DTYPES else torch.bfloat16
    bias_dtype = c.bias_dtype
    if bias_dtype is not None and bias_dtype not in (dtype, torch.float32):
        bias_dtype = torch.float32
    return dataclasses.replace(c, dtype=dtype, bias_dtype=bias_dtype, d=max(8, -(-c.d // 8) * 8))


def random_varlen_case(seed: int, device: str = "cpu") -> VarlenCase:
    if device == "cuda":
        return random_cuda_case(seed)
    rng = random.Random(seed)
    b = rng.choice([1, 2, 3, 4, 5])
    small = [0, 1, 1, 2, 3, 5, 7, 9, 13, 17, 31, 33]
    tile_edges = [63, 64, 65, 100]  # around the CPU tile size 64

    def length():
        return rng.choice(tile_edges) if rng.random() < 0.12 else rng.choice(small)

    lens_q = [length() for _ in range(b)]
    lens_k = list(lens_q) if rng.random() < 0.4 else [length() for _ in range(b)]
    hkv = rng.choice([1, 1, 2, 3])
    h = hkv * rng.choice([1, 2, 3])
    c = VarlenCase(rng.choice(CPU_DTYPES), lens_q, lens_k, h, hkv, rng.choice([1, 3, 8, 16, 33, 64]),
                   seed=seed)
    c.causal = rng.random() < 0.4
    if rng.random() < 0.3:
        c.window = (rng.choice([-1, 0, 1, 4, 16]), rng.choice([-1, 0, 2, 8]))
    if rng.random() < 0.2:
        c.scale = rng.choice([0.1, 0.5, 2.0])
    if rng.random() < 0.15:
        c.softcap = rng.choice([2.0, 20.0])
    if rng.random() < 0.5:
        c.mask_heads = rng.choice([1, hkv, h])
    if rng.random() < 0.6:
        c.bias_heads = rng.choice([1, hkv, h])
        c.bias_dtype = rng.choice([c.dtype, torch.float32])
        c.bias_grad = rng.random() < 0.8
    c.max_slack = rng.choice([0, 0, 3])
    return c


def random_cuda_case(seed: int) -> VarlenCase:
    """Lengths around the CUDA tiles (64 and 128 rows), GPU dtypes and head dims."""
    rng = random.Random(10_000 + seed)
    b = rng.choice([1, 2, 3, 4, 6])
    lengths = [0, 1, 2, 7, 31, 63, 64, 65, 100, 127, 128, 129, 191, 255, 257, 300]
    lens_q = [rng.choice(lengths) for _ in range(b)]
    lens_k = list(lens_q) if rng.random() < 0.5 else [rng.choice(lengths) for _ in range(b)]
    hkv = rng.choice([1, 2, 3])
    h = hkv * rng.choice([1, 2, 4])
    c = VarlenCase(rng.choice(GPU_DTYPES), lens_q, lens_k, h, hkv, rng.choice([32, 64, 64, 80, 128, 128]),
                   seed=seed)
    c.causal = rng.random() < 0.4
    if rng.random() < 0.3:
        c.window = (rng.choice([-1, 0, 5, 70, 200]), rng.choice([-1, 0, 3, 64]))
    if rng.random() < 0.2:
        c.scale = rng.choice([0.05, 0.3])
    if rng.random() < 0.15:
        c.softcap = rng.choice([5.0, 30.0])
    if rng.random() < 0.5:
        c.mask_heads = rng.choice([1, hkv, h])
    if rng.random() < 0.7:
        c.bias_heads = rng.choice([1, hkv, h])
        c.bias_dtype = rng.choice([c.dtype, torch.float32])
        c.bias_grad = rng.random() < 0.85
    c.max_slack = rng.choice([0, 0, 5, 64])
    c.deterministic = rng.random() < 0.25
    return c


def cu_seqlens(lengths: List[int], device) -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


@dataclass
class VarlenInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    mask: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    dout: torch.Tensor

    def query_rows(self, b: int) -> slice:
        return slice(int(self.cu_q[b]), int(self.cu_q[b + 1]))

    def key_rows(self, b: int) -> slice:
        return slice(int(self.cu_k[b]), int(self.cu_k[b + 1]))


def make_varlen_inputs(c: VarlenCase, device: str) -> VarlenInputs:
    gen = torch.Generator().manual_seed(c.seed * 7919 + 5)
    total_q, total_k = sum(c.lens_q), sum(c.lens_k)
    q = torch.randn(total_q, c.h, c.d, generator=gen).to(c.dtype).to(device)
    k = torch.randn(total_k, c.hkv, c.d, generator=gen).to(c.dtype).to(device)
    v = torch.randn(total_k, c.hkv, c.d, generator=gen).to(c.dtype).to(device)
    mask = bias = None
    if c.mask_heads is not None:
        mask = torch.rand(c.mask_heads, total_k, generator=gen) < 0.8
        if c.mask_padding:
            for b, (k0, n) in enumerate(zip([0] + list(itertools.accumulate(c.lens_k)), c.lens_k)):
                mask[:, k0:k0 + n // 8] = False
                mask[:, k0 + n - n // 8:k0 + n] = False
                if b % 3 == 2:
                    mask[:, k0:k0 + n] = False
        mask = mask.to(device)
    if c.bias_heads is not None:
        bias = (1.5 * torch.randn(c.bias_heads, total_k, generator=gen)).to(c.bias_dtype).to(device)
    dout = torch.randn(total_q, c.h, c.d, generator=gen).to(c.dtype).to(device)
    max_q = max(c.lens_q, default=0) + c.max_slack
    max_k = max(c.lens_k, default=0) + c.max_slack
    return VarlenInputs(q, k, v, cu_seqlens(c.lens_q, device), cu_seqlens(c.lens_k, device),
                        max_q, max_k, mask, bias, dout)


# ---------------------------------------------------------------------------------------------
# Running a case: packed, and dense sequence by sequence
# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    out: torch.Tensor
    lse: torch.Tensor
    grads: dict  # "q", "k", "v", and "bias" when the bias requires grad


def _leaves(c: VarlenCase, x: VarlenInputs):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (x.q, x.k, x.v))
    bias = None
    if x.bias is not None:
        bias = x.bias.detach().clone().requires_grad_(c.bias_grad)
    return q, k, v, bias


def _grads_of(c: VarlenCase, out, dout, q, k, v, bias) -> dict:
    leaves = [q, k, v] + ([bias] if bias is not None and c.bias_grad else [])
    if out.requires_grad:
        grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    else:  # nothing to differentiate (no sequence at all)
        grads = [None] * len(leaves)
    # autograd gives None only when nothing flows (an empty batch).
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    return dict(zip(["q", "k", "v", "bias"], grads))


def run_varlen(c: VarlenCase, x: VarlenInputs) -> Result:
    q, k, v, bias = _leaves(c, x)
    out, lse = dmattn.attention_varlen(q, k, v, x.cu_q, x.cu_k, x.max_q, x.max_k, x.mask, bias,
                                       causal=c.causal, window=c.window, scale=c.scale,
                                       softcap=c.softcap, deterministic=c.deterministic,
                                       return_lse=True)
    return Result(out.detach(), lse, _grads_of(c, out, x.dout, q, k, v, bias))


def key_side_as_dense(t: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    """The (1, Hb, 1, len_k) dense operand of one sequence's keys."""
    return None if t is None else t[:, rows].unsqueeze(0).unsqueeze(2)


def run_dense_per_sequence(c: VarlenCase, x: VarlenInputs) -> Result:
    q, k, v, bias = _leaves(c, x)
    outs, lses = [], []
    for b in range(len(c.lens_q)):
        qr, kr = x.query_rows(b), x.key_rows(b)
        out, lse = dmattn.attention(q[qr].unsqueeze(0), k[kr].unsqueeze(0), v[kr].unsqueeze(0),
                                    key_side_as_dense(x.mask, kr), key_side_as_dense(bias, kr),
                                    causal=c.causal, window=c.window, scale=c.scale,
                                    softcap=c.softcap, deterministic=c.deterministic,
                                    return_lse=True)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:
        return Result(q.new_empty(q.shape).detach(), None, _grads_of(c, q[:0], x.dout, q, k, v, bias))
    out = torch.cat(outs, 0)
    return Result(out.detach(), torch.cat(lses, 1), _grads_of(c, out, x.dout, q, k, v, bias))


def assert_bitwise_equal(name: str, got: torch.Tensor, expected: torch.Tensor, context: str) -> None:
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)} [{context}]"
    assert got.dtype == expected.dtype, f"{name}: dtype {got.dtype} != {expected.dtype} [{context}]"
    same = (got == expected) | (torch.isnan(got) & torch.isnan(expected))
    assert same.all(), (f"{name}: differs from dmattn.attention per sequence at "
                        f"{(~same).nonzero()[:4].tolist()} [{context}]")


def assert_close_to_dense(name: str, got: torch.Tensor, expected: torch.Tensor, context: str) -> None:
    """CUDA gradients vs the dense path: the same kernels, fp32 atomics in another order; the
    results differ by a few roundings of the 16-bit output at most."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, f"{name}: [{context}]"
    if got.numel() == 0:
        return
    scale = expected.abs().max().item()
    err = (got.double() - expected.double()).abs().max().item()
    assert err <= 1e-2 * scale + 1e-6, (f"{name}: max |varlen - dense per sequence| = {err:.3e}, "
                                        f"max |dense| = {scale:.3e} [{context}]")


def check_varlen_case(c: VarlenCase, device: str) -> None:
    c = for_device(c, device)
    x = make_varlen_inputs(c, device)
    got = run_varlen(c, x)
    context = c.short()
    assert got.out.shape == x.q.shape and got.lse.shape == (c.h, x.q.shape[0]), context
    empty_rows = got.lse == float("-inf")
    assert_finite("out", got.out)
    assert_finite("lse", got.lse, allow_neg_inf_where=empty_rows)
    for name, g in got.grads.items():
        assert_finite(f"d{name}", g)

    # 1. The dense path, sequence by sequence: bitwise identical (CUDA gradients without
    #    deterministic=True: see the top).
    dense = run_dense_per_sequence(c, x)
    assert_bitwise_equal("out", got.out, dense.out, context)
    if dense.lse is not None:
        assert_bitwise_equal("lse", got.lse, dense.lse, context)
    atomics = device == "cuda" and not c.deterministic
    for name in got.grads:
        if atomics:
            assert_close_to_dense(f"d{name}", got.grads[name], dense.grads[name], context)
        else:
            assert_bitwise_equal(f"d{name}", got.grads[name], dense.grads[name], context)

    # 2. The float64 reference, sequence by sequence. On CUDA the gradients are checked against
    #    it only where step 1 could not pin them to the dense path bit for bit, and not on the
    #    FlashAttention-2 backward path (Delta from the stored 16-bit O), whose gradients of rows
    #    with a few keys carry O's rounding beyond the tolerance rule -- the dense path's do too
    #    (see test_gpu_backward.py's FA2_CASES); there step 1 is the check.
    check_grads = device != "cuda" or (atomics and os.environ.get("DMATTN_BWD_EXACT") != "0")
    for b in range(len(c.lens_q)):
        qr, kr = x.query_rows(b), x.key_rows(b)
        grads = {n: got.grads[n][qr if n == "q" else kr].unsqueeze(0) for n in ("q", "k", "v")}
        if "bias" in got.grads:
            grads["bias"] = key_side_as_dense(got.grads["bias"], kr)
        check_against_reference(
            x.q[qr].unsqueeze(0), x.k[kr].unsqueeze(0), x.v[kr].unsqueeze(0),
            key_side_as_dense(x.mask, kr), key_side_as_dense(x.bias, kr),
            got.out[qr].unsqueeze(0), got.lse[:, qr].unsqueeze(0), grads if check_grads else None,
            causal=c.causal,
            window=c.window, scale=c.scale, softcap=c.softcap, dout=x.dout[qr].unsqueeze(0),
            context=f"[sequence {b} of {context}]")


# ---------------------------------------------------------------------------------------------
# Functional tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_cases(device, nan_poison, seed):
    check_varlen_case(random_varlen_case(seed, device), device)


# Explicit shapes: lengths 0 and 1 on either side, lengths around the tile size, GQA/MQA with
# every key-side head count, causal and window per sequence, a loose max_seqlen.
EXPLICIT_CASES = {
    "zeros_and_ones": VarlenCase(torch.float32, [0, 1, 0, 3, 1, 2], [2, 0, 0, 1, 1, 5], h=4, hkv=2,
                                 d=8, causal=True, mask_heads=2, bias_heads=4,
                                 bias_dtype=torch.float32),
    "all_empty": VarlenCase(torch.float32, [0, 0, 0], [0, 0, 0], h=2, hkv=1, d=4, mask_heads=1,
                            bias_heads=1, bias_dtype=torch.float32),
    "queries_without_keys": VarlenCase(torch.bfloat16, [3, 2], [0, 0], h=2, hkv=2, d=8,
                                       bias_heads=2, bias_dtype=torch.bfloat16),
    "keys_without_queries": VarlenCase(torch.float16, [0, 0, 4], [5, 3, 2], h=3, hkv=1, d=8,
                                       mask_heads=3, bias_heads=1, bias_dtype=torch.float32),
    "tile_edges_causal": VarlenCase(torch.float32, [63, 64, 65, 1], [65, 64, 63, 1], h=2, hkv=1,
                                    d=8, causal=True, bias_heads=1, bias_dtype=torch.float32),
    "tile_edges_window_gqa": VarlenCase(torch.bfloat16, [130, 17], [129, 70], h=4, hkv=2, d=16,
                                        window=(20, 3), mask_heads=4, bias_heads=2,
                                        bias_dtype=torch.bfloat16, max_slack=7),
    "mqa_float64_softcap": VarlenCase(torch.float64, [5, 9, 1], [7, 2, 11], h=3, hkv=1, d=5,
                                      softcap=5.0, scale=0.7, mask_heads=3, bias_heads=3,
                                      bias_dtype=torch.float64),
    "padded_key_mask": VarlenCase(torch.bfloat16, [300, 700, 129, 1000], [300, 700, 129, 1000], h=4, hkv=2,
                                  d=64, causal=True, mask_heads=2, bias_heads=4, bias_dtype=torch.bfloat16,
                                  mask_padding=True),
    "single_sequence": VarlenCase(torch.float16, [33], [47], h=2, hkv=1, d=32, causal=True,
                                  window=(8, -1), bias_heads=2, bias_dtype=torch.float16),
    "no_sequences": VarlenCase(torch.float32, [], [], h=2, hkv=1, d=8, bias_heads=1,
                               bias_dtype=torch.float32),
}


@pytest.mark.parametrize("name", EXPLICIT_CASES)
def test_explicit_cases(device, nan_poison, name):
    check_varlen_case(EXPLICIT_CASES[name], device)


def test_sequences_without_keys_or_queries(device, nan_poison):
    """The empty-row rule per sequence: no keys -> out 0, lse -inf, dq 0; no queries -> the
    sequence's dk, dv and dbias are exactly 0."""
    c = for_device(EXPLICIT_CASES["zeros_and_ones"], device)
    x = make_varlen_inputs(c, device)
    r = run_varlen(c, x)
    for b, (lq, lk) in enumerate(zip(c.lens_q, c.lens_k)):
        qr, kr = x.query_rows(b), x.key_rows(b)
        if lk == 0:
            assert (r.out[qr] == 0).all() and (r.grads["q"][qr] == 0).all()
            assert (r.lse[:, qr] == float("-inf")).all()
        if lq == 0:
            for n in ("k", "v"):
                assert (r.grads[n][kr] == 0).all(), f"d{n} of sequence {b}"
            assert (r.grads["bias"][:, kr] == 0).all(), f"dbias of sequence {b}"


def test_max_seqlen_is_an_upper_bound(device):
    # deterministic: bitwise comparable on CUDA too (no atomics)
    c = dataclasses.replace(for_device(random_varlen_case(3), device), deterministic=True)
    x = make_varlen_inputs(c, device)
    tight = run_varlen(c, x)
    x.max_q, x.max_k = x.max_q + 50, x.max_k + 1
    loose = run_varlen(c, x)
    assert_bitwise_equal("out", loose.out, tight.out, "looser max_seqlen")
    for n in tight.grads:
        assert_bitwise_equal(f"d{n}", loose.grads[n], tight.grads[n], "looser max_seqlen")


def test_strided_inputs_are_used_in_place(device, nan_poison):
    """Head-major q/k/v buffers and a key-strided mask/bias give the same bits as contiguous ones."""
    c = for_device(random_varlen_case(11), device)
    c = dataclasses.replace(c, mask_heads=c.h, bias_heads=c.hkv, bias_dtype=torch.float32,
                            deterministic=True)
    x = make_varlen_inputs(c, device)
    head_major = lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)  # noqa: E731
    key_major = lambda t: t.t().contiguous().t()  # noqa: E731
    strided = dataclasses.replace(x, q=head_major(x.q), k=head_major(x.k), v=head_major(x.v),
                                  mask=key_major(x.mask), bias=key_major(x.bias))
    assert strided.q.stride() != x.q.stride() and strided.bias.stride() != x.bias.stride()
    a, b = run_varlen(c, x), run_varlen(c, strided)
    assert_bitwise_equal("out", b.out, a.out, c.short())
    assert_bitwise_equal("lse", b.lse, a.lse, c.short())
    for n in a.grads:
        assert_bitwise_equal(f"d{n}", b.grads[n], a.grads[n], c.short())


def test_dbias_is_the_sum_over_queries_and_group(device):
    """A (1, total_k) bias gets every query head's and every query's dS of its sequence."""
    c = for_device(VarlenCase(torch.float64, [4, 6, 130], [5, 3, 200], h=4, hkv=2, d=8,
                              causal=True, bias_heads=1, bias_dtype=torch.float64), device)
    x = make_varlen_inputs(c, device)
    one = run_varlen(c, x)
    c_full = dataclasses.replace(c, bias_heads=4)
    full = run_varlen(c_full, dataclasses.replace(x, bias=x.bias.expand(4, -1).contiguous()))
    torch.testing.assert_close(one.out, full.out, rtol=0, atol=0)
    tol = 1e-12 if c.dtype == torch.float64 else 1e-4  # CUDA: an fp32 dbias, summed in fp32
    torch.testing.assert_close(one.grads["bias"], full.grads["bias"].sum(0, keepdim=True),
                               rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------
# torch.library integration and argument errors: the registration and the validation are the
# same for every device, so these run on the CPU only (their float32 / float64 inputs and tiny
# head dims are outside the CUDA kernels' range); CUDA's own value check is at the end.
# ---------------------------------------------------------------------------------------------

CPU = "cpu"


def _op_inputs(device, mask_heads=2, bias_heads=4, grad=False):
    c = VarlenCase(torch.float32, [3, 0, 5, 1], [4, 2, 0, 6], h=4, hkv=2, d=8,
                   mask_heads=mask_heads, bias_heads=bias_heads, bias_dtype=torch.float32)
    x = make_varlen_inputs(c, device)
    for t in (x.q, x.k, x.v) + ((x.bias,) if x.bias is not None else ()):
        t.requires_grad_(grad)
    return x


OPCHECK_VARIANTS = [
    dict(mask_heads=2, bias_heads=4, causal=False, window=(-1, -1), scale=None, softcap=0.0),
    dict(mask_heads=None, bias_heads=None, causal=True, window=(-1, -1), scale=0.3, softcap=0.0),
    dict(mask_heads=4, bias_heads=1, causal=True, window=(2, -1), scale=None, softcap=3.0),
]


def _packed_args(x):
    return (x.q, x.k, x.v, x.cu_q, x.cu_k, x.max_q, x.max_k, x.mask, x.bias)


@pytest.mark.parametrize("var", range(len(OPCHECK_VARIANTS)), ids=lambda i: f"v{i}")
def test_opcheck_fwd_varlen(var):
    o = OPCHECK_VARIANTS[var]
    x = _op_inputs(CPU, o["mask_heads"], o["bias_heads"], grad=True)
    args = _packed_args(x) + (o["causal"], *o["window"], o["scale"], o["softcap"], False)
    torch.library.opcheck(torch.ops.dmattn.fwd_varlen.default, args)


@pytest.mark.parametrize("var", range(len(OPCHECK_VARIANTS)), ids=lambda i: f"v{i}")
def test_opcheck_bwd_varlen(var):
    o = OPCHECK_VARIANTS[var]
    x = _op_inputs(CPU, o["mask_heads"], o["bias_heads"])
    opts = (o["causal"], *o["window"], o["scale"], o["softcap"])
    out, lse = torch.ops.dmattn.fwd_varlen(*_packed_args(x), *opts, False)
    args = ((x.dout,) + _packed_args(x)[:7] + (out, lse, x.mask, x.bias, x.bias is not None)
            + opts + (True,))
    torch.library.opcheck(torch.ops.dmattn.bwd_varlen.default, args)


def test_compile_fullgraph():
    torch._dynamo.reset()
    x = _op_inputs(CPU, grad=True)

    def f(q, k, v, bias):
        out = dmattn.attention_varlen(q, k, v, x.cu_q, x.cu_k, x.max_q, x.max_k, x.mask, bias,
                                      causal=True, window=(3, -1))
        return (out * 2).sum()

    leaves = (x.q, x.k, x.v, x.bias)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads_c = torch.autograd.grad(compiled(*leaves), leaves)
    grads_e = torch.autograd.grad(f(*leaves), leaves)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Errors: each malformed argument, named in the message
# ---------------------------------------------------------------------------------------------


def _valid_call_args(device):
    """q (7, 4, 8), k/v (9, 2, 8); sequences of (3, 4), (0, 1), (4, 4) query/key rows."""
    g = torch.Generator().manual_seed(1)
    return dict(
        q=torch.randn(7, 4, 8, generator=g).to(device),
        k=torch.randn(9, 2, 8, generator=g).to(device),
        v=torch.randn(9, 2, 8, generator=g).to(device),
        cu_seqlens_q=torch.tensor([0, 3, 3, 7], dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor([0, 4, 5, 9], dtype=torch.int32, device=device),
        max_seqlen_q=4,
        max_seqlen_k=4,
        mask=torch.ones(2, 9, dtype=torch.bool, device=device),
        bias=torch.zeros(4, 9, device=device),
    )


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


ERRORS = {
    # cu_seqlens
    "cu_q_int64": (dict(cu_seqlens_q=torch.tensor([0, 3, 3, 7])), TypeError,
                   "cu_seqlens_q: expected dtype int32, got torch.int64"),
    "cu_k_float": (dict(cu_seqlens_k=torch.tensor([0.0, 4, 5, 9])), TypeError,
                   "cu_seqlens_k: expected dtype int32, got torch.float32"),
    "cu_q_not_monotone": (dict(cu_seqlens_q=_i32([0, 4, 3, 7])), ValueError,
                          r"cu_seqlens_q: expected non-decreasing values, got cu_seqlens_q\[2\] = 3"),
    "cu_k_not_monotone": (dict(cu_seqlens_k=_i32([0, 4, 2, 9])), ValueError,
                          "cu_seqlens_k: expected non-decreasing values"),
    "cu_q_first_not_zero": (dict(cu_seqlens_q=_i32([1, 3, 3, 7])), ValueError,
                            "cu_seqlens_q: expected first entry 0, got 1"),
    "cu_k_wrong_length": (dict(cu_seqlens_k=_i32([0, 4, 9])), ValueError,
                          r"cu_seqlens_k: expected length 4 \(batch \+ 1, like cu_seqlens_q\), got 3"),
    "cu_q_last_not_total": (dict(cu_seqlens_q=_i32([0, 3, 3, 6])), ValueError,
                            r"cu_seqlens_q: expected last entry total_q \(q.shape\[0\]\) = 7, got 6"),
    "cu_k_last_not_total": (dict(cu_seqlens_k=_i32([0, 4, 5, 8])), ValueError,
                            r"cu_seqlens_k: expected last entry total_k \(k.shape\[0\]\) = 9, got 8"),
    "cu_q_above_max": (dict(max_seqlen_q=3), ValueError,
                       "cu_seqlens_q: sequence 2 has length 4, more than max_seqlen_q = 3"),
    "cu_k_above_max": (dict(max_seqlen_k=2), ValueError,
                       "cu_seqlens_k: sequence 0 has length 4, more than max_seqlen_k = 2"),
    "cu_q_2d": (dict(cu_seqlens_q=_i32([[0, 3, 3, 7]])), ValueError,
                "cu_seqlens_q: expected a 1-D tensor"),
    "cu_q_empty": (dict(cu_seqlens_q=_i32([])), ValueError,
                   "cu_seqlens_q: expected at least one entry"),
    "cu_k_strided": (dict(cu_seqlens_k=_i32([0, -1, 4, -1, 5, -1, 9, -1])[::2]), ValueError,
                     r"cu_seqlens_k: expected a contiguous tensor \(stride 1\), got stride 2"),
    "cu_q_not_tensor": (dict(cu_seqlens_q=[0, 3, 3, 7]), TypeError,
                        "cu_seqlens_q: expected a torch.Tensor, got list"),
    # max_seqlen
    "max_q_negative": (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q: expected an int >= 0"),
    "max_k_float": (dict(max_seqlen_k=4.0), TypeError, "max_seqlen_k: expected an int, got float"),
    "max_k_bool": (dict(max_seqlen_k=True), TypeError, "max_seqlen_k: expected an int, got bool"),
    # packed tensors
    "q_dense_layout": (dict(q=torch.randn(1, 7, 4, 8)), ValueError,
                       r"q: expected a 3-D tensor \(total_q, num_heads, head_dim\)"),
    "k_head_dim": (dict(k=torch.randn(9, 2, 4)), ValueError, "k: expected head_dim 8 like q"),
    "k_heads_ratio": (dict(k=torch.randn(9, 3, 8), v=torch.randn(9, 3, 8)), ValueError,
                      r"k: num_heads_kv \(k.shape\[1\] = 3\) must be >= 1 and divide num_heads"),
    "v_shape": (dict(v=torch.randn(8, 2, 8)), ValueError, r"v: expected shape \(9, 2, 8\)"),
    "k_dtype": (dict(k=torch.randn(9, 2, 8, dtype=torch.float64)), TypeError,
                "k: expected dtype float32"),
    # key-side mask / bias
    "mask_dense_layout": (dict(mask=torch.ones(1, 2, 1, 9, dtype=torch.bool)), ValueError,
                          r"mask: expected a 2-D tensor \(Hb, total_k\)"),
    "mask_bad_heads": (dict(mask=torch.ones(3, 9, dtype=torch.bool)), ValueError,
                       r"mask: expected shape \(Hb, total_k\) = \(1, 9\), \(2, 9\) or \(4, 9\), got \(3, 9\)"),
    "bias_bad_keys": (dict(bias=torch.zeros(4, 8)), ValueError,
                      r"bias: expected shape \(Hb, total_k\)"),
    "mask_dtype": (dict(mask=torch.ones(2, 9)), TypeError, "mask: expected dtype bool"),
    "bias_dtype": (dict(bias=torch.zeros(4, 9, dtype=torch.float64)), TypeError,
                   "bias: expected dtype float32"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_errors(name):
    overrides, exc, match = ERRORS[name]
    args = _valid_call_args(CPU)
    args.update({n: (t.to(CPU) if isinstance(t, torch.Tensor) else t)
                 for n, t in overrides.items()})
    dmattn.attention_varlen(**_valid_call_args(CPU))  # the baseline is valid
    with pytest.raises(exc, match=match):
        dmattn.attention_varlen(**args)


def test_backward_op_checks_cu_seqlens():
    a = _valid_call_args(CPU)
    out, lse = torch.ops.dmattn.fwd_varlen(a["q"], a["k"], a["v"], a["cu_seqlens_q"],
                                           a["cu_seqlens_k"], 4, 4, None, None, False, -1, -1,
                                           None, 0.0, False)
    bad = _i32([0, 3, 7, 3]).to(CPU)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing values"):
        torch.ops.dmattn.bwd_varlen(torch.ones_like(out), a["q"], a["k"], a["v"], bad,
                                    a["cu_seqlens_k"], 4, 4, out, lse, None, None, False, False,
                                    -1, -1, None, 0.0, False)


# ---------------------------------------------------------------------------------------------
# CUDA only: larger and sharper cases than the shared ones above
# ---------------------------------------------------------------------------------------------


CUDA_CASES = {
    # Every key-side head count with a gradient, GQA 8/2, lengths 0, 1, odd, around 64 and 128.
    **{f"bias_grad_hb{hb}": VarlenCase(torch.bfloat16, [0, 1, 63, 129, 200, 1], [5, 1, 64, 130, 0, 77],
                                       h=8, hkv=2, d=64, causal=True, mask_heads=hb, bias_heads=hb,
                                       bias_dtype=torch.bfloat16) for hb in (1, 2, 8)},
    **{f"bias_grad_hb{hb}_fp32_window": VarlenCase(torch.float16, [300, 17, 128], [257, 64, 191], h=6,
                                                   hkv=3, d=128, window=(40, 7), mask_heads=hb,
                                                   bias_heads=hb, bias_dtype=torch.float32, max_slack=9)
       for hb in (1, 3, 6)},
    "mqa_causal_q_longer": VarlenCase(torch.bfloat16, [190, 65, 3], [70, 64, 9], h=4, hkv=1, d=80,
                                      causal=True, bias_heads=1, bias_dtype=torch.float32),
    "softcap_scale_det": VarlenCase(torch.float16, [100, 0, 255], [99, 33, 256], h=2, hkv=2, d=32,
                                    softcap=20.0, scale=0.2, mask_heads=1, bias_heads=2,
                                    bias_dtype=torch.float16, deterministic=True),
    "hd256": VarlenCase(torch.bfloat16, [70, 1, 130], [129, 2, 64], h=2, hkv=1, d=256, causal=True,
                        bias_heads=2, bias_dtype=torch.bfloat16),
    "one_long_many_short": VarlenCase(torch.bfloat16, [1000, 1, 2, 3, 5, 8], [1100, 1, 3, 2, 5, 8],
                                      h=4, hkv=2, d=128, causal=True, bias_heads=2,
                                      bias_dtype=torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("exact", ["0", "1"], ids=["fa2_bwd", "exact_bwd"])
@pytest.mark.parametrize("name", CUDA_CASES)
def test_cuda_cases(name, exact, monkeypatch, nan_poison):
    monkeypatch.setenv("DMATTN_BWD_EXACT", exact)
    check_varlen_case(CUDA_CASES[name], "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("exact", ["0", "1"], ids=["fa2_bwd", "exact_bwd"])
@pytest.mark.parametrize("hb", [1, 2, 8])
def test_cuda_deterministic_is_bitwise_repeatable(hb, exact, monkeypatch, nan_poison):
    """deterministic=True: no atomics anywhere (dq from the query-major kernel, a dbias shared by
    kv heads reduced by one CTA walking them), so two calls give the same bits."""
    monkeypatch.setenv("DMATTN_BWD_EXACT", exact)
    c = VarlenCase(torch.bfloat16, [129, 0, 1, 300, 64], [200, 7, 1, 301, 0], h=8, hkv=2, d=64,
                   causal=True, mask_heads=hb, bias_heads=hb, bias_dtype=torch.float32,
                   deterministic=True, seed=5)
    x = make_varlen_inputs(c, "cuda")
    a, b = run_varlen(c, x), run_varlen(c, x)
    assert_bitwise_equal("out", b.out, a.out, c.short())
    assert_bitwise_equal("lse", b.lse, a.lse, c.short())
    for n in a.grads:
        assert_finite(f"d{n}", a.grads[n])
        assert_bitwise_equal(f"d{n}", b.grads[n], a.grads[n], c.short())


@pytest.mark.gpu
@pytest.mark.parametrize("exact", ["0", "1"], ids=["fa2_bwd", "exact_bwd"])
def test_cuda_long_sequences_match_dense(exact, monkeypatch):
    """Thousands of rows per sequence (no float64 reference at this size): the packed batch
    against the dense path per sequence."""
    monkeypatch.setenv("DMATTN_BWD_EXACT", exact)
    c = VarlenCase(torch.bfloat16, [2048, 1, 1500, 3001], [2048, 1, 1700, 2999], h=8, hkv=4, d=128,
                   causal=True, bias_heads=4, bias_dtype=torch.bfloat16, seed=9)
    x = make_varlen_inputs(c, "cuda")
    got, dense = run_varlen(c, x), run_dense_per_sequence(c, x)
    assert_bitwise_equal("out", got.out, dense.out, c.short())
    assert_bitwise_equal("lse", got.lse, dense.lse, c.short())
    for n in got.grads:
        assert_finite(f"d{n}", got.grads[n])
        assert_close_to_dense(f"d{n}", got.grads[n], dense.grads[n], c.short())


def _cuda_bf16_call_args():
    args = _valid_call_args("cuda")
    for n in ("q", "k", "v", "bias"):
        args[n] = args[n].to(torch.bfloat16)
    return args


@pytest.mark.gpu
def test_cuda_cu_seqlens_values_are_checked():
    args = _cuda_bf16_call_args()
    args["cu_seqlens_k"] = _i32([0, 4, 5, 8]).cuda()
    with pytest.raises(ValueError, match="cu_seqlens_k: expected last entry"):
        dmattn.attention_varlen(**args)


@pytest.mark.gpu
def test_cuda_cu_seqlens_modified_in_place_are_checked_again():
    """The value check runs once per pair of cu_seqlens tensors (the host copy is a device
    synchronization): a call with the same, unmodified tensors skips it, but an in-place change
    (version counter) makes the next call check again."""
    args = _cuda_bf16_call_args()
    args["cu_seqlens_k"] = args["cu_seqlens_k"].cuda()
    args["cu_seqlens_q"] = args["cu_seqlens_q"].cuda()
    dmattn.attention_varlen(**args)
    dmattn.attention_varlen(**args)  # cached: no error, same tensors
    args["cu_seqlens_k"][-1] -= 1  # last entry no longer total_k (the lengths stay valid)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected last entry"):
        dmattn.attention_varlen(**args)


def test_cu_seqlens_check_cache_keys():
    """What makes a cached value check reusable: the same two tensors, unmodified, checked
    against the same max lengths and totals."""
    from dmattn import ops

    cu_q, cu_k = _i32([0, 3, 5]), _i32([0, 2, 6])
    sizes = (3, 4, 5, 6)
    assert not ops._cu_seqlens_already_checked(cu_q, cu_k, *sizes)
    ops._remember_cu_seqlens_checked(cu_q, cu_k, *sizes)
    assert ops._cu_seqlens_already_checked(cu_q, cu_k, *sizes)
    assert not ops._cu_seqlens_already_checked(cu_q, cu_k, 2, 4, 5, 6)  # other max_seqlen_q
    assert not ops._cu_seqlens_already_checked(cu_q, cu_k.clone(), *sizes)  # another k tensor
    assert not ops._cu_seqlens_already_checked(cu_q.clone(), cu_k, *sizes)  # another q tensor
    cu_k[1] = 1  # in place: bumps the version counter
    assert not ops._cu_seqlens_already_checked(cu_q, cu_k, *sizes)
    ops._remember_cu_seqlens_checked(cu_q, cu_k, *sizes)
    cu_q.add_(0)
    assert not ops._cu_seqlens_already_checked(cu_q, cu_k, *sizes)
