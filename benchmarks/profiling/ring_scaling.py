"""Figures: docs/perf.md, "Context parallelism on two and four GPUs".

Scaling of dmattn.distributed.ring_attention over 1, 2, 4 and 8 GPUs (those visible) at a fixed
number of tokens per GPU: fwd+bwd time per rank of the ring and of the all-gather exchange,
against one GPU doing one rank's share of the work alone, and how much of the ring's
communication its computation hides.

    PYTHONPATH=python python3 benchmarks/profiling/ring_scaling.py [--world-sizes 1,2,4,8
        --seqlen-per-rank 32768 --iters 10 --warmup 3 --json FILE]
    PYTHONPATH=python python3 benchmarks/profiling/ring_scaling.py --device cpu --tiny   (dry run: gloo, tiny)

Each world size W runs in W processes spawned here, one GPU each, NCCL over a file://
rendezvous in a temporary folder, with NCCL_NVLS_ENABLE=0 (gloo on the CPU). Problem per rank:
B=1, S_local=32768 positions in the zigzag layout (the sequence is S = W * S_local), D=128, bf16,
causal, a learnable key bias (B, H, 1, S_local); heads H=16 (MHA) and GQA 32/8. Every time is one
fwd+bwd (torch.autograd.grad of out for q, k, v and the bias), the median of --iters CUDA-event
timings after --warmup runs, every timed run starting right after a barrier of all ranks; a
table cell is the largest of the ranks' medians (the ring couples the ranks: the slowest sets
the step).

Columns:
  share     one rank's share of the work on one GPU, nothing exchanged: its queries against the keys
            they see, as one dmattn call. zigzag: the rank's two chunks of S_local / 2 queries, each
            against its causal prefix [0, chunk end) of the global sequence, one dense causal call per
            chunk (bottom-right aligned); every rank's share is the same work, 1/W of causal
            attention over S.
  ring      ring_attention(kv_exchange="ring", layout="zigzag").
  eff       share / ring: the fraction of the ideal (each GPU does its share, nothing else) that the
            ring reaches. Likewise for the all-gather exchange.
  compute   the ring with its exchanges skipped: each step computes on the block at hand (every
            block has the same shape, so each step makes the same calls) and the gradient
            accumulators stay; the ring's computation without its communication.
  exchange  the ring's exchanges alone: the point-to-point transfers of one ring fwd+bwd (forward:
            W-1 hops of K, V and the key bias; backward: W-1 such hops and W hops of the float32 dK,
            dV and dbias accumulators), recorded from a ring run and replayed in its order, with the
            same transfers in flight together, without computation.
  hidden    the fraction of the exchange time hidden behind computation:
            1 - max(0, ring - compute) / exchange, clipped at 0 ("-" at W = 1: nothing exchanged).
            ring - compute is the exposed communication: waits for transfers plus the slowdown of
            kernels that share the GPU with NCCL's.
  allgather ring_attention(kv_exchange="allgather", layout="zigzag"): K, V and the bias gathered
            before the computation, nothing overlapped.

Each rank also checks that the ring's and the all-gather's outputs agree (the tests compare both
with one dmattn call); a disagreement is printed after the table and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dmattn
import dmattn.distributed as dd
from dmattn.bench import time_ms
from dmattn.distributed import layout as lay
from dmattn.distributed.comm import RingExchange

LAYOUT = "zigzag"
MEASURES = ("share", "ring", "compute", "exchange", "allgather")


@dataclass(frozen=True)
class Heads:
    name: str
    heads: int
    heads_kv: int


HEADS = (Heads("MHA 16", 16, 16), Heads("GQA 32/8", 32, 8))
TINY_HEADS = (Heads("MHA 4", 4, 4), Heads("GQA 4/2", 4, 2))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true",
                        help="S_local=256, D=32, 4 heads and GQA 4/2, 1 warm-up and 3 runs: a quick check of the "
                             "script end to end (with --device cpu: gloo, float32)")
    parser.add_argument("--world-sizes", default="", help="comma-separated (default: 1,2,4,8 up to the GPUs "
                                                          "visible; 1,2 on the CPU)")
    parser.add_argument("--seqlen-per-rank", type=int, default=32768)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--deadline-s", type=float, default=0,
                        help="for the whole run (0: none): the running group is ended then, and the table "
                             "holds the world sizes that finished")
    parser.add_argument("--json", default="", help="also write every rank's medians here")
    args = parser.parse_args()
    if args.tiny:
        args.seqlen_per_rank, args.head_dim = 256, 32
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 3)
    if args.seqlen_per_rank % 2:
        parser.error("--seqlen-per-rank: the zigzag layout needs an even length")
    if args.world_sizes:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    else:
        available = torch.cuda.device_count() if args.device == "cuda" else 2
        args.world_sizes = [w for w in (1, 2, 4, 8) if w <= available]
    if args.device == "cuda" and max(args.world_sizes, default=0) > torch.cuda.device_count():
        parser.error(f"--world-sizes: {torch.cuda.device_count()} CUDA devices visible")
    if not args.world_sizes:
        parser.error("no CUDA device visible (--device cpu --tiny runs on the CPU)")
    return args


# ---------------------------------------------------------------------------------------------
# The ring's exchanges: skipped, or recorded and replayed.
# ---------------------------------------------------------------------------------------------


class _Held:
    """A finished exchange that received what was sent: the next step computes on the block at
    hand (the same shapes as the one it would have received)."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def wait(self):
        return self.tensors


