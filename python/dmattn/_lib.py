"""Loads the native tvm-ffi module (libdmattn_ffi.so) once, on first use."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
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
    """What the native library was built with: {"cuda": bool, "archs": ["80", "90a"] (machine
    code), "ptx": ["80"] (PTX the driver JIT-compiles for other GPUs), "cuda_version": "13.0.88"
    or "", "blas": bool}. A library older than build_info() gives {"cuda": cuda_available(),
    "archs": None, ...} (archs unknown); one older than its "ptx" entry had no PTX ([])."""
    fn = getattr(lib(), "build_info", None)
    if fn is None:
        return {"cuda": cuda_available(), "archs": None, "ptx": [], "cuda_version": "", "blas": None}
    pairs = dict(item.split("=", 1) for item in str(fn()).split() if "=" in item)
    return {
        "cuda": pairs.get("cuda") == "1",
        "archs": [a for a in pairs.get("archs", "").split(",") if a],
        "ptx": [a for a in pairs.get("ptx", "").split(",") if a],
        "cuda_version": pairs.get("cuda_version", ""),
        "blas": pairs.get("blas") == "1",
    }


# The oldest GPU the CUDA kernels run on (they use sm_80 instructions: cp.async, bf16 MMA).
MIN_COMPUTE_CAPABILITY = (8, 0)

# The CUDA driver's switches for PTX: ignore every machine code and JIT-compile the PTX (the
# first two), or never JIT-compile (the last two).
_FORCE_JIT_VARS = ("CUDA_FORCE_PTX_JIT", "CUDA_FORCE_JIT")
_DISABLE_JIT_VARS = ("CUDA_DISABLE_PTX_JIT", "CUDA_DISABLE_JIT")
# The largest JIT cache the driver keeps (CUDA_CACHE_MAXSIZE, bytes): room for every kernel of
# the library beside other programs' kernels.
JIT_CACHE_ADVICE = 4 * 1024 ** 3


def _arch_version(arch: str):
    """("90a" -> (9, 0), "a"): the compute capability an arch names and its suffix ("a":
    arch-specific, "f": family-specific, "" portable); None for an arch spelled otherwise."""
    digits = arch.rstrip("af")
    try:
        return (int(digits[:-1]), int(digits[-1])), arch[len(digits):]
    except (ValueError, IndexError):
        return None


def arch_runs_on(arch: str, capability) -> bool:
    """Whether code compiled for ``arch`` ("80", "90a", "100f") runs on a GPU of compute
    capability ``capability`` (major, minor): a cubin runs on its own major version at the same
    or a newer minor, and so does a family-specific one ("100f": 10.0 and 10.3); an
    arch-specific one ("90a") only on exactly its capability."""
    parsed = _arch_version(arch)
    if parsed is None:  # an arch spelled otherwise: no grounds to refuse the GPU
        return True
    (a_major, a_minor), suffix = parsed
    major, minor = capability
    if suffix == "a":
        return (a_major, a_minor) == (major, minor)
    return a_major == major and a_minor <= minor


def ptx_runs_on(arch: str, capability) -> bool:
    """Whether PTX for ``arch`` ("80") can be JIT-compiled for a GPU of ``capability``: any GPU of
    that compute capability or newer (an arch-specific one only on exactly its own)."""
    parsed = _arch_version(arch)
    if parsed is None:
        return False
    version, suffix = parsed
    return version == tuple(capability) if suffix else version <= tuple(capability)


def _env_on(environ, names) -> bool:
    return any(environ.get(name, "0") not in ("", "0") for name in names)


def kernel_path(capability, archs, ptx=(), environ=None) -> str:
    """The code of a build with machine code for ``archs`` and PTX for ``ptx`` that a GPU of
    ``capability`` runs, as the CUDA driver chooses it: "native sm_90a", "native sm_80",
    "PTX JIT (compute_80)" (compiled by the driver at first use; the sm80-class kernels), or ""
    when none (gpu_support says why). ``environ`` (default os.environ) holds the driver's
    switches: CUDA_FORCE_PTX_JIT=1 ignores machine code, CUDA_DISABLE_PTX_JIT=1 forbids JIT."""
    environ = os.environ if environ is None else environ
    if tuple(capability) < MIN_COMPUTE_CAPABILITY:
        return ""
    if not _env_on(environ, _FORCE_JIT_VARS):
        native = [a for a in archs if arch_runs_on(a, capability) and _arch_version(a)]
        if native:  # the newest that runs, arch-specific first, then family-specific
            rank = {"": 0, "f": 1, "a": 2}
            best = max(native, key=lambda a: (_arch_version(a)[0], rank[_arch_version(a)[1]]))
            return "native sm_" + best
    if not _env_on(environ, _DISABLE_JIT_VARS):
        jit = [a for a in ptx if ptx_runs_on(a, capability)]
        if jit:
            return "PTX JIT (compute_%s)" % max(jit, key=lambda a: _arch_version(a)[0])
    return ""


def gpu_support(capability, archs, ptx=(), environ=None) -> str:
    """"" when this build's kernels run on a GPU of ``capability``, else why not."""
    environ = os.environ if environ is None else environ
    if tuple(capability) < MIN_COMPUTE_CAPABILITY:
        return "dmattn needs an NVIDIA GPU of compute capability 8.0 (sm_80, Ampere) or newer"
    if archs is None or kernel_path(capability, archs, ptx, environ):
        return ""  # (archs unknown: only the minimum applies)
    own = "90a" if tuple(capability) == (9, 0) else "%d%d" % tuple(capability)
    rebuild = f'rebuild it for this GPU (DMATTN_CUDA_ARCHS="{own}" pip install .)'
    runs_ptx = any(ptx_runs_on(a, capability) for a in ptx)
    if _env_on(environ, _FORCE_JIT_VARS):
        if not runs_ptx:
            return ("CUDA_FORCE_PTX_JIT=1 makes the driver ignore machine code, and this build of "
                    "dmattn has no PTX for this GPU (DMATTN_CUDA_PTX=OFF); unset it, or " + rebuild)
        return ("CUDA_FORCE_PTX_JIT=1 and CUDA_DISABLE_PTX_JIT=1 are both set: no code of this "
                "build may run; unset one")
    kinds = ", ".join("sm_" + a for a in archs) or "no machine code"
    if runs_ptx:
        return ("this build of dmattn has CUDA kernels for " + kinds + " and compute_"
                + ", compute_".join(ptx) + " PTX, which CUDA_DISABLE_PTX_JIT=1 forbids the "
                "driver to compile; unset it, or " + rebuild)
    return ("this build of dmattn has CUDA kernels for " + kinds + " only"
            + (" and no PTX" if not ptx else "") + "; " + rebuild)


