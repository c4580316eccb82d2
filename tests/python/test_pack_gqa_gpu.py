"""The Hopper forward with the query heads of each KV head packed into its tiles (plain scores:
src/cuda/sm90/pack_gqa_sm90.h). Forced on (DMATTN_FWD_PACK_GQA=1) against the float64
reference, and bit for bit against the same call unpacked (=0), which packing must not change:
group sizes that do and do not divide the tile, short and long query chunks, causal and window
rows (bottom-right), head dims 64 / 96 / 128 / 256, q in other layouts, packed batches,
persistent CTAs taking many packed tiles. A NaN in one head's query row stays in that row. On GPUs
without the Hopper kernels the switch changes nothing and the checks still hold."""

import pytest
import torch

import dmattn
from reference import check_against_reference
from test_varlen import VarlenCase, check_varlen_case

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(b, sq, sk, h, hkv, d, dtype, seed, q_layout="bshd"):
    g = torch.Generator().manual_seed(seed)
    if q_layout == "bhsd":  # head-major storage (q's row stride D, head stride Sq * D)
        q = torch.randn(b, h, sq, d, generator=g).to(DEV, dtype).transpose(1, 2)
    else:
        q = torch.randn(b, sq, h, d, generator=g).to(DEV, dtype)
    k, v = (torch.randn(b, sk, hkv, d, generator=g).to(DEV, dtype) for _ in range(2))
    return q, k, v


def _both_ways(monkeypatch, fn):
    """fn() with the heads packed and unpacked."""
    outs = []
    for mode in ("1", "0"):
        monkeypatch.setenv("DMATTN_FWD_PACK_GQA", mode)
        with torch.no_grad():
            outs.append(fn())
    return outs


CASES = [
    # (B, Sq, Sk, H, Hkv, D, causal, window)
    (2, 1, 300, 8, 2, 128, False, (-1, -1)),
    (1, 3, 1030, 16, 2, 128, True, (-1, -1)),     # group 8: 24 rows
    (2, 16, 2000, 32, 8, 128, True, (-1, -1)),    # 64 rows, the keys of 16 blocks
    (1, 17, 517, 28, 4, 128, False, (-1, -1)),    # group 7: tiles cut a query's heads apart
    (2, 40, 700, 12, 4, 64, True, (-1, -1)),      # group 3, D 64 (192-row tiles)
    (1, 33, 900, 6, 2, 96, True, (-1, -1)),       # D 96 on 128: zero columns
    (2, 20, 640, 8, 4, 256, True, (-1, -1)),      # D 256 (80-key blocks)
    (1, 100, 1500, 8, 1, 128, False, (200, 0)),   # MQA, sliding window
    (2, 60, 333, 16, 4, 128, False, (50, 20)),    # window without causal
    (1, 300, 1200, 8, 2, 128, True, (-1, -1)),    # a long chunk (the default does not pack it)
    (2, 50, 30, 4, 2, 128, True, (-1, -1)),       # Sq > Sk causal: the first rows see no key
    (1, 24, 1, 4, 2, 64, False, (-1, -1)),        # one key
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}_h{c[3]}_{c[4]}_d{c[5]}"
                         f"{'_causal' if c[6] else ''}{'_w%d_%d' % c[7] if c[7] != (-1, -1) else ''}")
def test_packed_heads_forward(monkeypatch, nan_poison, dtype, case):
    b, sq, sk, h, hkv, d, causal, window = case
    q, k, v = _inputs(b, sq, sk, h, hkv, d, dtype, seed=sq * 31 + sk + d + h)
    (out, lse), (out_u, lse_u) = _both_ways(
        monkeypatch, lambda: dmattn.attention(q, k, v, causal=causal, window=window, return_lse=True))
    check_against_reference(q, k, v, None, None, out, lse, causal=causal, window=window, context=str(case))
    assert torch.equal(out, out_u), case
    assert torch.equal(lse, lse_u), case


