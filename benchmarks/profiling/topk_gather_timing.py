"""Figures: docs/perf.md, "Doge, one key set per (batch, head)": where the time goes.

Where the time of dmattn.attention_topk (the gather path) goes on the GPU.

    PYTHONPATH=python python3 benchmarks/profiling/topk_gather_timing.py [--profile]

Times (median of CUDA events, dmattn.bench.time_ms) for bf16, D=128, H=16, a per-key bias
(B, H, 1, S) with gradient, keep=2048, causal:
  * attention_topk end to end (top-k selection, positions, gathers, kernels, scatter-back),
    forward and forward+backward, gather path and (for comparison) the dense masked path;
  * its pieces at B=2, S=8192: the dense path's selection (dynamic_mask), the gather path's
    key set (its selection kernel, which also writes the bias at the kept keys), the copies of
    the kept K / V rows, the raw forward and backward ops reading the kept rows in place and
    from the copies, the scatter-back of dK, dV;
  * the scaling series S = 4096 .. 32768 at B=1 (work should follow keep, not S);
  * --profile: the CUDA kernels of one forward and one forward+backward step (torch.profiler), by total time,
    the step's GPU idle gaps (where the GPU waited for the host, and before which kernel), and
    the host time to enqueue one step while the GPU is kept busy (no waiting on the GPU).
"""

from __future__ import annotations

import argparse
import time

import torch

import dmattn
from dmattn import gather
from dmattn.bench import time_ms
from dmattn.masks import bias_over_keys

H, D, KEEP = 16, 128, 2048


def make(batch: int, seqlen: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device="cuda", dtype=torch.bfloat16)

    q, k, v, dout = (randn(batch, seqlen, H, D) for _ in range(4))
    bias = randn(batch, H, 1, seqlen)
    for t in (q, k, v, bias):
        t.requires_grad_(True)
    return q, k, v, bias, dout


def step_fns(q, k, v, bias, dout, path=None):
    def fwd():
        with torch.no_grad(), gather.force_path(path):
            return dmattn.attention_topk(q, k, v, bias, KEEP, causal=True)

    def fwd_bwd():
        with gather.force_path(path):
            out = dmattn.attention_topk(q, k, v, bias, KEEP, causal=True)
        return torch.autograd.grad(out, (q, k, v, bias), dout)

    return fwd, fwd_bwd


def pieces(q, k, v, bias, dout, warmup, iters):
    """Times of the gather path's parts on these inputs (ms): the selection, then the kernels
    reading the kept rows in place (the default) and from gathered copies
    (DMATTN_INDEXED_KEYS=0)."""
    batch, num_keys = q.shape[0], k.shape[1]
    t = {}
    t["selection (dynamic_mask)"] = time_ms(lambda: dmattn.dynamic_mask(bias, KEEP), "cuda", warmup, iters)

    def key_set():  # the selection: sorted positions and the bias at them, one kernel
        return gather.topk_key_set(q, k, bias, KEEP, None, False)

    t["key set: positions + bias rows (one kernel)"] = time_ms(key_set, "cuda", warmup, iters)
    ks = key_set()
    positions, bias_rows = ks.positions, ks.bias_rows
    flat = gather._flat_row_index(ks.key_index(), batch, H, num_keys, k.shape[2])

    def gathers():
        return (gather._gather_rows(k, flat, KEEP, H, True), gather._gather_rows(v, flat, KEEP, H, True))

    t["copies of the kept K, V rows"] = time_ms(gathers, "cuda", warmup, iters)
    k_rows, v_rows = (x.detach() for x in gathers())
    opts = (True, -1, -1, None, 0.0, False)
    q0, k0, v0 = q.detach(), k.detach(), v.detach()
    for rows, (kk, vv, key_rows) in (("in place", (k0, v0, positions)), ("copies", (k_rows, v_rows, None))):
        fwd = lambda: torch.ops.dmattn.fwd(q0, kk, vv, None, bias_rows, *opts, positions, num_keys, None, key_rows)
        t[f"forward kernel, rows {rows} (raw op)"] = time_ms(fwd, "cuda", warmup, iters)
        out, lse = fwd()
        bwd = lambda: torch.ops.dmattn.bwd(dout, q0, kk, vv, out, lse, None, bias_rows, True, *opts, positions,
                                           num_keys, None, False, key_rows)
        t[f"backward kernels, rows {rows} (raw op)"] = time_ms(bwd, "cuda", warmup, iters)
        grads = bwd()

    def scatter_back():
        zeros = torch.zeros(batch * num_keys * H, D, dtype=k.dtype, device=k.device)
        zeros.index_copy_(0, flat, grads[1].reshape(-1, D))
        zeros2 = torch.zeros_like(zeros).index_copy_(0, flat, grads[2].reshape(-1, D))
        return zeros, zeros2

    t["scatter-back of dK, dV (index_copy_)"] = time_ms(scatter_back, "cuda", warmup, iters)
    return t


