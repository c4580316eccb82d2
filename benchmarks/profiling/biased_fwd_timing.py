"""Figures: docs/perf.md, "Biased and masked forward" (H200, D = 128, 64 and 256).

Forward timings of dmattn's biased and masked problems at one head dim (CUDA, bf16, B=2, S=8192,
H=16 up to head dim 128, H=8 above): a full bias (B,H,S,S), in bf16 or fp32, alone or with a key
padding mask (B,1,1,S; the second sequence's last 1536 keys padding), and a full boolean mask
(half true at random), causal or not, with the full bias, with a per-key bias (B,H,1,S) or with
softcap; the
mask and the bias with rows that are not 16-byte multiples (S - 8 and S - 4 keys: the backend's
padded copy, src/cuda/host/aligned_operand.h); a key mask (2048 of S) with a per-key bias, causal, and
`attention_topk` 2048 with the selection, causal; the raw forward over 2048 gathered keys
(key_positions, the rows read in place) with a full bias or a full mask over them (B, H, S,
2048), causal. Median of three medians of
CUDA-event timings. Run it once per kernel selection to compare paths, e.g. the
Hopper kernel against the sm80-class kernels that serve the same problems without it:
    python benchmarks/profiling/biased_fwd_timing.py --head-dim 128
    DMATTN_FWD_SM90=0 python benchmarks/profiling/biased_fwd_timing.py --head-dim 128
"""

import argparse
import statistics

import torch

import dmattn
from dmattn.bench import time_ms
from dmattn.ops import attention_forward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--tag", default="", help="a label printed on every row")
    args = ap.parse_args()
    B, S, D = 2, 8192, args.head_dim
    H = 16 if D <= 128 else 8
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=dt, generator=g) for _ in range(3))
    bias = torch.randn(B, H, S, S, device=dev, dtype=dt, generator=g)
    bias32 = bias.float()  # a learnable bias kept in fp32 beside bf16 q, k, v
    key_bias = torch.randn(B, H, 1, S, device=dev, dtype=dt, generator=g)
    keep = torch.rand(B, H, 1, S, device=dev, generator=g).topk(2048, dim=-1).indices
    key_mask = torch.zeros(B, H, 1, S, device=dev, dtype=torch.bool).scatter_(-1, keep, True)
    lens = torch.tensor([S, S - 1536], device=dev)
    key_padding = (torch.arange(S, device=dev) < lens[:, None]).view(B, 1, 1, S)
    full_mask = torch.randint(0, 2, (B, H, S, S), device=dev, dtype=torch.uint8, generator=g).bool()
    # Rows of S - 8 mask bytes and S - 4 bias elements (with as many keys).
    k_mask_rows, v_mask_rows = k[:, : S - 8], v[:, : S - 8]
    mask_rows = full_mask[..., : S - 8].contiguous()
    k_bias_rows, v_bias_rows = k[:, : S - 4], v[:, : S - 4]
    bias_rows = bias[..., : S - 4].contiguous()
    # 2048 gathered keys of each (batch, head): sorted positions, the rows read in place.
    positions = keep.view(B, H, 2048).sort(-1).values.to(torch.int32)
    gathered_bias = torch.randn(B, H, S, 2048, device=dev, dtype=dt, generator=g)
    gathered_mask = torch.randint(0, 2, (B, H, S, 2048), device=dev, dtype=torch.uint8, generator=g).bool()

    def gathered(mask, bias):
        return attention_forward(q, k, v, mask, bias, True, -1, -1, None, 0.0, False, positions, S, None, positions)

    # Clocks settle before the first row: about a second of bf16 GEMMs.
    warm = torch.randn(8192, 8192, device=dev, dtype=dt, generator=g)
    for _ in range(500):
        warm @ warm
    torch.cuda.synchronize()
    del warm
    cases = {
        "full bias": lambda: dmattn.attention(q, k, v, bias=bias),
        "full bias, causal": lambda: dmattn.attention(q, k, v, bias=bias, causal=True),
        "full bias + key padding": lambda: dmattn.attention(q, k, v, key_padding, bias),
        "full bias + key padding, causal": lambda: dmattn.attention(q, k, v, key_padding, bias, causal=True),
        "full mask (half true)": lambda: dmattn.attention(q, k, v, full_mask),
        "full mask (half true), causal": lambda: dmattn.attention(q, k, v, full_mask, causal=True),
        "full mask + full bias": lambda: dmattn.attention(q, k, v, full_mask, bias),
        "full mask + full bias, causal": lambda: dmattn.attention(q, k, v, full_mask, bias, causal=True),
        "full fp32 bias": lambda: dmattn.attention(q, k, v, bias=bias32),
        "full fp32 bias, causal": lambda: dmattn.attention(q, k, v, bias=bias32, causal=True),
        "full fp32 bias + key padding": lambda: dmattn.attention(q, k, v, key_padding, bias32),
        "full mask + full fp32 bias": lambda: dmattn.attention(q, k, v, full_mask, bias32),
        "full mask + per-key bias": lambda: dmattn.attention(q, k, v, full_mask, key_bias),
        "full mask + per-key bias, causal": lambda: dmattn.attention(q, k, v, full_mask, key_bias, causal=True),
        "full mask + softcap 30": lambda: dmattn.attention(q, k, v, full_mask, softcap=30.0),
        "full mask, rows of S - 8 keys": lambda: dmattn.attention(q, k_mask_rows, v_mask_rows, mask_rows),
        "full bias, rows of S - 4 keys": lambda: dmattn.attention(q, k_bias_rows, v_bias_rows, bias=bias_rows),
        "key mask + per-key bias, causal": lambda: dmattn.attention(q, k, v, key_mask, key_bias, causal=True),
        "attention_topk 2048, causal": lambda: dmattn.attention_topk(q, k, v, key_bias, 2048, causal=True),
        "2048 gathered keys + full bias, causal": lambda: gathered(None, gathered_bias),
        "2048 gathered keys + full mask, causal": lambda: gathered(gathered_mask, None),
    }
    print(f"B={B} H={H} S={S} D={D} bf16")
    with torch.no_grad():
        for name, fn in cases.items():
            ms = statistics.median(time_ms(fn, dev, 3, 10) for _ in range(3))
            print(f"{args.tag} {name:<40} {ms:8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