@pytest.mark.parametrize("q_layout", ["bhsd", "q_in_wider"])
def test_packed_heads_layouts(monkeypatch, nan_poison, q_layout):
    """q head-major; or q inside a wider tensor (a row stride past H * D, a head offset)."""
    b, sq, sk, h, hkv, d = 2, 24, 800, 8, 2, 128
    q, k, v = _inputs(b, sq, sk, h, hkv, d, torch.bfloat16, seed=5, q_layout=q_layout)
    if q_layout == "q_in_wider":
        wide = torch.randn(b, sq, h + 4, d, device=DEV, dtype=torch.bfloat16)
        wide[:, :, 2:2 + h] = q
        q = wide[:, :, 2:2 + h]
    (out, lse), (out_u, lse_u) = _both_ways(
        monkeypatch, lambda: dmattn.attention(q, k, v, causal=True, return_lse=True))
    check_against_reference(q, k, v, None, None, out, lse, causal=True, context=q_layout)
    assert torch.equal(out, out_u) and torch.equal(lse, lse_u)


# Packed batches of plain scores (no key-side mask or bias): lengths 0, 1, odd, around the tiles.
VARLEN_CASES = {
    "window_g4": VarlenCase(torch.bfloat16, [130, 17, 0, 1, 64], [129, 70, 5, 1, 300], h=8, hkv=2, d=128,
                            window=(20, 3), max_slack=7),
    "causal_g8_d64": VarlenCase(torch.float16, [3, 40, 1, 200], [90, 40, 7, 150], h=16, hkv=2, d=64, causal=True),
    "causal_g2_d256": VarlenCase(torch.bfloat16, [70, 1, 33], [129, 2, 64], h=4, hkv=2, d=256, causal=True),
    "mqa_d96": VarlenCase(torch.bfloat16, [5, 9, 1, 77], [700, 2, 11, 77], h=6, hkv=1, d=96, causal=True),
}


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_packed_heads_varlen(monkeypatch, nan_poison, name):
    """Packed batches (bit for bit equal to their sequences one by one, which may not pack)."""
    monkeypatch.setenv("DMATTN_FWD_PACK_GQA", "1")
    check_varlen_case(VARLEN_CASES[name], "cuda")


def test_packed_heads_persistent(monkeypatch, nan_poison):
    """Few persistent CTAs, each taking many packed tiles (causal: paired)."""
    monkeypatch.setenv("DMATTN_FWD_PERSISTENT", "1")
    monkeypatch.setenv("DMATTN_FWD_PERSISTENT_CTAS", "3")
    q, k, v = _inputs(3, 70, 900, 16, 4, 128, torch.bfloat16, seed=11)
    for causal in (False, True):
        (out, lse), (out_u, lse_u) = _both_ways(
            monkeypatch, lambda: dmattn.attention(q, k, v, causal=causal, return_lse=True))
        check_against_reference(q, k, v, None, None, out, lse, causal=causal, context=f"causal={causal}")
        assert torch.equal(out, out_u) and torch.equal(lse, lse_u), causal


def test_packed_heads_nan_stays_in_its_row(monkeypatch):
    """A NaN in query row 5 of head 6 (a group of 4 heads packed into one tile): that output
    row and its lse are NaN; every other row, of the same tile included, is the NaN-free one."""
    monkeypatch.setenv("DMATTN_FWD_PACK_GQA", "1")
    q, k, v = _inputs(1, 12, 500, 8, 2, 128, torch.bfloat16, seed=3)
    with torch.no_grad():
        out0, lse0 = dmattn.attention(q, k, v, causal=True, return_lse=True)
        qn = q.clone()
        qn[0, 5, 6, 7] = float("nan")
        out, lse = dmattn.attention(qn, k, v, causal=True, return_lse=True)
    assert out[0, 5, 6].isnan().all() and lse[0, 6, 5].isnan()
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[0, 5, 6] = False
    assert torch.equal(out[keep], out0[keep])
    keep_lse = torch.ones_like(lse, dtype=torch.bool)
    keep_lse[0, 6, 5] = False
    assert torch.equal(lse[keep_lse], lse0[keep_lse])
