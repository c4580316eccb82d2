"""attention_with_kvcache in the balanced form (docs/decode.md, "Balanced shares": the batch's key
stages dealt out in equal shares over the GPU's CTA places, a share free to cut a row anywhere)
against the float64 reference: ragged rows (empty, one key, long), contiguous and paged caches,
appended keys, causal windows, a key bias (the wgmma kernel's bias product), caches whose rows
hold fewer stages than there are places; its two routes (eager, the traced op) and a CUDA graph
give the same bits. Outputs and buffers NaN-poisoned (nan_poison). The form is asked for with
DMATTN_DECODE_BALANCED=1 (the `balanced` fixture)."""

from __future__ import annotations

import pytest
import torch

import dmattn
from dmattn._lib import lib
from dmattn.decode import kvcache_forward
from dmattn.decode_kernel import native_allocates
from test_kvcache import _check, _make_case, _run, _run_graph

pytestmark = pytest.mark.gpu

HEADS, HEADS_KV, HEAD_DIM = 16, 4, 128
CAPACITY = 268 * 64  # (pages of 64 and of 256 divide it)


@pytest.fixture
def balanced(monkeypatch):
    """The balanced form asked for (the native call reads the switch at each call)."""
    monkeypatch.setenv("DMATTN_DECODE_BALANCED", "1")


def _require_balanced(case):
    """Skips unless this GPU and build run the case's shapes in the balanced form (Hopper, torch
    lending its allocator to the native call), so that no test below passes on the split form
    alone."""
    q = case["q"]
    seqlen_k = CAPACITY
    splits = lib().decode_balanced_splits(q.device.index or 0, q.shape[0], q.shape[1], q.shape[2],
                                          case["k_cache"].shape[2], q.shape[3], seqlen_k)
    if splits <= 0 or not native_allocates():
        pytest.skip("the balanced form runs on Hopper, with torch lending its allocator to the native call")


def _case(lens, *, seqlen_q=1, new=0, page_size=None, bias=False, seed=0):
    batch = len(lens)
    return _make_case("cuda", torch.bfloat16, batch=batch, seqlen_q=seqlen_q, heads=HEADS, heads_kv=HEADS_KV,
                      head_dim=HEAD_DIM, capacity=CAPACITY, lens=lens, new=new, page_size=page_size,
                      bias_shape=(batch, HEADS, 1, CAPACITY) if bias else None, generator_seed=seed)


def _balanced_splits(batch, env, monkeypatch):
    if env is None:
        monkeypatch.delenv("DMATTN_DECODE_BALANCED", raising=False)
    else:
        monkeypatch.setenv("DMATTN_DECODE_BALANCED", env)
    return lib().decode_balanced_splits(torch.cuda.current_device(), batch, 1, HEADS, HEADS_KV, HEAD_DIM, CAPACITY)


def test_balanced_only_when_asked(monkeypatch):
    """Off unless DMATTN_DECODE_BALANCED=1 (a batch of equal long rows runs faster in splits)."""
    if _balanced_splits(1, "1", monkeypatch) <= 0:
        pytest.skip("the balanced form runs on Hopper")
    assert _balanced_splits(4, "1", monkeypatch) > 0
    for env in (None, "0"):
        assert _balanced_splits(1, env, monkeypatch) == 0 and _balanced_splits(4, env, monkeypatch) == 0


@pytest.mark.parametrize("page_size", [None, 256])
def test_balanced_one_sequence(nan_poison, balanced, page_size):
    """One sequence's step: its kv heads' rows alone share the places."""
    case = _case([CAPACITY - 5], page_size=page_size, seed=5)
    _require_balanced(case)
    out, lse = _run(case)
    _check(case, out, lse)


@pytest.mark.parametrize("page_size", [None, 64, 256])
def test_balanced_ragged_rows(nan_poison, balanced, page_size):
    case = _case([0, 1, 5003, CAPACITY - 52], page_size=page_size)
    _require_balanced(case)
    out, lse = _run(case)
    _check(case, out, lse)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))  # the row without keys


@pytest.mark.parametrize("window,bias", [((-1, -1), True), ((700, 0), False), ((64, 0), True)])
def test_balanced_append_window_bias(nan_poison, balanced, window, bias):
    """Four queries appended (16 packed rows a kv head, the bias product's limit), causal with a
    window or a key bias: the shares start at each row's first visible stage."""
    case = _case([9000, 3, 0, CAPACITY - 4], seqlen_q=4, new=4, bias=bias, seed=1)
    _require_balanced(case)
    out, lse = _run(case, window=window)
    _check(case, out, lse, window=window)


def test_balanced_fewer_stages_than_places(nan_poison, balanced):
    """A full-capacity cache whose rows hold a handful of stages: the shares shrink to one stage
    each, the other CTAs idle."""
    case = _case([3, 0, 0, 70], seed=2)
    _require_balanced(case)
    out, lse = _run(case)
    _check(case, out, lse)


def test_balanced_routes_and_graph_equal(balanced):
    """The eager route, the traced op (attention_with_kvcache under torch.compile takes it) and a
    CUDA graph's replay run the same form: the same bits."""
    case = _case([17000, 40, 8000, 12345], page_size=256, seed=3)
    _require_balanced(case)
    out, lse = _run(case)
    _check(case, out, lse)
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"], case["block_table"], None, None,
            True, -1, -1, None, 0.0)
    out_op, lse_op = kvcache_forward(*args)
    assert torch.equal(out_op, out) and torch.equal(lse_op, lse)

    out_graph, lse_graph = _run_graph(case)
    assert torch.equal(out_graph, out) and torch.equal(lse_graph, lse)


def test_balanced_equal_rows_fill_every_place(balanced):
    """B = 8 rows of equal length (the decoding benchmark's shape, shortened): every CTA place
    holds a share, every row is cut; against the reference."""
    lens = [CAPACITY] * 8
    case = _case(lens, seed=4)
    _require_balanced(case)
    out, lse = _run(case)
    _check(case, out, lse)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref = dmattn.attention(case["q"], case["k_cache"], case["v_cache"], causal=True)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
