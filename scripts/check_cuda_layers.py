"""Checks the layers of src/cuda (src/cuda/README.md): every file lives in a folder of a known
layer, and includes only files of the layers below it or of its own:

    inst -> host -> sm90 -> sm80 -> common
            host -> decode, indexed -> common
                    sm90 -> decode

(the Hopper kernels reuse the sm80-class tiles and score transforms, and the Hopper decode kernel
the decode kernels' steps; nothing includes a launcher
or a backend but the layers above). Prints each offending include and exits 1 if there is one.

    python3 scripts/check_cuda_layers.py [repo root]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ALLOWED = {
    "common": {"common"},
    "sm80": {"common", "sm80"},
    "sm90": {"common", "sm80", "sm90", "decode"},
    "decode": {"common", "decode"},
    "indexed": {"common", "indexed"},
    "host": {"common", "sm80", "sm90", "decode", "indexed", "host"},
    "inst": {"host"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"cuda/([^"]+)"', re.MULTILINE)


def problems(root: Path) -> list:
    cuda = root / "src" / "cuda"
    found = []
    for path in sorted(cuda.rglob("*")):
        if not path.is_file() or path.suffix not in (".h", ".cu", ".cuh", ".cpp"):
            continue
        rel = path.relative_to(cuda)
        layer = rel.parts[0] if len(rel.parts) > 1 else None
        if layer not in ALLOWED:
            found.append(f"src/cuda/{rel}: not in a layer's folder ({', '.join(sorted(ALLOWED))})")
            continue
        for target in INCLUDE.findall(path.read_text()):
            parts = target.split("/")
            to = parts[0] if len(parts) > 1 else None
            if to not in ALLOWED[layer]:
                found.append(f"src/cuda/{rel}: includes cuda/{target} ({layer} may include "
                             f"{', '.join(sorted(ALLOWED[layer]))})")
            elif not (cuda / target).is_file():
                found.append(f"src/cuda/{rel}: includes cuda/{target}, which does not exist")
    return found


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    found = problems(root)
    for line in found:
        print(line)
    print(f"check_cuda_layers: {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
