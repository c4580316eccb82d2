"""The main job: dmattn beside its peers on the same device.

    python -m dmattn.bench                         # every suite; or: dmattn-bench
    python -m dmattn.bench --suite dense,topk      # suites: dense, bias, topk, varlen, gqa, long, fsa
    python -m dmattn.bench --quick --out results/  # fewer, smaller configurations

Every row runs the same inputs through each provider that supports the configuration,
checks dmattn's output against a float64 reference on a slice of query rows (and every
gradient for finiteness and against the peer), and reports the median time and TFLOP/s
(FlashAttention's convention: forward 4*B*H*Sq*Sk*D, halved when causal; fwd+bwd 3.5x).
The table (with dmattn's speed against the best peer of each row and a summary line), a JSON
file and PNG plots go to one folder (bench-results/<date>-<device>/ unless --out says), named
at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Tuple

import torch

from . import dynamic_mask
from . import bench_report as report
from .bench_providers import providers_for
from ._lib import cuda_available


@dataclass
class Config:
    name: str
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool = False
    bias: str = "none"        # "none" | "dense" (B,H,S,S) | "per_key" (B,H,1,S)
    keep: int = 0             # per_key only: top-k keys kept per (b, h), 0 = all
    heads_kv: int = 0         # 0 = heads
    dtype: str = "bfloat16"
    packed: bool = False      # dmattn only: the batch as one packed varlen batch (B sequences of S)
    variant: str = ""         # suite fsa: "gated" | "threshold" (flash-sparse-attn's sparse softmax)
                              # | "windows" (windows with sinks, fsa_window_sizes)
    suite: str = ""           # the --suite name that selects it
    series: str = ""          # configurations of one series are plotted as time vs seqlen

    @property
    def hkv(self) -> int:
        return self.heads_kv or self.heads

    def flops(self, backward: bool) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        f = f / 2 if self.causal else f
        return f * 3.5 if backward else f


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    dout: torch.Tensor
    alpha: Optional[torch.Tensor] = None    # variant "gated": (B, S, H) and (B, S, Hkv)
    delta: Optional[torch.Tensor] = None
    windows: Optional[torch.Tensor] = None  # variant "windows": dmattn's rows [sink, near, gap, far]


@dataclass
class Row:
    config: str
    provider: str
    fwd_ms: float = math.nan
    fwdbwd_ms: float = math.nan
    fwd_tflops: float = math.nan
    fwdbwd_tflops: float = math.nan
    peak_mem_gib: float = math.nan
    check: str = ""
    note: str = ""


SUITES = ("dense", "bias", "topk", "varlen", "gqa", "long", "fsa")


def fsa_window_sizes(seqlen: int) -> Tuple[int, int, int, int]:
    """The fsa suite's windows in flash-sparse-attn's convention (sink, left, right, near): at
    S=8192 sink 128, left 1024 (the distant band), right 2048 (the gap before it), near 1024;
    the same fractions of S at other lengths."""
    return seqlen // 64, seqlen // 8, seqlen // 4, seqlen // 8


def fsa_configs(batch: int, seqlen: int, heads: int, head_dim: int, dtype: str) -> List[Config]:
    """flash-sparse-attn's workloads: gated attention, its threshold-sparse softmax (threshold
    1.0; dmattn computes exactly), windows with sinks and dense causal."""
    tail = f"S={seqlen} B={batch}"
    sink, left, right, near = fsa_window_sizes(seqlen)
    rows = []
    for causal in (False, True):
        c = " causal" if causal else ""
        rows.append(Config(f"gated {tail}{c}", batch, seqlen, heads, head_dim, causal, dtype=dtype,
                           variant="gated", suite="fsa"))
        rows.append(Config(f"sparse softmax threshold 1.0 (dmattn exact) {tail}{c}", batch, seqlen, heads,
                           head_dim, causal, dtype=dtype, variant="threshold", suite="fsa"))
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


def make_inputs(cfg: Config, device: str, seed: int = 0) -> Inputs:
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q = randn(cfg.batch, cfg.seqlen, cfg.heads, cfg.head_dim)
    k = randn(cfg.batch, cfg.seqlen, cfg.hkv, cfg.head_dim)
    v = randn(cfg.batch, cfg.seqlen, cfg.hkv, cfg.head_dim)
    dout = randn(cfg.batch, cfg.seqlen, cfg.heads, cfg.head_dim)
    mask = bias = None
    if cfg.bias == "dense":
        bias = randn(cfg.batch, cfg.heads, cfg.seqlen, cfg.seqlen)
    elif cfg.bias == "per_key":
        bias = randn(cfg.batch, cfg.heads, 1, cfg.seqlen)
        if 0 < cfg.keep < cfg.seqlen:
            # Doge-style selection: the top-`keep` keys by (detached) bias, one set per (b, h),
            # for the peers and the reference (dmattn's rows select inside the timed call, with
            # the same tie rule, so they attend to the same keys).
            mask = dynamic_mask(bias, cfg.keep)
    alpha = delta = windows = None
    if cfg.variant == "gated":
        alpha, delta = randn(cfg.batch, cfg.seqlen, cfg.heads), randn(cfg.batch, cfg.seqlen, cfg.hkv)
    elif cfg.variant == "windows":
        sink, left, right, near = fsa_window_sizes(cfg.seqlen)
        windows = torch.tensor([[sink, near, right, left]] * cfg.hkv, dtype=torch.int32, device=device)
    for t in (q, k, v, bias, alpha, delta):
        if t is not None:
            t.requires_grad_(True)
    return Inputs(q, k, v, mask, bias, dout, alpha, delta, windows)


# ---------------------------------------------------------------------------------------------
# Timing and checking
# ---------------------------------------------------------------------------------------------

def cuda_graph_of(fn: Callable[[], object], repeat: int = 1) -> Callable[[], None]:
    """The replay of fn captured in a CUDA graph (after a warm-up on a side stream, as torch's
    documentation does it): timing it gives the kernels' time without the host's (the
    scripts in benchmarks/profiling/). repeat: fn captured that many times back to back in the
    one graph; the replay's time divided by repeat leaves out the graph launch's own latency,
    which a call of a few hundred microseconds otherwise carries in full."""
    if repeat < 1:
        raise ValueError(f"repeat: expected >= 1, got {repeat}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    return graph.replay


def time_ms(fn: Callable[[], object], device: str, warmup: int, iters: int,
            before_each: Optional[Callable[[], object]] = None) -> float:
    """Median time of fn in ms: CUDA events on "cuda", wall clock otherwise (also used by
    the scripts in benchmarks/profiling/). before_each, if given, runs before every timed run,
    outside the timing (a barrier of several processes, say)."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            if before_each is not None:
                before_each()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            if before_each is not None:
                before_each()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _grads(x: Inputs) -> List[torch.Tensor]:
    return [t for t in (x.q, x.k, x.v, x.bias, x.alpha, x.delta) if t is not None]


