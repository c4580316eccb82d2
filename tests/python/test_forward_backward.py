"""Randomized forward + backward against the float64 reference (tests/python/reference.py).

300 seeded configurations per device over dtype, B, Sq, Sk (0, 1, odd, Sq != Sk), MHA/GQA/MQA,
head dims that are not multiples of 8 (CPU), causal, window, scale, softcap, masks and biases
of every broadcast shape (rank 2/3/4; head 1/Hkv/H; query 1/Sq; key 1/Sk), bias in q's dtype or
fp32, with or without requires_grad, expanded or transposed, -inf and finfo.min entries, and
non-contiguous q/k/v. Every call runs with NaN-poisoned allocations (``nan_poison``), so an
output element the kernel forgets to write fails the check. A failure message carries the full
configuration; re-run one with ``pytest -k "seed_123"``.
"""

import pytest
import torch

from cases import Case, check_case, random_case

N_CASES = 300


@pytest.mark.parametrize("seed", range(N_CASES), ids=lambda s: f"seed_{s}")
def test_random_config(seed, device, nan_poison):
    check_case(random_case(seed, device), device)


# A few hand-picked configurations that the random draw must not miss.
FIXED = [
    Case(torch.float32, 2, 33, 33, 4, 4, 64),
    Case(torch.float32, 1, 17, 65, 6, 2, 40, causal=True),
    Case(torch.float32, 1, 65, 17, 6, 2, 40, causal=True),           # Sq > Sk: empty rows
    Case(torch.bfloat16, 2, 31, 47, 8, 1, 64, causal=True,
         mask_shape=(2, 1, 31, 47), bias_shape=(2, 8, 31, 47), bias_dtype=torch.bfloat16,
         bias_grad=True),
    Case(torch.float16, 1, 40, 40, 4, 2, 24, window=(5, 3),
         bias_shape=(2, 1, 40), bias_dtype=torch.float32, bias_grad=True),    # head dim = Hkv
    Case(torch.float32, 2, 16, 24, 3, 3, 5, window=(2, 0), causal=True,
         bias_shape=(24,), bias_dtype=torch.float32, bias_grad=True),           # rank 1
    Case(torch.float32, 2, 16, 24, 4, 2, 8, mask_shape=(2, 2, 1, 24), mask_density=0.3,
         bias_shape=(2, 4, 16, 1), bias_dtype=torch.float32, bias_grad=True),   # key dim 1
    Case(torch.bfloat16, 1, 64, 64, 2, 2, 128, softcap=30.0, scale=0.5,
         bias_shape=(1, 2, 64, 64), bias_dtype=torch.bfloat16, bias_grad=True, bias_scale=3.0),
    Case(torch.float64, 2, 9, 11, 4, 1, 7, causal=True, window=(3, -1),
         mask_shape=(9, 11), bias_shape=(4, 1, 11), bias_dtype=torch.float64, bias_grad=True),
    Case(torch.float32, 1, 48, 48, 2, 1, 32, bias_shape=(1, 2, 48, 48),
         bias_dtype=torch.float32, bias_grad=True, bias_neg_inf=0.5),
    Case(torch.bfloat16, 1, 48, 48, 2, 1, 32, bias_shape=(1, 1, 48, 48),
         bias_dtype=torch.bfloat16, bias_grad=True, bias_finfo_min=0.5),
    Case(torch.float32, 2, 20, 20, 4, 2, 16, layouts=("bhsd", "padded", "strided_last")),
]


@pytest.mark.parametrize("idx", range(len(FIXED)), ids=lambda i: f"fixed_{i}")
def test_fixed_config(idx, device, nan_poison):
    c = FIXED[idx]
    if device == "cuda" and c.dtype not in (torch.float16, torch.bfloat16):
        pytest.skip("CUDA takes fp16/bf16 only")
    if device == "cuda" and c.d % 8:
        pytest.skip("CUDA head_dim must be a multiple of 8")
    check_case(c, device)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(100), ids=lambda s: f"big_{s}")
def test_random_config_gpu_large(seed, nan_poison):
    """Larger shapes on CUDA (multiple tiles in every direction)."""
    import random
    rng = random.Random(10_000 + seed)
    c = random_case(10_000 + seed, "cuda")
    c.sq = rng.choice([1, 127, 128, 129, 255, 256, 511, 777, 1024])
    c.sk = rng.choice([c.sq, 1, 128, 200, 513, 1024, 1500])
    c.d = rng.choice([64, 128, 64, 96, 256])
    c.b = rng.choice([1, 2])
    # Re-derive the broadcast shapes for the new sizes.
    from cases import broadcast_shape
    if c.mask_shape is not None:
        c.mask_shape = broadcast_shape(rng, c.b, c.h, c.hkv, c.sq, c.sk)
    if c.bias_shape is not None:
        c.bias_shape = broadcast_shape(rng, c.b, c.h, c.hkv, c.sq, c.sk)
    check_case(c, "cuda")
