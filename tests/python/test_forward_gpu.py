"""Forward-only checks of the CUDA backend against the float64 reference: the random draws of
test_forward_backward.py (small and large shapes, fixed cases) without the backward, plus masks
whose tiles are entirely false (key-block skipping, src/cuda/sm80/block_skip.h). Runs where the
CUDA backward is not available yet, and isolates forward failures where it is."""

import random

import pytest
import torch

from cases import Case, broadcast_shape, check_case, random_case
from test_forward_backward import FIXED

pytestmark = pytest.mark.gpu


def _check_fwd(c):
    """check_case without the backward; a layout the CUDA backend refuses (its documented
    16-byte alignment of pointers and strides) is skipped, not failed."""
    try:
        check_case(c, "cuda", backward=False)
    except ValueError as e:
        if "16-byte aligned" in str(e):
            pytest.skip(f"CUDA alignment requirement: {e}")
        raise


def _random_qkv(g, b, sq, sk, h, hkv, d, dtype):
    """q (b, sq, h, d) and k, v (b, sk, hkv, d), standard normal from generator g, on the GPU."""
    q = torch.randn(b, sq, h, d, generator=g).to("cuda", dtype)
    k, v = (torch.randn(b, sk, hkv, d, generator=g).to("cuda", dtype) for _ in range(2))
    return q, k, v


def _attend_and_check(q, k, v, mask, bias, causal, window, softcap, case):
    """dmattn.attention's out and lse against the float64 reference."""
    import dmattn
    from reference import check_against_reference
    out, lse = dmattn.attention(q, k, v, mask, bias, causal=causal, window=window, softcap=softcap,
                                return_lse=True)
    check_against_reference(q, k, v, mask, bias, out, lse, causal=causal, window=window, softcap=softcap,
                            context=str(case))


