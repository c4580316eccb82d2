"""Figures: docs/perf.md, "Decode": transformers generate() with dmattn beside sdpa.

Greedy generate() throughput of transformers models with attn_implementation "dmattn" beside
"sdpa" (and "eager" with --eager), in one process.

Models (random weights, bf16, DynamicCache, or with --cache static a StaticCache, whose
decoding steps transformers compiles, torch.compile with CUDA graphs; the warm-up call
compiles): a Llama-style model (4 layers, hidden 2048, 16 query
heads, 4 kv heads, head_dim 128) and a Doge model of the same size (keep_window_size 2048: its
decoding steps attend to the top 2048 keys of the cache by dt_states). Every row gets exactly
--new tokens after a --prompt-token prompt (no padding). Reported per batch size:
  tokens/s   batch * new / the whole generate() call (prefill included);
  decode/s   batch * (new - 1) / (time of generate(new) - time of generate(1)): the decoding
             steps alone, where the attention reads the cache.
Median of --runs timed rounds after one warm-up call of each implementation; the rounds take the
implementations in alternating order, so that a machine's drift falls on all alike. Also reports
how many of the first row's greedy tokens equal eager's, for sdpa and dmattn (eager's tokens from
one untimed call unless --eager times it; reported, not asserted: bf16 near-ties can part them).
Eager is the reference: transformers' Doge under sdpa does not compute eager's attention (its
logits differ from eager's by far more than rounding), dmattn's do within bf16 rounding.
    PYTHONPATH=python python3 benchmarks/profiling/hf_generate_timing.py [--batch 1,8] [--prompt 8192]
        [--new 64] [--models llama,doge] [--cache dynamic|static] [--eager] [--json FILE]
"""

import argparse
import json
import statistics
import time

import torch

from dmattn.integrations.transformers import register


def build(name: str, prompt: int, new: int):
    import transformers

    common = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=prompt + new + 8)
    torch.manual_seed(0)
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.DogeForCausalLM(transformers.DogeConfig(keep_window_size=2048, is_moe=False, **common))
        with torch.no_grad():  # A is zero at initialization: every dt_state 1, all keys tied
            for layer in model.model.layers:
                layer.self_attn.A.normal_()
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


@torch.no_grad()
def generate_call(model, ids, new: int, cache: str):
    """(seconds, output ids) of one greedy generate() call, from a synchronized GPU to its end."""
    options = dict(cache_implementation="static") if cache == "static" else {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0, **options)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def timed_rounds(model, ids, impls, new: int, runs: int, cache: str):
    """{impl: (median seconds of generate(new), of generate(1), the warm-up's output)}: each
    implementation warmed up once, then ``runs`` rounds that take the implementations in
    alternating order (a machine's drift over the rounds falls on all of them alike)."""
    times = {impl: ([], []) for impl in impls}
    outputs = {}
    for impl in impls:
        model.set_attn_implementation(impl)
        _, outputs[impl] = generate_call(model, ids, new, cache)
        generate_call(model, ids, 1, cache)
    for r in range(runs):
        for impl in (impls if r % 2 == 0 else impls[::-1]):
            model.set_attn_implementation(impl)
            times[impl][0].append(generate_call(model, ids, new, cache)[0])
            times[impl][1].append(generate_call(model, ids, 1, cache)[0])
    return {impl: (statistics.median(full), statistics.median(first), outputs[impl])
            for impl, (full, first) in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--models", default="llama,doge")
    ap.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
    ap.add_argument("--eager", action="store_true", help="also time attn_implementation='eager'")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs: expected >= 1, got {args.runs}")
    register()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, prompt {args.prompt}, new {args.new}, "
          f"{args.cache} cache")
    rows = []
    impls = ["sdpa", "dmattn"] + (["eager"] if args.eager else [])
    for name in args.models.split(","):
        model = build(name, args.prompt, args.new)
        for batch in (int(b) for b in args.batch.split(",")):
            ids = torch.randint(1, 32000, (batch, args.prompt), device="cuda",
                                generator=torch.Generator(device="cuda").manual_seed(batch))
            tokens = {}
            try:
                timed = timed_rounds(model, ids, impls, args.new, args.runs, args.cache)
            except torch.cuda.OutOfMemoryError:
                print(f"{name:<6} B={batch:<2} out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            for impl, (full, first, out) in timed.items():
                tokens[impl] = out[0, args.prompt:]
                row = dict(model=name, batch=batch, impl=impl, cache=args.cache, tokens_s=batch * args.new / full,
                           decode_tokens_s=batch * (args.new - 1) / (full - first), generate_s=full)
                rows.append(row)
                print(f"{name:<6} B={batch:<2} {impl:<7} {row['tokens_s']:9.1f} tokens/s  "
                      f"{row['decode_tokens_s']:9.1f} decode tokens/s  ({full:.3f} s)", flush=True)
            torch.cuda.empty_cache()
            if "eager" not in tokens:  # (the reference's tokens, untimed)
                model.set_attn_implementation("eager")
                _, out = generate_call(model, ids, args.new, args.cache)
                tokens["eager"] = out[0, args.prompt:]
                torch.cuda.empty_cache()
            same = {impl: int((tokens[impl] == tokens["eager"]).cumprod(0).sum()) for impl in ("sdpa", "dmattn")
                    if impl in tokens}
            print(f"{name:<6} B={batch:<2} greedy tokens equal to eager's, first row: "
                  + ", ".join(f"{impl} first {n} of {args.new}" for impl, n in same.items()), flush=True)
        del model
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), prompt=args.prompt, new=args.new, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
