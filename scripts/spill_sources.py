#!/usr/bin/env python3
"""Where a kernel's register spills come from: its local-memory stores and loads (STL / LDL) by
the source line whose value they keep, read from the SASS of a compiled object.

`scripts/spill_report.py` says how many bytes each kernel spills; this says which values. The
object must carry line info (the library's build passes `-lineinfo`). It needs `cuobjdump` and
`nvdisasm` from a CUDA toolkit, or from the PyPI wheels `nvidia-cuda-cuobjdump` and
`nvidia-cuda-nvdisasm` (their `nvidia/cu13/bin`), found on PATH, under $CUDA_HOME/bin or in
--tools. For example:

    python scripts/spill_sources.py build/CMakeFiles/dmattn_core.dir/src/cuda/inst/bwd_ws_gate_bf16.cu.o \\
        --kernel 'kKeyRows|BwdWsScoresE1'

Each kernel whose name matches --kernel (a regular expression on the mangled or demangled name)
gets a table: source line (the innermost one, as nvdisasm annotates the instruction), spill
stores, spill loads. Stores name the values a kernel parks in local memory; the loads, where it
reads them back (often a loop's body).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spill_report import demangle, enum_names, shorten  # noqa: E402  (the kernels' readable names)

_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_SECTION = re.compile(r"^\.text\.(\S+):")
_SPILL = re.compile(r"\b(STL|LDL)(\.[A-Z0-9.]+)?\s")


def find_tool(name: str, extra: Optional[str]) -> str:
    for d in ([extra] if extra else []) + [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")]:
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    p = shutil.which(name)
    if p is None:
        sys.exit(f"spill_sources: {name} not found (PATH, $CUDA_HOME/bin or --tools; PyPI: nvidia-cuda-{name})")
    return p


def short_path(path: str) -> str:
    for marker in ("/src/", "/include/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1:]
    return path


def spills_by_line(sass: str) -> Dict[str, Dict[Tuple[str, int], List[int]]]:
    """{kernel: {(file, line): [stores, loads]}} from nvdisasm -g output."""
    kernels: Dict[str, Dict[Tuple[str, int], List[int]]] = {}
    current: Optional[Dict[Tuple[str, int], List[int]]] = None
    where: Tuple[str, int] = ("?", 0)
    for text in sass.splitlines():
        m = _SECTION.match(text)
        if m:
            current = kernels.setdefault(m.group(1), collections.defaultdict(lambda: [0, 0]))
            where = ("?", 0)
            continue
        m = _LINE.search(text)
        if m:
            where = (short_path(m.group(1)), int(m.group(2)))
            continue
        if current is not None:
            m = _SPILL.search(text)
            if m:
                current[where][0 if m.group(1) == "STL" else 1] += 1
    return kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("objects", nargs="+", help="object files (.o) or cubins")
    ap.add_argument("--kernel", default="", help="regular expression on the kernel's name")
    ap.add_argument("--tools", help="folder holding cuobjdump and nvdisasm")
    ap.add_argument("--most", type=int, default=20, help="source lines per kernel at most")
    args = ap.parse_args()
    cuobjdump, nvdisasm = find_tool("cuobjdump", args.tools), find_tool("nvdisasm", args.tools)
    pattern = re.compile(args.kernel)
    enums = enum_names()
    with tempfile.TemporaryDirectory() as tmp:
        cubins: List[str] = []
        for i, obj in enumerate(args.objects):
            if obj.endswith(".cubin"):
                cubins.append(obj)
                continue
            out = os.path.join(tmp, str(i))
            os.makedirs(out)
            subprocess.run([cuobjdump, "-xelf", "all", os.path.abspath(obj)], cwd=out, capture_output=True, check=True)
            cubins += [os.path.join(out, f) for f in sorted(os.listdir(out)) if f.endswith(".cubin")]
        for cubin in cubins:
            sass = subprocess.run([nvdisasm, "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
            kernels = spills_by_line(sass)
            names = dict(zip(kernels, (shorten(n, enums) for n in demangle(list(kernels)))))
            for mangled, lines in kernels.items():
                name = names[mangled]
                if not (pattern.search(mangled) or pattern.search(name)):
                    continue
                stores = sum(v[0] for v in lines.values())
                loads = sum(v[1] for v in lines.values())
                print(f"{name}\n  {stores} spill stores, {loads} spill loads ({os.path.basename(cubin)})")
                ranked = sorted(lines.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[: args.most]
                for (path, line), (st, ld) in ranked:
                    print(f"  {st:4d} {ld:4d}  {path}:{line}")


if __name__ == "__main__":
    main()
