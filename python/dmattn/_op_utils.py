"""What every op body and inference path checks or converts on each call, with no op of its
own: the devices the native library reads (check_devices), the CUDA kernels' row layout
(_cuda_layout), the scale argument's native form (_scale_arg), and whether a call records no
gradient (records_no_gradient) or may run a custom op's Python body directly (_plain_eager).

Below ops.py (the custom ops) and decode_kernel.py (the split-KV decode kernel's calls, which
dmattn::fwd's body takes), so that both read these without importing each other. These run on
every call: plain functions, bound by name where they are used.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch._C import _are_functorch_transforms_active, _len_torch_dispatch_stack
from torch.autograd import profiler as _autograd_profiler
from torch.compiler import is_compiling as _is_compiling

from ._lib import check_cuda_device

_ROCM = torch.version.hip is not None  # (torch's "cuda" device is then a ROCm GPU)


def _cuda_layout(x: Tensor) -> Tensor:
    """The CUDA kernels copy q/k/v/out/dout rows in 16-byte chunks: they need a 16-byte aligned
    data pointer and row/head/batch strides that are multiples of 8 elements (the native
    backend rejects anything else with a clear error). Copy such rare layouts (a view at an odd
    offset, a slice of a packed qkv with odd strides) into a fresh contiguous tensor here, as
    FlashAttention's wrappers do, instead of failing. Runs inside the op bodies, on real
    tensors only (never while tracing)."""
    if not x.is_cuda:
        return x
    if x.data_ptr() % 16 == 0:
        # (contiguous with a head dim of 8k: every stride a multiple of 8, the usual case and the
        # cheaper test; decoding steps run this per layer. torch calls every empty tensor
        # contiguous, whatever its strides: those take the full test.)
        if x.is_contiguous() and x.shape[-1] % 8 == 0 and x.numel() > 0:
            return x
        # (a loop, not any() over a generator: the layouts of transformers' (B, H, S, D) caches
        # seen as (B, S, H, D) come here on every decoding step)
        shape, stride = x.shape, x.stride()
        for d in range(len(shape) - 1):
            if shape[d] > 1 and stride[d] % 8:
                break
        else:
            return x
    return x.clone(memory_format=torch.contiguous_format)


def check_devices(**tensors: Optional[Tensor]) -> None:
    """Rejects, naming the argument, a tensor the native library cannot read: one on a device
    other than cpu / cuda (meta, mps, xpu, ...) or on a ROCm GPU (torch's "cuda" on HIP
    builds). Without this the DLPack hand-over fails with a C++ stack trace. Same-device and
    every other rule are the native validation's. The first CUDA tensor's GPU must be one the
    kernels run on (compute capability 8.0 or newer, with machine code of this build for it or
    its PTX, which the driver compiles for newer GPUs): an older one is refused by name here
    rather than failing a kernel launch."""
    gpu_checked = False
    for name, t in tensors.items():
        if t is None or not isinstance(t, Tensor):
            continue  # absent, or a type error that the caller reports
        # (is_cuda / is_cpu: no device object per tensor, on every call of the API)
        if t.is_cuda and not _ROCM:
            if not gpu_checked and not torch.compiler.is_compiling():
                gpu_checked = True
                check_cuda_device(t.device)
        elif not t.is_cpu:
            where = "a ROCm GPU" if t.is_cuda else f"the {t.device.type} device"
            raise ValueError(f"{name}: dmattn runs on CPU and NVIDIA CUDA tensors; this one is "
                             f"on {where} ({t.device})")


def _scale_arg(scale: Optional[float]) -> float:
    # NaN asks the native side for the default 1/sqrt(head_dim).
    return math.nan if scale is None else float(scale)


def records_no_gradient(*tensors) -> bool:
    """No gradient to record for these tensors (None and other non-tensor entries ignored): grad
    mode is off, or none of them requires one. The inference-only paths' condition."""
    if not torch.is_grad_enabled():
        return True
    for t in tensors:  # (a loop: no generator frames on the inference paths' every call)
        if isinstance(t, Tensor) and t.requires_grad:
            return False
    return True


def _plain_eager(args: tuple) -> bool:
    """Whether a call with these arguments may run a custom op's Python body directly instead of
    going through the dispatcher: eager mode, plain tensors (no fake / functional / subclass
    tensors), no dispatch mode, no functorch transform, no profiler (which should see the op by
    name). The dispatcher's autograd and backend layers are Python code for a
    torch.library.custom_op (argument re-binding, the outputs' aliasing check): about 0.1 ms of
    host time per call, which the gather path's step pays twice on the GPU's critical path."""
    # (the names bound at import: a decoding step runs this per layer, and each attribute
    # lookup of a torch submodule is host time)
    if _is_compiling() or not _no_dispatch_layers():
        return False
    for t in args:  # (a loop: a generator's frames are host time on every call)
        if isinstance(t, Tensor) and type(t) is not Tensor:
            return False
    return True


def _no_dispatch_layers() -> bool:
    """_plain_eager's test of the dispatcher's state alone (no profiler, dispatch mode or
    functorch transform), for callers that tested tracing and their tensors' types already."""
    return not (_autograd_profiler._is_profiler_enabled or _len_torch_dispatch_stack() > 0
                or _are_functorch_transforms_active())


def _aligned_rows(x: Tensor) -> Tensor:
    """_cuda_layout for a CUDA tensor whose last dimension is a multiple of 8 and that holds
    elements (the decode kernels' shapes): the usual contiguous, 16-byte aligned tensor as it
    is with two tests, anything else through _cuda_layout."""
    return x if x.is_contiguous() and x.data_ptr() % 16 == 0 else _cuda_layout(x)
