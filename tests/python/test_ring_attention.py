"""dmattn.distributed (context parallelism) against single-process dmattn on the whole sequence.

* One spawned gloo group per world size (2, 3, 4) runs every case of distributed_cases.py in a
  loop (spawning costs a few seconds) and the invalid-argument checks; each rank writes its
  failures to a file. The group is joined with a deadline and killed after it, and gloo's own
  timeout bounds every collective, so a failing rank cannot hang the suite.
* Marked gpu: the same over NCCL with one GPU per rank (world sizes 2, 4, 8, each skipped where
  fewer GPUs are visible), the cases mapped onto the CUDA kernels (distributed_cases.for_cuda) and
  compared with one dmattn call on one GPU over the whole sequence.
* Local parts without communication: the sharding helpers, the plans, and the backward op's
  ``forward_stats`` mode that the ring's backward is built on.
* World size 1 (a group of this process only) on CPU and, marked gpu, on CUDA (NCCL).
"""

from __future__ import annotations

import datetime
import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dmattn
import dmattn.distributed as dd
from dmattn.distributed import layout as lay
from dmattn.distributed import ring
from dmattn.ops import attention_backward, attention_forward

import distributed_cases

DEADLINE_S = 300
GPU_COUNT = torch.cuda.device_count()


def _spawn(world_size: int, tmp_path, monkeypatch, case_names=None, device="cpu"):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2..4 processes share the machine's cores
    # NVLink multicast (NVLS) off: the exchanges are point-to-point, all-gather and all-to-all;
    # NVLS would only add its per-communicator setup and buffers (no effect with gloo).
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    ctx = mp.start_processes(distributed_cases.worker, nprocs=world_size, join=False, start_method="spawn",
                             args=(world_size, str(tmp_path / "init"), str(tmp_path), case_names, device))
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"world size {world_size}: the ranks did not finish within {DEADLINE_S} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    results = []
    for rank in range(world_size):
        with open(tmp_path / f"rank{rank}.json") as f:
            results.append(json.load(f))
    return results


def _check(results, device: str) -> None:
    failures = [f"rank {rank}: {line}" for rank, r in enumerate(results) for line in r["failures"]]
    assert not failures, "\n".join(failures)
    assert all(r["ran"] == len(distributed_cases.cases_for(device)) for r in results), results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_attention_matches_single_process(world_size, tmp_path, monkeypatch):
    _check(_spawn(world_size, tmp_path, monkeypatch), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [
    pytest.param(w, marks=pytest.mark.skipif(GPU_COUNT < w, reason=f"needs {w} CUDA devices (one per rank), "
                                                                   f"{GPU_COUNT} visible"))
    for w in (2, 4, 8)])
def test_ring_attention_nccl_matches_single_gpu(world_size, tmp_path, monkeypatch):
    """Over NCCL, one GPU per rank: outputs and gradients of every case equal one dmattn call on
    one GPU over the whole sequence (both layouts, both exchanges, key-side and full masks and
    biases, GQA, per-query top-k, determinism, NaN)."""
    _check(_spawn(world_size, tmp_path, monkeypatch, device="cuda"), "cuda")


# ---------------------------------------------------------------------------------------------
# Local parts (no communication).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shard_helpers_roundtrip(world_size):
    x = torch.arange(2 * 4 * world_size * 3).view(2, 4 * world_size, 3)
    for shard, unshard, layout in ((dd.zigzag_shard, dd.zigzag_unshard, "zigzag"),
                                   (dd.contiguous_shard, dd.contiguous_unshard, "contiguous")):
        shards = [shard(x, 1, world_size, r) for r in range(world_size)]
        assert torch.equal(unshard(shards, 1, world_size), x)
        assert torch.equal(unshard(torch.cat(shards, 1), 1, world_size), x)
        for r, s in enumerate(shards):  # the rows hold the positions sequence_positions says
            positions = dd.sequence_positions(4, world_size=world_size, rank=r, layout=layout)
            assert torch.equal(s, x[:, positions])
    if world_size == 2:  # chunks 0 and 3 on rank 0, 1 and 2 on rank 1
        assert dd.zigzag_shard(x, 1, 2, 0)[0, :, 0].tolist() == [0, 3, 18, 21]
    with pytest.raises(ValueError, match="x"):
        dd.zigzag_shard(x[:, :-1], 1, world_size, 0)
    with pytest.raises(ValueError, match="rank"):
        dd.zigzag_shard(x, 1, world_size, world_size)


def _visible(plan_layout, world_size, local_len, causal):
    """Per rank, the (query position, key position) pairs its plan computes, each at most once."""
    seen = set()
    for rank in range(world_size):
        q_pos = dd.sequence_positions(local_len, world_size=world_size, rank=rank, layout=plan_layout).tolist()
        for source, calls in lay.ring_plan(plan_layout, world_size, rank, local_len, causal):
            k_pos = dd.sequence_positions(local_len, world_size=world_size, rank=source,
                                          layout=plan_layout).tolist()
            for call in calls:
                n_q, n_k = call.q_hi - call.q_lo, call.k_end
                for i in range(n_q):
                    for j in range(n_k):
                        if call.causal and j > i + n_k - n_q:  # bottom-right aligned
                            continue
                        pair = (q_pos[call.q_lo + i], k_pos[j])
                        assert pair not in seen
                        seen.add(pair)
    return seen


