"""Loads the native tvm-ffi module (libdmattn_ffi.so) once, on first use."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Iterator


def _candidates():
    env = os.environ.get("DMATTN_LIBRARY")
    if env:
        yield Path(env)
    here = Path(__file__).resolve().parent
    yield here / "libdmattn_ffi.so"


@functools.lru_cache(maxsize=None)
def lib():
    """The native module; its functions are forward, backward and cuda_available."""
    import tvm_ffi

    # The core raises these kinds by name (dmattn::Error::python_kind); tvm-ffi knows the
    # others (ValueError, TypeError, RuntimeError) already.
    tvm_ffi.register_error("NotImplementedError", NotImplementedError)

    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            return tvm_ffi.load_module(str(path))
    raise ImportError(
        "dmattn: native library libdmattn_ffi.so not found (looked in: "
        + ", ".join(tried)
        + "). Install the package with `pip install .` or set DMATTN_LIBRARY."
    )


def cuda_available() -> bool:
    """True when this build of dmattn contains the CUDA kernels."""
    return bool(lib().cuda_available())


@contextlib.contextmanager
def persistent_kernels(enabled: bool) -> Iterator[None]:
    """Within the block, the calls of this thread launch persistent kernels (Hopper's forward:
    one CTA per multiprocessor taking tiles in turn; the default) only if ``enabled``; otherwise
    one CTA per tile, so that multiprocessors free up as tiles finish and kernels of other
    streams start during the call rather than after it: communication overlapped with attention
    (NCCL's transfers are kernels; dmattn.distributed.ring_attention turns persistence off for
    its steps with a transfer in flight). Results are the same bits either way.
    DMATTN_FWD_PERSISTENT in the environment, where set, decides instead."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    previous = bool(lib().set_persistent_kernels(enabled))
    try:
        yield
    finally:
        lib().set_persistent_kernels(previous)


@functools.lru_cache(maxsize=None)
def build_info() -> dict:
    """What the native library was built with: {"cuda": bool, "archs": ["80", "90a"],
    "cuda_version": "13.0.88" or "", "blas": bool}. A library older than build_info() gives
    {"cuda": cuda_available(), "archs": None, ...} (archs unknown)."""
    fn = getattr(lib(), "build_info", None)
    if fn is None:
        return {"cuda": cuda_available(), "archs": None, "cuda_version": "", "blas": None}
    pairs = dict(item.split("=", 1) for item in str(fn()).split() if "=" in item)
    return {
        "cuda": pairs.get("cuda") == "1",
        "archs": [a for a in pairs.get("archs", "").split(",") if a],
        "cuda_version": pairs.get("cuda_version", ""),
        "blas": pairs.get("blas") == "1",
    }


# The oldest GPU the CUDA kernels run on (they use sm_80 instructions: cp.async, bf16 MMA).
MIN_COMPUTE_CAPABILITY = (8, 0)


def arch_runs_on(arch: str, capability) -> bool:
    """Whether code compiled for ``arch`` ("80", "90a") runs on a GPU of compute capability
    ``capability`` (major, minor): a cubin runs on its own major version at the same or a newer
    minor; an arch-specific one ("90a") only on exactly its capability."""
    major, minor = capability
    digits = arch.rstrip("af")
    try:
        a_major, a_minor = int(digits[:-1]), int(digits[-1])
    except ValueError:  # an arch spelled otherwise: no grounds to refuse the GPU
        return True
    if arch != digits:
        return (a_major, a_minor) == (major, minor)
    return a_major == major and a_minor <= minor


def gpu_support(capability, archs) -> str:
    """"" when this build's kernels run on a GPU of ``capability``, else why not."""
    if tuple(capability) < MIN_COMPUTE_CAPABILITY:
        return "dmattn needs an NVIDIA GPU of compute capability 8.0 (sm_80, Ampere) or newer"
    if archs and not any(arch_runs_on(a, capability) for a in archs):
        return ("this build of dmattn has CUDA kernels for " + ", ".join("sm_" + a for a in archs)
                + " only; rebuild it for this GPU (DMATTN_CUDA_ARCHS=\"%d%d\" pip install .)"
                % tuple(capability))
    return ""


@functools.lru_cache(maxsize=None)
def _device_problem(index: int) -> str:
    import torch

    capability = torch.cuda.get_device_capability(index)
    why = gpu_support(capability, build_info()["archs"])
    if not why:
        return ""
    name = torch.cuda.get_device_name(index)
    return (f"cuda:{index} ({name}) has compute capability {capability[0]}.{capability[1]}: "
            f"{why}")


def check_cuda_device(device) -> None:
    """Raises RuntimeError naming the GPU when the CUDA kernels cannot run on ``device`` (a
    torch.device of type "cuda"); cached per device, so cheap after the first call."""
    import torch

    check_cuda_index(device.index if device.index is not None else torch.cuda.current_device())


def check_cuda_index(index: int) -> None:
    """check_cuda_device for the GPU of that index."""
    problem = _device_problem(index)
    if problem:
        raise RuntimeError(problem)
