"""dmattn.integrations.transformers: registration, HF layout and masks, attention_bias +
keep_window_size, against a direct dmattn.attention call and against HF's own sdpa function
(and whole tiny Llama / Doge models). Skipped where transformers is not importable, except
the checks that dmattn works without it."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

import dmattn
from dmattn.integrations import transformers as hf_dmattn

try:
    import transformers
    from transformers.utils import is_torch_available
    if not is_torch_available():  # transformers refuses this torch (too old): no models
        transformers = None
except ImportError:
    transformers = None

needs_transformers = pytest.mark.skipif(transformers is None,
                                        reason="transformers (with torch support) not installed")


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _tol(device):
    return dict(atol=2e-2, rtol=2e-2) if device == "cuda" else dict(atol=1e-5, rtol=1e-5)


class TinyAttention(torch.nn.Module):
    """What an HF attention module exposes to the attention function."""

    def __init__(self, heads, kv_heads, is_causal=True, dtype=torch.float32):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = heads // kv_heads
        self.o_proj = torch.nn.Linear(8, 8, dtype=dtype)


def _hf_qkv(b, h, hkv, sq, sk, d, dtype, device):
    """HF layout: query (B, H, Sq, D), key/value (B, Hkv, Sk, D)."""
    q = torch.randn(b, h, sq, d).to(dtype).to(device)
    k = torch.randn(b, hkv, sk, d).to(dtype).to(device)
    v = torch.randn(b, hkv, sk, d).to(dtype).to(device)
    return q, k, v


def _direct(q, k, v, **kw):
    """dmattn.attention on the same HF-layout tensors; (B, Sq, H, D) out."""
    return dmattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)


# --------------------------------------------------------------------------- without transformers


def test_import_dmattn_never_needs_transformers():
    code = ("import sys; sys.modules['transformers'] = None; import dmattn, torch; "
            "q = torch.randn(1, 3, 2, 8); assert dmattn.attention(q, q, q).shape == q.shape; "
            "import dmattn.integrations.transformers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_register_without_transformers_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="pip install transformers"):
        hf_dmattn.register()


# --------------------------------------------------------------------------- registration


@needs_transformers
def test_register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from dmattn.integrations import hf_common, hf_mask

    hf_dmattn.register()
    assert AttentionInterface()["dmattn"] is hf_dmattn.attention_forward
    # Without a mask function HF would hand attention_mask=None (padding dropped).
    assert AttentionMaskInterface()["dmattn"] is hf_mask.compact_causal_mask
    forward = transformers.models.doge.modeling_doge.DogeAttention.forward
    assert getattr(forward, "_dmattn_doge_hook", False)
    hf_dmattn.register()  # idempotent: the hook wraps once
    assert transformers.models.doge.modeling_doge.DogeAttention.forward is forward
    assert "dmattn" in hf_common.DOGE_NAMES


# --------------------------------------------------------------------------- masks and flags

B, H, HKV, SQ, SK, D = 2, 4, 2, 6, 9, 16


def _mask_cases(device):
    """(name, attention_mask, kwargs for the equivalent direct dmattn.attention call)."""
    g = torch.Generator().manual_seed(3)
    bool4 = (torch.rand(B, 1, SQ, SK, generator=g) < 0.7).to(device)
    heads4 = (torch.rand(B, H, SQ, SK, generator=g) < 0.7).to(device)
    dtype = _dtype(device)
    fmin = torch.finfo(dtype).min
    additive = (torch.randn(B, 1, SQ, SK, generator=g) * 0.5).to(dtype).to(device)
    return [
        ("bool_4d", bool4, dict(mask=bool4)),
        ("bool_4d_heads", heads4, dict(mask=heads4)),
        ("float_4d_min", torch.where(bool4, 0.0, fmin).to(dtype), dict(mask=bool4)),
        ("float_4d_neg_inf", torch.where(bool4, 0.0, float("-inf")).to(dtype), dict(mask=bool4)),
        ("float_4d_additive", torch.where(bool4, additive, fmin), dict(mask=bool4, bias=additive)),
        ("bool_4d_longer_than_keys", torch.cat([bool4, bool4[..., :2]], -1), dict(mask=bool4)),
    ]


@pytest.mark.parametrize("case", range(6))
def test_masks_match_direct_call(device, case):
    name, attention_mask, direct_kw = _mask_cases(device)[case]
    q, k, v = _hf_qkv(B, H, HKV, SQ, SK, D, _dtype(device), device)
    module = TinyAttention(H, HKV, dtype=_dtype(device)).to(device)
    out, weights = hf_dmattn.attention_forward(module, q, k, v, attention_mask, scaling=0.3)
    assert weights is None
    assert tuple(out.shape) == (B, SQ, H, D) and out.dtype == q.dtype, name
    expected = _direct(q, k, v, scale=0.3, **direct_kw)
    torch.testing.assert_close(out, expected, atol=0, rtol=0, msg=name)


def _padding(kind, device):
    """A 2D padding mask (B, SK): sequence 0 whole, sequence 1 padded on the left or the right."""
    pad = torch.ones(B, SK, dtype=torch.long, device=device)
    if kind == "left":
        pad[1, :3] = 0
    else:
        pad[1, -4:] = 0
    return pad


def _real_queries(pad, sq):
    real = pad.bool()
    return real if sq == real.shape[1] else torch.ones(B, 1, dtype=torch.bool, device=pad.device) if sq == 1 \
        else real[:, -sq:]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("sq", [SK, 5, 1], ids=["prefill", "chunk", "decode"])
@pytest.mark.parametrize("mask_dtype", [torch.long, torch.bool])
def test_padding_2d_runs_packed(device, side, sq, mask_dtype):
    """A 2D padding mask runs the real tokens through attention_varlen (and the padded rows after
    a sequence's last token through a second call): every query row equals the dense key-masked
    causal call, as transformers' eager and sdpa attention give it -- a right-padded row sees
    the whole sequence, a left-padded one nothing (0) -- with the same gradients, and the
    key-side bias gets its gradient back at the real keys."""
    pad = _padding(side, device).to(mask_dtype)
    q, k, v = _hf_qkv(B, H, HKV, sq, SK, D, _dtype(device), device)
    bias = (torch.randn(B, H, 1, SK) * 0.5).to(_dtype(device)).to(device)
    module = TinyAttention(H, HKV, dtype=_dtype(device)).to(device)
    real_q = _real_queries(pad, sq)
    weight = torch.randn(B, sq, H, D).to(_dtype(device)).to(device)

    def run(fn):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
        out = fn(*inputs)
        grads = torch.autograd.grad((out.float() * weight.float()).sum(), inputs)
        return out, grads

    got, got_grads = run(lambda q_, k_, v_, b_: hf_dmattn.attention_forward(
        module, q_, k_, v_, pad, scaling=0.3, attention_bias=b_)[0])
    want, want_grads = run(lambda q_, k_, v_, b_: _direct(
        q_, k_, v_, mask=pad.bool()[:, None, None, :], bias=b_, causal=True, scale=0.3))
    torch.testing.assert_close(got, want, **_tol(device))
    padded = got[~real_q]
    if side == "left":  # (no key before a left-padded row)
        assert torch.equal(padded, torch.zeros_like(padded))
    elif padded.numel():  # a right-padded row sees the sequence: not 0
        assert padded.abs().amax() > 0
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got_grads, want_grads):
        torch.testing.assert_close(g, w, **_tol(device), msg=name)
        assert torch.isfinite(g).all(), name


def test_padding_2d_with_a_query_dependent_bias_stays_dense(device):
    """A bias with a query dimension has no packed form: the key mask on the dense path."""
    pad = _padding("left", device)
    q, k, v = _hf_qkv(B, H, HKV, SQ, SK, D, _dtype(device), device)
    bias = torch.randn(B, H, SQ, SK).to(_dtype(device)).to(device)
    module = TinyAttention(H, HKV, dtype=_dtype(device)).to(device)
    out, _ = hf_dmattn.attention_forward(module, q, k, v, pad, scaling=0.3, attention_bias=bias)
    expected = _direct(q, k, v, mask=pad.bool()[:, None, None, :], bias=bias, causal=True, scale=0.3)
    assert torch.equal(out, expected)


def test_is_causal_flag_and_kwarg(device):
    q, k, v = _hf_qkv(B, H, HKV, SQ, SQ, D, _dtype(device), device)
    causal = _direct(q, k, v, causal=True)
    full = _direct(q, k, v)
    mod_causal = TinyAttention(H, HKV, is_causal=True, dtype=_dtype(device)).to(device)
    mod_full = TinyAttention(H, HKV, is_causal=False, dtype=_dtype(device)).to(device)
    f = hf_dmattn.attention_forward
    assert torch.equal(f(mod_causal, q, k, v, None)[0], causal)
    assert torch.equal(f(mod_full, q, k, v, None)[0], full)
    assert torch.equal(f(mod_causal, q, k, v, None, is_causal=False)[0], full)  # the kwarg wins
    assert torch.equal(f(mod_full, q, k, v, None, is_causal=True)[0], causal)
    # A 4D mask already holds the pattern: is_causal does not apply on top of it.
    ones = torch.ones(B, 1, SQ, SQ, dtype=torch.bool, device=device)
    assert torch.equal(f(mod_causal, q, k, v, ones)[0], full)


def test_causal_without_mask_drops_empty_static_cache_slots(device):
    # HF's sdpa mask is None for a prefill into an empty static cache (Sk > Sq); the keys past
    # Sq are empty slots and sdpa's top-left causal never reads them.
    q, k, v = _hf_qkv(B, H, HKV, 4, 7, D, _dtype(device), device)
    k[:, :, 4:] = float("nan")
    v[:, :, 4:] = float("nan")
    module = TinyAttention(H, HKV, dtype=_dtype(device)).to(device)
    out, _ = hf_dmattn.attention_forward(module, q, k, v, None)
    expected = _direct(q, k[:, :, :4], v[:, :, :4], causal=True)
    assert torch.equal(out, expected)


def test_softcap_and_scaling(device):
    q, k, v = _hf_qkv(B, H, HKV, SQ, SK, D, _dtype(device), device)
    module = TinyAttention(H, HKV, is_causal=False, dtype=_dtype(device)).to(device)
    out, _ = hf_dmattn.attention_forward(module, q, k, v, None, scaling=0.7, softcap=2.0)
    assert torch.equal(out, _direct(q, k, v, scale=0.7, softcap=2.0))


def test_dropout_in_training_is_not_implemented(device):
    q, k, v = _hf_qkv(B, H, HKV, SQ, SK, D, _dtype(device), device)
    module = TinyAttention(H, HKV, dtype=_dtype(device)).to(device)
    with pytest.raises(NotImplementedError, match="dropout"):
        hf_dmattn.attention_forward(module.train(), q, k, v, None, dropout=0.1)
    hf_dmattn.attention_forward(module.train(), q, k, v, None, dropout=0.0)
    hf_dmattn.attention_forward(module.eval(), q, k, v, None, dropout=0.1)  # eval: no dropout


def test_input_dtypes(device):
    q, k, v = _hf_qkv(B, H, HKV, SQ, SQ, D, torch.float32, device)
    module = TinyAttention(H, HKV).to(device)
    out, _ = hf_dmattn.attention_forward(module, q, k, v, None)
    if device == "cpu":  # CPU computes fp32 as is
        assert out.dtype == torch.float32
        assert torch.equal(out, _direct(q, k, v, causal=True))
        return
    # CUDA: an fp32 model computes in bf16 and gets fp32 back; half-precision weights set
    # the compute dtype, and the output stays in it for the module's projections.
    ref = _direct(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert out.dtype == torch.float32 and torch.equal(out, ref.float())
    module_fp16 = TinyAttention(H, HKV, dtype=torch.float16).to(device)
    out16, _ = hf_dmattn.attention_forward(module_fp16, q, k, v, None)
    assert out16.dtype == torch.float16
    assert torch.equal(out16, _direct(q.half(), k.half(), v.half(), causal=True))


# --------------------------------------------------------------------------- attention_bias, keep


def test_attention_bias_and_keep_window_size(device):
    dtype = _dtype(device)
    q, k, v = _hf_qkv(B, H, HKV, SQ, SK, D, dtype, device)
    module = TinyAttention(H, HKV, dtype=dtype).to(device)
    mask = (torch.rand(B, 1, SQ, SK) < 0.8).to(device)
    bias = torch.randn(B, H, 1, SK, device=device, requires_grad=True)  # fp32, learnable
    out, _ = hf_dmattn.attention_forward(module, q, k, v, mask, attention_bias=bias, keep_window_size=4)
    grad_out = torch.randn_like(out)
    (dbias,) = torch.autograd.grad(out, bias, grad_out)
    ql, kl, vl = (x.transpose(1, 2) for x in (q, k, v))
    expected = dmattn.attention_topk(ql, kl, vl, bias, 4, mask=mask)
    (expected_dbias,) = torch.autograd.grad(expected, bias, grad_out)
    assert torch.equal(out, expected)
    assert torch.equal(dbias, expected_dbias) and dbias.shape == bias.shape
    assert dbias.abs().sum() > 0
    # keep_window_size >= Sk keeps everything: the plain biased attention.
    out_all, _ = hf_dmattn.attention_forward(module, q, k, v, mask, attention_bias=bias,
                                             keep_window_size=SK)
    assert torch.equal(out_all, _direct(q, k, v, mask=mask, bias=bias))
    with pytest.raises(ValueError, match="keep_window_size: needs attention_bias"):
        hf_dmattn.attention_forward(module, q, k, v, mask, keep_window_size=4)
    with pytest.raises(ValueError, match="keep: "):
        hf_dmattn.attention_forward(module, q, k, v, mask, attention_bias=bias, keep_window_size=0)


def test_bias_sources_combine(device):
    dtype = _dtype(device)
    q, k, v = _hf_qkv(B, H, HKV, SQ, SK, D, dtype, device)
    module = TinyAttention(H, HKV, dtype=dtype).to(device)
    allowed = (torch.rand(B, 1, SQ, SK) < 0.8).to(device)
    additive = torch.randn(B, 1, SQ, SK).to(dtype).to(device)
    float_mask = torch.where(allowed, additive, float("-inf"))
    bias = torch.randn(B, HKV, 1, SK).half().to(device)  # neither q's dtype nor fp32: cast
    out, _ = hf_dmattn.attention_forward(module, q, k, v, float_mask, attention_bias=bias)
    expected = _direct(q, k, v, mask=allowed, bias=(bias + additive).to(dtype))
    torch.testing.assert_close(out, expected, **_tol(device))


def test_float_mask_with_keep_window_size(device):
    """A float mask is a bias with -inf where masked: selecting from it keeps the same keys as
    selecting among the allowed ones, and its gradient reaches the mask's values."""
    dtype = _dtype(device)
    q, k, v = _hf_qkv(B, H, HKV, SQ, SK, D, dtype, device)
    module = TinyAttention(H, HKV, dtype=dtype).to(device)
    allowed = (torch.rand(B, 1, SQ, SK) < 0.7).to(device)
    values = torch.randn(B, H, 1, SK).to(dtype).to(device)
    float_mask = torch.where(allowed, values, torch.finfo(dtype).min).requires_grad_(True)
    out, _ = hf_dmattn.attention_forward(module, q, k, v, float_mask, keep_window_size=3,
                                         attention_bias=torch.zeros(1, device=device, dtype=dtype))
    expected = dmattn.attention_topk(*(x.transpose(1, 2) for x in (q, k, v)), values, 3, mask=allowed)
    torch.testing.assert_close(out, expected, **_tol(device))
    (grad,) = torch.autograd.grad(out.sum(), float_mask)
    assert torch.isfinite(grad).all() and grad[~allowed.expand_as(grad)].abs().sum() == 0


@pytest.mark.parametrize("mask_kind", ["float_4d", "padding_2d"])
def test_masks_trace_without_graph_breaks(mask_kind):
    """No host read of a float mask; a 2D padding mask takes the dense key-mask path when
    compiled (packing needs the lengths on the host) and gives the same real rows."""
    q, k, v = _hf_qkv(B, H, HKV, SQ, SQ, D, torch.float32, "cpu")
    module = TinyAttention(H, HKV)
    if mask_kind == "float_4d":
        allowed = torch.ones(SQ, SQ, dtype=torch.bool).tril().expand(B, 1, SQ, SQ)
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        real = torch.ones(B, SQ, dtype=torch.bool)
    else:
        mask = torch.ones(B, SQ, dtype=torch.long)
        mask[1, :2] = 0
        real = mask.bool()

    def call(q_, k_, v_, mask_):
        return hf_dmattn.attention_forward(module, q_, k_, v_, mask_, scaling=0.3)[0]

    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(call)(q, k, v, mask)
        compiled = torch.compile(call, backend="eager", fullgraph=True)(q, k, v, mask)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    torch.testing.assert_close(compiled[real], call(q, k, v, mask)[real], atol=1e-5, rtol=1e-5)


def test_padding_2d_without_host_reads_stays_dense(monkeypatch):
    """Where the host may not read a tensor (a CUDA graph being captured; torch.compile: the test
    above) a 2D padding mask runs the dense key-mask path, not the packed one, and gives the
    same real rows."""
    q, k, v = _hf_qkv(B, H, HKV, SQ, SQ, D, torch.float32, "cpu")
    module = TinyAttention(H, HKV)
    mask = torch.ones(B, SQ, dtype=torch.long)
    mask[1, :2] = 0
    real = mask.bool()
    packed = hf_dmattn.attention_forward(module, q, k, v, mask, scaling=0.3)[0]

    def refuse(*args, **kwargs):
        raise AssertionError("packed although the host may not read the lengths")

    monkeypatch.setattr(hf_dmattn, "host_reads_allowed", lambda t: False)
    monkeypatch.setattr(hf_dmattn, "padded_attention", refuse)
    dense = hf_dmattn.attention_forward(module, q, k, v, mask, scaling=0.3)[0]
    torch.testing.assert_close(dense[real], packed[real], atol=1e-5, rtol=1e-5)


def test_unsupported_kwargs(device):
    q, k, v = _hf_qkv(B, H, HKV, SQ, SQ, D, _dtype(device), device)
    module = TinyAttention(H, HKV, dtype=_dtype(device)).to(device)
    for name in ("s_aux", "position_bias"):
        with pytest.raises(NotImplementedError, match=name):
            hf_dmattn.attention_forward(module, q, k, v, None, **{name: torch.zeros(H, device=device)})


def test_attention_mask_errors():
    q, k, v = _hf_qkv(1, 2, 2, 3, 3, 8, torch.float32, "cpu")
    module = TinyAttention(2, 2)
    with pytest.raises(ValueError, match="attention_mask: .*2D .*4D"):
        hf_dmattn.attention_forward(module, q, k, v, torch.ones(1, 3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask: "):
        hf_dmattn.attention_forward(module, q, k, v, torch.ones(1, 1, 3, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="attention_mask: "):
        hf_dmattn.attention_forward(module, q, k, v, "causal")


# --------------------------------------------------------------------------- against HF itself


@needs_transformers
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_matches_hf_sdpa_function(device, mask_kind):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = _dtype(device)
    q, k, v = _hf_qkv(B, H, HKV, SQ, SQ, D, dtype, device)
    module = TinyAttention(H, HKV, dtype=dtype).to(device)
    allowed = torch.ones(SQ, SQ, dtype=torch.bool).tril().expand(B, 1, SQ, SQ).clone()
    allowed[1, :, :, :2] = False  # left padding of sequence 1
    allowed = allowed.to(device)
    mask = {"none": None, "bool": allowed,
            "float": torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)}[mask_kind]
    ours, _ = hf_dmattn.attention_forward(module, q, k, v, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    rows = allowed.any(-1)[:, 0]  # (B, Sq): fully padded query rows differ by convention
    torch.testing.assert_close(ours[rows], theirs[rows], **_tol(device))


def _tiny_model(name, device):
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:  # Doge: dynamic masks built from the values, handed over as a float mask
        model = transformers.DogeForCausalLM(transformers.DogeConfig(keep_window_size=5, is_moe=False, **common))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".A"):  # zero at init: make the dynamic bias non-trivial
                    p.normal_()
    return model.to(device=device, dtype=_dtype(device)).eval()


@needs_transformers
@pytest.mark.parametrize("name", ["llama", "doge"])
def test_tiny_model_matches_sdpa(device, name):
    hf_dmattn.register()
    model = _tiny_model(name, device)
    # Distinct tokens: Doge's first-layer dt_states tie for a repeated token, and HF's torch.topk
    # orders ties arbitrarily where dmattn keeps the lower key index (test_hf_doge.py).
    ids = torch.stack([torch.randperm(64)[:12] for _ in range(2)]).to(device)
    pad = torch.ones(2, 12, dtype=torch.long, device=device)
    pad[1, :3] = 0
    logits = {}
    for impl in ("sdpa", "dmattn"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(input_ids=ids, attention_mask=pad).logits
    keep = pad.bool()
    torch.testing.assert_close(logits["dmattn"][keep], logits["sdpa"][keep], **_tol(device))
    if name == "llama":  # decoding with a KV cache (Sq = 1 after the prefill)
        tokens = {}
        for impl in ("sdpa", "dmattn"):
            model.set_attn_implementation(impl)
            tokens[impl] = model.generate(input_ids=ids, attention_mask=pad, max_new_tokens=3,
                                          do_sample=False, pad_token_id=0)
        if device == "cpu":
            assert torch.equal(tokens["dmattn"], tokens["sdpa"])
    model.set_attn_implementation("dmattn")
    model.zero_grad()
    model.train()
    model(input_ids=ids, attention_mask=pad, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), n


def test_padded_attention_refuses_a_bias_with_a_query_dimension(device):
    """The packed layout has only key-side biases: any other shape is named in the error."""
    from dmattn.integrations.padding import padded_attention

    q, k, v = (t.transpose(1, 2) for t in _hf_qkv(B, H, HKV, SQ, SK, D, _dtype(device), device))
    real = _padding("left", device).bool()
    bias = torch.zeros(B, H, SQ, SK, dtype=_dtype(device), device=device)
    with pytest.raises(ValueError, match=r"bias: expected a bias without a query dimension"):
        padded_attention(q, k, v, real, bias, causal=True)


def _padding_of(side, batch, length, device):
    """A 2D padding mask (batch, length): row 0 whole, row b padded by 3 * b tokens on the side."""
    pad = torch.ones(batch, length, dtype=torch.long, device=device)
    for b in range(1, batch):
        if side == "left":
            pad[b, :3 * b] = 0
        else:
            pad[b, length - 3 * b:] = 0
    return pad


@needs_transformers
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_rows_same_on_both_caches(side, monkeypatch):
    """A padded batch's forward (float32, CPU): dmattn gives every logit row the same on the dynamic
    cache (2D padding mask: the packed path) and the static cache (4D mask: the dense path); the
    real rows are eager's and sdpa's; a padded row after its sequence's last token (right padding)
    sees the whole sequence, as under eager and sdpa; a padded row before the first token (left
    padding) has no key: attention 0 on both caches, as sdpa gives (eager averages the values of
    every key slot there, so its rows depend on the slot count and are not compared)."""
    hf_dmattn.register()
    model = _tiny_model("llama", "cpu")
    ids = torch.randint(1, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    pad = _padding_of(side, 3, 10, "cpu")
    real = pad.bool()
    packed_calls = []
    packed = hf_dmattn.padded_attention
    monkeypatch.setattr(hf_dmattn, "padded_attention", lambda *a, **kw: packed_calls.append(1) or packed(*a, **kw))
    # (transformers 5.x names the cache argument `cache`, earlier versions `past_key_values`)
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits, packed_by_run = {}, {}
    for impl in ("eager", "sdpa", "dmattn"):
        model.set_attn_implementation(impl)
        for cache in ("dynamic", "static"):
            static = transformers.StaticCache(config=model.config, max_cache_len=16) if cache == "static" else None
            before = len(packed_calls)
            with torch.no_grad():
                logits[impl, cache] = model(input_ids=ids, attention_mask=pad, use_cache=True,
                                            **{cache_kwarg: static}).logits
            packed_by_run[impl, cache] = len(packed_calls) - before
    assert packed_by_run["dmattn", "dynamic"] == model.config.num_hidden_layers  # every layer packed
    assert packed_by_run["dmattn", "static"] == 0  # the 4D mask: dense
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["dmattn", "dynamic"], logits["dmattn", "static"], **tol)
    for key, value in logits.items():
        torch.testing.assert_close(value[real], logits["eager", "dynamic"][real], **tol, msg=str(key))
    padded = ~real
    for cache in ("dynamic", "static"):
        torch.testing.assert_close(logits["dmattn", cache][padded], logits["sdpa", cache][padded], **tol)
        if side == "right":
            torch.testing.assert_close(logits["dmattn", cache][padded], logits["eager", cache][padded], **tol)


def _padded_runs(device, side, impls=("eager", "sdpa", "dmattn"), monkeypatch=None):
    """Greedy generate() of a tiny Llama on a padded prompt, each implementation on the dynamic cache
    (dmattn: the 2D padding mask, packed rows; decoding steps on the decode kernel on CUDA) and on
    the static cache (dmattn: sdpa's 4D mask, the dense path). Right padding is the case
    transformers warns about: the next token comes from the last padded row, which attends to the
    whole prompt under eager's and sdpa's 4D mask. With monkeypatch, also how many packed calls
    each run made: {(impl, cache): count}."""
    hf_dmattn.register()
    model = _tiny_model("llama", device)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    ids = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(s))[:12] for s in range(2)])
    ids = ids.to(device)
    pad = _padding_of(side, 2, 12, device)
    packed_calls = []
    if monkeypatch is not None:
        packed = hf_dmattn.padded_attention
        monkeypatch.setattr(hf_dmattn, "padded_attention",
                            lambda *a, **kw: packed_calls.append(1) or packed(*a, **kw))
    runs, packed_by_run = {}, {}
    for impl in impls:
        model.set_attn_implementation(impl)
        for cache in ("dynamic", "static"):
            extra = dict(cache_implementation="static", disable_compile=True) if cache == "static" else {}
            before = len(packed_calls)
            runs[impl, cache] = model.generate(input_ids=ids, attention_mask=pad, max_new_tokens=6,
                                               do_sample=False, pad_token_id=0, output_scores=True,
                                               return_dict_in_generate=True, **extra)
            packed_by_run[impl, cache] = len(packed_calls) - before
    return runs, packed_by_run


@needs_transformers
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_prompt_same_on_both_caches(side, monkeypatch):
    """Greedy generate() on a right- or left-padded prompt (float32, CPU): dmattn's dynamic cache
    (packed prefill) and static cache (dense prefill) give the same tokens as each other and as
    eager and sdpa on either cache, with eager's logits at every step."""
    runs, packed = _padded_runs("cpu", side, monkeypatch=monkeypatch)
    assert packed["dmattn", "dynamic"] > 0 and packed["dmattn", "static"] == 0
    reference = runs["eager", "dynamic"]
    for key, run in runs.items():
        assert torch.equal(run.sequences, reference.sequences), key
        for step, (ours, theirs) in enumerate(zip(run.scores, reference.scores)):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=f"{key}, step {step}")


