"""The Hopper forward's persistent CTAs on small problems. With DMATTN_FWD_PERSISTENT=1 and the
grid capped at a few CTAs (DMATTN_FWD_PERSISTENT_CTAS), every CTA takes many tiles, paired
under causal / window sweeps: the hand-over from tile to tile (the scheduler's slots, Q's buffer,
the pipelines running on, tiles without key blocks, packed sequences' skipped tiles, gathered
keys) runs in cases that would otherwise get one tile a CTA. Random and fixed cases against the
float64 reference, and the persistent outputs bit for bit against one tile a CTA. On GPUs
without the Hopper kernels the switches change nothing."""

import pytest
import torch

import dmattn
from cases import random_case
from test_forward_gpu import _check_fwd, large_case
from test_varlen import CUDA_CASES, check_varlen_case

pytestmark = pytest.mark.gpu


@pytest.fixture
def few_persistent_ctas(monkeypatch):
    monkeypatch.setenv("DMATTN_FWD_PERSISTENT", "1")
    monkeypatch.setenv("DMATTN_FWD_PERSISTENT_CTAS", "3")


@pytest.mark.parametrize("seed", range(120), ids=lambda s: f"seed_{s}")
def test_random_forward(seed, nan_poison, few_persistent_ctas):
    _check_fwd(random_case(seed, "cuda"))


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"big_{s}")
def test_random_forward_large(seed, nan_poison, few_persistent_ctas):
    _check_fwd(large_case(seed))


@pytest.mark.parametrize("name", ["bias_grad_hb2", "mqa_causal_q_longer", "hd256", "one_long_many_short"])
def test_packed_cases(name, nan_poison, few_persistent_ctas):
    check_varlen_case(CUDA_CASES[name], "cuda")


def _inputs(seed, b=2, s=704, h=4, hkv=2, d=128, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=g).to("cuda", dtype) for n in (h, hkv, hkv))
    key_bias = torch.randn(b, h, 1, s, generator=g).to("cuda", dtype)
    bias = torch.randn(b, h, s, s, generator=g).to("cuda", dtype)
    return q, k, v, key_bias, bias


CALLS = {
    "plain": lambda q, k, v, kb, fb, causal: dmattn.attention(q, k, v, causal=causal, return_lse=True),
    "full_bias": lambda q, k, v, kb, fb, causal: dmattn.attention(q, k, v, bias=fb, causal=causal, return_lse=True),
    # (at head dim 256: one stage of each tile stream, fwd_ws_tile_sm90.h)
    "full_bias_mask": lambda q, k, v, kb, fb, causal: dmattn.attention(q, k, v, fb > -0.5, fb, causal=causal,
                                                                       return_lse=True),
    "key_bias": lambda q, k, v, kb, fb, causal: dmattn.attention(q, k, v, bias=kb, causal=causal, return_lse=True),
    "window": lambda q, k, v, kb, fb, causal: dmattn.attention(q, k, v, window=(100, 0 if causal else 50),
                                                               return_lse=True),
    "topk_64": lambda q, k, v, kb, fb, causal: dmattn.attention_topk(q, k, v, kb, 64, causal=causal,
                                                                     return_lse=True),
    "topk_300": lambda q, k, v, kb, fb, causal: dmattn.attention_topk(q, k, v, kb, 300, causal=causal,
                                                                      return_lse=True),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("ctas", ["1", "3", "7"])
def test_bitwise_equal_to_one_tile_per_cta(call, causal, ctas, monkeypatch, nan_poison):
    """Each tile is computed the same way whichever CTA takes it: the persistent outputs equal
    one tile a CTA's bit for bit (every element written: the outputs start as NaN)."""
    args = _inputs(len(call) + int(ctas), d={"key_bias": 64, "full_bias_mask": 256}.get(call, 128))
    monkeypatch.setenv("DMATTN_FWD_PERSISTENT", "0")
    out0, lse0 = CALLS[call](*args, causal)
    monkeypatch.setenv("DMATTN_FWD_PERSISTENT", "1")
    monkeypatch.setenv("DMATTN_FWD_PERSISTENT_CTAS", ctas)
    out1, lse1 = CALLS[call](*args, causal)
    torch.cuda.synchronize()
    assert torch.isfinite(out0).all(), "one tile a CTA: non-finite output"
    assert torch.equal(out1, out0), f"{call}: the persistent output differs"
    assert torch.equal(lse1, lse0), f"{call}: the persistent lse differs"
