"""Benchmark of Doge-style per-query causal top-k attention, at two levels, with peers in the
same run:

* ``kernel``: one attention layer, forward + backward with the selection included:
  dmattn.attention_topk(causal=True, per_query=True) with a learnable per-key bias
  (B, H, 1, S) and keep = 2048, beside dmattn's shared key set (one top-k per (batch, head)),
  dmattn's dense causal attention and PyTorch SDPA's causal attention (no bias);
* ``hf``: one training step (forward, loss, backward) of transformers' DogeForCausalLM
  (2 layers, hidden 2048, 16 heads of 128, keep_window_size 2048, bf16) with
  attn_implementation "dmattn" (dmattn.integrations.transformers.register()), "sdpa" and
  "eager": median step time and peak memory; and "floor": the dmattn model with its attention
  replaced by the value rows (no selection, no attention; zero times q, k and the bias added, so
  that every projection's gradient is still computed), the time and memory of the rest of the
  model.

    python -m dmattn.bench.doge [--suite kernel,hf] [--seq 8192,32768] [--json out.json]

CUDA only. Times: median of CUDA-event timings, each run started on an idle GPU (host launch
latency included), and beside it for the kernel rows the mean of runs issued back to back; TFLOP/s for the kernel rows count the work of
the kept keys only (4 * B * H * D * sum over queries of the kept count, x 3.5 with backward).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Dict, List, Optional

import torch

from .. import per_query_path
from .timing import back_to_back_ms, time_ms

KEEP = 2048


def _kept_pairs(num_queries: int, keep: int) -> int:
    """Sum over causal queries of min(keep, i + 1): the attended (query, key) pairs."""
    full = max(0, num_queries - keep)
    ramp = min(num_queries, keep)
    return ramp * (ramp + 1) // 2 + full * keep


def _kernel_rows(batch: int, heads: int, seq: int, head_dim: int, segments: List[int], warmup: int,
                 iters: int) -> List[Dict]:
    from ..interface import attention
    from ..topk import attention_topk

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = (randn(batch, seq, heads, head_dim).requires_grad_() for _ in range(3))
    bias = randn(batch, heads, 1, seq).requires_grad_()
    dout = randn(batch, seq, heads, head_dim)
    leaves = [q, k, v, bias]

    def step(fn: Callable[[], torch.Tensor], with_bias: bool = True) -> Callable[[], object]:
        def run():
            return torch.autograd.grad(fn(), leaves if with_bias else leaves[:3], dout)
        return run

    pairs = batch * heads * _kept_pairs(seq, KEEP)
    flops = 4 * head_dim * pairs * 3.5
    dense_flops = 4 * head_dim * batch * heads * (seq * (seq + 1) // 2) * 3.5
    rows = []

    def add(name: str, fn: Callable[[], object], work: float) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = time_ms(fn, "cuda", warmup, iters)
        b2b = back_to_back_ms(fn, iters)
        rows.append(dict(suite="kernel", config=f"B={batch} H={heads} S={seq} D={head_dim} keep={KEEP}",
                         provider=name, ms=ms, back_to_back_ms=b2b, tflops=work / ms / 1e9,
                         peak_gib=torch.cuda.max_memory_allocated() / 2**30))
        print(f"  {rows[-1]['config']:<40} {name:<34} {ms:8.2f} ms  {b2b:8.2f} ms back to back  "
              f"{rows[-1]['tflops']:6.0f} TFLOP/s  {rows[-1]['peak_gib']:5.1f} GiB", flush=True)

    saved = per_query_path.SEGMENT_LEN
    try:
        for seg in segments:
            per_query_path.SEGMENT_LEN = seg
            add("dmattn per-query top-k" + (f" (segment {seg})" if seg else ""),
                step(lambda: attention_topk(q, k, v, bias, KEEP, causal=True, per_query=True)), flops)
    finally:
        per_query_path.SEGMENT_LEN = saved
    add("dmattn shared-set top-k", step(lambda: attention_topk(q, k, v, bias, KEEP, causal=True)),
        4 * head_dim * batch * heads * KEEP * seq / 2 * 3.5)
    add("dmattn dense causal, no bias", step(lambda: attention(q, k, v, causal=True), False), dense_flops)

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)
    add("SDPA causal, no bias", step(sdpa, False), dense_flops)
    return rows


def _doge_config(seq: int):
    from transformers import DogeConfig

    return DogeConfig(vocab_size=32768, hidden_size=2048, intermediate_size=4096, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=16, keep_window_size=KEEP,
                      max_position_embeddings=max(seq, 2048), is_moe=False, attention_dropout=0.0)


def _values_only(q, k, v, bias, *args, **kwargs):
    """The "floor" row's attention: the value rows as they are (no selection, no attention),
    plus zero times q, k and the bias, so that the backward still reaches every projection the
    attention reads (q_proj, k_proj, their norms and rotary embedding, dt_proj and A): the
    floor is the rest of the step, not a smaller model."""
    group = q.shape[2] // k.shape[2]  # query heads per kv head
    if group > 1:
        k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    return v + (q + k) * 0 + bias.sum() * 0


def _hf_rows(seq: int, implementations: List[str], warmup: int, iters: int) -> List[Dict]:
    from transformers import DogeForCausalLM

    from ..integrations import doge as hf_doge
    from ..integrations.transformers import register

    register()
    rows = []
    for impl in implementations:
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        row = dict(suite="hf", config=f"DogeForCausalLM 2 layers, hidden 2048, 16 heads, keep {KEEP}, B=1 S={seq}",
                   provider=impl)
        model = None
        # floor: the dmattn model with its attention call returning the value rows (and zero
        # times q, k and the bias), i.e. what the rest of the step costs (projections, norms,
        # rotary embedding, dt_states, MLP, output layer, loss, and all their gradients).
        saved_attention = hf_doge.attention_topk
        if impl == "floor":
            hf_doge.attention_topk = _values_only
        try:
            config = _doge_config(seq)
            config._attn_implementation = "dmattn" if impl == "floor" else impl
            model = DogeForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():  # A is zero at initialization: every dt_state 1, all keys tied
                for layer in model.model.layers:
                    layer.self_attn.A.normal_()
            ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda")

            def step():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                model.zero_grad(set_to_none=True)

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            row["ms"] = time_ms(step, "cuda", warmup, iters)
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            print(f"  S={seq:<6} {impl:<8} {row['ms']:8.1f} ms  peak {row['peak_gib']:5.1f} GiB", flush=True)
        except torch.cuda.OutOfMemoryError:
            row["error"] = "out of memory"
            print(f"  S={seq:<6} {impl:<8} out of memory", flush=True)
        finally:
            hf_doge.attention_topk = saved_attention
            del model
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="kernel,hf", help="comma-separated: kernel, hf")
    ap.add_argument("--seq", default="8192,32768", help="comma-separated sequence lengths")
    ap.add_argument("--segments", default="",
                    help="comma-separated segment lengths of the per-query path to time (default: its own "
                         "choice)")
    ap.add_argument("--impl", default="dmattn,sdpa,eager,floor",
                    help="HF attn_implementations, and floor (the model without its attention)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", help="write the rows to this JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dmattn.bench.doge: needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    suites = args.suite.split(",")
    seqs = [int(s) for s in args.seq.split(",")]
    segments = [int(s) for s in args.segments.split(",")] if args.segments else [None]
    rows: List[Dict] = []
    for seq in seqs:
        if "kernel" in suites:
            batch = 2 if seq <= 8192 else 1
            rows += _kernel_rows(batch, 16, seq, 128, segments, args.warmup, args.iters)
        if "hf" in suites:
            impls = args.impl.split(",")
            if seq > 8192:  # eager materializes (B, H, S, S) fp32 scores: far beyond the GPU's memory
                impls = [i for i in impls if i != "eager"]
            rows += _hf_rows(seq, impls, max(1, args.warmup - 1), max(3, args.iters // 2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
