"""Bad inputs: every argument of dmattn.attention (and flash_dmattn_func) rejected with a
ValueError / TypeError / RuntimeError whose message names the argument. Never a crash, a hang
or a silent broadcast. Also: inputs that look unusual but are legal must NOT raise."""

import math

import pytest
import torch

import dmattn

ERR = (ValueError, TypeError, RuntimeError)
B, SQ, SK, H, HKV, D = 2, 8, 10, 4, 2, 16


def base(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, SQ, H, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, SK, HKV, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, SK, HKV, D, generator=g).to(dtype).to(device)
    mask = (torch.rand(B, 1, SQ, SK, generator=g) < 0.8).to(device)
    bias = torch.randn(B, H, SQ, SK, generator=g).to(dtype).to(device)
    return dict(q=q, k=k, v=v, mask=mask, bias=bias)


def call(args, **kw):
    a = dict(args)
    return dmattn.attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("mask", None),
                            a.pop("bias", None), **kw)


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# (id, argument the message must name, modification of the base args, kwargs)
CASES = [
    # q
    ("q_rank3", "q", dict(q=rnd(SQ, H, D)), {}),
    ("q_rank5", "q", dict(q=rnd(B, SQ, H, D, 1)), {}),
    ("q_int", "q", dict(q=torch.ones(B, SQ, H, D, dtype=torch.int32)), {}),
    ("q_complex", "q", dict(q=torch.ones(B, SQ, H, D, dtype=torch.complex64)), {}),
    ("q_not_tensor", "q", dict(q=[[1.0]]), {}),
    ("q_zero_heads", "q", dict(q=rnd(B, SQ, 0, D)), {}),
    # k
    ("k_rank3", "k", dict(k=rnd(SK, HKV, D)), {}),
    ("k_dtype", "k", dict(k=rnd(B, SK, HKV, D, dtype=torch.float16)), {}),
    ("k_batch", "k", dict(k=rnd(B + 1, SK, HKV, D), v=rnd(B + 1, SK, HKV, D)), {}),
    ("k_head_dim", "k", dict(k=rnd(B, SK, HKV, D + 1)), {}),
    ("k_heads_not_dividing", "k", dict(k=rnd(B, SK, 3, D), v=rnd(B, SK, 3, D)), {}),
    ("k_more_heads_than_q", "k", dict(k=rnd(B, SK, 2 * H, D), v=rnd(B, SK, 2 * H, D)), {}),
    ("k_zero_heads", "k", dict(k=rnd(B, SK, 0, D), v=rnd(B, SK, 0, D)), {}),
    ("k_not_tensor", "k", dict(k=3.0), {}),
    # v
    ("v_rank3", "v", dict(v=rnd(SK, HKV, D)), {}),
    ("v_dtype", "v", dict(v=rnd(B, SK, HKV, D, dtype=torch.bfloat16)), {}),
    ("v_seqlen", "v", dict(v=rnd(B, SK + 1, HKV, D)), {}),
    ("v_heads", "v", dict(v=rnd(B, SK, HKV * 2, D)), {}),
    ("v_head_dim", "v", dict(v=rnd(B, SK, HKV, D * 2)), {}),
    ("v_batch", "v", dict(v=rnd(1, SK, HKV, D)), {}),
    ("v_not_tensor", "v", dict(v="v"), {}),
    # mask
    ("mask_float", "mask", dict(mask=torch.ones(B, 1, SQ, SK)), {}),
    ("mask_int", "mask", dict(mask=torch.ones(B, 1, SQ, SK, dtype=torch.int64)), {}),
    ("mask_uint8", "mask", dict(mask=torch.ones(B, 1, SQ, SK, dtype=torch.uint8)), {}),
    ("mask_rank5", "mask", dict(mask=torch.ones(1, B, 1, SQ, SK, dtype=torch.bool)), {}),
    ("mask_sq", "mask", dict(mask=torch.ones(B, 1, SQ + 1, SK, dtype=torch.bool)), {}),
    ("mask_sk", "mask", dict(mask=torch.ones(B, 1, SQ, SK - 1, dtype=torch.bool)), {}),
    ("mask_heads", "mask", dict(mask=torch.ones(B, 3, SQ, SK, dtype=torch.bool)), {}),
    ("mask_batch", "mask", dict(mask=torch.ones(B + 1, 1, SQ, SK, dtype=torch.bool)), {}),
    ("mask_rank2_wrong", "mask", dict(mask=torch.ones(SK, SQ, dtype=torch.bool)), {}),
    ("mask_not_tensor", "mask", dict(mask=True), {}),
    # bias
    ("bias_fp16_with_fp32_q", "bias", dict(bias=rnd(B, H, SQ, SK, dtype=torch.float16)), {}),
    ("bias_fp64_with_fp32_q", "bias", dict(bias=rnd(B, H, SQ, SK, dtype=torch.float64)), {}),
    ("bias_int", "bias", dict(bias=torch.ones(B, H, SQ, SK, dtype=torch.int32)), {}),
    ("bias_bool", "bias", dict(bias=torch.ones(B, H, SQ, SK, dtype=torch.bool)), {}),
    ("bias_rank5", "bias", dict(bias=rnd(1, B, H, SQ, SK)), {}),
    ("bias_sq", "bias", dict(bias=rnd(B, H, SQ - 1, SK)), {}),
    ("bias_sk", "bias", dict(bias=rnd(B, H, SQ, SK + 1)), {}),
    ("bias_heads", "bias", dict(bias=rnd(B, 3, SQ, SK)), {}),
    ("bias_batch", "bias", dict(bias=rnd(3, H, SQ, SK)), {}),
    ("bias_not_tensor", "bias", dict(bias=0.5), {}),
    # window
    ("window_left_-2", "window", {}, dict(window=(-2, 0))),
    ("window_right_-5", "window", {}, dict(window=(0, -5))),
    ("window_three", "window", {}, dict(window=(1, 2, 3))),
    ("window_float", "window", {}, dict(window=(1.5, 2))),
    ("window_str", "window", {}, dict(window="ab")),
    ("window_int", "window", {}, dict(window=3)),
    ("window_none_entry", "window", {}, dict(window=(None, 2))),
    # scale
    ("scale_zero", "scale", {}, dict(scale=0.0)),
    ("scale_negative", "scale", {}, dict(scale=-1.0)),
    ("scale_nan", "scale", {}, dict(scale=float("nan"))),
    ("scale_inf", "scale", {}, dict(scale=float("inf"))),
    ("scale_str", "scale", {}, dict(scale="0.1")),
    # softcap
    ("softcap_negative", "softcap", {}, dict(softcap=-1.0)),
    ("softcap_nan", "softcap", {}, dict(softcap=float("nan"))),
    ("softcap_inf", "softcap", {}, dict(softcap=float("inf"))),
    ("softcap_none", "softcap", {}, dict(softcap=None)),
    ("softcap_str", "softcap", {}, dict(softcap="x")),
    # head_dim
    ("head_dim_0", "head_dim", dict(q=rnd(B, SQ, H, 0), k=rnd(B, SK, HKV, 0), v=rnd(B, SK, HKV, 0),
                                   bias=None), {}),
    ("head_dim_257", "head_dim", dict(q=rnd(B, SQ, H, 257), k=rnd(B, SK, HKV, 257),
                                      v=rnd(B, SK, HKV, 257)), {}),
    ("head_dim_512", "head_dim", dict(q=rnd(1, 2, 1, 512), k=rnd(1, 2, 1, 512), v=rnd(1, 2, 1, 512),
                                      mask=None, bias=None), {}),
]


