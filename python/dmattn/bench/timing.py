"""How the benchmark times a call: the median of CUDA-event (or wall-clock) timings, each run
started on an idle GPU (time_ms); runs issued back to back (back_to_back_ms); the replay of a
CUDA graph, the kernels without the host's time (cuda_graph_of). Also used by the scripts in
benchmarks/profiling/.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch


def cuda_graph_of(fn: Callable[[], object], repeat: int = 1) -> Callable[[], None]:
    """The replay of fn captured in a CUDA graph (after a warm-up on a side stream, as torch's
    documentation does it): timing it gives the kernels' time without the host's (the
    scripts in benchmarks/profiling/). repeat: fn captured that many times back to back in the
    one graph; the replay's time divided by repeat leaves out the graph launch's own latency,
    which a call of a few hundred microseconds otherwise carries in full."""
    if repeat < 1:
        raise ValueError(f"repeat: expected >= 1, got {repeat}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    return graph.replay


def time_ms(fn: Callable[[], object], device: str, warmup: int, iters: int,
            before_each: Optional[Callable[[], object]] = None) -> float:
    """Median time of fn in ms: CUDA events on "cuda", wall clock otherwise (also used by
    the scripts in benchmarks/profiling/). before_each, if given, runs before every timed run,
    outside the timing (a barrier of several processes, say)."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            if before_each is not None:
                before_each()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            if before_each is not None:
                before_each()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def back_to_back_ms(fn: Callable[[], object], iters: int, device: str = "cuda") -> float:
    """Mean time of fn over `iters` runs issued back to back between two CUDA events (the host
    runs ahead while the GPU is busy: launch latency hidden, as in FlashAttention's and Triton's
    timing loops); time_ms, the headline figure, waits for the GPU before each run instead. On
    another device the wall clock of the loop (there the two figures differ by the clock's and
    the loop's costs alone)."""
    fn()
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