@pytest.mark.parametrize("plan_layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_ring_plan_covers_each_pair_once(plan_layout, world_size):
    """Every (query, key) pair that causal allows is computed exactly once over the ring, no
    other pair (and every pair without causal); zigzag gives every rank the same work."""
    local_len = 6
    total = world_size * local_len
    assert _visible(plan_layout, world_size, local_len, False) == {(i, j) for i in range(total) for j in range(total)}
    assert _visible(plan_layout, world_size, local_len, True) == {(i, j) for i in range(total) for j in range(i + 1)}
    if plan_layout == "zigzag":
        work = {sum((c.q_hi - c.q_lo) * c.k_end for _, calls in lay.ring_plan("zigzag", world_size, r, local_len, True)
                    for c in calls) for r in range(world_size)}
        assert len(work) == 1


def test_backward_forward_stats_splits_keys(device):
    """dmattn::bwd with forward_stats on the whole row's out and lse: the gradients of two halves
    of the keys are the two halves of the whole (and dq their sum); the ring's backward relies on
    it. On its own call's out and lse it is the ordinary backward. CUDA (float16): FlashAttention's
    statistics path against the exact one, to rounding."""
    dtype = torch.float64 if device == "cpu" else torch.float16
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device, dtype)

    q, dout = randn(2, 40, 4, 16), randn(2, 40, 4, 16)
    k, v = randn(2, 50, 2, 16), randn(2, 50, 2, 16)
    bias = randn(2, 4, 1, 50)
    mask = (torch.rand(1, 1, 40, 50, generator=gen) > 0.3).to(device)
    out, lse = attention_forward(q, k, v, mask, bias, True, -1, -1, None, 0.0, False)
    whole = attention_backward(dout, q, k, v, out, lse, mask, bias, True, True, -1, -1, None, 0.0, False)[:4]
    given = attention_backward(dout, q, k, v, out, lse, mask, bias, True, True, -1, -1, None, 0.0, False,
                               None, 0, None, True)[:4]

    def close(a, b):
        tol = 1e-12 if dtype == torch.float64 else 2e-2 * b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)

    for a, b in zip(whole, given):
        close(a, b)
    cut = 22  # keys [0, 22) and [22, 50)
    # Causal over the whole row: key j <= i + 10. The halves' calls see the same rule through the mask.
    causal = (torch.arange(50) <= torch.arange(40).unsqueeze(1) + 10).to(device)
    first = attention_backward(dout, q, k[:, :cut], v[:, :cut], out, lse, (mask & causal)[..., :cut],
                               bias[..., :cut], True, False, -1, -1, None, 0.0, False, None, 0, None, True)
    second = attention_backward(dout, q, k[:, cut:], v[:, cut:], out, lse, (mask & causal)[..., cut:],
                                bias[..., cut:], True, False, -1, -1, None, 0.0, False, None, 0, None, True)
    close(first[0].double() + second[0].double(), whole[0].double())
    for index in (1, 2, 3):
        close(torch.cat([first[index], second[index]], 1 if index < 3 else -1), whole[index])


# ---------------------------------------------------------------------------------------------
# World size 1: a group of this process alone.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def single_rank_group(tmp_path, device):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    backend = "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, init_method="file://" + str(tmp_path / "init"), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kv_exchange", ["ring", "ring_general", "allgather"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_world_size_one_equals_attention(single_rank_group, device, layout, kv_exchange, monkeypatch):
    """One rank: ring_attention is dmattn.attention (causal, GQA, a key bias with its gradient).
    ring_general: the ring pass's general code (accumulators, merge, the backward with the given
    statistics, on CUDA FlashAttention's against the exact path: rounding) instead of the one call."""
    if kv_exchange == "ring_general":
        monkeypatch.setattr(ring, "_single_call", lambda spec: False)
        kv_exchange = "ring"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 256, 8, 64, generator=gen).to(device, dtype)
    k, v = (torch.randn(2, 256, 2, 64, generator=gen).to(device, dtype) for _ in range(2))
    bias = torch.randn(2, 8, 1, 256, generator=gen).to(device, dtype)
    dout = torch.randn(2, 256, 8, 64, generator=gen).to(device, dtype)
    results = []
    for fn in (lambda *a, **kw: dmattn.attention(*a, **kw),
               lambda *a, **kw: dd.ring_attention(*a, layout=layout, kv_exchange=kv_exchange, **kw)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out, lse = fn(*leaves[:3], None, leaves[3], causal=True, return_lse=True)
        results.append([out, lse, *torch.autograd.grad(out, leaves, dout)])
    for name, got, want in zip(["out", "lse", "dq", "dk", "dv", "dbias"], results[1], results[0]):
        bound = (2e-2 if dtype == torch.bfloat16 else 1e-5) * want.float().abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= bound, name