@pytest.mark.parametrize("name,modify,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument(name, modify, kw):
    args = base()
    args.update(modify)
    with pytest.raises(ERR) as ei:
        call(args, **kw)
    msg = str(ei.value)
    assert name in msg, f"message does not name {name!r}: {type(ei.value).__name__}: {msg}"


def test_bias_dtype_mismatch_bf16_q():
    args = base(torch.bfloat16)
    args["bias"] = args["bias"].half()
    with pytest.raises(TypeError, match="bias"):
        call(args)


def test_error_types():
    """Shape problems are ValueError, dtype problems TypeError (as the native layer maps them)."""
    args = base()
    with pytest.raises(ValueError, match="mask"):
        call(dict(args, mask=torch.ones(B, 1, SQ + 1, SK, dtype=torch.bool)))
    with pytest.raises(TypeError, match="mask"):
        call(dict(args, mask=torch.ones(B, 1, SQ, SK)))
    with pytest.raises(TypeError, match="k"):
        call(dict(args, k=args["k"].double()))
    with pytest.raises(ValueError, match="window"):
        call(args, window=(-3, -1))
    with pytest.raises(ValueError, match="scale"):
        call(args, scale=-2.0)


def test_message_says_what_it_got_and_expected():
    args = base()
    with pytest.raises(ERR) as ei:
        call(dict(args, bias=rnd(B, 3, SQ, SK)))
    msg = str(ei.value)
    assert "3" in msg and str(H) in msg, msg
    with pytest.raises(ERR) as ei:
        call(dict(args, k=rnd(B, SK, HKV, D, dtype=torch.float16)))
    assert "float16" in str(ei.value) and "float32" in str(ei.value), str(ei.value)


def test_flash_dmattn_func_errors_name_arguments():
    args = base()
    with pytest.raises(ERR, match="mask"):
        dmattn.flash_dmattn_func(args["q"], args["k"], args["v"], attn_mask=torch.ones(B, 1, SQ, SK))
    with pytest.raises(ERR, match="bias"):
        dmattn.flash_dmattn_func(args["q"], args["k"], args["v"], attn_bias=rnd(B, H, SQ, 3))
    with pytest.raises(ERR, match="scale"):
        dmattn.flash_dmattn_func(args["q"], args["k"], args["v"], softmax_scale=0.0)
    with pytest.raises(ERR, match="softcap"):
        dmattn.flash_dmattn_func(args["q"], args["k"], args["v"], softcap=-0.5)


def test_attention_topk_bias_shape_names_the_bias():
    """attention_topk builds its selection mask from the bias: a bias of a wrong shape is named
    as the bias, not as the mask made from it."""
    args = base()
    for shape in [(B, 3, 1, SK), (B, H, SQ, SK + 1), (B + 1, H, 1, SK)]:
        with pytest.raises(ValueError, match=r"^bias: shape"):
            dmattn.attention_topk(args["q"], args["k"], args["v"], rnd(*shape), 3)


# --------------------------------------------------------------------------- legal, must not raise


def test_last_dim_non_contiguous_is_accepted():
    """q/k/v with a strided last dimension are copied by the API (FlashAttention does the same);
    mask and bias may have any strides."""
    args = base()
    ref = call(args, causal=True)
    q2 = torch.stack([args["q"], torch.zeros_like(args["q"])], dim=-1)[..., 0]
    k2 = torch.stack([args["k"], torch.zeros_like(args["k"])], dim=-1)[..., 0]
    v2 = torch.stack([args["v"], torch.zeros_like(args["v"])], dim=-1)[..., 0]
    assert q2.stride(-1) == 2
    m2 = args["mask"].transpose(-1, -2).contiguous().transpose(-1, -2)
    b2 = args["bias"].transpose(-1, -2).contiguous().transpose(-1, -2)
    assert b2.stride(-1) != 1 and m2.stride(-1) != 1
    out = dmattn.attention(q2, k2, v2, m2, b2, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_broadcast_shapes_accepted():
    args = base()
    for mshape in [(SK,), (SQ, SK), (1, SK), (SQ, 1), (H, 1, SK), (HKV, SQ, SK), (B, HKV, 1, 1),
                   (1, 1, 1, 1), ()]:
        call(dict(args, mask=torch.ones(mshape, dtype=torch.bool)))
    for bshape in [(SK,), (SQ, 1), (HKV, 1, SK), (B, 1, SQ, SK), (1,), ()]:
        call(dict(args, bias=torch.randn(bshape)))


def test_scale_none_is_default():
    args = base()
    torch.testing.assert_close(call(args), call(args, scale=1 / math.sqrt(D)), rtol=0, atol=0)


@pytest.mark.parametrize("d", [1, 3, 7, 13, 100, 200, 256])
def test_cpu_any_head_dim_up_to_256(d):
    q = rnd(1, 3, 2, d)
    k = rnd(1, 4, 1, d)
    out = dmattn.attention(q, k, k)
    assert out.shape == q.shape and torch.isfinite(out).all()


# --------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_device_mismatch():
    args = base(torch.bfloat16, "cuda")
    for name in ("k", "v", "mask", "bias"):
        a = dict(args)
        a[name] = a[name].cpu()
        with pytest.raises(ERR, match=name):
            call(a)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [12, 4, 264, 260])
def test_cuda_head_dim(d):
    q = torch.randn(1, 4, 2, d, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ERR, match="head_dim"):
        dmattn.attention(q, q[:, :, :1], q[:, :, :1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_dtype(dtype):
    q = torch.randn(1, 4, 2, 64, device="cuda", dtype=dtype)
    with pytest.raises(TypeError, match="q"):
        dmattn.attention(q, q, q)


# A tensor on a device the library does not run on (here meta) is rejected in Python, naming
# the argument, before anything reaches the native library (whose DLPack hand-over would fail
# with a C++ stack trace).
@pytest.mark.parametrize("name", ["q", "k", "v", "mask", "bias"])
def test_meta_tensor_names_the_argument(name):
    args = base()
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"^{name}: .*meta device"):
        call(args)


@pytest.mark.parametrize("name", ["q", "k", "v", "bias"])
def test_meta_tensor_attention_topk(name):
    args = base()
    args["bias"] = args["bias"][:, :, :1]  # a per-key bias (B, H, 1, Sk)
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"^{name}: .*meta device"):
        dmattn.attention_topk(args["q"], args["k"], args["v"], args["bias"], 3)


@pytest.mark.parametrize("name", ["q", "cu_seqlens_q", "bias"])
def test_meta_tensor_attention_varlen(name):
    args = dict(q=rnd(SQ, H, D), k=rnd(SQ, HKV, D), v=rnd(SQ, HKV, D),
                cu_seqlens_q=torch.tensor([0, 3, SQ], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 3, SQ], dtype=torch.int32), bias=rnd(H, SQ))
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"^{name}: .*meta device"):
        dmattn.attention_varlen(args["q"], args["k"], args["v"], args["cu_seqlens_q"],
                                args["cu_seqlens_k"], SQ - 3, SQ - 3, bias=args["bias"])
