"""pytest configuration for the dmattn Python suite.

* Every test starts from a fixed seed (``torch.manual_seed`` / ``random.seed``).
* ``@pytest.mark.gpu`` tests are skipped when no CUDA device is visible.
* The ``device`` fixture runs a test on "cpu" and, when available, on "cuda";
  ``device_bwd_path`` likewise, with CUDA once per backward path (DMATTN_BWD_EXACT=0 / 1).
* The run ends with one line counting the skipped tests by reason.
* ``nan_poison``: while active, every torch.empty/empty_like/new_empty allocation (in particular
  the outputs and scratch buffers the dmattn ops allocate) is filled with NaN, through
  ``torch.use_deterministic_algorithms(True)`` + ``torch.utils.deterministic.
  fill_uninitialized_memory`` (on CPU and CUDA). A kernel that leaves any element of its
  outputs unwritten then fails the finiteness checks.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CUDA = torch.cuda.is_available()
# The CUDA parameter carries the gpu marker, so `pytest -m gpu` (scripts/gpu_cycle.sh) selects
# every test's CUDA variant and `-m "not gpu"` the CPU ones.
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if CUDA else [])


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line: how many tests were skipped, and why (grouped by reason)."""
    reasons = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        parts = [f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
        terminalreporter.write_line(f"skipped {sum(reasons.values())}: " + "; ".join(parts))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)
    yield


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


# (device, DMATTN_BWD_EXACT): the CPU backend has one backward path, CUDA two (FlashAttention-2's
# Delta = rowsum(dO * O) with dq atomics, and the exact three-pass path). Forcing one per variant
# tests both (the automatic choice looks at the problem size). The CUDA variants carry the gpu
# marker, like `device`'s.
BWD_PATH_DEVICES = [pytest.param(("cpu", None), id="cpu")]
if CUDA:
    BWD_PATH_DEVICES += [pytest.param(("cuda", exact), id=f"cuda-{name}", marks=pytest.mark.gpu)
                         for exact, name in (("0", "fa2_bwd"), ("1", "exact_bwd"))]


@pytest.fixture(params=BWD_PATH_DEVICES)
def device_bwd_path(request, monkeypatch):
    """`device`, with each CUDA backward path as its own variant (DMATTN_BWD_EXACT set for the
    test); a module takes it as its `device` by overriding that fixture."""
    dev, exact = request.param
    if exact is not None:
        monkeypatch.setenv("DMATTN_BWD_EXACT", exact)
    return dev


@pytest.fixture
def nan_poison():
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = prev_fill
        torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)
