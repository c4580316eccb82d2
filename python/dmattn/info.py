"""What this installation of dmattn contains and which GPUs it can use:
``python -m dmattn.info``."""

from __future__ import annotations

import sys

from . import __version__
from ._lib import _candidates, build_info, gpu_support, kernel_code, kernel_path, lib


def _library_path() -> str:
    for path in _candidates():
        if path.is_file():
            return str(path.resolve())
    return "(not found)"


def _gpus(archs, ptx):
    """(index, name, "major.minor", problem or "", kernel path or "") for every visible CUDA
    device."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return []
    rows = []
    for index in range(torch.cuda.device_count()):
        capability = torch.cuda.get_device_capability(index)
        path = kernel_path(capability, archs, ptx) if archs is not None else ""
        rows.append((index, torch.cuda.get_device_name(index), "%d.%d" % capability,
                     gpu_support(capability, archs, ptx), path))
    return rows


def _loaded_code(index: int) -> str:
    """What the driver loaded for the kernels on that GPU, as it reports it (a check of the path
    above): " [driver: compute_80 PTX JIT-compiled for sm_100]"."""
    try:
        code = kernel_code(index)
    except Exception as exc:  # noqa: BLE001 - the report says why
        return f" [driver: {exc}]"
    if not code["binary"]:
        return " [driver: no code of this build loads on it]"
    if code["ptx"] == code["binary"]:
        return f" [driver: sm_{code['binary']} machine code loaded]"
    return f" [driver: compute_{code['ptx']} PTX JIT-compiled for sm_{code['binary']}]"


def report() -> str:
    """The report ``python -m dmattn.info`` prints."""
    lines = [f"dmattn {__version__}", f"  library:       {_library_path()}"]
    try:
        lib()
        info = build_info()
    except Exception as exc:  # noqa: BLE001 - the report says why the library did not load
        lines.append(f"  native library failed to load: {exc}")
        return "\n".join(lines)
    archs = info["archs"]
    if info["cuda"]:
        lines.append("  CUDA:          yes")
        lines.append("  CUDA archs:    " + (", ".join("sm_" + a for a in archs) if archs
                                            else "none" if archs is not None
                                            else "(unknown: library older than build_info)"))
        ptx = info.get("ptx") or []
        lines.append("  CUDA PTX:      " + (", ".join("compute_" + a for a in ptx)
                                            + " (JIT-compiled by the driver for newer GPUs)"
                                            if ptx else "none"))
        lines.append("  CUDA runtime:  " + (f"{info['cuda_version']} (linked statically; needs "
                                            "only the NVIDIA driver)" if info["cuda_version"]
                                            else "(unknown)"))
    else:
        lines.append("  CUDA:          no (CPU-only build)")
    blas = info["blas"]
    lines.append("  CPU BLAS:      " + ("unknown" if blas is None else "yes" if blas
                                       else "no (plain loops)"))
    try:
        import torch

        lines.append(f"  torch:         {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    except ImportError:
        lines.append("  torch:         not installed (the PyTorch API needs torch >= 2.4)")
    gpus = _gpus(archs, info.get("ptx") or [])
    if gpus is None:
        lines.append("  GPUs:          unknown (no torch)")
    elif not gpus:
        lines.append("  GPUs:          none visible to torch")
    else:
        lines.append("  GPUs:")
        for index, name, capability, problem, path in gpus:
            if not info["cuda"]:
                status = "not used (CPU-only build)"
            elif problem:
                status = "NOT supported: " + problem
            elif path.startswith("PTX JIT"):
                status = ("supported, " + path + ": the sm80-class kernels, compiled by the "
                          "driver at their first use and cached (CUDA_CACHE_PATH; "
                          "CUDA_CACHE_MAXSIZE=4294967296 keeps them all)")
            else:
                status = "supported, " + (path or "architectures unknown")
            if info["cuda"] and not problem:
                status += _loaded_code(int(index))
            lines.append(f"    cuda:{index} {name} (compute capability {capability}): {status}")
    return "\n".join(lines)


def main(argv=None) -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
