#!/usr/bin/env python3
"""Registers, stack frames and spills per kernel, read from a CUDA build's output.

The build must pass `-Xptxas=-v` (every kernel: registers, stack frame, spill bytes) or, as the
library's own build does, `-Xptxas=--warn-on-spills` (only the kernels that spill, without their
architecture). For example, a build for sm_90a with the full report:

    cmake -S . -B /tmp/b -G Ninja -DDMATTN_CUDA_ARCHS=90a -DDMATTN_CUDA_PTX=OFF \\
          "-DCMAKE_CUDA_FLAGS=-Xptxas=-v" && ninja -C /tmp/b dmattn_core > build.log 2>&1
    python scripts/spill_report.py build.log                # every kernel, a markdown table
    python scripts/spill_report.py build.log --only spills  # the kernels that spill
    python scripts/spill_report.py build.log --families     # per kernel template: counts, maxima

Kernel names are demangled (c++filt, where the machine has it), without the namespaces and the
parameter list, and enum template arguments are given their enumerator's name from the headers
under src/cuda (`(BwdWsScores)3` becomes `BwdWsScores::kWindows`). A kernel compiled in
several translation units is listed once per architecture.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_WARNED = re.compile(r"Registers are spilled to local memory in function '([^']+)', "
                     r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass
class Kernel:
    arch: str  # "sm_90a", ...; "?" where only a spill warning named the kernel
    mangled: str
    registers: Optional[int] = None
    stack: Optional[int] = None
    spill_stores: int = 0
    spill_loads: int = 0
    name: str = ""

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def parse(lines: Iterable[str]) -> List[Kernel]:
    """The kernels of a build log, each (architecture, mangled name) once, in order of first
    appearance. With -v, the entry line names the kernel and the next frame / register lines
    belong to it; a --warn-on-spills line alone gives the spills of a kernel with arch "?"."""
    kernels: Dict[tuple, Kernel] = {}
    warned: Dict[str, Kernel] = {}
    current: Optional[Kernel] = None
    for line in lines:
        m = _ENTRY.search(line)
        if m:
            key = (m.group(2), m.group(1))
            current = kernels.setdefault(key, Kernel(arch=m.group(2), mangled=m.group(1)))
            continue
        m = _WARNED.search(line)
        if m:
            warned.setdefault(m.group(1), Kernel(arch="?", mangled=m.group(1), spill_stores=int(m.group(2)),
                                                 spill_loads=int(m.group(3))))
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
            continue
        m = _REGS.search(line)
        if m:
            current.registers = int(m.group(1))
            current = None  # (the register line closes a kernel's report)
    reported = {k.mangled for k in kernels.values()}
    return list(kernels.values()) + [k for name, k in warned.items() if name not in reported]


def enum_names(src: str = os.path.join(ROOT, "src", "cuda")) -> Dict[str, List[str]]:
    """enum class name -> its enumerators in order, from the headers under src (for the
    `(Enum)N` template arguments c++filt prints)."""
    names: Dict[str, List[str]] = {}
    pattern = re.compile(r"enum\s+class\s+(\w+)\s*(?::\s*[\w:]+\s*)?\{([^}]*)\}", re.S)
    for folder, _, files in os.walk(src):
        for f in files:
            if not f.endswith((".h", ".cuh", ".cu")):
                continue
            with open(os.path.join(folder, f)) as fh:
                text = re.sub(r"//[^\n]*", "", fh.read())
            for m in pattern.finditer(text):
                if "=" not in m.group(2):  # implicit values only: the position is the value
                    names[m.group(1)] = [v.strip() for v in m.group(2).split(",") if v.strip()]
    return names


def demangle(mangled: List[str]) -> List[str]:
    tool = shutil.which("c++filt")
    if tool is None or not mangled:
        return list(mangled)
    out = subprocess.run([tool], input="\n".join(mangled), capture_output=True, text=True, check=True)
    names = out.stdout.splitlines()
    return names if len(names) == len(mangled) else list(mangled)


def shorten(name: str, enums: Dict[str, List[str]]) -> str:
    """A demangled kernel name without return type, parameters and namespaces."""
    name = re.sub(r"^void ", "", name).replace("(anonymous namespace)::", "")
    # The parameter list: from the '(' that closes the template argument list's '>'.
    depth = 0
    for i, c in enumerate(name):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0:
            name = name[:i]
            break
    for ns in ("dmattn::cuda::sm90::", "dmattn::cuda::", "cutlass::"):
        name = name.replace(ns, "")

    def enum_value(m: re.Match) -> str:
        values = enums.get(m.group(1), [])
        i = int(m.group(2))
        return f"{m.group(1)}::{values[i]}" if 0 <= i < len(values) else m.group(0)

    return re.sub(r"\((\w+)\)(\d+)", enum_value, name)


def selected(kernels: List[Kernel], only: Optional[str]) -> List[Kernel]:
    if only == "spills":
        return [k for k in kernels if k.spills]
    if only == "frames":  # spills, or a stack frame (local arrays indexed at run time, calls)
        return [k for k in kernels if k.spills or (k.stack or 0) > 0]
    return list(kernels)


def totals(kernels: List[Kernel]) -> str:
    return (f"{len(kernels)} kernels: {sum(k.spills for k in kernels)} spill, "
            f"{sum((k.stack or 0) > 0 for k in kernels)} have a stack frame; "
            f"{sum(k.spill_stores for k in kernels)} B of spill stores in all.")


def table(kernels: List[Kernel], only: Optional[str]) -> str:
    rows = sorted(selected(kernels, only), key=lambda k: (k.arch, k.name))
    out = ["| arch | kernel | registers | stack B | spill stores / loads B |", "|---|---|---|---|---|"]
    for k in rows:
        regs = "" if k.registers is None else str(k.registers)
        stack = "" if k.stack is None else str(k.stack)
        out.append(f"| {k.arch} | `{k.name}` | {regs} | {stack} | {k.spill_stores} / {k.spill_loads} |")
    return "\n".join(out + ["", totals(kernels)])


def family_table(kernels: List[Kernel]) -> str:
    """One row per (architecture, kernel template): how many instantiations, how many spill,
    the largest spill and stack frame among them."""
    families: Dict[tuple, List[Kernel]] = {}
    for k in kernels:
        families.setdefault((k.arch, k.name.split("<")[0]), []).append(k)
    out = ["| arch | kernel | instantiations | spilling | max spill stores B | max stack B |",
           "|---|---|---|---|---|---|"]
    for (arch, name), ks in sorted(families.items()):
        out.append(f"| {arch} | `{name}` | {len(ks)} | {sum(k.spills for k in ks)} | "
                   f"{max(k.spill_stores for k in ks)} | {max((k.stack or 0) for k in ks)} |")
    return "\n".join(out + ["", totals(kernels)])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="*", help="build logs (default: standard input)")
    ap.add_argument("--only", choices=("spills", "frames"),
                    help="only the kernels that spill (spills), or that spill or have a stack frame (frames)")
    ap.add_argument("--families", action="store_true",
                    help="one row per kernel template and architecture instead of one per kernel")
    ap.add_argument("--json", action="store_true", help="one JSON object per kernel instead of a table")
    args = ap.parse_args(argv)
    lines: List[str] = []
    if args.logs:
        for path in args.logs:
            with open(path, errors="replace") as f:
                lines.extend(f)
    else:
        lines = sys.stdin.readlines()
    kernels = parse(lines)
    enums = enum_names()
    for k, name in zip(kernels, demangle([k.mangled for k in kernels])):
        k.name = shorten(name, enums)
    if args.json:
        for k in selected(kernels, args.only):
            print(json.dumps(asdict(k)))
    elif args.families:
        print(family_table(selected(kernels, args.only)))
    else:
        print(table(kernels, args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
