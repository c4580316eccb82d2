"""Figures: docs/perf.md, "Decode (one short query block against a KV cache)".

Decode timings (one short query block against a long KV cache) of dmattn against SDPA
(enable_gqa, PyTorch's own kernel choice) in one process.

bf16, D=128; median of CUDA-event timings after warm-up. Rows: B=8 H=32 Hkv=8 with a full 32k
cache, Sq=1 (plain and with a per-key bias (B, H, 1, Sk)), paged caches (page 64 and 256), Sq=4 and
16 (16 also with the per-key bias, and with a key mask (B, 1, 1, Sk) hiding 1 key in 8); B=1 with a
128k cache; B=8 with ragged cache lengths (1k to
32k: a server's batch; dmattn only, TB/s of the keys the rows hold); a Doge decoding step (top 2048
of a 32k cache by a per-key bias, selection included). dmattn runs attention_with_kvcache (the
split-KV decode kernel; the cache is read in place) and dmattn.attention (the decode kernel too,
unless DMATTN_DECODE=0 in the environment), and flash_dmattn_func too (flash-dmattn's function, the
same route as dmattn.attention). --general times dmattn.attention with DMATTN_DECODE=0 (the kernels
of the long-sequence path), in a process of its own. TB/s counts the K and V bytes read once (the
floor of any decode kernel; for the Doge step, the kept keys' bytes). --graph adds, under each row,
the same call replayed from a CUDA graph (GRAPH_REPEAT calls in one graph, the time per call): the
kernels' time without the host's. Every row is also timed back to back (calls issued without
waiting, the mean per call: the launch latency hidden). No causal mask (SDPA's is top-left
aligned), so every call reads every key.

--rounds N (default 3) runs the whole set N times, each round on tensors allocated afresh, and
ends with a table of each row's median over the rounds and its range (single rows move by a few
percent between rounds). --only REGEX keeps the cases whose name it finds. DMATTN_DECODE_BALANCED=1
in the environment runs attention_with_kvcache in the balanced form (docs/decode.md, "Balanced
shares").
    PYTHONPATH=python python3 benchmarks/profiling/decode_timing.py [--general] [--graph] [--iters 50] [--rounds 3] [--only REGEX] [--json FILE]
"""

import argparse
import json
import os
import re
import statistics

import torch
import torch.nn.functional as F

import dmattn
from dmattn.bench import cuda_graph_of, time_ms as bench_time_ms
from dmattn.bench.timing import back_to_back_ms


# Calls per CUDA graph: the graph rows time GRAPH_REPEAT calls replayed back to back and give the
# time per call, the kernels' alone. One call per graph also times the graph launch's latency:
# tens of microseconds, and up to 65 more in some processes (the profiled kernels unchanged).
GRAPH_REPEAT = 10


def time_ms(fn, iters=50):
    return bench_time_ms(fn, "cuda", 5, iters)


