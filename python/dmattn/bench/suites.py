"""The benchmark's suites: which configurations each runs, on the CPU (sizes a 2-core machine
runs in about a minute) and on a GPU (docs/perf.md's), and the selection by --suite / --filter.
"""

from __future__ import annotations

import re
from typing import List, Optional

from .config import Config, fsa_window_sizes


SUITES = ("dense", "bias", "topk", "varlen", "gqa", "long", "fsa")


def fsa_configs(batch: int, seqlen: int, heads: int, head_dim: int, dtype: str) -> List[Config]:
    """flash-sparse-attn's workloads: gated attention, its threshold-sparse softmax (threshold
    1.0; dmattn computes exactly), gates that close blocks of keys (exact, and with gate skipping
    at flash-sparse-attn's default threshold), windows with sinks and dense causal."""
    tail = f"S={seqlen} B={batch}"
    sink, left, right, near = fsa_window_sizes(seqlen)
    rows = []
    for causal in (False, True):
        c = " causal" if causal else ""
        rows.append(Config(f"gated {tail}{c}", batch, seqlen, heads, head_dim, causal, dtype=dtype,
                           variant="gated", suite="fsa"))
        rows.append(Config(f"sparse softmax threshold 1.0 (dmattn exact) {tail}{c}", batch, seqlen, heads,
                           head_dim, causal, dtype=dtype, variant="threshold", suite="fsa"))
    for causal in (False, True):
        c = " causal" if causal else ""
        rows.append(Config(f"gated, closed blocks, exact {tail}{c}", batch, seqlen, heads, head_dim, causal,
                           dtype=dtype, variant="gated_blocks", suite="fsa"))
        rows.append(Config(f"gated, closed blocks, gate skipping {tail}{c}", batch, seqlen, heads, head_dim, causal,
                           dtype=dtype, variant="gated_blocks_skip", suite="fsa"))
    rows.append(Config(f"windows sink {sink} near {near} left {left} right {right} {tail}", batch, seqlen, heads,
                       head_dim, True, dtype=dtype, variant="windows", suite="fsa"))
    rows.append(Config(f"dense causal {tail} (fsa)", batch, seqlen, heads, head_dim, True, dtype=dtype,
                       suite="fsa"))
    return rows


def cpu_configs(quick: bool) -> List[Config]:
    """fp32 unless named, B=1, H=8, D=64: sizes a 2-core machine runs in about a minute."""
    s = 512 if quick else 1024
    dense_series, topk_series = "dense causal (B=1, H=8)", "per-key bias + top-256 causal (B=1, H=8)"

    def dense_causal(n):
        return Config(f"dense causal S={n}", 1, n, 8, 64, causal=True, dtype="float32",
                      suite="dense" if n == s else "long", series=dense_series)

    def topk(n):
        return Config(f"per-key bias + top-256 S={n}", 1, n, 8, 64, causal=True, bias="per_key",
                      keep=256, dtype="float32", suite="topk" if n == s else "long",
                      series=topk_series)

    longer = (s // 2, s * 2)
    return [
        Config(f"dense S={s}", 1, s, 8, 64, dtype="float32", suite="dense"),
        dense_causal(s),
        Config(f"bias (B,H,S,S) S={s}", 1, s, 8, 64, bias="dense", dtype="float32", suite="bias"),
        Config(f"bias causal S={s}", 1, s, 8, 64, causal=True, bias="dense", dtype="float32",
               suite="bias"),
        Config(f"bias bf16 S={s}", 1, s, 8, 64, bias="dense", dtype="bfloat16", suite="bias"),
        topk(s),
        Config(f"dense S={s // 4} B=4", 4, s // 4, 8, 64, dtype="float32", suite="varlen"),
        Config(f"varlen packed equal lengths S={s // 4} B=4", 4, s // 4, 8, 64, dtype="float32",
               packed=True, suite="varlen"),
        Config(f"GQA 8/2 bias (B,H,S,S) S={s}", 1, s, 8, 64, bias="dense", heads_kv=2,
               dtype="float32", suite="gqa"),
    ] + [dense_causal(n) for n in longer] + [topk(n) for n in longer] + fsa_configs(1, s // 2, 8, 64, "float32")


def gpu_configs() -> List[Config]:
    """bf16, D=128, H=16: the configurations of docs/perf.md."""
    rows = []
    for s, b in ((2048, 8), (8192, 2)):
        for causal in (False, True):
            c = " causal" if causal else ""
            rows.append(Config(f"dense S={s} B={b}{c}", b, s, 16, 128, causal, suite="dense"))
            # The same tokens as one packed batch (attention_varlen): what packing costs against
            # the dense batched path for equal lengths.
            rows.append(Config(f"varlen packed equal lengths S={s} B={b}{c}", b, s, 16, 128, causal,
                               packed=True, suite="varlen"))
    for s in (4096, 8192):
        for causal in (False, True):
            c = " causal" if causal else ""
            rows.append(Config(f"bias (B,H,S,S) S={s}{c}", 2, s, 16, 128, causal, bias="dense",
                               suite="bias"))
            rows.append(Config(f"per-key bias top-2048 S={s}{c}", 2, s, 16, 128, causal,
                               bias="per_key", keep=2048, suite="topk"))
    for causal in (False, True):
        rows.append(Config(f"GQA 32/8 bias (B,H,S,S) S=8192 B=1{' causal' if causal else ''}", 1,
                           8192, 32, 128, causal, bias="dense", heads_kv=8, suite="gqa"))
    # Long context at B=1: dense causal grows with S^2, the Doge top-k rows with S * keep.
    for s in (4096, 8192, 16384, 32768):
        rows.append(Config(f"scaling dense S={s} B=1 causal", 1, s, 16, 128, True, suite="long",
                           series="dense causal (B=1)"))
        rows.append(Config(f"scaling per-key top-2048 S={s} B=1 causal", 1, s, 16, 128, True,
                           bias="per_key", keep=2048, suite="long",
                           series="per-key bias + top-2048 causal (B=1)"))
    return rows + fsa_configs(2, 8192, 16, 128, "bfloat16")


def select_configs(configs: List[Config], suites: Optional[str], pattern: Optional[str]) -> List[Config]:
    """The configurations of the named suites (comma-separated; None = all) matching `pattern`."""
    if suites:
        wanted = [name.strip() for name in suites.split(",") if name.strip()]
        unknown = sorted(set(wanted) - set(SUITES))
        if unknown:
            raise ValueError(f"--suite: unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
        configs = [c for c in configs if c.suite in wanted]
    if pattern:
        configs = [c for c in configs if re.search(pattern, c.name)]
    return configs
