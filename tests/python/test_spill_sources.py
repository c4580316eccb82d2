"""scripts/spill_sources.py attributes a kernel's spill stores and loads (STL / LDL) to the source
line nvdisasm annotates them with, per kernel section."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("spill_sources", os.path.join(ROOT, "scripts", "spill_sources.py"))
spill_sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spill_sources)

# nvdisasm -g -c output of two kernels (shortened): the second's first spill comes before any
# line annotation of its own section, so it must not inherit the first kernel's last line.
SASS = """
.text._Z6kernelAv:
	//## File "/home/user/dmattn/src/cuda/sm90/bwd_ws_kernel_sm90.h", line 561
        /*4330*/                   STL [R1+0x8], R4          (*"SpillRefill"*);
        /*4340*/                   STL [R1+0x4], R15         (*"SpillRefill"*);
	//## File "/opt/venv/lib/python3.12/site-packages/cutlass_library/source/include/cute/stride.hpp", line 210
        /*4350*/                   IADD3 R2, R9, R2, -R8 ;
        /*4360*/                   STL [R1], R2              (*"SpillRefill"*);
	//## File "/home/user/dmattn/src/cuda/sm90/bwd_ws_kernel_sm90.h", line 600, inlined at "/home/user/dmattn/src/x.h", line 3
        /*9060*/                   LDL.LU R4, [R1+0x4]       (*"SpillRefill"*);
        /*9070*/                   LDL R5, [R1+0x8]          (*"SpillRefill"*);
        /*9080*/                   STS [R12+0x34010], R31 ;
.text._Z6kernelBv:
        /*0010*/                   STL [R1], R0              (*"SpillRefill"*);
	//## File "/home/user/dmattn/src/cuda/common/bwd_common.h", line 98
        /*0020*/                   LDL R0, [R1]              (*"SpillRefill"*);
"""


def test_spills_attributed_to_their_source_lines():
    kernels = spill_sources.spills_by_line(SASS)
    assert set(kernels) == {"_Z6kernelAv", "_Z6kernelBv"}
    a = {k: tuple(v) for k, v in kernels["_Z6kernelAv"].items()}
    assert a == {
        ("src/cuda/sm90/bwd_ws_kernel_sm90.h", 561): (2, 0),
        ("include/cute/stride.hpp", 210): (1, 0),
        ("src/cuda/sm90/bwd_ws_kernel_sm90.h", 600): (0, 2),
    }
    b = {k: tuple(v) for k, v in kernels["_Z6kernelBv"].items()}
    assert b == {("?", 0): (1, 0), ("src/cuda/common/bwd_common.h", 98): (0, 1)}


def test_short_paths_keep_the_tree_below_src_or_include():
    assert spill_sources.short_path("/a/b/src/cuda/x.h") == "src/cuda/x.h"
    assert spill_sources.short_path("/opt/cutlass/include/cute/tensor.hpp") == "include/cute/tensor.hpp"
    assert spill_sources.short_path("relative.h") == "relative.h"
