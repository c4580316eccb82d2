"""The main job: dmattn beside its peers on the same device.

    python -m dmattn.bench                         # every suite; or: dmattn-bench
    python -m dmattn.bench --suite dense,topk      # suites: dense, bias, topk, varlen, gqa, long, fsa
    python -m dmattn.bench --quick --out results/  # fewer, smaller configurations
    python -m dmattn.bench --suite fsa --rounds 3  # each row: the median of three rounds

Every row runs the same inputs through each provider that supports the configuration,
checks dmattn's output and its rows' q / alpha gradients against a float64 reference on a
slice of query rows (and every gradient for finiteness and against the peer), and reports the
median time of single calls, each from an idle device (host time included, as a user's first
call sees it), the mean of calls issued back to back, and TFLOP/s (FlashAttention's
convention: forward 4*B*H*Sq*Sk*D, halved when causal; fwd+bwd 3.5x).
The table (with dmattn's speed against the best peer of each row and a summary line), a JSON
file and PNG plots go to one folder (bench-results/<date>-<device>/ unless --out says), named
at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import asdict
from typing import List, Optional

import torch

from .._lib import cuda_available
from . import report
from .config import Row
from .rounds import merge_rounds
from .run import run_config
from .suites import SUITES, cpu_configs, gpu_configs, select_configs


def default_out_dir(device: str) -> str:
    kind = "cpu" if device == "cpu" else re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-").lower()
    return os.path.join("bench-results", f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}")


def main(argv: Optional[List[str]] = None) -> int:
    # (run as `python -m dmattn.bench`, argv[0] is this package's __main__.py: name the command instead)
    prog = "python -m dmattn.bench" if os.path.basename(sys.argv[0]) == "__main__.py" else None
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times; each row reports the median of its rounds")
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
    if args.rounds < 1:
        ap.error(f"--rounds: expected an int >= 1, got {args.rounds}")
    device_name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    if device == "cuda" and not cuda_available():
        print("note: this dmattn build has no CUDA backend; showing the peers only", file=sys.stderr)
    out_dir = args.out or default_out_dir(device)
    os.makedirs(out_dir, exist_ok=True)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"dmattn benchmark on {device_name}: {len(configs)} configurations, "
        f"median of {iters} after {warmup} warm-up(s)"
        + (f", {args.rounds} rounds (each row: the median of its rounds)" if args.rounds > 1 else "")
        + f"; results go to {out_dir}/")
    rounds: List[List[Row]] = []
    start = time.perf_counter()
    for r in range(args.rounds):
        rows: List[Row] = []
        for n, cfg in enumerate(configs, 1):
            which = f"round {r + 1}/{args.rounds}, " if args.rounds > 1 else ""
            log(f"[{which}{n}/{len(configs)}] {cfg.name} ({time.perf_counter() - start:.0f} s elapsed)")
            rows.extend(run_config(cfg, device, warmup, iters, args.providers, args.fwd_only, log))
        rounds.append(rows)
    rows, per_round = merge_rounds(rounds)
    row_dicts = [asdict(r) for r in rows]
    if args.rounds > 1:
        for d in row_dicts:
            d["per_round"] = per_round[(d["config"], d["provider"])]
    results = report.results_dict(device_name, [asdict(c) for c in configs], row_dicts,
                                  command=" ".join(["python -m dmattn.bench"] + list(argv if argv is not None else sys.argv[1:])),
                                  rounds=args.rounds)
    table = report.format_table(results)
    print(table)
    written = report.write_results(results, table, out_dir, extra_json=args.json)
    if not args.no_plots:
        try:
            from . import plots

            written += plots.plot_results(results, out_dir)
        except ImportError as e:  # the figures are already safe on disk
            log(f"no plots: {e} (pip install matplotlib)")
    log(f"\nresults in {out_dir}/: " + ", ".join(os.path.basename(p) for p in written))
    failed = [r for r in rows if r.check.startswith("FAIL")]
    return 1 if failed else 0