@pytest.mark.parametrize("case", [
    # (Sq, Sk, D, causal, mask shape kind, density)
    (1000, 1000, 128, False, "full", 0.02),
    (1000, 4097, 64, True, "per_key", 0.01),
    (300, 2000, 128, False, "per_key", 0.005),
    (777, 1500, 256, False, "full", 0.01),
    (129, 129, 64, False, "full", 0.0),
], ids=lambda c: f"{c[0]}x{c[1]}_d{c[2]}_{'causal_' if c[3] else ''}{c[4]}_{c[5]}")
def test_sparse_mask_forward(case, nan_poison):
    """Masks so sparse that most key tiles (and some query rows) have no true element."""
    import dmattn
    sq, sk, d, causal, kind, density = case
    g = torch.Generator(device="cpu").manual_seed(sq * 7 + sk)
    b, h = 2, 4
    q = torch.randn(b, sq, h, d, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(b, sk, h, d, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(b, sk, h, d, generator=g).to("cuda", torch.bfloat16)
    shape = (b, h, sq, sk) if kind == "full" else (b, h, 1, sk)
    mask = torch.rand(shape, generator=g) < density
    if kind == "full":
        mask[:, :, : sq // 3, :] = False          # whole query blocks without any key
    mask = mask.to("cuda")
    bias = torch.randn(shape, generator=g).to("cuda", torch.bfloat16)
    out, lse = dmattn.attention(q, k, v, mask, bias, causal=causal, return_lse=True)
    # float64 reference
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / d ** 0.5 + bias.double()
    allowed = mask.expand(b, h, sq, sk).clone()
    if causal:
        i = torch.arange(sq, device="cuda")[:, None]
        j = torch.arange(sk, device="cuda")[None, :]
        allowed &= j <= i + sk - sq
    s = s.masked_fill(~allowed, float("-inf"))
    ref_lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    ref = torch.einsum("bhqk,bkhd->bqhd", p, v.double())
    assert torch.isfinite(out).all()
    empty = ~allowed.any(-1)                        # (b, h, sq)
    assert torch.equal(lse[empty], torch.full_like(lse[empty], float("-inf")))
    assert (out.permute(0, 2, 1, 3)[empty] == 0).all()
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-2 * max(1.0, ref.abs().max().item()), err
    lse_err = (lse[~empty].double() - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    assert lse_err < 1e-2, lse_err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    # (B, Sq, Sk, H, Hkv, D, mask heads, causal, window, density)
    (2, 300, 512, 4, 4, 128, "h", False, (-1, -1), 0.5),
    (1, 1000, 1024, 4, 2, 64, "1", True, (-1, -1), 0.3),
    (2, 129, 256, 4, 2, 128, "hkv", False, (64, 32), 0.5),
    (1, 256, 784, 2, 1, 96, "expand", False, (-1, -1), 0.02),
    (2, 200, 320, 4, 2, 256, "h", True, (-1, -1), 0.5),
    (1, 130, 144, 2, 2, 256, "1", False, (40, 8), 0.3),
], ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}_h{c[3]}_{c[4]}_d{c[5]}_{c[6]}{'_causal' if c[7] else ''}_w{c[8][0]}_{c[9]}")
def test_full_mask_tiles_forward(dtype, case, nan_poison):
    """Full boolean masks whose rows are 16-byte multiples (Sk % 16 == 0), which the Hopper
    warp-specialized forward reads by TMA (fwd_ws_supports): one per head, broadcast over heads
    (a size-1 dim and an expanded one), one per kv head (GQA); causal and window bounds, tail
    blocks, query rows without a true element and a query block without any; against the
    float64 reference."""
    b, sq, sk, h, hkv, d, heads, causal, window, density = case
    g = torch.Generator(device="cpu").manual_seed(sq + sk + d + (dtype == torch.float16))
    q, k, v = _random_qkv(g, b, sq, sk, h, hkv, d, dtype)
    mask = torch.rand(b, {"h": h, "hkv": hkv}.get(heads, 1), sq, sk, generator=g) < density
    mask[:, :, 5] = False              # a row without any key
    mask[:, :, 128:min(sq, 256)] = False  # a whole query block without any
    mask = mask.to("cuda")
    if heads == "expand":
        mask = mask.expand(b, h, sq, sk)
    _attend_and_check(q, k, v, mask, None, causal, window, 0.0, case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    # (B, Sq, Sk, H, Hkv, D, mask heads, key bias heads, softcap, causal, window)
    (2, 300, 512, 4, 4, 128, "h", "h", 0.0, False, (-1, -1)),
    (1, 1000, 1024, 4, 2, 64, "1", "1", 30.0, True, (-1, -1)),
    (2, 129, 256, 4, 2, 128, "hkv", None, 20.0, False, (64, 32)),
    (1, 256, 784, 2, 1, 96, "expand", "h", 0.0, True, (-1, -1)),
    (2, 200, 320, 4, 4, 256, "h", "1", 25.0, False, (-1, -1)),
], ids=lambda c: (f"{c[0]}x{c[1]}x{c[2]}_h{c[3]}_{c[4]}_d{c[5]}_mask{c[6]}_keybias{c[7]}_cap{c[8]:g}"
                  f"{'_causal' if c[9] else ''}_w{c[10][0]}"))
def test_full_mask_with_key_bias_forward(dtype, case, nan_poison):
    """A full mask (rows of 16-byte multiples: the Hopper warp-specialized forward's mask tiles)
    with a key bias (B, H | 1, 1, Sk) and / or softcap, which that kernel reads beside the tiles
    as per-key rows: one mask per head, broadcast (a size-1 dim and an expanded one), one per kv
    head (GQA); finfo.min and -inf key biases, a row and a query block without any true element;
    causal and window bounds; against the float64 reference."""
    b, sq, sk, h, hkv, d, mask_heads, bias_heads, softcap, causal, window = case
    g = torch.Generator(device="cpu").manual_seed(sq + sk + d + int(softcap) + (dtype == torch.float16))
    q, k, v = _random_qkv(g, b, sq, sk, h, hkv, d, dtype)
    mask = torch.rand(b, {"h": h, "hkv": hkv}.get(mask_heads, 1), sq, sk, generator=g) < 0.6
    mask[:, :, 5] = False                 # a row without any key
    mask[:, :, 128:min(sq, 256)] = False  # a whole query block without any
    mask = mask.to("cuda")
    if mask_heads == "expand":
        mask = mask.expand(b, h, sq, sk)
    bias = None
    if bias_heads is not None:
        bias = 2 * torch.randn(b, h if bias_heads == "h" else 1, 1, sk, generator=g)
        bias[..., : sk // 4] = torch.finfo(dtype).min  # keys at the dtype's lowest
        bias[..., -2:] = float("-inf")                  # keys of the tail block
        bias = bias.to("cuda", dtype)
    _attend_and_check(q, k, v, mask, bias, causal, window, softcap, case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    # (B, Sq, Sk, H, Hkv, D, bias heads, key mask heads, softcap, causal, window)
    (2, 300, 512, 4, 4, 128, "h", "h", 0.0, False, (-1, -1)),
    (2, 1000, 1024, 4, 2, 64, "1", "1", 0.0, True, (-1, -1)),
    (2, 129, 264, 4, 2, 128, "hkv", "h", 20.0, False, (64, 32)),
    (1, 256, 776, 2, 1, 96, "expand", None, 30.0, True, (-1, -1)),
    (2, 200, 320, 4, 4, 256, "h", "1", 0.0, False, (-1, -1)),
    (1, 130, 136, 2, 2, 256, "1", "h", 25.0, True, (-1, -1)),
    (2, 300, 512, 4, 4, 128, "h", None, 0.0, False, (-1, -1)),
    (1, 1000, 1024, 4, 2, 64, "1", None, 0.0, True, (-1, -1)),
    (2, 300, 520, 4, 2, 256, "hkv", None, 0.0, True, (-1, -1)),
], ids=lambda c: (f"{c[0]}x{c[1]}x{c[2]}_h{c[3]}_{c[4]}_d{c[5]}_bias{c[6]}_keymask{c[7]}_cap{c[8]:g}"
                  f"{'_causal' if c[9] else ''}_w{c[10][0]}"))
@pytest.mark.parametrize("bias_fp32", [False, True], ids=["bias_q_dtype", "bias_fp32"])
def test_full_bias_with_key_mask_forward(dtype, case, bias_fp32, nan_poison):
    """A full bias in q's dtype or fp32 (a learnable bias kept in fp32 beside 16-bit q, k, v;
    rows of 16-byte multiples: the Hopper warp-specialized forward's bias tiles), alone or with a key mask (B, H | 1, 1, Sk) and / or softcap, which that kernel
    reads beside the tiles as per-key rows: one bias per head, broadcast (a size-1 dim and an
    expanded one), one per kv head (GQA); finfo.min and -inf bias entries, values beyond fp16's
    range in fp32, a batch whose key mask is all false, keys masked in the tail block; causal and
    window bounds; against the float64 reference."""
    b, sq, sk, h, hkv, d, bias_heads, mask_heads, softcap, causal, window = case
    g = torch.Generator(device="cpu").manual_seed(sq + sk + d + int(softcap) + (dtype == torch.float16))
    q, k, v = _random_qkv(g, b, sq, sk, h, hkv, d, dtype)
    bias_dtype = torch.float32 if bias_fp32 else dtype
    bias = 2 * torch.randn(b, {"h": h, "hkv": hkv}.get(bias_heads, 1), sq, sk, generator=g)
    if bias_fp32:
        bias[:, :, 2, : sk // 3] = -1e6                   # beyond fp16's range (still fp32)
    bias[:, :, 3, : sk // 2] = torch.finfo(bias_dtype).min  # half a row at the dtype's lowest
    bias[:, :, 7, :] = float("-inf")                        # a row without any key
    bias = bias.to("cuda", bias_dtype)
    if bias_heads == "expand":
        bias = bias.expand(b, h, sq, sk)
    mask = None
    if mask_heads is not None:
        mask = torch.rand(b, h if mask_heads == "h" else 1, 1, sk, generator=g) < 0.7
        mask[..., -3:] = False  # keys of the tail block
        if b > 1:
            mask[1] = False     # a batch without any key
        mask = mask.to("cuda")
    _attend_and_check(q, k, v, mask, bias, causal, window, softcap, case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [
    # (B, Sq, Sk, H, Hkv, D, bias heads, mask heads, softcap, causal, window)
    (2, 300, 512, 4, 4, 128, "h", "h", 0.0, False, (-1, -1)),
    (1, 1000, 1024, 4, 2, 64, "1", "hkv", 0.0, True, (-1, -1)),
    (2, 129, 256, 4, 2, 128, "hkv", "1", 20.0, False, (64, 32)),
    (1, 256, 784, 2, 1, 96, "expand", "h", 30.0, True, (-1, -1)),
    (2, 130, 144, 4, 4, 64, "h", "expand", 0.0, False, (-1, -1)),
    (1, 200, 320, 2, 2, 256, "h", "h", 25.0, True, (-1, -1)),
    (2, 384, 1000, 4, 2, 256, "hkv", "expand", 0.0, False, (-1, -1)),
    (1, 300, 600, 4, 4, 192, "1", "h", 0.0, False, (128, 64)),
], ids=lambda c: (f"{c[0]}x{c[1]}x{c[2]}_h{c[3]}_{c[4]}_d{c[5]}_bias{c[6]}_mask{c[7]}_cap{c[8]:g}"
                  f"{'_causal' if c[9] else ''}_w{c[10][0]}"))
@pytest.mark.parametrize("bias_fp32", [False, True], ids=["bias_q_dtype", "bias_fp32"])
def test_full_bias_with_full_mask_forward(dtype, case, bias_fp32, nan_poison):
    """A full bias (q's dtype or fp32) and a full mask together (rows of 16-byte multiples: on
    Hopper the warp-specialized forward's two tile streams, at head dims 192 and 256 with one
    stage each and a 16-bit bias, the general kernel there for an fp32 one), with softcap: each
    per head, broadcast (a size-1 dim and an expanded one) or per kv head (GQA); finfo.min and
    -inf bias entries, a bias of -inf where the mask is true and a large one where it is false,
    a row and a query block without any true element; causal and window bounds; against the
    float64 reference."""
    b, sq, sk, h, hkv, d, bias_heads, mask_heads, softcap, causal, window = case
    g = torch.Generator(device="cpu").manual_seed(sq + 3 * sk + d + int(softcap) + (dtype == torch.float16))
    q, k, v = _random_qkv(g, b, sq, sk, h, hkv, d, dtype)
    bias_dtype = torch.float32 if bias_fp32 else dtype
    heads = {"h": h, "hkv": hkv}
    bias = 2 * torch.randn(b, heads.get(bias_heads, 1), sq, sk, generator=g)
    mask = torch.rand(b, heads.get(mask_heads, 1), sq, sk, generator=g) < 0.6
    bias[:, :, 3, : sk // 2] = torch.finfo(bias_dtype).min  # half a row at the dtype's lowest
    bias[:, :, 9, :] = float("-inf")                         # a row without any key by its bias
    bias[:, :, 11] = torch.where(mask[:, :1, 11], float("-inf"), 1e3)  # true keys -inf, false ones large
    mask[:, :, 5] = False                               # a row without any key by its mask
    mask[:, :, 128:min(sq, 256)] = False                # a whole query block without any
    bias, mask = bias.to("cuda", bias_dtype), mask.to("cuda")
    if bias_heads == "expand":
        bias = bias.expand(b, h, sq, sk)
    if mask_heads == "expand":
        mask = mask.expand(b, h, sq, sk)
    _attend_and_check(q, k, v, mask, bias, causal, window, softcap, case)


def _scatter_keys(x, positions, heads, width):
    """x (..., K) with a head dim at -3 (1 or ``heads``) and one column per gathered row -> (...,
    width) with each column at its original position (positions (B, 1 or Hkv, K), -1 for
    padding, which goes nowhere); the other columns 0 / False."""
    b = positions.shape[0]
    pos = positions.long().repeat_interleave(heads // positions.shape[1], dim=1)  # (B, H, K)
    pos = torch.where(pos < 0, width, pos)[:, :, None, :].expand(b, heads, x.shape[-2], -1)
    out = torch.zeros(b, heads, x.shape[-2], width + 1, dtype=x.dtype, device=x.device)
    return out.scatter_(-1, pos, x.expand(b, heads, -1, -1))[..., :width]


@pytest.mark.parametrize("case", [
    # (D, scores, indexed rows, key ends, causal, softcap)
    (64, "bias", False, False, True, 0.0),
    (128, "bias", True, True, True, 0.0),
    (256, "bias32", True, False, False, 0.0),
    (128, "bias32", False, True, True, 0.0),
    (64, "bias", True, False, False, 20.0),
    (128, "bias_key_mask", True, False, True, 0.0),
    (64, "mask", True, False, False, 0.0),
    (128, "mask", False, True, True, 0.0),
    (256, "mask", True, True, True, 0.0),
    (128, "mask_key_bias", True, False, True, 30.0),
    (128, "bias_mask", True, True, True, 0.0),
    (256, "bias_mask", False, False, False, 0.0),
], ids=lambda c: f"d{c[0]}_{c[1]}{'_indexed' if c[2] else ''}{'_ends' if c[3] else ''}"
                 f"{'_causal' if c[4] else ''}_cap{c[5]:g}")
def test_gathered_keys_with_full_operands_forward(case, nan_poison):
    """Gathered keys (key_positions, with key ends, the rows copied or indexed in place) with a
    full bias (q's dtype or fp32) and / or a full mask over the gathered rows (B, H, Sq, K),
    beside a key-side mask or bias and softcap: on Hopper the warp-specialized forward's bias or
    mask tiles beside its key rows (a full bias with a full mask: the sm80-class general kernel);
    against the float64 reference of the same problem over the original keys, the gathered rows
    scattered back to their positions. Indexed rows equal the gathered copy bit for bit."""
    from reference import check_against_reference
    from test_indexed_keys import _gathered
    from dmattn.ops import attention_forward
    d, scores, indexed, ends, causal, softcap = case
    b, sq, h, hkv, width, original, source = 2, 200, 4, 2, 304, 520, 400
    g = torch.Generator(device="cpu").manual_seed(d + len(scores) + 2 * indexed + ends)
    q = torch.randn(b, sq, h, d, generator=g).to("cuda", torch.bfloat16)
    k_src, v_src = (torch.randn(b, source, hkv, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    index = torch.randint(0, source, (b, hkv, width), generator=g, dtype=torch.int32).to("cuda")
    k, v = _gathered(k_src, index, 1), _gathered(v_src, index, 1)
    positions = torch.full((b, hkv, width), -1, dtype=torch.int32)
    for bi in range(b):
        for hi in range(hkv):
            n = [width, 250, 131, 0][bi * hkv + hi]  # (one row of padding only)
            positions[bi, hi, :n] = torch.randperm(original, generator=g)[:n].sort().values.to(torch.int32)
    positions = positions.to("cuda")
    key_ends = torch.randint(0, sq + 8, (b, hkv, width), generator=g, dtype=torch.int32).to("cuda") if ends else None
    bias = mask = None
    if scores.startswith("bias"):
        bias = (2 * torch.randn(b, h, sq, width, generator=g)).to("cuda", torch.float32 if scores == "bias32"
                                                                   else torch.bfloat16)
    if "mask" in scores:
        mask = (torch.rand(b, h if "key" not in scores else 1, sq if "key" not in scores else 1, width,
                           generator=g) < 0.7).to("cuda")
    if scores == "mask_key_bias":
        bias = torch.randn(b, h, 1, width, generator=g).to("cuda", torch.bfloat16)
    out, lse = attention_forward(q, k, v, mask, bias, causal, -1, -1, None, softcap, False, positions, original,
                                 key_ends)
    if indexed:
        out1, lse1 = attention_forward(q, k_src, v_src, mask, bias, causal, -1, -1, None, softcap, False, positions,
                                       original, key_ends, index)
        assert torch.equal(out1, out) and torch.equal(lse1, lse), "indexed rows differ from the gathered copy"
    # The same problem over the original keys: each gathered row at its position, allowed where
    # its mask is true and (key ends) below its end; the other positions never allowed.
    allowed = _scatter_keys(torch.ones(1, 1, sq, width, dtype=torch.bool, device="cuda"), positions, h, original)
    if mask is not None:
        allowed &= _scatter_keys(mask, positions, h, original)
    if key_ends is not None:
        below_end = torch.arange(sq, device="cuda")[:, None] < key_ends[:, :, None, :]  # (B, Hkv, Sq, K)
        allowed &= _scatter_keys(below_end.repeat_interleave(h // hkv, 1), positions, h, original)
    bias_dense = None if bias is None else _scatter_keys(bias, positions, h, original)
    k_dense, v_dense = (_scatter_keys(x.permute(0, 2, 3, 1), positions, hkv, original).permute(0, 3, 1, 2)
                        for x in (k, v))
    check_against_reference(q, k_dense, v_dense, allowed, bias_dense, out, lse, causal=causal, softcap=softcap,
                            context=str(case))


@pytest.mark.parametrize("expanded", ["q_batch", "kv_heads", "k_batch_v_heads", "all"])
@pytest.mark.parametrize("scores", ["plain", "full_bias", "full_mask", "key_bias"])
def test_broadcast_qkv_forward(expanded, scores, nan_poison):
    """q, k, v expanded over the batch or the heads (stride 0 there; on Hopper the
    warp-specialized forward reads them through views of one batch / head, and k and v expanded
    differently run the sm80-class kernels), with plain scores, a full bias, a full mask or a
    per-key bias; against the float64 reference."""
    b, sq, sk, h, hkv = 2, 300, 320, 4, 2
    d = {"plain": 64, "full_bias": 128, "full_mask": 256, "key_bias": 96}[scores]
    g = torch.Generator(device="cpu").manual_seed(len(expanded) + 7 * len(scores))
    dtype = torch.bfloat16

    def operand(heads, seq, over_batch, over_heads):
        x = torch.randn(1 if over_batch else b, seq, 1 if over_heads else heads, d, generator=g).to("cuda", dtype)
        return x.expand(b, seq, heads, d)

    all_ = expanded == "all"
    q = operand(h, sq, expanded == "q_batch" or all_, all_)
    k = operand(hkv, sk, expanded == "k_batch_v_heads" or all_, expanded == "kv_heads" or all_)
    v = operand(hkv, sk, all_, expanded in ("kv_heads", "k_batch_v_heads") or all_)
    mask = bias = None
    if scores == "full_bias":
        bias = torch.randn(b, h, sq, sk, generator=g).to("cuda", dtype)
    elif scores == "full_mask":
        mask = (torch.rand(b, h, sq, sk, generator=g) < 0.7).to("cuda")
    elif scores == "key_bias":
        bias = torch.randn(b, h, 1, sk, generator=g).to("cuda", dtype)
    _attend_and_check(q, k, v, mask, bias, True, (-1, -1), 0.0, (expanded, scores))


@pytest.mark.parametrize("case", [
    # (B, Sq, Sk, H, D, bias, causal, window, key mask layout)
    (3, 300, 1024, 4, 128, "full", False, (-1, -1), "contiguous"),
    (3, 1000, 1000, 4, 64, "key", True, (-1, -1), "contiguous"),
    (3, 200, 776, 2, 256, "full", False, (96, 64), "strided"),
    (3, 129, 1500, 2, 96, None, False, (-1, -1), "strided"),
    (3, 64, 3000, 2, 64, "key", False, (-1, -1), "contiguous"),
], ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}_d{c[4]}_bias{c[5]}{'_causal' if c[6] else ''}_w{c[7][0]}_{c[8]}")
def test_key_mask_padding_forward(case, nan_poison):
    """Key masks (B, H, 1, Sk) of padded batches: false before a first and after a last key
    (left and right padding, random keys false between), one batch without any true key and
    one with all true, whose padding the Hopper warp-specialized forward never loads (the
    key-block range between the first and last true key); a contiguous mask (16-byte loads of
    the row, Sk % 16 != 0 among them) and a strided view (byte loads); with a full or a per-key
    bias or none; against the float64 reference."""
    import dmattn
    from reference import check_against_reference
    b, sq, sk, h, d, bias_kind, causal, window, layout = case
    g = torch.Generator(device="cpu").manual_seed(sq + sk + d)
    q = torch.randn(b, sq, h, d, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(b, sk, h, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    mask = torch.rand(b, h, 1, sk, generator=g) < 0.8
    mask[0, :, :, : sk // 3] = False           # left padding over whole key blocks
    mask[0, :, :, sk - sk // 4:] = False       # and right padding
    mask[0, 1:, :, sk // 2 + 7:] = False       # more of it on the other heads
    mask[1] = False                            # no key at all
    mask[2] = True                             # every key (also: off the gather path, which
                                               # masks keeping at most half of the keys take)
    mask = mask.to("cuda")
    if layout == "strided":                    # (a view whose keys are 2 bytes apart)
        mask = torch.stack([mask, ~mask], -1)[..., 0]
        assert mask.stride(-1) == 2
    bias = None
    if bias_kind == "full":
        bias = torch.randn(b, h, sq, sk, generator=g).to("cuda", torch.bfloat16)
    elif bias_kind == "key":
        bias = torch.randn(b, h, 1, sk, generator=g).to("cuda", torch.bfloat16)
    out, lse = dmattn.attention(q, k, v, mask, bias, causal=causal, window=window, return_lse=True)
    check_against_reference(q, k, v, mask, bias, out, lse, causal=causal, window=window, context=str(case))


@pytest.mark.parametrize("operand", ["mask", "bias"])
def test_no_keys_full_operand_slice(operand, nan_poison):
    """No key (Sk = 0) with a full mask or bias sliced from a larger one (a real pointer, rows of
    16-byte multiples, as the tile paths take): every row is empty, out 0, lse -inf."""
    import dmattn
    b, sq, h, d = 2, 130, 4, 64
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, 0, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if operand == "mask":
        full = torch.ones(b, h, sq, 64, dtype=torch.bool, device="cuda")
        kw = dict(mask=full[..., :0])
    else:
        full = torch.randn(b, h, sq, 64, device="cuda", dtype=torch.bfloat16)
        kw = dict(bias=full[..., :0])
    out, lse = dmattn.attention(q, k, v, return_lse=True, **kw)
    assert torch.all(out == 0)
    assert torch.all(lse == float("-inf"))


@pytest.mark.parametrize("seed", range(300), ids=lambda s: f"seed_{s}")
def test_random_forward(seed, nan_poison):
    _check_fwd(random_case(seed, "cuda"))


@pytest.mark.parametrize("idx", range(len(FIXED)), ids=lambda i: f"fixed_{i}")
def test_fixed_forward(idx, nan_poison):
    c = FIXED[idx]
    if c.dtype not in (torch.float16, torch.bfloat16) or c.d % 8:
        pytest.skip("CUDA takes fp16/bf16 and head_dim % 8 == 0")
    _check_fwd(c)


def large_case(seed: int):
    """random_case's features at lengths up to a few query / key blocks."""
    rng = random.Random(10_000 + seed)
    c = random_case(10_000 + seed, "cuda")
    c.sq = rng.choice([1, 127, 128, 129, 255, 256, 511, 777, 1024])
    c.sk = rng.choice([c.sq, 1, 128, 200, 513, 1024, 1500])
    c.d = rng.choice([64, 128, 64, 96, 256, 40, 200])
    c.b = rng.choice([1, 2])
    if c.mask_shape is not None:
        c.mask_shape = broadcast_shape(rng, c.b, c.h, c.hkv, c.sq, c.sk)
    if c.bias_shape is not None:
        c.bias_shape = broadcast_shape(rng, c.b, c.h, c.hkv, c.sq, c.sk)
    return c


@pytest.mark.parametrize("seed", range(100), ids=lambda s: f"big_{s}")
def test_random_forward_large(seed, nan_poison):
    _check_fwd(large_case(seed))




@pytest.mark.parametrize("kind", ["full", "full_by_warp", "per_key", "topk"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_large_bias_offsets_forward(kind, d, nan_poison):
    """Biased scores far from zero: rows whose maximum lies between -1e5 and 3e4 (where an
    exponent computed as s * log2e - m * log2e in one FMA would be off by the rounding of
    m * log2e, src/cuda/common/softmax.h), against the float64 reference (softmax is shift-invariant,
    so the offsets change nothing but the rounding). Full biases, per-key biases and the top-k
    gather path (per-key rows with gathered keys). "full" varies the offset from row to row, so
    that every 16-row group (a warp's rows in the Hopper kernel) holds some beyond 4096 and takes
    the safe subtraction; "full_by_warp" gives each 16-row group one offset, so that groups up to
    2900 take the one-FMA exponent."""
    import dmattn
    g = torch.Generator(device="cpu").manual_seed(d + len(kind))
    b, h, sq, sk = 2, 4, 300, 700
    q = torch.randn(b, sq, h, d, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(b, sk, h, d, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(b, sk, h, d, generator=g).to("cuda", torch.bfloat16)
    offsets = torch.tensor([0.0, 1000.0, -2500.0, 2900.0, -3000.0, 6000.0, -1e5, 3e4])
    if kind == "full":  # per query row
        shape, shift = (b, h, sq, sk), offsets[torch.arange(sq) % 8].view(1, 1, sq, 1)
    elif kind == "full_by_warp":  # per group of 16 query rows
        shape, shift = (b, h, sq, sk), offsets[torch.arange(sq) // 16 % 8].view(1, 1, sq, 1)
    else:  # per (batch, head)
        shape, shift = (b, h, 1, sk), offsets.view(b, h, 1, 1)
    bias = (4 * torch.randn(shape, generator=g) + shift).to("cuda", torch.bfloat16)
    if kind == "topk":
        out, lse = dmattn.attention_topk(q, k, v, bias, 300, causal=True, return_lse=True)
        allowed = dmattn.dynamic_mask(bias, 300).expand(b, h, sq, sk).clone()
    else:
        out, lse = dmattn.attention(q, k, v, bias=bias, causal=True, return_lse=True)
        allowed = torch.ones(b, h, sq, sk, dtype=torch.bool, device="cuda")
    i = torch.arange(sq, device="cuda")[:, None]
    j = torch.arange(sk, device="cuda")[None, :]
    allowed &= j <= i + sk - sq
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / d ** 0.5 + bias.double()
    s = s.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1)
    ref_lse = torch.logsumexp(s, dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1).nan_to_num(0.0), v.double())
    assert torch.isfinite(out).all()
    assert (out.permute(0, 2, 1, 3)[empty] == 0).all()
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-2 * max(1.0, ref.abs().max().item()), err
    lse_err = ((lse.double() - ref_lse).abs() - 2e-6 * ref_lse.abs())[~empty].max().item()
    assert lse_err < 1e-2, lse_err  # (float32 lse: 2e-6 relative at the offsets' magnitudes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_bias_extremes(dtype, d, causal, nan_poison):
    """A per-key bias (B, H, 1, Sk) with extreme values among ordinary ones, against the float64
    reference: a row (batch 0, head 0) with biases near finfo.min in its third key block (the
    Hopper forward reads the key blocks from the last to the first, so they arrive mid-tile), a
    row (batch 1, head 1) whose every key carries such a bias (uniform for finfo.min: its lse is
    the bias plus log Sk), -inf keys (a mask) and a row of them only (empty: out 0, lse -inf);
    without and with a softcap. fp16 q / k / v take an fp32 bias of -1e4 in the place of
    finfo.min (far below any score, beyond fp16's range once divided by a scale below 1)."""
    import dmattn
    from reference import check_against_reference
    g = torch.Generator(device="cpu").manual_seed(d + 7 * causal + (dtype == torch.float16))
    b, h, sq, sk = 2, 2, 300, 700
    q, k, v = (torch.randn(b, n, h, d, generator=g).to("cuda", dtype) for n in (sq, sk, sk))
    bias_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    # near finfo.min for bf16; -1e4 (in fp32) for fp16
    extreme = torch.finfo(torch.bfloat16).min if dtype == torch.bfloat16 else -1e4
    bias = 3 * torch.randn(b, h, 1, sk, generator=g)
    bias[0, 0, 0, 300:310] = extreme
    bias[1, 1, 0, :] = extreme
    bias[0, 1, 0, 100:200] = float("-inf")
    bias[1, 0, 0, :] = float("-inf")
    bias = bias.to("cuda", bias_dtype)
    for softcap in (0.0, 20.0):
        out, lse = dmattn.attention(q, k, v, bias=bias, causal=causal, softcap=softcap, return_lse=True)
        check_against_reference(q, k, v, None, bias, out, lse, causal=causal, softcap=softcap,
                                context=f"softcap={softcap}")
        assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))
        assert torch.isneginf(lse[1, 0]).all()
