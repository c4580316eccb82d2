"""dmattn.persistent_kernels: a per-thread setting of the native library, scoped by the context
manager (nested blocks restore the outer setting; other threads keep theirs). What it changes on
the GPU (the Hopper forward's grid) is checked by the GPU suite's forward tests, which give the
same bits either way, and by the ring's NCCL cases (distributed_cases.persistence_cases)."""

import threading

import pytest
import torch

import dmattn
from dmattn._lib import lib


def allowed_now() -> bool:
    """The current thread's setting (read by setting it back to what it was)."""
    previous = lib().set_persistent_kernels(True)
    lib().set_persistent_kernels(previous)
    return bool(previous)


def test_scoped_and_nested():
    assert allowed_now()
    with dmattn.persistent_kernels(False):
        assert not allowed_now()
        with dmattn.persistent_kernels(True):
            assert allowed_now()
        assert not allowed_now()
    assert allowed_now()


def test_restored_when_the_block_raises():
    with pytest.raises(RuntimeError):
        with dmattn.persistent_kernels(False):
            raise RuntimeError("inside")
    assert allowed_now()


def test_enabled_must_be_a_bool():
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match="enabled"):
            with dmattn.persistent_kernels(bad):
                pass
    assert allowed_now()


def test_per_thread():
    seen = []
    with dmattn.persistent_kernels(False):
        thread = threading.Thread(target=lambda: seen.append(allowed_now()))
        thread.start()
        thread.join()
        assert not allowed_now()
    assert seen == [True]


def test_results_unchanged_on_the_cpu():
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    want = dmattn.attention(q, k, v, causal=True)
    with dmattn.persistent_kernels(False):
        got = dmattn.attention(q, k, v, causal=True)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_forward_bits_equal_without_persistent_kernels():
    # (1024 tiles of 128 queries, 512 causal pairs: several per multiprocessor, so the two grids differ)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8192, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    bias = torch.randn(2, 8, 1, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    for causal in (False, True):
        want = dmattn.attention(q, k, v, bias=bias, causal=causal)
        with dmattn.persistent_kernels(False):
            got = dmattn.attention(q, k, v, bias=bias, causal=causal)
        assert torch.equal(got, want)
