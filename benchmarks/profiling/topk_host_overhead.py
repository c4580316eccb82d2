"""Host-side cost of dmattn.attention_topk's glue (gather path), measured on the CPU.

    PYTHONPATH=python python3 benchmarks/profiling/topk_host_overhead.py [--shape B,S,H,Hkv,D,keep]
        [--dtype float32|bfloat16|float64] [--mask] [--list]

On the GPU the kernels run asynchronously, so the Python/ATen work around them (selection,
compaction of the positions, gathers, scatter-back) costs host time per call whatever the
sizes. Tiny CPU tensors make the arithmetic negligible, so what is left is that host time:

  * ops: the ATen ops dispatched per call (a TorchDispatchMode counting them), for the
    forward alone (no grad), and for forward + backward with every gradient;
  * sync: the ops among them that read tensor data on the host (would synchronize a GPU);
  * us/call: wall time per call (time.perf_counter, the fastest of --rounds rounds of --iters
    calls: the least disturbed by other processes), forward, forward+backward, and the glue
    alone (everything but the dmattn ops).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dmattn
from dmattn import gather

# ATen ops whose result needs tensor values on the host (a device synchronization on CUDA):
# scalar reads (.item(), bool(t), int(t)) and ops with data-dependent output shapes.
SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero",
            "aten::nonzero_static", "aten::masked_select", "aten::unique_consecutive",
            "aten::_unique2", "aten::unique_dim", "aten::equal", "aten::allclose"}


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while active, by name (custom ops count as one)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def syncs(self):
        return {name: n for name, n in self.ops.items() if name in SYNC_OPS}


def make(batch, seqlen, heads, heads_kv, head_dim, dtype, grad, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, head_dim, generator=g)
    k, v = (torch.randn(batch, seqlen, heads_kv, head_dim, generator=g) for _ in range(2))
    bias = torch.randn(batch, heads, 1, seqlen, generator=g)
    return [t.to(dtype).requires_grad_(grad) for t in (q, k, v, bias)]


def per_call_us(fn, iters: int, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) / iters * 1e6)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--shape", default="1,64,2,2,16,16", help="B,S,H,Hkv,D,keep")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    ap.add_argument("--mask", action="store_true", help="with a (B, 1, 1, S) padding mask (70%% kept)")
    ap.add_argument("--list", action="store_true", help="print the ops of each call by name")
    args = ap.parse_args()
    batch, seqlen, heads, heads_kv, head_dim, keep = map(int, args.shape.split(","))
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, CPU, {args.dtype}, B={batch} S={seqlen} H={heads} Hkv={heads_kv} "
          f"D={head_dim} keep={keep}, causal, per-key bias (B, H, 1, S)"
          + (", padding mask (B, 1, 1, S)" if args.mask else ""))

    q, k, v, bias = make(batch, seqlen, heads, heads_kv, head_dim, dtype, grad=False)
    qg, kg, vg, biasg = make(batch, seqlen, heads, heads_kv, head_dim, dtype, grad=True)
    dout = torch.randn_like(qg)
    mask = None
    if args.mask:
        mask = torch.rand(batch, 1, 1, seqlen, generator=torch.Generator().manual_seed(1)) < 0.7

    def fwd():
        return dmattn.attention_topk(q, k, v, bias, keep, mask=mask, causal=True)

    def fwd_bwd():
        out = dmattn.attention_topk(qg, kg, vg, biasg, keep, mask=mask, causal=True)
        return torch.autograd.grad(out, (qg, kg, vg, biasg), dout)

    # The glue alone: the same calls with the dmattn op replaced by a cheap stand-in of the
    # right shapes (dmattn.gather looks the op's caller up at call time).
    def fake_forward(q, k, v, mask, bias, *rest):
        return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]))

    op_caller = "forward_with_grad" if hasattr(gather, "forward_with_grad") else "attention_forward"
    real_forward = getattr(gather, op_caller)

    def glue():
        setattr(gather, op_caller, fake_forward)
        try:
            return fwd()
        finally:
            setattr(gather, op_caller, real_forward)

    results = {}
    for name, fn in (("forward (no grad)", fwd), ("forward + backward", fwd_bwd)):
        counter = OpCounter()
        with counter:
            fn()
        results[name] = counter
        print(f"{name:22} ops {counter.total:4d}  sync ops {counter.syncs() or 'none'}")
        if args.list:
            for op, n in sorted(counter.ops.items()):
                print(f"    {n:3d}  {op}")
    print(f"{'forward (no grad)':22} {per_call_us(fwd, args.iters, args.rounds):8.1f} us/call")
    print(f"{'forward + backward':22} {per_call_us(fwd_bwd, args.iters, args.rounds):8.1f} us/call")
    print(f"{'glue only (fwd)':22} {per_call_us(glue, args.iters, args.rounds):8.1f} us/call")


if __name__ == "__main__":
    main()
