"""Figures: docs/perf.md, "Forward + backward": top-k rows in place against a copy.

Times of the key-bias and top-k calls, forward alone and training step, for comparing two
builds of the library (the companion of build_ab_timing.py, whose rows are dense): run it once
per build (each on its own PYTHONPATH), the builds alternated, on one GPU, one process after
another.

    PYTHONPATH=/path/to/build_a/python python benchmarks/profiling/step_ab_timing.py a1 [PREFIXES]

bf16, B=2, H=16, S=8192, D=128, a per-key bias (B, H, 1, S); attention_topk keeps 2048 keys
(selection included), and the "2048 keys" rows take the first 2048 keys directly. Rows (all, or
those whose name starts with one of the comma-separated PREFIXES, e.g. "step"): forward alone
(no gradient) and training steps (forward + backward with every gradient). One line per row:
the tag, the row, the eager and the CUDA-graph time in ms, each the median of three medians of
10 CUDA-event timings (after 3 warm-up calls). With one build and DMATTN_TOPK_ROWS_COPY=0, then 1,
it compares attention_topk's forward reading the kept K / V rows in place and from a gathered
copy (docs/design.md, "Indexed keys").
"""

import statistics
import sys

import torch

import dmattn
from dmattn.bench import cuda_graph_of, time_ms
from keep_problem import KEEP, keep_inputs


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else "build"
    prefixes = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    q, k, v, dout, bias, k2, v2, bias2 = keep_inputs()
    for t in (q, k, v, bias):
        t.requires_grad_(True)
    kk, vv, bb = (t.clone().requires_grad_(True) for t in (k2, v2, bias2))

    def forward(f):
        def run():
            with torch.no_grad():
                return f()
        return run

    def step(f, leaves):
        return lambda: torch.autograd.grad(f(), leaves, dout)

    rows = {
        "fwd 2048 keys": forward(lambda: dmattn.attention(q, k2, v2)),
        "fwd 2048 keys, key bias": forward(lambda: dmattn.attention(q, k2, v2, bias=bias2)),
        "fwd key bias": forward(lambda: dmattn.attention(q, k, v, bias=bias)),
        "fwd key bias, causal": forward(lambda: dmattn.attention(q, k, v, bias=bias, causal=True)),
        "fwd topk": forward(lambda: dmattn.attention_topk(q, k, v, bias, KEEP)),
        "fwd topk, causal": forward(lambda: dmattn.attention_topk(q, k, v, bias, KEEP, causal=True)),
        "step topk": step(lambda: dmattn.attention_topk(q, k, v, bias, KEEP), (q, k, v, bias)),
        "step 2048 keys, key bias": step(lambda: dmattn.attention(q, kk, vv, bias=bb), (q, kk, vv, bb)),
        "step 2048 keys": step(lambda: dmattn.attention(q, kk, vv), (q, kk, vv)),
        "step topk, causal": step(lambda: dmattn.attention_topk(q, k, v, bias, KEEP, causal=True), (q, k, v, bias)),
    }
    for name, fn in rows.items():
        if prefixes and not any(name.startswith(p) for p in prefixes):
            continue
        eager = statistics.median(time_ms(fn, "cuda", 3, 10) for _ in range(3))
        graph = cuda_graph_of(fn)
        replay = statistics.median(time_ms(graph, "cuda", 3, 10) for _ in range(3))
        print(f"{tag} {name}: eager {eager:.3f} graph {replay:.3f}", flush=True)


if __name__ == "__main__":
    main()