@needs_transformers
@pytest.mark.gpu
def test_gpu_right_padded_prompt_same_on_both_caches():
    """On CUDA (bf16) both caches give sdpa's greedy tokens and each other's, up to near ties of
    bf16 rounding."""
    runs, _ = _padded_runs("cuda", "right", impls=("sdpa", "dmattn"))
    reference = runs["sdpa", "dynamic"]
    for key in (("dmattn", "dynamic"), ("dmattn", "static")):
        _assert_same_tokens_but_near_ties(reference, runs[key], prompt=12)
    _assert_same_tokens_but_near_ties(runs["dmattn", "dynamic"], runs["dmattn", "static"], prompt=12)


@needs_transformers
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "doge"])
@pytest.mark.parametrize("left_pad", [False, True])
def test_gpu_generate_matches_eager(name, left_pad, monkeypatch):
    """Greedy generate() on CUDA (bf16) gives eager's tokens; decoding steps run on the decode
    kernel (Llama: the attention function's decode_step; Doge without padding: the kept keys read
    in place, attention_topk's decoding form; Doge with padding selects among the real keys on
    the general path).
    The output layer is scaled up so that greedy choices are not near ties; where eager's top two
    logits are closer than the two paths' rounding can separate, the sequences may part, and the
    rest of that row is not compared."""
    from dmattn import decode

    hf_dmattn.register()
    model = _tiny_model(name, "cuda")
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    ids = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(s))[:12] for s in range(2)]).cuda()
    pad = torch.ones(2, 12, dtype=torch.long, device="cuda")
    if left_pad:
        pad[1, :3] = 0
    from dmattn import topk

    runs = []
    run_decode = decode._run_decode
    monkeypatch.setattr(decode, "_run_decode", lambda *a, **kw: runs.append(1) or run_decode(*a, **kw))
    # (Doge's steps: the kept keys on the decode kernel wherever it has a split count for them,
    # in one native call that also selects, or through _run_decode.)
    splits_of = topk.gathered_decode_splits

    def counted_splits(*a):
        splits = splits_of(*a)
        if splits:
            runs.append(1)
        return splits

    monkeypatch.setattr(topk, "gathered_decode_splits", counted_splits)
    result = {}
    for impl in ("eager", "dmattn"):
        model.set_attn_implementation(impl)
        result[impl] = model.generate(input_ids=ids, attention_mask=pad, max_new_tokens=8, do_sample=False,
                                      pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    if not (name == "doge" and left_pad):  # (Doge with a padding mask: the general kernels)
        assert runs, "no decoding step ran on the decode kernel"
    _assert_same_tokens_but_near_ties(result["eager"], result["dmattn"], prompt=12)


def _assert_same_tokens_but_near_ties(reference_run, our_run, prompt):
    """Greedy tokens equal to the reference's, a row compared up to the first step where the
    reference's top two logits lie closer (< 0.1) than two summation orders can separate."""
    expected, ours = reference_run.sequences[:, prompt:], our_run.sequences[:, prompt:]
    for b in range(expected.shape[0]):
        for t in range(expected.shape[1]):
            if expected[b, t] == ours[b, t]:
                continue
            top2 = reference_run.scores[t][b].float().topk(2).values
            assert top2[0] - top2[1] < 0.1, f"row {b} step {t}: {ours[b].tolist()} != {expected[b].tolist()}"
            break


@needs_transformers
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "doge"])
def test_gpu_generate_static_cache(name, monkeypatch):
    """Greedy generate() with a StaticCache, whose decoding steps transformers compiles
    (torch.compile, here fullgraph, CUDA graphs): the compiled steps run on the decode kernel
    (the cache's unused slots masked; Doge's static-cache mask takes HF's own forward, its float
    mask the bias) and give sdpa's tokens, sdpa's steps compiled the same way. (sdpa, not eager:
    eager rounds the scores and, for Doge, the dt_states added to them to bf16, which parts its
    greedy choices from both fp32 softmax paths at gaps of ~0.1.) Doge keeps every key here
    (keep_window_size above the cache): its hard top-k of bf16 dt_states turns a rounding
    difference in an earlier layer into a different kept key, and the sequences part for that
    reason alone; the selection itself is tested on the dynamic cache above."""
    from dmattn import decode

    hf_dmattn.register()
    model = _tiny_model(name, "cuda")
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    if name == "doge":
        for layer in model.model.layers:
            layer.self_attn.keep_window_size = 64
    ids = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(s))[:12] for s in range(2)]).cuda()
    pad = torch.ones(2, 12, dtype=torch.long, device="cuda")
    runs = []
    run_decode = decode._run_decode
    monkeypatch.setattr(decode, "_run_decode", lambda *a, **kw: runs.append(1) or run_decode(*a, **kw))
    torch._dynamo.reset()
    result = {}
    for impl in ("sdpa", "dmattn"):
        model.set_attn_implementation(impl)
        result[impl] = model.generate(
            input_ids=ids, attention_mask=pad, max_new_tokens=8, do_sample=False, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True, cache_implementation="static",
            compile_config=transformers.CompileConfig(fullgraph=True))
    assert runs, "no decoding step ran on the decode kernel"
    _assert_same_tokens_but_near_ties(result["sdpa"], result["dmattn"], prompt=12)
