"""No module of the dmattn package imports, directly or through others, a module that imports it
back. The sources are parsed, not imported: no GPU, no transformers, no native library needed.

The edges are every import statement of a module, wherever it stands: at module level, inside
a function (a lazy import still ties the two modules: the cycle is only postponed to the first
call), and under ``if TYPE_CHECKING:`` (the two modules still know each other's insides). Both
relative (``from . import x``, ``from ..ops import y``) and absolute (``import dmattn.z``,
``from dmattn.z import w``) imports count; imports of other packages do not.

An import names one module: ``from P import x`` is an edge to the submodule ``P.x`` when that is
a module of the package (a file or a subpackage), otherwise to ``P`` itself (a name ``P``
defines, so ``from . import attention`` inside dmattn is an edge to the package ``dmattn``).
Loading a module first loads its parent packages, but that is not an edge: a package's
``__init__`` importing its own submodules is the normal layout, and Python initializes the
parent before the child, so no partially initialized module is ever seen that way.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set

PACKAGE = "dmattn"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", PACKAGE)


def _modules(root: str = ROOT) -> Dict[str, str]:
    """Module name -> source path, for every .py file under root (a package as its __init__)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        parts = [PACKAGE] + os.path.relpath(folder, root).split(os.sep)
        parts = [p for p in parts if p != "."]
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            stem = name[:-3]
            module = ".".join(parts if stem == "__init__" else parts + [stem])
            found[module] = os.path.join(folder, name)
    return found


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    """The absolute name of ``from <level dots><target> import ...`` inside ``module``."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(module: str, path: str, modules: Dict[str, str]) -> Set[str]:
    """The package's modules that ``module`` imports (see the module docstring for the rules)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = os.path.basename(path) == "__init__.py"
    targets: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in modules:  # import dmattn.x.y: the deepest module named
                    name = name.rpartition(".")[0]
                if name:
                    targets.add(name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                source = _resolve_relative(module, is_package, node.level, node.module)
            else:
                source = node.module or ""
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:
                    targets.add(sub)
                elif source in modules:
                    targets.add(source)
    targets.discard(module)
    return targets


def import_graph(root: str = ROOT) -> Dict[str, Set[str]]:
    modules = _modules(root)
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle as a path [a, b, ..., a], or None (depth-first search, in sorted order)."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def all_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Cycles until none is left, each found with its closing edge then set aside: every
    circle of the package shows at least once."""
    graph = {node: set(targets) for node, targets in graph.items()}
    found = []
    while True:
        cycle = find_cycle(graph)
        if cycle is None:
            return found
        found.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])


def test_the_walker_sees_the_package():
    graph = import_graph()
    assert {"dmattn", "dmattn.ops", "dmattn.integrations.transformers", "dmattn.distributed.ring"} <= set(graph)
    assert "dmattn.ops" in graph["dmattn.interface"]  # from .ops import ...
    assert "dmattn.gather" in graph["dmattn.interface"]  # from . import gather (a submodule)
    assert "dmattn.integrations.transformers" in graph["dmattn.integrations"]


def test_the_walker_finds_a_cycle(tmp_path):
    """Lazy, relative, absolute and package-level imports all make edges."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import dmattn.sub.c\n")
    (pkg / "sub" / "c.py").write_text("from .. import f\n")
    graph = import_graph(str(pkg))
    assert find_cycle(graph) == ["dmattn", "dmattn.a", "dmattn.sub.b", "dmattn.sub.c", "dmattn"]
    (pkg / "sub" / "c.py").write_text("from ..a import f\n")  # a -> b -> c -> a
    assert find_cycle(import_graph(str(pkg))) == ["dmattn.a", "dmattn.sub.b", "dmattn.sub.c", "dmattn.a"]
    (pkg / "sub" / "c.py").write_text("import torch\n")
    assert find_cycle(import_graph(str(pkg))) is None


def test_no_import_cycle():
    cycles = all_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
