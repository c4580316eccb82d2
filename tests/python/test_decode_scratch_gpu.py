"""The decode calls' scratch (the splits' partial rows and an lse the caller does not want;
src/binding/decode_scratch.cpp): eager calls of one stream reuse one buffer, calls on another
stream get a buffer of their own, calls captured in a CUDA graph get memory of the graph's pool,
and calls of two threads on one stream queue their launches one call at a time.
Each case compares eager outputs, bit for bit, with a replay of the same call captured in a
graph (whose scratch is fresh memory, never reused), after other calls filled the reused buffer
with their own partial rows."""

from __future__ import annotations

import pytest
import torch

import dmattn
from reference import check_against_reference

pytestmark = pytest.mark.gpu

HEADS, HEADS_KV, HEAD_DIM = 8, 2, 128


def _inputs(batch, keys, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(batch, keys, HEADS_KV, HEAD_DIM, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    return q, k, v, lens


def _call(inputs, return_lse=False):
    q, k, v, lens = inputs
    return dmattn.attention_with_kvcache(q, k, v, cache_seqlens=lens, causal=False, return_lse=return_lse)


def _graphed(inputs, stream=None):
    """(graph, out): the call captured in a CUDA graph, on `stream` (a new one by default)."""
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _call(inputs)  # (warm-up outside the capture)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = _call(inputs)
    return graph, out


def _replayed(inputs):
    graph, out = _graphed(inputs)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


# (batch, keys): many splits of one row, a few splits of several rows, one split (the lse alone in
# the scratch), and the first again after the others wrote the buffer.
SHAPES = [(1, 8192), (4, 3000), (16, 300), (2, 20000), (1, 8192)]


def test_gpu_scratch_reused_across_shapes():
    cases = [_inputs(batch, keys, seed) for seed, (batch, keys) in enumerate(SHAPES)]
    expected = [_replayed(c) for c in cases]
    for _ in range(2):
        for i, c in enumerate(cases):
            torch.testing.assert_close(_call(c), expected[i], rtol=0, atol=0, msg=f"shape {SHAPES[i]}")
    out, lse = _call(cases[0], return_lse=True)
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    q, k, v, _ = cases[0]
    check_against_reference(q, k, v, None, None, out, lse)


def test_gpu_scratch_per_stream():
    """Two streams running calls of the same shape side by side (a shared buffer would mix their
    partial rows): each stream's outputs equal its own call's."""
    cases = [_inputs(1, 16384, 10 + s) for s in range(2)]
    expected = [_replayed(c) for c in cases]
    streams = [torch.cuda.Stream() for _ in cases]
    outs = [[], []]
    torch.cuda.synchronize()
    for _ in range(20):
        for s, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[s].append(_call(cases[s]))
    torch.cuda.synchronize()
    for s in range(2):
        for out in outs[s]:
            torch.testing.assert_close(out, expected[s], rtol=0, atol=0, msg=f"stream {s}")


def test_gpu_graph_keeps_its_scratch():
    """A graph captured on a stream whose eager calls have a buffer does not take that buffer: after
    a larger eager call replaced it (its memory back in the allocator, handed to new tensors), the
    replay still writes only its own memory."""
    small, large = _inputs(1, 4096, 20), _inputs(4, 30000, 21)
    expected = _replayed(small)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _call(small)  # (the stream's buffer, sized for the small call)
    graph, out = _graphed(small, stream=stream)
    with torch.cuda.stream(stream):
        _call(large)  # (replaces the buffer; the old one goes back to the allocator)
        # (tensors of every size the old buffer may have had, one of which likely takes its memory)
        fills = [torch.full((1 << n,), 7.0, device="cuda") for n in range(10, 22)]
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for fill in fills:
        assert bool((fill == 7.0).all()), f"a tensor of {fill.numel()} floats was overwritten by the replay"


def _topk_inputs(batch, keys, bias_rows, bias_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(batch, keys, HEADS_KV, HEAD_DIM, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    bias = torch.randn(*bias_rows, 1, keys, generator=g).to("cuda", bias_dtype)
    return q, k, v, bias


def test_gpu_topk_step_scratch():
    """attention_topk's decoding step keeps the kept keys' positions and bias in the front of the
    scratch too: odd counts of kept keys (the regions behind them rounded to 16 bytes), 16- and
    32-bit biases, alternating shapes, each equal bit for bit to its graph replay."""
    cases = [(_topk_inputs(1, 3001, (1, 1), torch.bfloat16, 30), 701),
             (_topk_inputs(2, 9000, (2, HEADS_KV), torch.float32, 31), 2047),
             (_topk_inputs(3, 1500, (3, 1), torch.bfloat16, 32), 333)]

    def step(case):
        (q, k, v, bias), keep = case
        with torch.no_grad():
            return dmattn.attention_topk(q, k, v, bias, keep, causal=True, per_query=True)

    expected = []
    for case in cases:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(case)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(case)
        graph.replay()
        torch.cuda.synchronize()
        expected.append(out.clone())
    for _ in range(2):
        for i, case in enumerate(cases):
            torch.testing.assert_close(step(case), expected[i], rtol=0, atol=0, msg=f"case {i}")


def test_gpu_threads_on_one_stream():
    """Two threads calling on the device's default stream at once (the native call runs without
    Python's GIL): a call's launches are queued together, so no call's kernels land between
    another's decode kernel and its merge, which would overwrite its partial rows."""
    import threading

    cases = [_inputs(1, 16384, 40 + t) for t in range(2)]
    expected = [_replayed(c) for c in cases]
    outs = [[], []]
    start = threading.Barrier(2)

    def worker(t):
        start.wait()
        for _ in range(50):
            outs[t].append(_call(cases[t]))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    for t in range(2):
        assert len(outs[t]) == 50
        for out in outs[t]:
            torch.testing.assert_close(out, expected[t], rtol=0, atol=0, msg=f"thread {t}")
