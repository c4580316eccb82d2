"""Figures: docs/perf.md, "Short query chunks with grouped-query heads".

Forward timings of short query chunks against a long cache with grouped-query heads (chunked
prefill, speculative decoding): dmattn as it chooses (the decode kernel up to 64 rows of a
group), then its general kernels (DMATTN_DECODE=0) with the query heads of each KV head packed
into its tiles (DMATTN_FWD_PACK_GQA=1) and unpacked (=0), and SDPA: its FlashAttention-2 backend given the
GQA heads (enable_gqa; the mem-efficient one refuses them), cuDNN on K / V expanded to every
query head outside the timing. Causal rows are bottom-right aligned (the chunk at the end of
the cache): SDPA gets causal_lower_right (cuDNN has none). bf16; median of CUDA-event timings
after warm-up. Each row gives the time and the K / V read rate (one read of the cache's bytes
per call over the time), the measure of a call bound by memory.
    python benchmarks/profiling/pack_gqa_timing.py [--iters 30]
"""

import argparse
import contextlib
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import dmattn
from dmattn.bench import time_ms

dev, dt = "cuda", torch.bfloat16

# (B, H, Hkv, D, Sq, Sk)
SHAPES = [
    (1, 32, 8, 128, 4, 32768),
    (1, 32, 8, 128, 16, 32768),
    (1, 32, 8, 128, 64, 32768),
    (1, 32, 8, 128, 256, 32768),
    (8, 32, 8, 128, 4, 32768),
    (8, 32, 8, 128, 16, 32768),
    (4, 32, 8, 128, 64, 8192),
    (1, 64, 8, 128, 16, 32768),
    (1, 28, 4, 128, 32, 32768),
    (2, 32, 8, 64, 32, 16384),
    (2, 16, 8, 256, 32, 16384),
]


@contextlib.contextmanager
def env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"{'shape':<44} {'variant':<34} {'ms':>8} {'K/V TB/s':>9}", flush=True)
    for b, h, hkv, d, sq, sk in SHAPES:
        q = torch.randn(b, sq, h, d, device=dev, dtype=dt, generator=g)
        k, v = (torch.randn(b, sk, hkv, d, device=dev, dtype=dt, generator=g) for _ in range(2))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        ke, ve = (t.repeat_interleave(h // hkv, dim=1) for t in (kt, vt))
        kv_bytes = 2 * k.numel() * k.element_size()
        for causal in (False, True):
            shape = f"B={b} H={h}/{hkv} D={d} Sq={sq} Sk={sk}{' causal' if causal else ''}"
            variants = {
                "dmattn": (lambda: dmattn.attention(q, k, v, causal=causal), {}),
                "dmattn general, heads packed": (lambda: dmattn.attention(q, k, v, causal=causal),
                                                 {"DMATTN_FWD_PACK_GQA": "1", "DMATTN_DECODE": "0"}),
                "dmattn general, heads unpacked": (lambda: dmattn.attention(q, k, v, causal=causal),
                                                   {"DMATTN_FWD_PACK_GQA": "0", "DMATTN_DECODE": "0"}),
            }
            mask = causal_lower_right(sq, sk) if causal else None
            def sdpa_flash():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
            variants["sdpa flash (enable_gqa)"] = (sdpa_flash, {})
            if not causal:  # (cuDNN: no lower-right causal)
                def sdpa_cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(qt, ke, ve)
                variants["sdpa cudnn (K/V expanded)"] = (sdpa_cudnn, {})
            with torch.no_grad():
                for name, (fn, switches) in variants.items():
                    with env(**switches):
                        try:
                            ms = time_ms(fn, "cuda", 5, args.iters)
                        except RuntimeError as e:  # a backend that refuses the shape
                            print(f"{shape:<44} {name:<34} {'-':>8}  ({str(e).splitlines()[0][:60]})", flush=True)
                            continue
                    print(f"{shape:<44} {name:<34} {ms:8.4f} {kv_bytes / ms / 1e9:9.2f}", flush=True)
        del q, k, v, qt, kt, vt, ke, ve


if __name__ == "__main__":
    main()
