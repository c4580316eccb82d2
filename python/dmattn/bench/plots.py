"""PNG plots of a benchmark run (matplotlib), from the results dict of report.py:

* ``speedup.png``: per configuration, dmattn's speed against each peer (the peer's time /
  dmattn's; right of 1 = dmattn faster), fwd+bwd (forward in a --fwd-only run).
* ``scaling.png``: time against sequence length for each series of configurations (the dense
  and the Doge top-k rows at growing S), one line per provider.

    python -m dmattn.bench.plots results.json --out DIR [--prefix h100-]

regenerates them from a saved run (docs/ holds the README's plots, made this way).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional

from .report import DMATTN, _fwd_only, _time


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _providers(rows: List[dict]) -> List[str]:
    names: List[str] = []
    for r in rows:
        if r["provider"] not in names:
            names.append(r["provider"])
    return names


def plot_speedup(results: dict, path: str) -> Optional[str]:
    rows, fwd_only = results["rows"], _fwd_only(results["rows"])
    peers = [p for p in _providers(rows) if p != DMATTN]
    data: Dict[str, Dict[str, float]] = {}
    for cfg in results["configs"]:
        mine = [r for r in rows if r["config"] == cfg["name"] and r["provider"] == DMATTN]
        if not mine or not _time(mine[0], fwd_only) > 0:
            continue
        ratios = {}
        for r in rows:
            if r["config"] == cfg["name"] and r["provider"] in peers and _time(r, fwd_only) > 0:
                ratios[r["provider"]] = _time(r, fwd_only) / _time(mine[0], fwd_only)
        if ratios:
            data[cfg["name"]] = ratios
    if not data:
        return None
    peers = [p for p in peers if any(p in d for d in data.values())]
    plt = _pyplot()
    height = 0.8 / len(peers)
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.42 * len(data) * max(1, len(peers) * 0.6)))
    names = list(data)
    for n, peer in enumerate(peers):
        ys = [i + (n - (len(peers) - 1) / 2) * height for i in range(len(names))]
        xs = [data[c].get(peer, math.nan) for c in names]
        # Bars grow from 1 (parity) to the ratio, on a log axis: 2x faster and 2x slower
        # look equally long.
        ax.barh(ys, [x - 1 for x in xs], left=1.0, height=height * 0.92, label=peer)
        for y, x in zip(ys, xs):
            if x == x:
                ax.text(x, y, f" {x:.2f}x ", va="center",
                        ha="left" if x >= 1 else "right", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    values = [v for d in data.values() for v in d.values() if v == v]
    lo, hi = min(values + [1.0]), max(values + [1.0])
    ax.set_xlim(lo / 1.6, hi * 1.6)
    ticks = [2.0 ** e for e in range(math.floor(math.log2(lo / 1.6)), math.ceil(math.log2(hi * 1.6)) + 1)]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}x" for t in ticks])
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    what = "forward" if fwd_only else "forward + backward"
    ax.set_xlabel(f"peer's {what} time / dmattn's (right of 1: dmattn faster)")
    ax.set_title(f"dmattn vs each peer, {results['device']}", fontsize=10, pad=24)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(peers),
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_scaling(results: dict, path: str) -> Optional[str]:
    rows, fwd_only = results["rows"], _fwd_only(results["rows"])
    series: Dict[str, List[dict]] = {}
    for cfg in results["configs"]:
        if cfg.get("series"):
            series.setdefault(cfg["series"], []).append(cfg)
    series = {name: cfgs for name, cfgs in series.items() if len(cfgs) > 1}
    if not series:
        return None
    plt = _pyplot()
    from matplotlib import ticker

    fig, axes = plt.subplots(1, len(series), figsize=(5.2 * len(series), 4), squeeze=False)
    for ax, (name, cfgs) in zip(axes[0], series.items()):
        cfgs = sorted(cfgs, key=lambda c: c["seqlen"])
        for provider in _providers(rows):
            points = []
            for c in cfgs:
                for r in rows:
                    if r["config"] == c["name"] and r["provider"] == provider and _time(r, fwd_only) > 0:
                        points.append((c["seqlen"], _time(r, fwd_only)))
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=provider,
                        linewidth=2.2 if provider == DMATTN else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_minor_locator(ticker.LogLocator(base=10, subs=(2.0, 3.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xticks([c["seqlen"] for c in cfgs])
        ax.set_xticklabels([str(c["seqlen"]) for c in cfgs])
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(("forward" if fwd_only else "fwd+bwd") + " ms")
        ax.set_title(name, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"time vs sequence length, {results['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_results(results: dict, out_dir: str, prefix: str = "") -> List[str]:
    """Writes the plots that the results have data for; returns their paths."""
    made = [plot_speedup(results, os.path.join(out_dir, f"{prefix}speedup.png")),
            plot_scaling(results, os.path.join(out_dir, f"{prefix}scaling.png"))]
    return [p for p in made if p]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="results.json of a dmattn.bench run")
    ap.add_argument("--out", default=".", help="folder for the PNG files")
    ap.add_argument("--prefix", default="", help="prefix of the file names")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    for path in plot_results(results, args.out, args.prefix):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
