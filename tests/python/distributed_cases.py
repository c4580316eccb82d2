"""The cases of test_ring_attention.py and the worker that runs them in each rank of a process
group: gloo on the CPU, or NCCL with one CUDA device per rank.

Every rank builds the same global q, k, v, bias, mask and dout from the case's seed, shards
them, runs dmattn.distributed.ring_attention and its backward, gathers out, lse and the
gradients (unshard_sequence) and compares them, on every rank, with single-process dmattn on the
whole sequence on the same device (dmattn.attention, or dmattn.attention_topk(per_query=True)
for ``keep``). The failures of each rank go to a JSON file that the test reads.

CUDA runs ``cases_for("cuda")``: the same cases mapped onto what the CUDA kernels take
(``for_cuda``), so that every path the gloo tests cover (layouts, exchanges, key-side and full
masks and biases, Doge's per-query top-k, determinism, NaN) is checked over NCCL too.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
from dataclasses import dataclass, replace
from typing import List, Optional

import torch
import torch.distributed as dist

import dmattn
import dmattn.distributed as dd

F64, F32 = torch.float64, torch.float32


@dataclass(frozen=True)
class RingCase:
    name: str
    dtype: torch.dtype = F64
    b: int = 2
    local_len: int = 8
    h: int = 4
    hkv: int = 2
    d: int = 16
    causal: bool = True
    layout: str = "zigzag"
    kv_exchange: str = "ring"
    bias: str = "none"    # none | key (B, H, 1, S_local) | key_hkv (1, Hkv, 1, S_local)
                          # | full (1, H, S_local, S) | full_q1 (B, 1, 1, S) | full_k1 (1, H, S_local, 1)
    bias_dtype: Optional[torch.dtype] = None
    mask: str = "none"    # none | key (B, 1, 1, S_local) | full (B, 1, S_local, S) | first_rank_off
    keep: Optional[int] = None
    scale: Optional[float] = None
    softcap: float = 0.0
    deterministic: bool = False
    nan_row: Optional[int] = None  # a NaN in q at this global position of batch 0, head 0

    def tolerance(self) -> float:
        # 16-bit: each step's partial output is rounded before the merge, and the backward reads
        # the rounded out (docs/semantics.md, "Numerics"): rounding of the dtype, a few times.
        return {F64: 1e-10, F32: 1e-5, torch.float16: 1e-2}.get(self.dtype, 3e-2)


BASE = [
    RingCase("plain"),
    RingCase("plain_noncausal", causal=False),
    RingCase("gqa_key_bias", bias="key"),
    RingCase("gqa_key_bias_hkv", bias="key_hkv", mask="key"),
    RingCase("full_bias", bias="full", mask="key"),
    RingCase("full_bias_noncausal", bias="full", causal=False),
    RingCase("full_mask_q1_bias", bias="full_q1", mask="full"),
    RingCase("full_mask_k1_bias", bias="full_k1", mask="full", causal=False),
    RingCase("mha_softcap_scale", hkv=4, d=32, bias="key", softcap=5.0, scale=0.3),
    RingCase("empty_rows", layout="contiguous", mask="first_rank_off", bias="full"),
    RingCase("float32", dtype=F32, bias="key", mask="key", local_len=12),
    RingCase("float32_bias", dtype=F32, bias="full", b=1),
    RingCase("bfloat16", dtype=torch.bfloat16, bias="key", bias_dtype=F32, local_len=12, b=1),
    RingCase("nan", bias="key", nan_row=5),
]
# Every base case with the contiguous layout and the all-gather exchange too.
CASES: List[RingCase] = []
for case in BASE:
    CASES.append(case)
    if case.layout == "zigzag":
        CASES.append(replace(case, name=case.name + "/contiguous", layout="contiguous"))
    CASES.append(replace(case, name=case.name + "/allgather", kv_exchange="allgather"))
CASES += [
    RingCase("keep", bias="key", kv_exchange="allgather", keep=5),
    RingCase("keep_mask_mqa", bias="key_hkv", hkv=1, mask="key", kv_exchange="allgather", keep=3, local_len=12),
    RingCase("keep_contiguous", bias="key", kv_exchange="allgather", keep=7, layout="contiguous"),
    RingCase("keep_large", bias="key", kv_exchange="allgather", keep=1000, dtype=F32),
    RingCase("deterministic", bias="key", mask="key", deterministic=True, dtype=F32),
    RingCase("deterministic/allgather", bias="full", deterministic=True, dtype=F32, kv_exchange="allgather"),
]

# CUDA takes float16 / bfloat16 and head dims that are multiples of 8. Rows per rank x32: zigzag
# chunks of 128 and 192 rows, so the kernels run whole tiles and a partial one (keep scales along).
CUDA_SCALE = 32


def for_cuda(case: RingCase) -> RingCase:
    """A case mapped onto the CUDA kernels: float64 -> bfloat16, float32 -> float16 (a float32
    bias_dtype stays: CUDA takes a float32 bias), head dims 16 / 32 -> 64 / 128, CUDA_SCALE
    times the rows and keep."""
    return replace(case, dtype=torch.bfloat16 if case.dtype in (F64, torch.bfloat16) else torch.float16,
                   local_len=case.local_len * CUDA_SCALE, d=64 if case.d <= 16 else 128,
                   keep=None if case.keep is None else case.keep * CUDA_SCALE)


CUDA_CASES: List[RingCase] = [for_cuda(case) for case in CASES]


def cases_for(device: str) -> List[RingCase]:
    return CUDA_CASES if device == "cuda" else CASES


def make_inputs(case: RingCase, world_size: int, seed: int, device: str = "cpu"):
    """The global tensors of a case (the same on every rank), on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    b, h, hkv, d = case.b, case.h, case.hkv, case.d
    s = world_size * case.local_len

    def randn(*shape, dtype=case.dtype):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)

    q, k, v, dout = randn(b, s, h, d), randn(b, s, hkv, d), randn(b, s, hkv, d), randn(b, s, h, d)
    if case.nan_row is not None:
        q[0, case.nan_row, 0, 0] = float("nan")
    bias_dtype = case.bias_dtype or case.dtype
    bias = {
        "none": None,
        "key": lambda: randn(b, h, 1, s, dtype=bias_dtype),
        "key_hkv": lambda: randn(1, hkv, 1, s, dtype=bias_dtype),
        "full": lambda: randn(1, h, s, s, dtype=bias_dtype),
        "full_q1": lambda: randn(b, 1, 1, s, dtype=bias_dtype),
        "full_k1": lambda: randn(1, h, s, 1, dtype=bias_dtype),
    }[case.bias]
    bias = bias() if bias else None
    if case.keep is not None:  # coarse values: ties in the selection
        bias = (bias * 2).round() / 2
    mask = None
    if case.mask == "key":
        mask = torch.rand(b, 1, 1, s, generator=gen) > 0.25
    elif case.mask == "full":
        mask = torch.rand(b, 1, s, s, generator=gen) > 0.3
        mask[0, 0, 3] = False  # a query row with no key anywhere
    elif case.mask == "first_rank_off":  # keys of the first S_local positions: none allowed
        mask = torch.ones(1, 1, 1, s, dtype=torch.bool)
        mask[..., :case.local_len] = False
    # Drawn on the CPU from the seed, then moved: the same values on every rank and device.
    return tuple(None if x is None else x.to(device) for x in (q, k, v, bias, mask, dout))


