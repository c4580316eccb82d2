"""Masks and biases with a row per query whose rows the CUDA kernels cannot load by 16-byte
vectors or TMA (a row length that is not a 16-byte multiple, a key stride other than 1, a key
dimension of size 1): the backend reads them through a padded copy (src/cuda/host/aligned_operand.h).
Forward and backward against the float64 reference, and the forward bitwise against the same
values in rows the kernels read directly."""

import pytest
import torch

from cases import leaf_grads, run_attention_backward
from reference import check_against_reference

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _padded_view(t, multiple):
    """The same values in storage whose rows are padded to `multiple` elements (aligned rows)."""
    sk = t.shape[-1]
    pad = -sk % multiple
    return torch.nn.functional.pad(t, (0, pad))[..., :sk] if pad else t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    # (B, Sq, Sk, H, Hkv, D, operand, layout, causal)
    (2, 200, 1001, 4, 2, 128, "mask", "rows", False),
    (1, 300, 517, 2, 2, 64, "mask", "rows", True),
    (2, 130, 260, 4, 4, 128, "mask", "key_bcast", False),
    (2, 250, 1003, 4, 2, 128, "bias", "rows", True),
    (1, 160, 333, 2, 1, 64, "bias", "transposed", False),
    (2, 190, 517, 4, 4, 128, "bias32", "rows", False),
    (1, 140, 777, 2, 2, 256, "both", "rows", True),
], ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}_h{c[3]}_{c[4]}_d{c[5]}_{c[6]}_{c[7]}{'_causal' if c[8] else ''}")
def test_unaligned_operand_rows(dtype, case, nan_poison):
    import dmattn
    b, sq, sk, h, hkv, d, operand, layout, causal = case
    g = torch.Generator(device="cpu").manual_seed(sq + sk + d + (dtype == torch.float16))
    q = torch.randn(b, sq, h, d, generator=g).to(DEV, dtype).requires_grad_()
    k, v = (torch.randn(b, sk, hkv, d, generator=g).to(DEV, dtype).requires_grad_() for _ in range(2))
    mask = bias = None
    if operand in ("mask", "both"):
        if layout == "key_bcast":  # (B, H, Sq, 1): one value a query row
            mask = (torch.rand(b, h, sq, 1, generator=g) < 0.8).to(DEV)
        else:
            mask = torch.rand(b, h, sq, sk, generator=g) < 0.7
            mask[:, :, 3] = False  # a row without any key
            mask = mask.to(DEV)
    if operand in ("bias", "bias32", "both"):
        bdt = torch.float32 if operand == "bias32" else dtype
        if layout == "transposed":  # key stride != 1
            bias = (2 * torch.randn(b, 1, sk, sq, generator=g)).to(DEV, bdt).transpose(-1, -2)
        else:
            bias = (2 * torch.randn(b, 1, sq, sk, generator=g)).to(DEV, bdt)
            bias[:, :, 5, : sk // 2] = torch.finfo(bdt).min
        bias.requires_grad_()
    out, lse, dout = run_attention_backward(q, k, v, mask, bias, causal=causal)
    check_against_reference(q, k, v, mask, bias, out, lse, leaf_grads(q, k, v, bias), causal=causal, dout=dout,
                            context=str(case))
    # The same values in aligned rows: the kernels read those directly, and the copy must
    # give them exactly what they would read there.
    if layout == "rows":
        mask_a = None if mask is None else _padded_view(mask, 16)
        bias_a = None if bias is None else _padded_view(bias.detach(), 16 // bias.element_size())
        with torch.no_grad():
            out_a, lse_a = dmattn.attention(q, k, v, mask_a, bias_a, causal=causal, return_lse=True)
        assert torch.equal(out_a, out), case
        assert torch.equal(lse_a, lse), case
