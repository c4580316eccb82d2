"""scripts/spill_report.py reads ptxas's reports out of a build log: per kernel and architecture
its registers, stack frame and spills, with readable names."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("spill_report", os.path.join(ROOT, "scripts", "spill_report.py"))
spill_report = importlib.util.module_from_spec(_spec)
sys.modules["spill_report"] = spill_report  # (its dataclass looks its module up there)
_spec.loader.exec_module(spill_report)

WINDOWS_BWD = ("_ZN6dmattn4cuda4sm9018bwd_ws_kernel_sm90INS1_9BwdWsTileIN7cutlass10bfloat16_tELi64E"
               "LNS1_11BwdWsScoresE3ELb0ELb0EEELb1EEEvNS1_11BwdWsParamsIT_EE")
PROBE = "_ZN6dmattn4cuda17kernel_code_probeEv"
SCATTER = ("_ZN6dmattn4cuda44_GLOBAL__N__61d5b82b_11_key_glue_cu_d72a6da919scatter_rows_kernelIjEEv"
           "NS0_15ScatterRowsArgsE")

# -Xptxas=-v for two kernels on sm_90a (one of them again from a second translation unit) and
# one on sm_80, and a --warn-on-spills line for a kernel no -v report covers.
LOG = f"""[3/53] Building CUDA object CMakeFiles/dmattn_core.dir/src/cuda/inst/bwd_ws_bf16_hd64.cu.o
ptxas info    : Compiling entry function '{WINDOWS_BWD}' for 'sm_90a'
ptxas info    : Function properties for {WINDOWS_BWD}
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 8 bytes cumulative stack size
ptxas info    : Compiling entry function '{PROBE}' for 'sm_90a'
ptxas info    : Function properties for {PROBE}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 4 registers, used 0 barriers
ptxas info    : Compiling entry function '{PROBE}' for 'sm_90a'
ptxas info    : Function properties for {PROBE}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 4 registers, used 0 barriers
ptxas info    : Compiling entry function '{PROBE}' for 'sm_80'
ptxas info    : Function properties for {PROBE}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 6 registers, used 0 barriers
ptxas warning : Registers are spilled to local memory in function '{SCATTER}', 4 bytes spill stores, 4 bytes spill loads
ptxas warning : Registers are spilled to local memory in function '{WINDOWS_BWD}', 4 bytes spill stores, 12 bytes spill loads
"""


def kernels():
    return spill_report.parse(LOG.splitlines(keepends=True))


def test_each_kernel_once_per_architecture_with_its_figures():
    ks = {(k.arch, k.mangled): k for k in kernels()}
    assert len(ks) == 4
    windows = ks[("sm_90a", WINDOWS_BWD)]
    assert (windows.registers, windows.stack, windows.spill_stores, windows.spill_loads) == (168, 8, 4, 12)
    assert windows.spills
    assert ks[("sm_90a", PROBE)].registers == 4 and not ks[("sm_90a", PROBE)].spills
    assert ks[("sm_80", PROBE)].registers == 6
    # Known from the warning only: no architecture, no registers.
    scatter = ks[("?", SCATTER)]
    assert (scatter.registers, scatter.spill_stores, scatter.spill_loads) == (None, 4, 4)


def test_selection_and_totals():
    ks = kernels()
    assert {k.mangled for k in spill_report.selected(ks, "spills")} == {WINDOWS_BWD, SCATTER}
    assert len(spill_report.selected(ks, None)) == 4
    assert spill_report.totals(ks) == "4 kernels: 2 spill, 1 have a stack frame; 8 B of spill stores in all."


def test_enum_arguments_get_their_names_from_the_headers():
    enums = spill_report.enum_names()
    assert enums["BwdWsScores"][:2] == ["kPlain", "kKeyRows"]
    name = ("void dmattn::cuda::sm90::bwd_ws_kernel_sm90<dmattn::cuda::sm90::BwdWsTile<cutlass::bfloat16_t, 64, "
            "(dmattn::cuda::sm90::BwdWsScores)3, false, false>, true>(dmattn::cuda::sm90::BwdWsParams<"
            "dmattn::cuda::sm90::BwdWsTile<cutlass::bfloat16_t, 64, (dmattn::cuda::sm90::BwdWsScores)3, false, "
            "false> >)")
    expected = f"bwd_ws_kernel_sm90<BwdWsTile<bfloat16_t, 64, BwdWsScores::{enums['BwdWsScores'][3]}, false, false>, true>"
    assert spill_report.shorten(name, enums) == expected
    anonymous = "void dmattn::cuda::(anonymous namespace)::scatter_rows_kernel<unsigned int>(dmattn::cuda::ScatterRowsArgs)"
    assert spill_report.shorten(anonymous, enums) == "scatter_rows_kernel<unsigned int>"


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="needs c++filt (binutils)")
def test_table_names_kernels_readably(capsys, tmp_path):
    log = tmp_path / "build.log"
    log.write_text(LOG)
    assert spill_report.main([str(log), "--only", "spills"]) == 0
    out = capsys.readouterr().out
    assert "| sm_90a | `bwd_ws_kernel_sm90<BwdWsTile<bfloat16_t, 64, BwdWsScores::" in out
    assert "| 168 | 8 | 4 / 12 |" in out
    assert "scatter_rows_kernel<unsigned int>" in out
    assert "kernel_code_probe" not in out
    assert spill_report.main([str(log), "--families"]) == 0
    assert "| sm_90a | `bwd_ws_kernel_sm90` | 1 | 1 | 4 | 8 |" in capsys.readouterr().out