KEY_SIDE = ("key", "key_hkv", "first_rank_off")


def _shard_operand(x, kind: str, layout: str):
    """A key-side operand is sharded along its keys; a full one along its query rows (dim -2)
    when it has them (its key axis stays global)."""
    if x is None:
        return None
    if kind in KEY_SIDE:
        return dd.shard_sequence(x, -1, layout=layout)
    if x.shape[-2] != 1:
        return dd.shard_sequence(x, -2, layout=layout)
    return x


def reference(case: RingCase, q, k, v, bias, mask, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    bias_leaf = bias.clone().requires_grad_() if bias is not None else None
    options = dict(causal=case.causal, scale=case.scale, softcap=case.softcap, return_lse=True)
    if case.keep is not None:
        out, lse = dmattn.attention_topk(*leaves, bias_leaf, case.keep, mask=mask, per_query=True, **options)
    else:
        out, lse = dmattn.attention(*leaves, mask, bias_leaf, **options)
    grads = torch.autograd.grad(out, leaves + ([bias_leaf] if bias_leaf is not None else []), dout)
    return out.detach(), lse, list(grads)


def distributed(case: RingCase, q, k, v, bias, mask, dout):
    layout = case.layout
    q_l, k_l, v_l = (dd.shard_sequence(t, 1, layout=layout).detach().requires_grad_() for t in (q, k, v))
    bias_l = _shard_operand(bias, case.bias, layout)
    if bias_l is not None:
        bias_l = bias_l.detach().requires_grad_()
    mask_l = _shard_operand(mask, case.mask, layout)
    out, lse = dd.ring_attention(q_l, k_l, v_l, mask_l, bias_l, causal=case.causal, layout=layout,
                                 kv_exchange=case.kv_exchange, scale=case.scale, softcap=case.softcap,
                                 deterministic=case.deterministic, return_lse=True, keep=case.keep)
    leaves = [q_l, k_l, v_l] + ([bias_l] if bias_l is not None else [])
    grads = torch.autograd.grad(out, leaves, dd.shard_sequence(dout, 1, layout=layout))
    return out.detach(), lse, list(grads)


def unshard_results(case: RingCase, bias, out, lse, grads):
    layout = case.layout
    full = [dd.unshard_sequence(out, 1, layout=layout), dd.unshard_sequence(lse, -1, layout=layout)]
    full += [dd.unshard_sequence(g, 1, layout=layout) for g in grads[:3]]
    if len(grads) > 3:
        if case.bias in KEY_SIDE:
            full.append(dd.unshard_sequence(grads[3], -1, layout=layout))
        elif bias.shape[-2] != 1:
            full.append(dd.unshard_sequence(grads[3], -2, layout=layout))
        else:  # a query-broadcast global bias: each rank holds a share of its gradient
            total = grads[3].clone(memory_format=torch.contiguous_format)  # (NCCL needs it dense)
            dist.all_reduce(total)
            full.append(total)
    return full


NAMES = ["out", "lse", "dq", "dk", "dv", "dbias"]


def _nan_required(case: RingCase, name: str, shape, device) -> Optional[torch.Tensor]:
    """Where a NaN in q[0, nan_row, 0, 0] must arrive (docs/semantics.md, "NaN in, NaN out"): its
    out and dq row, and the dk, dv and dbias entries of the keys that row attends (j <= nan_row
    under causal, in batch 0, kv head 0 / bias head 0). Elsewhere a NaN may or may not spread."""
    if name == "lse":
        return None
    required = torch.zeros(shape, dtype=torch.bool, device=device)
    keys = slice(0, case.nan_row + 1) if case.causal else slice(None)
    if name in ("out", "dq"):
        required[0, case.nan_row, 0] = True
    elif name in ("dk", "dv"):
        required[0, keys, 0] = True
    elif name == "dbias":
        required[0, 0, 0, keys] = True
    return required


def compare(case: RingCase, got: List[torch.Tensor], want: List[torch.Tensor]) -> List[str]:
    errors = []
    for name, a, b in zip(NAMES, got, want):
        if a.shape != b.shape or a.dtype != b.dtype:
            errors.append(f"{name}: shape/dtype {tuple(a.shape)} {a.dtype}, expected {tuple(b.shape)} {b.dtype}")
            continue
        a64, b64 = a.double(), b.double()
        if case.nan_row is not None:
            required = _nan_required(case, name, a.shape, a.device)
            if required is not None and not torch.isnan(a64[required]).all():
                errors.append(f"{name}: the NaN does not reach what it touches (hidden)")
            both = torch.isfinite(a64) & torch.isfinite(b64)
            a64, b64 = a64[both], b64[both]
        else:
            if not torch.equal(torch.isinf(a64), torch.isinf(b64)) or torch.isnan(a64).any():
                errors.append(f"{name}: inf/NaN pattern differs from the reference")
                continue
            finite = torch.isfinite(b64)
            a64, b64 = a64[finite], b64[finite]
        if b64.numel() == 0:
            continue
        err = (a64 - b64).abs().max().item()
        bound = case.tolerance() * max(1e-3, b64.abs().max().item())
        if not err <= bound:
            errors.append(f"{name}: max error {err:.3g} > {bound:.3g}")
    if case.nan_row is not None:
        out = got[0]
        if not torch.isnan(out[0, case.nan_row, 0]).all():
            errors.append("out: the NaN query row is not NaN")
        finite_rows = torch.ones(out.shape[1], dtype=torch.bool, device=out.device)
        finite_rows[case.nan_row] = False
        if not torch.isfinite(out[1:]).all() or not torch.isfinite(out[0, finite_rows]).all():
            errors.append("out: a NaN reached a row without one")
    return errors


def run_case(case: RingCase, world_size: int, seed: int, device: str = "cpu") -> List[str]:
    q, k, v, bias, mask, dout = make_inputs(case, world_size, seed, device)
    want_out, want_lse, want_grads = reference(case, q, k, v, bias, mask, dout)
    want = [want_out, want_lse] + want_grads
    out, lse, grads = distributed(case, q, k, v, bias, mask, dout)
    errors = compare(case, unshard_results(case, bias, out, lse, grads), want)
    if case.deterministic:  # a second run: bitwise the same
        out2, lse2, grads2 = distributed(case, q, k, v, bias, mask, dout)
        for name, a, b in zip(NAMES, [out, lse] + grads, [out2, lse2] + grads2):
            if not torch.equal(a, b):
                errors.append(f"{name}: differs between two deterministic runs")
    return errors


def error_cases(world_size: int, device: str = "cpu") -> List[str]:
    """Invalid arguments raise before any communication, naming the argument."""
    dtype = F32 if device == "cpu" else torch.bfloat16  # a dtype the device's kernels take

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, dtype=dtype, device=device)

    q = randn(1, 8, 4, 16)
    k = v = randn(1, 8, 2, 16)
    key_bias = randn(1, 4, 1, 8)
    checks = [
        (dict(layout="diagonal"), ValueError, "layout"),
        (dict(kv_exchange="p2p"), ValueError, "kv_exchange"),
        (dict(window=(4, 0)), ValueError, "window"),
        (dict(keep=4, causal=True, kv_exchange="allgather"), ValueError, "keep"),
        (dict(keep=4, bias=key_bias, causal=True), ValueError, "kv_exchange"),
        (dict(keep=4, bias=key_bias, kv_exchange="allgather"), ValueError, "causal"),
        (dict(keep=0, bias=key_bias, causal=True, kv_exchange="allgather"), ValueError, "keep"),
        (dict(keep=2, bias=randn(1, 4, 8, 8 * world_size), causal=True, kv_exchange="allgather"),
         ValueError, "bias"),
        (dict(bias=randn(1, 4, 8, 8)), ValueError, "bias") if world_size > 1 else None,
        (dict(bias=randn(1, 3, 1, 8)), ValueError, "bias"),
        (dict(bias=randn(1, 4, 1, 7)), ValueError, "bias"),
        (dict(bias=randn(1, 4, 1, 8, dtype=F64)), TypeError, "bias"),
        (dict(mask=torch.ones(1, 1, 1, 8, device=device)), TypeError, "mask"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(k=randn(1, 6, 2, 16), v=randn(1, 6, 2, 16)), ValueError, "S_local"),
        (dict(q=randn(1, 7, 4, 16), k=randn(1, 7, 2, 16), v=randn(1, 7, 2, 16)),
         ValueError, "even"),
        (dict(v=randn(1, 8, 2, 16, dtype=F64)), TypeError, "v"),
        (dict(k=randn(1, 8, 3, 16), v=randn(1, 8, 3, 16)), ValueError, "k"),
    ]
    errors = []
    for check in checks:
        if check is None:
            continue
        kwargs, exc, word = check
        args = dict(q=q, k=k, v=v)
        args.update(kwargs)
        try:
            dd.ring_attention(**args)
            errors.append(f"errors: {kwargs.keys()} raised nothing")
        except exc as e:
            if word not in str(e):
                errors.append(f"errors: {list(kwargs)}: message does not name {word!r}: {e}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"errors: {list(kwargs)}: {type(e).__name__} instead of {exc.__name__}: {e}")
    for call, exc in ((lambda: dd.shard_sequence(randn(1, 2 * world_size + 1, 2), 1), ValueError),
                      (lambda: dd.shard_sequence(q, 1, layout="stripes"), ValueError)):
        try:
            call()
            errors.append("errors: shard_sequence accepted an invalid argument")
        except exc:
            pass
    return errors


def persistence_cases(world_size: int, device: str = "cpu") -> List[str]:
    """The ring's forward steps with a transfer in flight run without persistent kernels (NCCL's
    kernels need multiprocessors: docs/design.md), the last step with them, and the caller's
    setting is back afterwards."""
    import dmattn.distributed.ring as ring

    dtype = F32 if device == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=dtype, device=device) for _ in range(3))
    seen = []
    real = ring.persistent_kernels

    def recording(enabled):
        seen.append(enabled)
        return real(enabled)

    ring.persistent_kernels = recording
    try:
        dd.ring_attention(q, k, v, causal=True)
    finally:
        ring.persistent_kernels = real
    errors = []
    want = [False] * (world_size - 1) + [True]
    if seen != want:
        errors.append(f"persistence: the forward's steps asked for {seen}, expected {want}")
    lib = dmattn._lib.lib()
    if lib.set_persistent_kernels(True) is not True:
        errors.append("persistence: the caller's setting (allowed) was not restored")
    return errors


def worker(rank: int, world_size: int, init_file: str, out_dir: str, case_names: Optional[List[str]],
           device: str = "cpu") -> None:
    """One rank: gloo on the CPU; on "cuda" NCCL with device ``rank`` (one GPU per rank)."""
    torch.set_num_threads(1)
    options = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)  # binds the communicator (barrier included)
    dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method="file://" + init_file, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120), **options)
    failures, ran = [], 0
    try:
        for index, case in enumerate(cases_for(device)):
            if case_names is not None and case.name not in case_names:
                continue
            try:
                failures += [f"{case.name}: {e}"
                             for e in run_case(case, world_size, seed=1000 * world_size + index, device=device)]
            except Exception:  # noqa: BLE001 (reported, then the next case)
                failures.append(f"{case.name}: raised\n{traceback.format_exc()}")
            ran += 1
        if case_names is None:
            failures += error_cases(world_size, device)
            failures += persistence_cases(world_size, device)
        dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"ran": ran, "failures": failures}, f)
        dist.destroy_process_group()