class PtxJitWarning(UserWarning):
    """A GPU runs this build's PTX, compiled by the CUDA driver at first use (dmattn.info)."""


def jit_notice(index: int, name: str, capability, path: str, environ=None) -> str:
    """The one-time notice for a GPU on a PTX JIT path: what the first calls cost and how the
    driver's cache keeps the result."""
    environ = os.environ if environ is None else environ
    cache = environ.get("CUDA_CACHE_PATH") or "~/.nv/ComputeCache"
    ptx = path[path.find("(") + 1:path.rfind(")")] if "(" in path else path
    text = (f"dmattn: cuda:{index} ({name}, compute capability {capability[0]}.{capability[1]}) "
            f"runs this build's {ptx} PTX (the sm80-class kernels), which the CUDA driver compiles "
            "at each kernel's first use: up to minutes in a first process that calls many of "
            f"them. The driver keeps the result in its cache ({cache}, CUDA_CACHE_PATH) for later "
            "processes.")
    if environ.get("CUDA_CACHE_DISABLE", "0") not in ("", "0"):
        return text + " CUDA_CACHE_DISABLE=1 is set: every process compiles them again."
    try:
        size = int(environ.get("CUDA_CACHE_MAXSIZE", "0"))
    except ValueError:
        size = 0
    if size < JIT_CACHE_ADVICE:
        text += (f" Let the cache hold them all: CUDA_CACHE_MAXSIZE={JIT_CACHE_ADVICE} (4 GiB, "
                 "the largest).")
    return text


def device_kernel_path(index: int) -> str:
    """kernel_path for the visible GPU of that index (the build's, the environment's), "" when
    its kernels cannot run there or the build's architectures are unknown."""
    import torch

    info = build_info()
    if not info["cuda"] or info["archs"] is None:
        return ""
    return kernel_path(torch.cuda.get_device_capability(index), info["archs"], info.get("ptx", []))


@functools.lru_cache(maxsize=None)
def _device_problem(index: int) -> str:
    """Why the kernels cannot run on GPU ``index`` ("" when they can); warns (PtxJitWarning),
    once per process and GPU, where they run from JIT-compiled PTX."""
    import torch

    capability = torch.cuda.get_device_capability(index)
    info = build_info()
    why = gpu_support(capability, info["archs"], info.get("ptx", []))
    if why:
        name = torch.cuda.get_device_name(index)
        return (f"cuda:{index} ({name}) has compute capability {capability[0]}.{capability[1]}: "
                f"{why}")
    path = device_kernel_path(index)
    if path.startswith("PTX JIT"):
        warnings.warn(jit_notice(index, torch.cuda.get_device_name(index), capability, path),
                      PtxJitWarning, stacklevel=4)
    return ""


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


def kernel_code(index: int) -> dict:
    """The code the driver loaded for this build's kernels on GPU ``index``: {"binary": 90,
    "ptx": 80} (machine code for sm_90, compiled from compute_80 PTX: a JIT path); zeros when
    none runs there or without CUDA. Initializes CUDA on that GPU."""
    fn = getattr(lib(), "kernel_code", None)
    if fn is None:
        return {"binary": 0, "ptx": 0}
    pairs = dict(item.split("=", 1) for item in str(fn(index)).split() if "=" in item)
    return {"binary": int(pairs.get("binary", 0)), "ptx": int(pairs.get("ptx", 0))}
