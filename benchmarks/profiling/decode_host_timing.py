"""Figures: host time per decoding call, docs/perf.md "Decode", docs/decode.md "Host time".

Host time of one decoding call, layer by layer, against SDPA: where an eager decode step's
time goes before the GPU starts.

B=8 H=32 Hkv=8, a 32k cache, one query, bf16, D=128. For each layer of the call
(`attention_with_kvcache`; `dmattn.attention` on the same cache (its direct route to the
decode kernel); the cache call's op body, `decode.kvcache_forward`; the native call alone with
the outputs and workspace allocated beforehand, with the key splits and with one split; the
native call that allocates them, as `attention_with_kvcache` calls it) and for
SDPA (enable_gqa), medians of single calls after a synchronization (as a timed eager call starts,
the CPU idle until then): the host time until the call returns, the CUDA-event time of the call,
the same call replayed from a CUDA graph, and their difference; then the host time per call of
200 calls back to back (the GPU busy meanwhile).
    PYTHONPATH=python python3 benchmarks/profiling/decode_host_timing.py [--calls 40]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import dmattn
from dmattn import decode, decode_kernel
from dmattn._lib import lib
from dmattn.bench import cuda_graph_of


def single_calls(fn, calls):
    """(host us, event us) medians of calls after a synchronization each."""
    hosts, events = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        hosts.append((t1 - t0) * 1e6)
        events.append(start.elapsed_time(end) * 1e3)
    return statistics.median(hosts), statistics.median(events)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    dev, dt, D = "cuda", torch.bfloat16, 128
    B, H, Hkv, Sk = 8, 32, 8, 32768
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, 1, H, D, device=dev, dtype=dt, generator=g)
    k = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dt, generator=g)
    lengths = torch.full((B,), Sk, dtype=torch.int32, device=dev)
    splits = decode_kernel._decode_splits(q, Hkv, Sk, decode_kernel.KVCACHE_MAX_ROWS)
    out, lse = torch.empty_like(q), torch.empty(B, H, 1, device=dev)
    workspace = torch.empty(splits * B * H * (D + 1), device=dev)
    nan = float("nan")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    cases = {
        "SDPA (enable_gqa)": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
        "attention_with_kvcache": lambda: dmattn.attention_with_kvcache(q, k, v, cache_seqlens=lengths,
                                                                        causal=False),
        "dmattn.attention": lambda: dmattn.attention(q, k, v),
        "its op's body": lambda: decode.kvcache_forward._init_fn(q, k, v, lengths, None, None, None, False, -1, -1,
                                                                 None, 0.0),
        f"native call, {splits} splits": lambda: lib().forward_decode(
            q, k, v, out, lse, None, None, False, -1, -1, nan, 0.0, lengths, None, workspace, splits, None),
        "native call, allocating": lambda: lib().decode_attention(
            q, k, v, None, None, None, False, -1, -1, nan, 0.0, lengths, None, splits, True, None),
        "native call, 1 split": lambda: lib().forward_decode(
            q, k, v, out, lse, None, None, False, -1, -1, nan, 0.0, lengths, None, None, 1, None),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us, medians of {args.calls} single calls")
    print(f"{'call':<28} {'host':>7} {'eager':>8} {'graph':>8} {'eager-graph':>12} {'host, back to back':>19}")
    for name, fn in cases.items():
        for _ in range(10):
            fn()
        host, eager = single_calls(fn, args.calls)
        _, graph = single_calls(cuda_graph_of(fn), args.calls)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        loop = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        print(f"{name:<28} {host:7.1f} {eager:8.1f} {graph:8.1f} {eager - graph:12.1f} {loop:19.1f}", flush=True)


if __name__ == "__main__":
    main()