def _fwd_bwd(run: Callable, x: Inputs) -> Callable[[], List[torch.Tensor]]:
    leaves = _grads(x)

    def step():
        out = run()
        return torch.autograd.grad(out, leaves, x.dout)

    return step


def _reference_rows(cfg: Config, x: Inputs, rows: torch.Tensor) -> torch.Tensor:
    """float64 reference output for the query rows `rows` (every key), (B, len(rows), H, D)."""
    q = x.q.detach()[:, rows].double().cpu()
    k, v = (t.detach().double().cpu() for t in (x.k, x.v))
    h, hkv = q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(h // hkv, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(cfg.head_dim)
    allowed = torch.ones_like(s, dtype=torch.bool)
    if x.bias is not None:
        bias = x.bias.detach().double().cpu()
        bias = bias[:, :, rows] if bias.shape[2] > 1 else bias
        s = s + bias
    if x.mask is not None:
        m = x.mask.cpu()
        allowed = allowed & (m[:, :, rows] if m.shape[2] > 1 else m)
    if x.alpha is not None:  # scale * logsigmoid(alpha_i * delta_j)
        a = x.alpha.detach()[:, rows].double().cpu().transpose(1, 2).unsqueeze(-1)
        d = x.delta.detach().double().cpu().repeat_interleave(h // hkv, dim=2).transpose(1, 2).unsqueeze(2)
        s = s + torch.nn.functional.logsigmoid(a * d) / math.sqrt(cfg.head_dim)
    if x.windows is not None:  # the same row for every head; implies causal
        sink, near, gap, far = x.windows[0].tolist()
        j = torch.arange(cfg.seqlen)
        dist = rows[:, None] - j[None, :]
        band = (dist >= near + gap) & (dist < near + gap + far)
        allowed = allowed & (dist >= 0) & ((j < sink) | (dist < near) | band)
    if cfg.causal:
        j = torch.arange(cfg.seqlen)
        allowed = allowed & (j[None, :] <= rows[:, None])
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def _check(cfg: Config, x: Inputs, out: torch.Tensor, grads, peer_grads) -> str:
    rows = torch.unique(torch.linspace(0, cfg.seqlen - 1, steps=min(cfg.seqlen, 64)).long())
    ref = _reference_rows(cfg, x, rows)
    got = out.detach()[:, rows].double().cpu()
    err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    tol = 1e-4 if cfg.dtype == "float32" else 2e-2
    finite = all(torch.isfinite(g).all().item() for g in (grads or [])) and torch.isfinite(out).all().item()
    msg = f"out err {err:.1e}"
    ok = finite and err <= tol
    if peer_grads is not None and grads is not None:
        worst = 0.0
        for g, pg in zip(grads, peer_grads):
            denom = max(pg.abs().max().item(), 1e-6)
            worst = max(worst, (g.double() - pg.double()).abs().max().item() / denom)
        msg += f", grads vs peer {worst:.1e}"
        ok = ok and worst <= (1e-3 if cfg.dtype == "float32" else 5e-2)
    return ("ok: " if ok else "FAIL: ") + msg + ("" if finite else ", NON-FINITE")


def run_config(cfg: Config, device: str, warmup: int, iters: int, providers: Optional[str] = None,
               fwd_only: bool = False, log: Callable[[str], None] = lambda line: None) -> List[Row]:
    x = make_inputs(cfg, device)
    rows: List[Row] = []
    dm_grads = None
    peer_grads = None
    dm_row = None
    for name, provider in providers_for(device).items():
        if providers and name != "dmattn" and not re.search(providers, name):
            continue
        if cfg.packed and name != "dmattn":
            continue  # the packed rows compare dmattn with itself (its dense row)
        row = Row(cfg.name, name)
        try:
            run = provider(cfg, x)
            if run is None:
                row.note = "not supported"
                rows.append(row)
                continue
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                row.fwd_ms = time_ms(lambda: run(), device, warmup, iters)
            row.fwd_tflops = cfg.flops(False) / (row.fwd_ms * 1e-3) / 1e12
            if fwd_only:
                if name == "dmattn":
                    dm_row = (row, run)
                rows.append(row)
                continue
            step = _fwd_bwd(run, x)
            row.fwdbwd_ms = time_ms(step, device, warmup, iters)
            if device == "cuda":
                row.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30
            row.fwdbwd_tflops = cfg.flops(True) / (row.fwdbwd_ms * 1e-3) / 1e12
            if name == "dmattn":
                dm_grads = step()
                dm_row = (row, run)
            elif peer_grads is None and not getattr(run, "approximate", False):
                peer_grads = step()  # (not from a peer that skips blocks: its gradients differ by design)
        except Exception as e:  # a peer that fails is reported, not fatal
            row.note = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"
            if name == "dmattn" and row.fwd_ms == row.fwd_ms:
                dm_row = (row, run)  # the forward ran: still check it
        log(f"    {name}: fwd {report.fmt(row.fwd_ms, '.2f')} ms, fwd+bwd {report.fmt(row.fwdbwd_ms, '.2f')} ms"
            + (f" ({row.note})" if row.note else ""))
        rows.append(row)
    if dm_row is not None:
        row, run = dm_row
        with torch.no_grad():
            out = run()
        row.check = _check(cfg, x, out, dm_grads, peer_grads)
    return rows


def default_out_dir(device: str) -> str:
    kind = "cpu" if device == "cpu" else re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-").lower()
    return os.path.join("bench-results", f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--suite", help=f"comma-separated suites to run ({', '.join(SUITES)}; default: all)")
    ap.add_argument("--quick", action="store_true", help="fewer, smaller configurations")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out", help="folder for table.md, results.json and the plots "
                    "(default: bench-results/<date>-<device>)")
    ap.add_argument("--json", help="also write the results JSON to this file")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    ap.add_argument("--filter", help="only configurations whose name contains this regex")
    ap.add_argument("--providers", help="only providers whose name contains this regex (dmattn always runs)")
    ap.add_argument("--fwd-only", action="store_true", help="time the forward pass only")
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible to PyTorch")
    warmup = args.warmup if args.warmup is not None else (3 if device == "cuda" else 1)
    iters = args.iters if args.iters is not None else (10 if device == "cuda" else 3)
    try:
        configs = select_configs(gpu_configs() if device == "cuda" else cpu_configs(args.quick),
                                 args.suite, args.filter)
        if args.quick and device == "cuda":
            configs = configs[:3]  # the GPU sizes stay (the kernels' regime); fewer of them
    except ValueError as e:
        ap.error(str(e))
    if not configs:
        ap.error("no configuration matches --suite / --filter on this device")
    device_name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    if device == "cuda" and not cuda_available():
        print("note: this dmattn build has no CUDA backend; showing the peers only", file=sys.stderr)
    out_dir = args.out or default_out_dir(device)
    os.makedirs(out_dir, exist_ok=True)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"dmattn benchmark on {device_name}: {len(configs)} configurations, "
        f"median of {iters} after {warmup} warm-up(s); results go to {out_dir}/")
    rows: List[Row] = []
    start = time.perf_counter()
    for n, cfg in enumerate(configs, 1):
        log(f"[{n}/{len(configs)}] {cfg.name} ({time.perf_counter() - start:.0f} s elapsed)")
        rows.extend(run_config(cfg, device, warmup, iters, args.providers, args.fwd_only, log))

    results = report.results_dict(device_name, [asdict(c) for c in configs], [asdict(r) for r in rows],
                                  command=" ".join(["python -m dmattn.bench"] + list(argv if argv is not None else sys.argv[1:])))
    table = report.format_table(results)
    print(table)
    written = report.write_results(results, table, out_dir, extra_json=args.json)
    if not args.no_plots:
        try:
            from . import bench_plots

            written += bench_plots.plot_results(results, out_dir)
        except ImportError as e:  # the figures are already safe on disk
            log(f"no plots: {e} (pip install matplotlib)")
    log(f"\nresults in {out_dir}/: " + ", ".join(os.path.basename(p) for p in written))
    failed = [r for r in rows if r.check.startswith("FAIL")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
