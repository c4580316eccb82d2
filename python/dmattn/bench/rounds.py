"""Rounds of the whole benchmark (``--rounds N``): each round runs every configuration once, and
each row is reported as the median of its rounds, with the rounds' values kept in the JSON
(``per_round``). Single rows move by a few per cent between rounds on one machine; the median of
three is the figure the performance targets are stated in."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Dict, List, Tuple

from .config import Row

# The timed fields: each reported as the median of the rounds where it was measured.
TIMES = ("fwd_ms", "fwdbwd_ms", "fwd_b2b_ms", "fwdbwd_b2b_ms")


def _median(values: List[float]) -> float:
    measured = [v for v in values if v == v]  # (NaN: not measured in that round)
    return statistics.median(measured) if measured else float("nan")


def merge_rounds(rounds: List[List[Row]]) -> Tuple[List[Row], Dict[Tuple[str, str], Dict[str, List[float]]]]:
    """One row per (config, provider), in the order the rounds first give them: the last round's
    row with its times the medians over the rounds and its TFLOP/s scaled to them; the check is
    the first round's that failed, else the last round's; a note is the first round's that has
    one; peak memory the largest. Also returns each row's per-round times."""
    by_key: Dict[Tuple[str, str], List[Row]] = {}
    for rows in rounds:
        for row in rows:
            by_key.setdefault((row.config, row.provider), []).append(row)
    merged: List[Row] = []
    per_round: Dict[Tuple[str, str], Dict[str, List[float]]] = {}
    for key, runs in by_key.items():
        times = {name: [getattr(r, name) for r in runs] for name in TIMES}
        row = replace(runs[-1], **{name: _median(values) for name, values in times.items()})
        for rate, time_name in (("fwd_tflops", "fwd_ms"), ("fwdbwd_tflops", "fwdbwd_ms")):
            # (the row's work, TFLOP/s x ms, from any round that measured it)
            work = _median([getattr(r, rate) * getattr(r, time_name) for r in runs])
            setattr(row, rate, work / getattr(row, time_name))
        failed = [r.check for r in runs if r.check.startswith("FAIL")]
        row.check = failed[0] if failed else runs[-1].check
        row.note = next((r.note for r in runs if r.note), "")
        peaks = [r.peak_mem_gib for r in runs if r.peak_mem_gib == r.peak_mem_gib]
        row.peak_mem_gib = max(peaks) if peaks else float("nan")
        merged.append(row)
        per_round[key] = times
    return merged, per_round
