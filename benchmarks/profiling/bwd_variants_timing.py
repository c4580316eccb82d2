"""Per-iteration cost of the backward main kernel on the gather path against the dense kernels,
to see what the gathered keys, the per-key bias and its column sums each cost.

    PYTHONPATH=python python3 benchmarks/profiling/bwd_variants_timing.py

B=2, H=16, D=128 bf16, causal, S=8192; the raw dmattn::bwd op (Delta, main kernel, dQ convert)
timed with CUDA events (median of 20). "iters" is the number of (key block, query block) tile
iterations of the key-block-major kernel (128 keys x 64 queries); us/iter is per SM
(time x 132 / iters), the figure to compare across rows.
"""

from __future__ import annotations

import torch

from dmattn.bench import time_ms

B, H, D, S, KEEP = 2, 16, 128, 8192, 2048
OPTS = (True, -1, -1, None, 0.0, False)


def iterations(positions) -> int:
    """Tile iterations of the causal key-block-major backward: per key block, the query blocks
    from the one holding its first position to the end."""
    if positions is None:
        per_head = sum(S // 64 - (128 * j) // 64 for j in range(S // 128))
        return per_head * B * H
    first = positions[..., ::128].long()  # first position of each key block
    return int((S // 64 - first // 64).sum())


def main() -> None:
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)
    q, k, v, dout = (rnd(B, S, H, D) for _ in range(4))
    bias = rnd(B, H, 1, S)
    idx = bias.float().topk(KEEP, dim=-1).indices.sort(dim=-1).values  # (B, H, 1, KEEP)
    positions = idx[:, :, 0].int().contiguous()
    rows = lambda x: torch.gather(x, 1, idx[:, :, 0].transpose(1, 2).unsqueeze(-1).expand(B, KEEP, H, D)).contiguous()
    k_rows, v_rows = rows(k), rows(v)
    bias_rows = torch.gather(bias, -1, idx).contiguous()
    cases = {
        "dense causal, no bias": (k, v, None, False, None, 0),
        "dense causal, per-key bias + dbias": (k, v, bias, True, None, 0),
        "dense causal, per-key bias, no dbias": (k, v, bias, False, None, 0),
        "gathered causal, no bias": (k_rows, v_rows, None, False, positions, S),
        "gathered causal, per-key bias + dbias": (k_rows, v_rows, bias_rows, True, positions, S),
        "gathered causal, per-key bias, no dbias": (k_rows, v_rows, bias_rows, False, positions, S),
    }
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: B={B} H={H} S={S} D={D} keep={KEEP}, causal, raw dmattn::bwd")
    for name, (kk, vv, bb, dbias, pos, sk) in cases.items():
        out, lse = torch.ops.dmattn.fwd(q, kk, vv, None, bb, *OPTS, pos, sk)
        fn = lambda: torch.ops.dmattn.bwd(dout, q, kk, vv, out, lse, None, bb, dbias, *OPTS, pos, sk)
        ms = time_ms(fn, "cuda", 3, 20)
        it = iterations(pos)
        print(f"  {name:42} {ms:7.3f} ms  iters {it:7d}  {ms * 1e3 * sms / it:6.2f} us/iter")


if __name__ == "__main__":
    main()
