"""The benchmark's report: the results as one JSON-ready dict, the Markdown table with dmattn's
speed against the best peer of each configuration, and the one-line summary.

Works on plain dicts (a Config / Row as dataclasses.asdict gives them, or as read back from
results.json), so that the plots and the docs can be regenerated from a saved run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from typing import Dict, List, Optional, Tuple

DMATTN = "dmattn"


def results_dict(device_name: str, configs: List[dict], rows: List[dict], command: str = "",
                 rounds: int = 1) -> dict:
    import torch

    from .. import __version__

    return {
        "device": device_name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dmattn": __version__,
        "command": command,
        "rounds": rounds,
        "configs": configs,
        "rows": [{k: _nan_to_none(v) for k, v in r.items()} for r in rows],
    }


def _nan_to_none(v):
    """NaN (no time) as JSON null, also inside a row's per-round lists: strict JSON has no NaN."""
    if isinstance(v, dict):
        return {k: _nan_to_none(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_nan_to_none(x) for x in v]
    return None if isinstance(v, float) and v != v else v


def _time(row: dict, fwd_only: bool) -> float:
    t = row.get("fwd_ms" if fwd_only else "fwdbwd_ms")
    return math.nan if t is None else float(t)


def _fwd_only(rows: List[dict]) -> bool:
    """True when no row has a fwd+bwd time (a --fwd-only run): speeds compare forwards then."""
    return all(not (_time(r, False) == _time(r, False)) for r in rows)


def speedups(results: dict) -> Dict[str, Tuple[float, str]]:
    """Per configuration: (best peer's time / dmattn's time, that peer), for configurations
    where dmattn and at least one peer have a time. > 1 means dmattn is faster."""
    rows = results["rows"]
    fwd_only = _fwd_only(rows)
    out: Dict[str, Tuple[float, str]] = {}
    for cfg in results["configs"]:
        mine = [r for r in rows if r["config"] == cfg["name"] and r["provider"] == DMATTN]
        peers = [r for r in rows if r["config"] == cfg["name"] and r["provider"] != DMATTN
                 and _time(r, fwd_only) == _time(r, fwd_only)]
        if not mine or not peers or not _time(mine[0], fwd_only) > 0:
            continue
        best = min(peers, key=lambda r: _time(r, fwd_only))
        out[cfg["name"]] = (_time(best, fwd_only) / _time(mine[0], fwd_only), best["provider"])
    return out


def summary_line(results: dict) -> str:
    ratios = speedups(results)
    what = "forward" if _fwd_only(results["rows"]) else "fwd+bwd"
    if not ratios:
        return f"Summary ({what}): no configuration had both a dmattn and a peer time."
    values = [r for r, _ in ratios.values()]
    faster = sum(r > 1 for r in values)
    geo = math.exp(sum(math.log(r) for r in values) / len(values))
    return (f"Summary ({what}): dmattn is faster than the best peer on {faster} of {len(values)} "
            f"configurations; speed vs best peer {min(values):.2f}x to {max(values):.2f}x, "
            f"geometric mean {geo:.2f}x (best peer's time / dmattn's time).")


def fmt(v, spec: str) -> str:
    """v formatted, "-" for a missing time (None or NaN)."""
    return "-" if v is None or v != v else format(v, spec)


def format_table(results: dict) -> str:
    ratios = speedups(results)
    what = "forward" if _fwd_only(results["rows"]) else "fwd+bwd"
    rounds = results.get("rounds", 1)
    lines = [f"dmattn benchmark on {results['device']} (torch {results['torch']}; "
             + (f"the median of {rounds} rounds of " if rounds > 1 else "")
             + f"median ms of single "
             f"calls, each from an idle device (host time included); 'back to back': the mean of calls "
             f"issued without waiting; TFLOP/s in FlashAttention's convention, of the first; 'vs best peer' = best "
             f"peer's {what} time / dmattn's)", ""]
    header = ["config", "provider", "fwd ms", "fwd+bwd ms", "back to back fwd / f+b", "fwd TF/s", "f+b TF/s",
              "peak GiB", "vs best peer", "check / note"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" for _ in header) + "|")
    for r in results["rows"]:
        ratio = ""
        if r["provider"] == DMATTN and r["config"] in ratios:
            value, peer = ratios[r["config"]]
            ratio = f"**{value:.2f}x** ({peer})"
        b2b = f"{fmt(r.get('fwd_b2b_ms'), '.2f')} / {fmt(r.get('fwdbwd_b2b_ms'), '.2f')}"
        cells = [r["config"], r["provider"], fmt(r["fwd_ms"], ".2f"), fmt(r["fwdbwd_ms"], ".2f"), b2b,
                 fmt(r["fwd_tflops"], ".3f"), fmt(r["fwdbwd_tflops"], ".3f"),
                 fmt(r["peak_mem_gib"], ".2f"), ratio, r.get("check") or r.get("note") or ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", summary_line(results)]
    return "\n".join(lines)


def write_results(results: dict, table: str, out_dir: str, extra_json: Optional[str] = None) -> List[str]:
    """Writes table.md and results.json into out_dir (and the JSON to extra_json); returns the paths."""
    paths = [os.path.join(out_dir, "table.md"), os.path.join(out_dir, "results.json")]
    with open(paths[0], "w") as f:
        f.write(table + "\n")
    for path in [paths[1]] + ([extra_json] if extra_json else []):
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return paths