@contextlib.contextmanager
def exchanges_skipped():
    real = RingExchange.start
    RingExchange.start = lambda comm, tensors: _Held(tensors)
    try:
        yield
    finally:
        RingExchange.start = real


class ExchangeTrace:
    """The exchanges of one ring run in issue order: ("start", id, tensors) and ("wait", id)."""

    def __init__(self):
        self.events: List[tuple] = []

    @contextlib.contextmanager
    def recording(self):
        real, events = RingExchange.start, self.events

        class Recorded:
            def __init__(self, pending, index):
                self.pending, self.index = pending, index

            def wait(self):
                events.append(("wait", self.index, None))
                return self.pending.wait()

        def start(comm, tensors):
            index = sum(1 for e in events if e[0] == "start")
            events.append(("start", index, list(tensors)))
            return Recorded(real(comm, tensors), index)

        RingExchange.start = start
        try:
            yield
        finally:
            RingExchange.start = real

    def replay(self, comm: RingExchange) -> None:
        pending = {}
        for kind, index, tensors in self.events:
            if kind == "start":
                pending[index] = comm.start(tensors)
            else:
                pending.pop(index).wait()


# ---------------------------------------------------------------------------------------------
# One rank.
# ---------------------------------------------------------------------------------------------


def timed(fn, device: str, warmup: int, iters: int) -> float:
    """Median ms of fn; every timed run starts right after a barrier, so the ranks run together
    (NCCL: the barrier returns once it has completed on the device)."""
    return time_ms(fn, device, warmup, iters, before_each=dist.barrier)


def measure(heads: Heads, args, device: str, dtype, world_size: int, rank: int) -> Dict[str, object]:
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    local_len, d, h, hkv = args.seqlen_per_rank, args.head_dim, heads.heads, heads.heads_kv

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q, k, v, dout = randn(1, local_len, h, d), randn(1, local_len, hkv, d), randn(1, local_len, hkv, d), \
        randn(1, local_len, h, d)
    bias = randn(1, h, 1, local_len)
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]

    def ring_step(kv_exchange):
        def step():
            out = dd.ring_attention(q, k, v, None, bias, causal=True, layout=LAYOUT, kv_exchange=kv_exchange)
            return torch.autograd.grad(out, leaves, dout)
        return step

    # This rank's share on one GPU: each chunk of its queries against keys [0, chunk end), one
    # dense causal (bottom-right) call per chunk. (One packed attention_varlen call would run the
    # general kernels, slower than the dense ones, and overstate the ring's efficiency.)
    chunks = lay.rank_chunks(LAYOUT, world_size, rank, local_len)
    share_inputs = []
    for start, n in chunks:
        end = start + n
        share_inputs.append([randn(1, n, h, d), randn(1, end, hkv, d), randn(1, end, hkv, d), randn(1, h, 1, end),
                             randn(1, n, h, d)])
        for t in share_inputs[-1][:4]:
            t.requires_grad_()

    def share_step():
        grads = []
        for q_c, k_c, v_c, bias_c, dout_c in share_inputs:
            out = dmattn.attention(q_c, k_c, v_c, bias=bias_c, causal=True)
            grads += torch.autograd.grad(out, [q_c, k_c, v_c, bias_c], dout_c)
        return grads

    with torch.no_grad():  # the two exchanges compute the same rows
        ring_out, ag_out = (dd.ring_attention(q, k, v, None, bias, causal=True, layout=LAYOUT,
                                              kv_exchange=exchange).float() for exchange in ("ring", "allgather"))
    agreement = (ring_out - ag_out).abs().max().item() / max(ag_out.abs().max().item(), 1e-6)
    del ring_out, ag_out

    times = {"share": timed(share_step, device, args.warmup, args.iters),
             "ring": timed(ring_step("ring"), device, args.warmup, args.iters)}
    with exchanges_skipped():
        times["compute"] = timed(ring_step("ring"), device, args.warmup, args.iters)
    trace = ExchangeTrace()
    with trace.recording():
        ring_step("ring")()
    comm = RingExchange(dist.group.WORLD, world_size, rank)
    times["exchange"] = timed(lambda: trace.replay(comm), device, args.warmup, args.iters) if trace.events else 0.0
    times["allgather"] = timed(ring_step("allgather"), device, args.warmup, args.iters)
    return {"times": times, "exchanges": sum(1 for e in trace.events if e[0] == "start"),
            "agreement": agreement}


