"""Loads the native tvm-ffi module (libdmattn_ffi.so) once, on first use."""

from __future__ import annotations

import functools
import os
from pathlib import Path


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
