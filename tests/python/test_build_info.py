"""The build report (dmattn.info, the native build_info) and the refusal of GPUs the CUDA
kernels cannot run on. The GPU checks run on the CPU: torch's capability queries are replaced."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import dmattn
from dmattn import _lib, info


def test_build_info_matches_library():
    built = _lib.build_info()
    assert built["cuda"] == dmattn.cuda_available()
    assert isinstance(built["blas"], bool)
    if built["cuda"]:
        assert built["archs"] and built["cuda_version"]
    else:
        assert built["archs"] == [] and built["cuda_version"] == ""


@pytest.mark.parametrize("arch, capability, runs", [
    ("80", (8, 0), True), ("80", (8, 6), True), ("80", (8, 9), True), ("80", (9, 0), False),
    ("86", (8, 0), False), ("90a", (9, 0), True), ("90a", (9, 1), False), ("90", (9, 0), True),
    ("100a", (10, 0), True), ("90a", (10, 0), False), ("120", (12, 0), True),
])
def test_arch_runs_on(arch, capability, runs):
    assert _lib.arch_runs_on(arch, capability) is runs


def test_gpu_support():
    archs = ["80", "90a"]
    assert _lib.gpu_support((8, 0), archs) == ""
    assert _lib.gpu_support((8, 9), archs) == ""
    assert _lib.gpu_support((9, 0), archs) == ""
    assert "8.0" in _lib.gpu_support((7, 5), archs)
    assert "sm_80" in _lib.gpu_support((7, 5), archs)
    assert "sm_80, sm_90a only" in _lib.gpu_support((10, 0), archs)
    assert _lib.gpu_support((12, 0), []) == ""  # archs unknown: only the minimum applies


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda reporting one GPU of the capability the test sets."""
    state = {"capability": (7, 5), "name": "Tesla T4"}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: state["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: state["name"])
    monkeypatch.setattr(_lib, "build_info", lambda: {"cuda": True, "archs": ["80", "90a"],
                                                     "cuda_version": "13.0", "blas": True})
    _lib._device_problem.cache_clear()
    yield state
    _lib._device_problem.cache_clear()


def test_old_gpu_refused_by_name(fake_gpu):
    with pytest.raises(RuntimeError) as err:
        _lib.check_cuda_device(torch.device("cuda", 0))
    message = str(err.value)
    assert "cuda:0 (Tesla T4)" in message and "7.5" in message and "sm_80" in message


def test_supported_gpu_accepted(fake_gpu):
    fake_gpu.update(capability=(8, 6), name="NVIDIA RTX A6000")
    _lib.check_cuda_device(torch.device("cuda", 0))
    fake_gpu.update(capability=(9, 0), name="NVIDIA H100")
    _lib._device_problem.cache_clear()
    _lib.check_cuda_device(torch.device("cuda", 0))


def test_gpu_without_kernels_refused(fake_gpu):
    fake_gpu.update(capability=(12, 0), name="NVIDIA RTX 5090")
    with pytest.raises(RuntimeError, match=r"12\.0.*sm_80, sm_90a only"):
        _lib.check_cuda_device(torch.device("cuda", 0))


def test_cpu_tensors_unaffected_by_gpu_check(fake_gpu):
    q = torch.randn(1, 4, 2, 16)
    out = dmattn.attention(q, q, q)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_info_report():
    text = info.report()
    assert f"dmattn {dmattn.__version__}" in text and "CUDA:" in text and "torch:" in text


def test_info_module_runs():
    result = subprocess.run([sys.executable, "-m", "dmattn.info"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "dmattn " in result.stdout