def host_enqueue_ms(fn, rounds: int = 10) -> float:
    """Host time to enqueue fn (best of rounds) while a sleep kernel keeps the GPU busy, so that
    nothing waits on the device: what a step costs the CPU alone."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time, longer than any host enqueue here
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best * 1e3


def gpu_gaps(prof, top: int = 8) -> None:
    """Span of the profiled step on the GPU, its busy time (kernels and memsets / copies), and
    the largest idle gaps with the kernel that ended each (the GPU waiting for the host)."""
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    if not evs:
        return
    span = evs[-1].time_range.end - evs[0].time_range.start
    busy, gaps, end = 0.0, [], evs[0].time_range.start
    for e in evs:
        start, stop = e.time_range.start, e.time_range.end
        if start > end:
            gaps.append((start - end, e.name))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    print(f"GPU span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms "
          f"in {len(gaps)} gaps; largest (us, next kernel):")
    for gap, name in sorted(gaps, reverse=True)[:top]:
        print(f"  {gap:8.1f}  {name[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    w, n = args.warmup, args.iters
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")

    x = make(2, 8192)
    print("\n## B=2, S=8192, H=16, D=128, bf16, per-key bias + grad, keep=2048, causal")
    for path in ("gather", "dense"):
        fwd, fwd_bwd = step_fns(*x, path=path)
        print(f"attention_topk [{path:6}]  fwd {time_ms(fwd, 'cuda', w, n):7.3f} ms   "
              f"fwd+bwd {time_ms(fwd_bwd, 'cuda', w, n):7.3f} ms  (mask construction included)")
    print("\npieces of the gather path:")
    for name, ms in pieces(*x, w, n).items():
        print(f"  {name:38} {ms:7.3f} ms")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        fwd, fwd_bwd = step_fns(*x, path="gather")
        for name, fn in (("forward", fwd), ("forward + backward", fwd_bwd)):
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            print(f"\n{name}:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
            gpu_gaps(prof)
        print(f"host enqueue time (GPU kept busy): fwd {host_enqueue_ms(fwd):.3f} ms, "
              f"fwd+bwd {host_enqueue_ms(fwd_bwd):.3f} ms")
    del x

    print("\n## scaling at B=1 (keep=2048, causal), attention_topk end to end")
    base = None
    for s in (4096, 8192, 16384, 32768):
        x = make(1, s)
        fwd, fwd_bwd = step_fns(*x, path="gather")
        tf, tfb = time_ms(fwd, "cuda", w, n), time_ms(fwd_bwd, "cuda", w, n)
        base = base or (s, tfb)
        print(f"S={s:6}  fwd {tf:7.3f} ms  fwd+bwd {tfb:7.3f} ms  "
              f"(fwd+bwd x{tfb / base[1]:.2f} for S x{s / base[0]:.0f})")
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
