"""The main job's report: the speed column against the best peer, the summary line, the
results folder (table, JSON, plots) and suite selection. The timings themselves are not
checked (any machine, any load)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from dmattn import bench
from dmattn.bench import report


def _row(config, provider, fwdbwd_ms, note=""):
    return dict(config=config, provider=provider, fwd_ms=1.0 if fwdbwd_ms else None,
                fwdbwd_ms=fwdbwd_ms, fwd_tflops=None, fwdbwd_tflops=None, peak_mem_gib=None,
                check="ok" if provider == "dmattn" else "", note=note)


def _results():
    configs = [dict(name="a", seqlen=512, series="s"), dict(name="b", seqlen=1024, series="s"),
               dict(name="c", seqlen=1024, series="")]
    rows = [_row("a", "dmattn", 2.0), _row("a", "p1", 4.0), _row("a", "p2", 3.0),
            _row("b", "dmattn", 8.0), _row("b", "p1", 4.0),
            _row("c", "dmattn", 1.0), _row("c", "p1", None, note="not supported")]
    return dict(device="test", torch="x", configs=configs, rows=rows)


def test_speed_is_against_the_best_peer():
    ratios = report.speedups(_results())
    assert ratios["a"] == (1.5, "p2")  # p2's 3.0 ms is the best peer; dmattn 2.0
    assert ratios["b"] == (0.5, "p1")
    assert "c" not in ratios  # no peer time


def test_table_has_the_speed_column_and_a_summary():
    table = report.format_table(_results())
    assert "vs best peer" in table.splitlines()[2]
    assert "**1.50x** (p2)" in table
    summary = table.splitlines()[-1]
    assert summary.startswith("Summary (fwd+bwd): dmattn is faster than the best peer on 1 of 2")
    assert f"geometric mean {math.sqrt(1.5 * 0.5):.2f}x" in summary


def test_suites_select_by_name():
    configs = bench.cpu_configs(quick=True)
    assert {c.suite for c in configs} == set(bench.SUITES)
    assert all(c.suite == "topk" for c in bench.select_configs(configs, "topk", None))
    with pytest.raises(ValueError, match="unknown suite"):
        bench.select_configs(configs, "dense,nope", None)


def test_main_writes_table_json_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    rc = bench.main(["--device", "cpu", "--quick", "--suite", "varlen", "--warmup", "0",
                     "--iters", "1", "--out", str(out)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "[1/2]" in err and "[2/2]" in err and f"results in {out}/" in err
    assert (out / "table.md").read_text().rstrip().splitlines()[-1].startswith("Summary")
    results = json.loads((out / "results.json").read_text())
    assert {r["provider"] for r in results["rows"]} >= {"dmattn"}
    assert os.path.exists(out / "speedup.png")


def test_rounds_report_each_rows_median():
    from dmattn.bench.config import Row
    from dmattn.bench.rounds import merge_rounds

    nan = float("nan")

    def row(provider, fwdbwd, b2b, check="ok", note="", peak=1.0):
        return Row("a", provider, fwd_ms=1.0, fwdbwd_ms=fwdbwd, fwd_b2b_ms=0.5, fwdbwd_b2b_ms=b2b,
                   fwd_tflops=10.0, fwdbwd_tflops=35.0 / fwdbwd if fwdbwd == fwdbwd else nan,
                   peak_mem_gib=peak, check=check, note=note)

    rounds = [[row("dmattn", 2.0, 1.0), row("p", 4.0, 3.0)],
              [row("dmattn", 3.0, 0.9, check="FAIL out", peak=2.0), row("p", nan, nan, note="OOM")],
              [row("dmattn", 2.2, 1.1), row("p", 5.0, 4.0)]]
    merged, per_round = merge_rounds(rounds)
    mine, peer = merged
    assert (mine.fwdbwd_ms, mine.fwdbwd_b2b_ms) == (2.2, 1.0)  # the medians, not one round's
    assert mine.fwdbwd_tflops == pytest.approx(35.0 / 2.2)  # the work over the median time
    assert mine.check == "FAIL out" and mine.peak_mem_gib == 2.0  # a failed round is not hidden
    assert peer.fwdbwd_ms == 4.5 and peer.note == "OOM"  # the rounds that measured it
    assert per_round[("a", "dmattn")]["fwdbwd_ms"] == [2.0, 3.0, 2.2]


def test_main_rounds(tmp_path, capsys):
    out = tmp_path / "run"
    rc = bench.main(["--device", "cpu", "--quick", "--suite", "varlen", "--warmup", "0", "--iters", "1",
                     "--rounds", "2", "--no-plots", "--out", str(out)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "[round 2/2, 2/2]" in err
    results = json.loads((out / "results.json").read_text())
    assert results["rounds"] == 2
    for r in results["rows"]:
        assert len(r["per_round"]["fwdbwd_ms"]) == 2
    assert "the median of 2 rounds" in (out / "table.md").read_text()


def test_main_refuses_no_rounds(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--quick", "--suite", "varlen", "--rounds", "0", "--no-plots"])
    assert "--rounds: expected an int >= 1, got 0" in capsys.readouterr().err


def test_cuda_graph_of_refuses_no_repeat():
    from dmattn.bench import cuda_graph_of
    with pytest.raises(ValueError, match="repeat"):
        cuda_graph_of(lambda: None, repeat=0)


@pytest.mark.parametrize("module", ["dmattn.bench", "dmattn.bench.plots", "dmattn.bench.doge"])
def test_command_lines_run_as_modules(module):
    """python -m for each command line of the benchmark (--help: no run, any machine)."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr[-2000:]
