"""Figures: the padded copy, docs/perf.md "Biased and masked forward", design.md "CUDA forward".

Forward timings of a full mask (B,H,S,S) and a full bias whose rows are not 16-byte multiples
(S - 8 keys of a bool mask, S - 4 of a bf16 bias), which the CUDA backend gives its kernels as a
padded copy (src/cuda/host/aligned_operand.h), beside the same operands with aligned rows (CUDA,
bf16, B=2, H=16, S=8192, D=128). Each row: the median of CUDA-event timings with a
synchronization after every call (the benchmarks' method), and the mean of ten calls back to
back; then the kernels of one call of each copied case (torch profiler), and both timings again
with the device's default memory pool keeping what it frees (release threshold set through the
CUDA runtime), which the copy's stream-ordered allocations come from.
    python benchmarks/profiling/padded_operand_timing.py
"""

import ctypes
import glob
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import dmattn
from dmattn.bench import back_to_back_ms, time_ms

dev, dt = "cuda", torch.bfloat16
B, S, H, D = 2, 8192, 16, 128


def keep_default_pool_memory():
    """cudaMemPoolSetAttribute(default pool, cudaMemPoolAttrReleaseThreshold, UINT64_MAX)."""
    pats = ("/usr/local/cuda/lib64/libcudart.so*",
            os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*"))
    for f in (f for pat in pats for f in glob.glob(pat)):
        try:
            rt = ctypes.CDLL(f)
        except OSError:
            continue
        pool = ctypes.c_void_p()
        threshold = ctypes.c_uint64(2**64 - 1)
        ok = rt.cudaDeviceGetDefaultMemPool(ctypes.byref(pool), torch.cuda.current_device()) == 0
        return ok and rt.cudaMemPoolSetAttribute(pool, 4, ctypes.byref(threshold)) == 0
    return False


def main():
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g) for _ in range(3))
    bias = torch.randn(B, H, S, S, device=dev, dtype=dt, generator=g)
    mask = torch.randint(0, 2, (B, H, S, S), device=dev, dtype=torch.uint8, generator=g).bool()
    mask_rows = mask[..., : S - 8].contiguous()
    bias_rows = bias[..., : S - 4].contiguous()
    cases = {
        "mask": lambda: dmattn.attention(q, k, v, mask),
        "mask, rows of S - 8": lambda: dmattn.attention(q, k[:, : S - 8], v[:, : S - 8], mask_rows),
        "bias": lambda: dmattn.attention(q, k, v, bias=bias),
        "bias, rows of S - 4": lambda: dmattn.attention(q, k[:, : S - 4], v[:, : S - 4], bias=bias_rows),
    }

    def run(tag):
        with torch.no_grad():
            for name, fn in cases.items():
                ms = statistics.median(time_ms(fn, dev, 3, 10) for _ in range(3))
                print(f"{tag:<14} {name:<20} sync a call {ms:7.3f} ms, back to back {back_to_back_ms(fn, 10):7.3f} ms",
                      flush=True)

    print(f"B={B} H={H} S={S} D={D} bf16")
    run("default pool")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for name in ("mask, rows of S - 8", "bias, rows of S - 4"):
            cases[name]()
            torch.cuda.synchronize()
    for evt in prof.key_averages():
        if evt.self_device_time_total > 0:
            print(f"  kernel {evt.key[:80]:<80} {evt.self_device_time_total / max(evt.count, 1) / 1e3:7.3f} ms")
    if keep_default_pool_memory():
        run("pool kept")
    else:
        print("(the CUDA runtime library was not found: no run with the pool's memory kept)")


if __name__ == "__main__":
    main()
