"""Figures: docs/perf.md, "Decode kernels on Hopper".

The decode kernels on Hopper against each other: calls without mask / bias entries take the
wgmma kernel (docs/decode.md), and with DMATTN_DECODE_SM90=0 (in a process of its own) the
mma.sync kernels (the one-tile kernel up to 16 rows, the 64-row kernel above). Each case is
`attention_with_kvcache` on a full contiguous cache, replayed from a CUDA graph (ten calls a
graph, the time per call: the kernels alone), median of 30 replays, in microseconds, with the
K / V read rate; SDPA (enable_gqa) in the same process as the default kernels. bf16. The largest
difference between the two kernels' outputs is printed too (within rounding: they add the keys'
products in different orders).
    PYTHONPATH=python python3 benchmarks/profiling/decode_kernel_ab.py
"""

import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import dmattn
from dmattn.bench import cuda_graph_of

# (B, Sq, H, Hkv, Sk, D)
CASES = [
    (8, 1, 32, 8, 32768, 128),
    (1, 1, 32, 8, 131072, 128),
    (8, 4, 32, 8, 32768, 128),
    (8, 16, 32, 8, 32768, 128),
    (8, 16, 32, 8, 32768, 64),
    (1, 16, 32, 8, 131072, 128),
    (8, 1, 16, 4, 4160, 128),
    (1, 1, 16, 4, 4160, 128),
]
GRAPH_REPEAT = 10


def graph_us(fn) -> float:
    replay = cuda_graph_of(fn, repeat=GRAPH_REPEAT)
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / GRAPH_REPEAT)
    return sorted(times)[len(times) // 2] * 1e3


def inputs(B, Sq, H, Hkv, Sk, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, torch.full((B,), Sk, device="cuda", dtype=torch.int32)


def measure(tag: str, out_dir: str) -> None:
    """One line per case: tag, time, rate (and SDPA's with the default kernels); the outputs
    saved for the comparison."""
    for case in CASES:
        q, k, v, lens = inputs(*case)
        call = lambda: dmattn.attention_with_kvcache(q, k, v, cache_seqlens=lens)  # noqa: E731
        torch.save(call().cpu(), os.path.join(out_dir, "_".join(map(str, case)) + f"_{tag}.pt"))
        us = graph_us(call)
        tbs = 2 * k.numel() * k.element_size() / (us * 1e-6) / 1e12
        line = f"{tag:9s} B={case[0]} Sq={case[1]} H={case[2]}/{case[3]} Sk={case[4]} D={case[5]}: {us:7.1f} us {tbs:5.2f} TB/s"
        if tag == "wgmma":
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            line += f"   SDPA {graph_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)):7.1f} us"
        print(line, flush=True)


def main() -> None:
    if len(sys.argv) == 3:  # the child process: python decode_kernel_ab.py TAG DIR
        measure(sys.argv[1], sys.argv[2])
        return
    out_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), "decode_kernel_ab")
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, DMATTN_DECODE_SM90="0")
    subprocess.run([sys.executable, __file__, "mma.sync", out_dir], env=env, check=True)
    measure("wgmma", out_dir)
    for case in CASES:
        stem = os.path.join(out_dir, "_".join(map(str, case)))
        a, b = torch.load(stem + "_mma.sync.pt"), torch.load(stem + "_wgmma.pt")
        print(f"B={case[0]} Sq={case[1]} Sk={case[4]} D={case[5]}: max |wgmma - mma.sync| = "
              f"{(a.float() - b.float()).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