def copy_ceiling(nbytes):
    """TB/s of a device-to-device copy of nbytes / 2 (reads + writes nbytes): the memory roof."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return nbytes / (time_ms(lambda: dst.copy_(src)) * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="runs of the whole set, each on fresh tensors")
    ap.add_argument("--json", default="")
    ap.add_argument("--general", action="store_true", help="only dmattn.attention with DMATTN_DECODE=0")
    ap.add_argument("--graph", action="store_true",
                    help="also time each call replayed from a CUDA graph (no host time: the kernels alone)")
    ap.add_argument("--only", default="", help="a regex: only the cases whose name it finds")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {args.rounds}")
    dev, dt, D = "cuda", torch.bfloat16, 128
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    current_round = [0]

    def add(case, name, fn, kv_bytes, form="idle"):
        """Times fn as a single call from an idle GPU (host time counts); then, for the same
        row, back to back (the host runs ahead) and, with --graph, from a CUDA graph."""
        try:
            if form == "graph":
                ms = time_ms(cuda_graph_of(fn, GRAPH_REPEAT), iters=args.iters) / GRAPH_REPEAT
            elif form == "back to back":
                ms = back_to_back_ms(fn, args.iters)
            else:
                ms = time_ms(fn, iters=args.iters)
        except Exception as e:  # noqa: BLE001
            print(f"{case} {name}: {type(e).__name__}: {str(e)[:200]}")
            ms = float("nan")
        tbs = kv_bytes / (ms * 1e-3) / 1e12
        label = name if form == "idle" else f"{name}, {form}"
        rows.append(dict(case=case, impl=label, ms=ms, kv_tb_s=tbs, kv_bytes=kv_bytes, round=current_round[0]))
        print(f"{case:<34} {label:<38} {ms:8.3f} ms {tbs:6.2f} TB/s", flush=True)
        if form == "idle":
            add(case, name, fn, kv_bytes, form="back to back")
            if args.graph:
                add(case, name, fn, kv_bytes, form="graph")

    if args.general:
        os.environ["DMATTN_DECODE"] = "0"

    def wanted(case):
        return not args.only or re.search(args.only, case) is not None

    def workload(case, B, H, Hkv, Sk, Sq, bias=False, pages=(), key_mask=False):
        if not wanted(case):
            return
        q = torch.randn(B, Sq, H, D, device=dev, dtype=dt, generator=g)
        k = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dt, generator=g)
        b = torch.randn(B, H, 1, Sk, device=dev, dtype=dt, generator=g) if bias else None
        # (a padding-like key mask: 1 in 8 keys hidden)
        m = torch.rand(B, 1, 1, Sk, device=dev, generator=g) > 0.125 if key_mask else None
        kv_bytes = 2 * k.numel() * k.element_size()
        seqlens = torch.full((B,), Sk, dtype=torch.int32, device=dev)
        if args.general:
            add(case, "dmattn attention (general)", lambda: dmattn.attention(q, k, v, bias=b), kv_bytes)
            return
        add(case, "dmattn kvcache", lambda: dmattn.attention_with_kvcache(
            q, k, v, cache_seqlens=seqlens, bias=b, mask=m, causal=False), kv_bytes)
        add(case, "dmattn attention", lambda: dmattn.attention(q, k, v, mask=m, bias=b), kv_bytes)
        add(case, "flash_dmattn_func", lambda: dmattn.flash_dmattn_func(q, k, v, attn_mask=m, attn_bias=b), kv_bytes)
        for page in pages:
            blocks = Sk // page
            table = torch.randperm(B * blocks, device=dev).view(B, blocks).to(torch.int32)
            kp = torch.empty(B * blocks, page, Hkv, D, device=dev, dtype=dt)
            vp = torch.empty_like(kp)
            kp[table.long()] = k.view(B, blocks, page, Hkv, D)
            vp[table.long()] = v.view(B, blocks, page, Hkv, D)
            add(case, f"dmattn kvcache page {page}", lambda: dmattn.attention_with_kvcache(
                q, kp, vp, cache_seqlens=seqlens, block_table=table, bias=b, mask=m, causal=False), kv_bytes)
            del kp, vp
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        sdpa_mask = b if m is None else m  # (the mask rows take no bias beside them)
        add(case, "SDPA (enable_gqa)", lambda: F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=sdpa_mask, enable_gqa=True), kv_bytes)
        # The decode kernel against the float64 reference of one row (sanity, not timed).
        out = dmattn.attention_with_kvcache(q[:1], k[:1], v[:1], cache_seqlens=seqlens[:1],
                                            bias=None if b is None else b[:1], mask=None if m is None else m[:1],
                                            causal=False)
        ref = F.scaled_dot_product_attention(qt[:1].double(), kt[:1].double(), vt[:1].double(),
                                             attn_mask=(None if b is None else b[:1].double()) if m is None else m[:1],
                                             enable_gqa=True)
        err = (out.transpose(1, 2).double() - ref).abs().max().item()
        print(f"{case:<34} max |dmattn - float64| = {err:.2e}", flush=True)
        del q, k, v, b

    def ragged(case, H, Hkv, lens):
        """attention_with_kvcache over rows of unequal cache lengths (the cache sized for the
        longest); TB/s of the keys the rows hold."""
        if not wanted(case):
            return
        B, Sk = len(lens), max(lens)
        q = torch.randn(B, 1, H, D, device=dev, dtype=dt, generator=g)
        k = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dt, generator=g)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
        kv_bytes = 2 * sum(lens) * Hkv * D * k.element_size()
        add(case, "dmattn kvcache", lambda: dmattn.attention_with_kvcache(
            q, k, v, cache_seqlens=seqlens, causal=False), kv_bytes)
        del q, k, v

    def doge(case, B, H, Hkv, Sk, keep):
        """A Doge decoding step: one query, the top-``keep`` keys of the cache by a per-key
        bias (B, Hkv, 1, Sk) (dt_states), selection included. SDPA gets the same selection as
        a float mask (torch.topk and a scatter, as transformers' Doge builds it)."""
        if not wanted(case):
            return
        q = torch.randn(B, 1, H, D, device=dev, dtype=dt, generator=g)
        k = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(B, Sk, Hkv, D, device=dev, dtype=dt, generator=g)
        dts = torch.randn(B, Hkv, 1, Sk, device=dev, dtype=dt, generator=g)
        kept_bytes = 2 * k.numel() * k.element_size() * keep // Sk
        add(case, "dmattn attention_topk", lambda: dmattn.attention_topk(
            q, k, v, dts, keep, causal=True, per_query=True), kept_bytes)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def sdpa():
            index = dts.topk(keep, dim=-1).indices
            mask = torch.full_like(dts, float("-inf")).scatter(-1, index, dts.gather(-1, index))
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask.repeat_interleave(H // Hkv, 1),
                                                  enable_gqa=True)
        add(case, "SDPA (top-k float mask)", sdpa, kept_bytes)
        del q, k, v, dts

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, D={D}")
    print(f"copy ceiling: {copy_ceiling(1 << 30):.2f} TB/s")
    for round_index in range(args.rounds):
        current_round[0] = round_index  # (read by add())
        print(f"-- round {round_index + 1} of {args.rounds}", flush=True)
        workload("B=8 H=32 Hkv=8 Sk=32k Sq=1", 8, 32, 8, 32768, 1, pages=(64, 256))
        workload("... per-key bias (B,H,1,Sk)", 8, 32, 8, 32768, 1, bias=True)
        workload("B=1 H=32 Hkv=8 Sk=128k Sq=1", 1, 32, 8, 131072, 1)
        workload("B=8 H=32 Hkv=8 Sk=32k Sq=4", 8, 32, 8, 32768, 4)
        workload("B=8 H=32 Hkv=8 Sk=32k Sq=16", 8, 32, 8, 32768, 16)
        workload("... Sq=16, per-key bias (B,H,1,Sk)", 8, 32, 8, 32768, 16, bias=True)
        workload("... Sq=16, key mask (B,1,1,Sk)", 8, 32, 8, 32768, 16, key_mask=True)
        if not args.general:
            ragged("B=8 H=32 Hkv=8 ragged 1k-32k Sq=1", 32, 8, [32768, 4096, 16384, 1024, 32768, 8192, 2048, 24576])
            doge("Doge B=8 H=32 Hkv=8 Sk=32k top-2048", 8, 32, 8, 32768, 2048)
    summary = summarize(rows)
    if args.rounds > 1:
        print(f"\nmedian over {args.rounds} rounds [min - max], ms, and TB/s of the median")
        for r in summary:
            print(f"{r['case']:<34} {r['impl']:<38} {r['ms']:8.3f} ms [{r['min']:.3f} - {r['max']:.3f}] "
                  f"{r['kv_tb_s']:6.2f} TB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rounds=args.rounds, rows=rows, summary=summary),
                      f, indent=1)


def summarize(rows):
    """One row per (case, impl) in first-seen order: the median over rounds, min, max."""
    groups = {}
    for r in rows:
        groups.setdefault((r["case"], r["impl"]), []).append(r)
    out = []
    for (case, impl), rs in groups.items():
        times = [r["ms"] for r in rs]
        ms = statistics.median(times)
        out.append(dict(case=case, impl=impl, ms=ms, min=min(times), max=max(times),
                        kv_tb_s=rs[0]["kv_bytes"] / (ms * 1e-3) / 1e12))
    return out


if __name__ == "__main__":
    main()