def rank_main(rank: int, world_size: int, args, out_dir: str) -> None:
    device = args.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    options = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)  # binds the communicator (barrier included)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method="file://" + os.path.join(out_dir, "init"), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=180), **options)
    try:
        results = {}
        for heads in (TINY_HEADS if args.tiny else HEADS):
            results[heads.name] = measure(heads, args, device, dtype, world_size, rank)
            if device == "cuda":
                torch.cuda.empty_cache()
        info = {"device": torch.cuda.get_device_name(rank) if device == "cuda" else "cpu",
                "backend": dist.get_backend()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"info": info, "results": results}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The launcher: one process group per world size, one table.
# ---------------------------------------------------------------------------------------------


def run_world(world_size: int, args, deadline: float) -> Optional[List[dict]]:
    """Every rank's results, or None when a rank failed or the deadline (time.monotonic) passed."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(rank_main, nprocs=world_size, args=(world_size, args, tmp), join=False,
                                 start_method="spawn")
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    print(f"W={world_size}: past the deadline (--deadline-s {args.deadline_s:.0f}); ranks ended",
                          file=sys.stderr)
                    return None
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            print(f"W={world_size}: a rank failed: {e}", file=sys.stderr)
            return None
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        ranks = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
        return ranks


def _ms(x: float) -> str:
    return f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def row(name: str, world_size: int, seqlen: int, ranks: List[dict]) -> str:
    """One table row; each time is the largest of the ranks' medians."""
    t = {m: max(r["results"][name]["times"][m] for r in ranks) for m in MEASURES}
    if world_size > 1 and t["exchange"] > 0:
        hidden = f"{max(0.0, 1 - max(0.0, t['ring'] - t['compute']) / t['exchange']):.0%}"
    else:
        hidden = "-"
    total = world_size * seqlen
    cells = [name, str(world_size), f"{total // 1024}k" if total % 1024 == 0 else str(total),
             _ms(t["share"]), _ms(t["ring"]), f"{t['share'] / t['ring']:.2f}",
             _ms(t["compute"]), _ms(t["exchange"]), hidden, _ms(t["allgather"]), f"{t['share'] / t['allgather']:.2f}"]
    return "| " + " | ".join(cells) + " |"


def main():
    args = parse_args()
    # NVLink multicast (NVLS) off: the exchanges are point-to-point, all-gather and all-to-all;
    # NVLS would only add its per-communicator setup and buffers. Inherited by the ranks.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if args.device == "cpu":
        os.environ["OMP_NUM_THREADS"] = "1"  # the ranks share the machine's cores
    dtype = "float32" if args.device == "cpu" else "bf16"
    print(f"# ring_attention scaling: {args.device}, torch {torch.__version__}"
          f"{', CUDA ' + str(torch.version.cuda) if args.device == 'cuda' else ''}; per rank B=1, "
          f"S_local={args.seqlen_per_rank}, D={args.head_dim}, {dtype}, causal, key bias (B, H, 1, S_local) "
          f"with its gradient, layout {LAYOUT}; fwd+bwd ms, per cell the largest of the ranks' medians of "
          f"{args.iters} (after {args.warmup} warm-up), each run after a barrier", flush=True)
    header = ["heads", "GPUs" if args.device == "cuda" else "ranks", "S", "share ms", "ring ms", "ring eff",
              "compute ms", "exchange ms", "hidden", "allgather ms", "allgather eff"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    records, problems = [], []
    deadline = time.monotonic() + (args.deadline_s or float("inf"))
    for world_size in args.world_sizes:
        start = time.monotonic()
        ranks = run_world(world_size, args, deadline)
        if ranks is None:
            problems.append(f"W={world_size}: no result (above)")
            break  # a larger group would fail alike
        if world_size == args.world_sizes[0]:
            print(f"# {ranks[0]['info']['device']}, {ranks[0]['info']['backend']}", flush=True)
        for name in ranks[0]["results"]:
            lines.append(row(name, world_size, args.seqlen_per_rank, ranks))
            worst = max(r["results"][name]["agreement"] for r in ranks)
            if not worst <= (2e-2 if args.device == "cuda" else 1e-4):
                problems.append(f"W={world_size} {name}: ring and allgather outputs differ by {worst:.3g} "
                                f"(relative to the largest |out|)")
        records.append({"world_size": world_size, "ranks": ranks})
        print(f"# W={world_size} done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    print("\n".join(lines))
    for problem in problems:
        print("PROBLEM:", problem)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "heads": [asdict(hd) for hd in (TINY_HEADS if args.tiny else HEADS)],
                       "records": records}, f, indent=1)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
