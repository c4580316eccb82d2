"""The build report (dmattn.info, the native build_info), which code a GPU runs (machine code or
the driver's JIT of the PTX) and the refusal of GPUs the CUDA kernels cannot run on. The GPU
checks run on the CPU: torch's capability queries are replaced."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import dmattn
from dmattn import _lib, info


def test_build_info_matches_library():
    built = _lib.build_info()
    assert built["cuda"] == dmattn.cuda_available()
    assert isinstance(built["blas"], bool)
    if built["cuda"]:
        assert (built["archs"] or built["ptx"]) and built["cuda_version"]
    else:
        assert built["archs"] == [] and built["ptx"] == [] and built["cuda_version"] == ""


@pytest.mark.parametrize("arch, capability, runs", [
    ("80", (8, 0), True), ("80", (8, 6), True), ("80", (8, 9), True), ("80", (9, 0), False),
    ("86", (8, 0), False), ("90a", (9, 0), True), ("90a", (9, 1), False), ("90", (9, 0), True),
    ("100a", (10, 0), True), ("90a", (10, 0), False), ("120", (12, 0), True),
    ("100a", (10, 3), False), ("100f", (10, 0), True), ("100f", (10, 3), True),
    ("103f", (10, 0), False), ("100f", (12, 0), False),
])
def test_arch_runs_on(arch, capability, runs):
    assert _lib.arch_runs_on(arch, capability) is runs


@pytest.mark.parametrize("arch, capability, runs", [
    ("80", (8, 0), True), ("80", (8, 6), True), ("80", (9, 0), True), ("80", (10, 0), True),
    ("80", (12, 1), True), ("80", (7, 5), False), ("90", (8, 9), False), ("90a", (9, 0), True),
    ("90a", (10, 0), False),
])
def test_ptx_runs_on(arch, capability, runs):
    assert _lib.ptx_runs_on(arch, capability) is runs


NO_ENV = {}
FORCE_JIT = {"CUDA_FORCE_PTX_JIT": "1"}
NO_JIT = {"CUDA_DISABLE_PTX_JIT": "1"}
JIT80 = "PTX JIT (compute_80)"


@pytest.mark.parametrize("capability, archs, ptx, env, path", [
    ((8, 0), ["80", "90a"], ["80"], NO_ENV, "native sm_80"),
    ((8, 6), ["80", "90a"], ["80"], NO_ENV, "native sm_80"),
    ((8, 9), ["80", "90a"], [], NO_ENV, "native sm_80"),
    ((9, 0), ["80", "90a"], ["80"], NO_ENV, "native sm_90a"),
    ((9, 0), ["80", "90", "90a"], [], NO_ENV, "native sm_90a"),  # arch-specific first
    ((10, 0), ["80", "90a"], ["80"], NO_ENV, JIT80),   # B200, B300, GB200
    ((10, 3), ["80", "90a"], ["80"], NO_ENV, JIT80),
    ((12, 0), ["80", "90a"], ["80"], NO_ENV, JIT80),   # RTX 50xx, RTX PRO 6000
    ((9, 0), ["80"], ["80"], NO_ENV, JIT80),            # a build without sm_90a on Hopper
    ((10, 0), ["80", "90a"], [], NO_ENV, ""),           # no PTX: nothing runs
    ((7, 5), ["80", "90a"], ["80"], NO_ENV, ""),        # below sm_80: never
    ((9, 0), ["80", "90a"], ["80"], FORCE_JIT, JIT80),  # the driver ignores machine code
    ((8, 0), ["80", "90a"], ["80"], FORCE_JIT, JIT80),
    ((9, 0), ["80", "90a"], [], FORCE_JIT, ""),
    ((10, 0), ["80", "90a"], ["80"], NO_JIT, ""),       # JIT forbidden
    ((9, 0), ["80", "90a"], ["80"], NO_JIT, "native sm_90a"),
    ((9, 0), [], ["80"], NO_ENV, JIT80),                # a PTX-only build
    ((10, 3), ["80", "90a", "100f"], ["80"], NO_ENV, "native sm_100f"),  # B300: the family's
    ((10, 0), ["80", "100", "100f", "100a"], [], NO_ENV, "native sm_100a"),
    ((10, 3), ["100", "100f"], [], NO_ENV, "native sm_100f"),
    ((12, 0), ["80", "90a", "100f"], ["80"], NO_ENV, JIT80),
])
def test_kernel_path(capability, archs, ptx, env, path):
    assert _lib.kernel_path(capability, archs, ptx, env) == path
    assert (_lib.gpu_support(capability, archs, ptx, env) == "") is bool(path)


def test_gpu_support():
    archs = ["80", "90a"]
    assert _lib.gpu_support((8, 0), archs, environ=NO_ENV) == ""
    assert _lib.gpu_support((8, 9), archs, environ=NO_ENV) == ""
    assert _lib.gpu_support((9, 0), archs, environ=NO_ENV) == ""
    assert "8.0" in _lib.gpu_support((7, 5), archs, ["80"], NO_ENV)
    assert "sm_80" in _lib.gpu_support((7, 5), archs, ["80"], NO_ENV)
    assert "sm_80, sm_90a only and no PTX" in _lib.gpu_support((10, 0), archs, environ=NO_ENV)
    assert 'DMATTN_CUDA_ARCHS="100"' in _lib.gpu_support((10, 0), archs, environ=NO_ENV)
    assert _lib.gpu_support((10, 0), archs, ["80"], NO_ENV) == ""
    assert _lib.gpu_support((12, 0), None) == ""  # archs unknown: only the minimum applies
    assert "CUDA_DISABLE_PTX_JIT=1" in _lib.gpu_support((12, 0), archs, ["80"], NO_JIT)
    assert "CUDA_FORCE_PTX_JIT=1" in _lib.gpu_support((9, 0), archs, [], FORCE_JIT)


def test_jit_notice_names_the_cache():
    text = _lib.jit_notice(0, "NVIDIA B200", (10, 0), JIT80, {})
    assert "cuda:0 (NVIDIA B200, compute capability 10.0)" in text and "compute_80 PTX" in text
    assert "CUDA_CACHE_PATH" in text and "CUDA_CACHE_MAXSIZE=4294967296" in text
    text = _lib.jit_notice(0, "NVIDIA B200", (10, 0), JIT80,
                           {"CUDA_CACHE_MAXSIZE": "4294967296", "CUDA_CACHE_PATH": "/cache"})
    assert "/cache" in text and "CUDA_CACHE_MAXSIZE=" not in text
    text = _lib.jit_notice(0, "NVIDIA B200", (10, 0), JIT80, {"CUDA_CACHE_DISABLE": "1"})
    assert "every process compiles them again" in text


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda reporting one GPU of the capability the test sets."""
    state = {"capability": (7, 5), "name": "Tesla T4", "ptx": ["80"]}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: state["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: state["name"])
    monkeypatch.setattr(_lib, "build_info", lambda: {"cuda": True, "archs": ["80", "90a"],
                                                     "ptx": state["ptx"], "cuda_version": "13.0",
                                                     "blas": True})
    for name in ("CUDA_FORCE_PTX_JIT", "CUDA_FORCE_JIT", "CUDA_DISABLE_PTX_JIT", "CUDA_DISABLE_JIT"):
        monkeypatch.delenv(name, raising=False)
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


def test_old_gpu_refused_with_ptx_too(fake_gpu):
    fake_gpu.update(capability=(6, 1), name="NVIDIA GeForce GTX 1080")
    with pytest.raises(RuntimeError, match=r"cuda:0 \(NVIDIA GeForce GTX 1080\).*6\.1.*8\.0"):
        _lib.check_cuda_device(torch.device("cuda", 0))


def test_gpu_without_kernels_refused(fake_gpu):
    fake_gpu.update(capability=(12, 0), name="NVIDIA RTX 5090", ptx=[])
    with pytest.raises(RuntimeError, match=r"12\.0.*sm_80, sm_90a only and no PTX"):
        _lib.check_cuda_device(torch.device("cuda", 0))


def test_newer_gpu_runs_ptx_and_warns_once(fake_gpu):
    fake_gpu.update(capability=(10, 0), name="NVIDIA B200")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _lib.check_cuda_device(torch.device("cuda", 0))
    jit = [w for w in caught if issubclass(w.category, _lib.PtxJitWarning)]
    assert len(jit) == 1, [str(w.message) for w in caught]
    assert "NVIDIA B200" in str(jit[0].message) and "CUDA_CACHE_PATH" in str(jit[0].message)
    assert _lib.device_kernel_path(0) == JIT80


def test_native_gpu_does_not_warn(fake_gpu, monkeypatch):
    fake_gpu.update(capability=(9, 0), name="NVIDIA H200")
    with warnings.catch_warnings():
        warnings.simplefilter("error", _lib.PtxJitWarning)
        _lib.check_cuda_device(torch.device("cuda", 0))
    assert _lib.device_kernel_path(0) == "native sm_90a"
    monkeypatch.setenv("CUDA_FORCE_PTX_JIT", "1")  # the way to take a newer GPU's path on Hopper
    _lib._device_problem.cache_clear()
    with pytest.warns(_lib.PtxJitWarning):
        _lib.check_cuda_device(torch.device("cuda", 0))
    assert _lib.device_kernel_path(0) == JIT80


def test_cpu_tensors_unaffected_by_gpu_check(fake_gpu):
    q = torch.randn(1, 4, 2, 16)
    out = dmattn.attention(q, q, q)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_info_report():
    text = info.report()
    assert f"dmattn {dmattn.__version__}" in text and "CUDA:" in text and "torch:" in text


def test_info_reports_each_gpus_path(fake_gpu, monkeypatch):
    gpus = [((8, 6), "NVIDIA RTX A6000"), ((9, 0), "NVIDIA H200"), ((10, 0), "NVIDIA B200"),
            ((7, 5), "Tesla T4")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: gpus[index][0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: gpus[index][1])
    loaded = {0: {"binary": 80, "ptx": 80}, 1: {"binary": 90, "ptx": 90}, 2: {"binary": 100, "ptx": 80}}
    monkeypatch.setattr(info, "kernel_code", lambda index: loaded[index])
    monkeypatch.setattr(info, "build_info", _lib.build_info)  # (the fixture's)
    monkeypatch.setattr(info, "lib", lambda: None)
    lines = info.report().splitlines()
    assert any("CUDA PTX:" in line and "compute_80" in line for line in lines)
    row = {name: line for _, name in gpus for line in lines if name in line}
    assert "native sm_80" in row["NVIDIA RTX A6000"] and "sm_80 machine code" in row["NVIDIA RTX A6000"]
    assert "native sm_90a" in row["NVIDIA H200"]
    assert JIT80 in row["NVIDIA B200"] and "JIT-compiled for sm_100" in row["NVIDIA B200"]
    assert "NOT supported" in row["Tesla T4"] and "8.0" in row["Tesla T4"]


@pytest.mark.gpu
def test_driver_loads_the_predicted_code():
    """The driver's own account of the code it loaded (what the launchers ask before choosing the
    Hopper kernels) agrees with the path dmattn.info predicts: under CUDA_FORCE_PTX_JIT=1, or on
    a GPU without machine code in the build, the compute_80 PTX JIT-compiled for the GPU."""
    if not torch.cuda.is_available() or not dmattn.cuda_available():
        pytest.skip("needs a CUDA device and a CUDA build")
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    path = _lib.device_kernel_path(index)
    code = _lib.kernel_code(index)
    if path.startswith("PTX JIT"):
        assert code == {"binary": major * 10 + minor, "ptx": 80}, (path, code)
    else:
        arch = int(path.removeprefix("native sm_").rstrip("af"))
        assert code == {"binary": arch, "ptx": arch}, (path, code)


def test_info_module_runs():
    result = subprocess.run([sys.executable, "-m", "dmattn.info"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "dmattn " in result.stdout
