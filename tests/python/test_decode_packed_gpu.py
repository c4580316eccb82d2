"""Short queries on the decode kernels through dmattn.attention and attention_varlen (gpu marker).

dmattn.attention takes the split-KV decode kernels for up to 64 query rows (Sq x H / Hkv), and
attention_varlen takes them for each packed sequence of that few rows, with the kernel and the
split count of that sequence's own call. So a packed batch of decoding rows, or one that mixes
them with long sequences (the general kernels), equals its sequences run one by one through
dmattn.attention bit for bit (out and lse), and both equal the float64 reference within the
suite's tolerance. Outputs and scratch buffers are NaN-poisoned (``nan_poison``).
"""

from __future__ import annotations

import pytest
import torch

import dmattn
from reference import check_against_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("nan_poison")]


def _packed(lens_q, lens_k, heads, heads_kv, head_dim, dtype, seed, operands):
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lens_q), sum(lens_k)
    q = torch.randn(total_q, heads, head_dim, generator=g).to("cuda", dtype)
    k, v = (torch.randn(total_k, heads_kv, head_dim, generator=g).to("cuda", dtype) for _ in range(2))
    mask = bias = None
    if operands:  # key-side: a padding-like mask over kv heads, a per-key bias per query head
        mask = (torch.rand(heads_kv, total_k, generator=g) > 0.1).to("cuda")
        bias = torch.randn(heads, total_k, generator=g).to("cuda", dtype)
    cu = [torch.tensor([0] + list(torch.tensor(x).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
          for x in (lens_q, lens_k)]
    return q, k, v, mask, bias, cu[0], cu[1]


CASES = [
    # lens_q, lens_k, heads, heads_kv, head_dim
    ([1, 1, 1, 1], [3000, 17, 0, 700], 8, 2, 128),          # one query each, a sequence without keys
    ([4, 0, 1, 3], [5000, 40, 300, 1], 8, 2, 128),          # 16-row tiles, an empty sequence
    ([16, 5, 1, 9], [2000, 1500, 64, 4100], 8, 2, 128),     # the 64-row kernel beside the 16-row one
    ([1, 200, 2, 33], [9000, 200, 700, 300], 8, 2, 64),     # long sequences on the general kernels
    ([2, 7, 1], [1000, 2500, 30], 6, 2, 256),               # head dim 256: 16-row chunks up to 64 rows
    ([3, 1, 12], [4096, 8192, 33], 32, 8, 128),             # the usual 4-way GQA
    ([1, 2, 1, 3], [6000, 2100, 0, 900], 16, 2, 64),        # 8-way GQA: 8 rows (Hopper: the narrow kernel), 16, 24
]


@pytest.mark.parametrize("lens_q,lens_k,heads,heads_kv,head_dim", CASES)
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(causal=True, window=(300, -1)),
                                     dict(softcap=20.0), "operands", "bias"])
def test_packed_equals_sequences_bitwise(lens_q, lens_k, heads, heads_kv, head_dim, options):
    """operands: a key mask and a per-key bias (the mma.sync kernels); bias: the bias alone (on
    Hopper the wgmma kernel: its bias product up to 16 rows, each thread's loaded entries above;
    its rows starting at any element)."""
    operands = options in ("operands", "bias")
    kw = dict(causal=True) if operands else options
    dtype = torch.bfloat16 if head_dim != 64 else torch.float16
    q, k, v, mask, bias, cu_q, cu_k = _packed(lens_q, lens_k, heads, heads_kv, head_dim, dtype, len(lens_q),
                                              operands)
    if options == "bias":
        mask = None
    out, lse = dmattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), mask, bias,
                                       return_lse=True, **kw)
    starts_q = [0] + torch.tensor(lens_q).cumsum(0).tolist()
    starts_k = [0] + torch.tensor(lens_k).cumsum(0).tolist()
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq == 0:
            continue
        q0, k0 = starts_q[b], starts_k[b]
        qb, kb, vb = q[None, q0:q0 + lq], k[None, k0:k0 + lk], v[None, k0:k0 + lk]
        mb = None if mask is None else mask[None, :, None, k0:k0 + lk]
        bb = None if bias is None else bias[None, :, None, k0:k0 + lk]
        ob, lb = dmattn.attention(qb, kb, vb, mb, bb, return_lse=True, **kw)
        context = f"sequence {b} (len_q {lq}, len_k {lk}), {kw}"
        assert torch.equal(out[q0:q0 + lq], ob[0]), context
        assert torch.equal(lse[:, q0:q0 + lq], lb[0]), context
        if lk > 0:
            check_against_reference(qb, kb, vb, mb, bb, ob, lb, causal=kw.get("causal", False),
                                    window=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0))


def test_packed_decode_off_matches_general(monkeypatch):
    """DMATTN_DECODE=0 keeps both forms on the general kernels; their results agree with the
    decode kernels' within rounding."""
    q, k, v, mask, bias, cu_q, cu_k = _packed([1, 3, 2], [4000, 900, 64], 8, 2, 128, torch.bfloat16, 0, True)
    out, lse = dmattn.attention_varlen(q, k, v, cu_q, cu_k, 3, 4000, mask, bias, causal=True, return_lse=True)
    monkeypatch.setenv("DMATTN_DECODE", "0")
    out_g, lse_g = dmattn.attention_varlen(q, k, v, cu_q, cu_k, 3, 4000, mask, bias, causal=True, return_lse=True)
    torch.testing.assert_close(out, out_g, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, lse_g, rtol=1e-4, atol=1e-4)


def test_flash_dmattn_func_short_query_takes_decode():
    """flash_dmattn_func at Sq = 1 (the decode kernels) against the reference, and equal to
    dmattn.attention's bits (one path)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 16, 128, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, 5000, 4, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    bias = torch.randn(2, 16, 1, 5000, generator=g).to("cuda", torch.bfloat16)
    out = dmattn.flash_dmattn_func(q, k, v, attn_bias=bias, is_causal=True)
    ref, lse = dmattn.attention(q, k, v, bias=bias, causal=True, return_lse=True)
    assert torch.equal(out, ref)
    check_against_reference(q, k, v, None, bias, ref, lse, causal=True)
