"""attention_topk's inference form (topk._inference_forward): with no gradient to record, a
shared key set on CUDA runs the selection and the forward kernel directly, without the general
path's layers. Its results must be the general path's bit for bit (the same kernels and
arguments), except for one query (a decoding step), which runs on the decode kernel and is
checked against the float64 reference; every other form must still reach the general path."""

import pytest
import torch

import dmattn
from dmattn import gather, topk
from reference import check_against_reference

CUDA = torch.cuda.is_available()


def _inputs(gen, *, batch=2, sq=333, sk=1000, heads=4, heads_kv=2, d=128, dtype=torch.bfloat16,
            bias_rows=(2, 2), bias_dtype=None):
    q = torch.randn(batch, sq, heads, d, generator=gen).to("cuda", dtype)
    k = torch.randn(batch, sk, heads_kv, d, generator=gen).to("cuda", dtype)
    v = torch.randn(batch, sk, heads_kv, d, generator=gen).to("cuda", dtype)
    bias = torch.randn(*bias_rows, 1, sk, generator=gen).to("cuda", bias_dtype or dtype)
    return q, k, v, bias


def _general(q, k, v, bias, keep, **kw):
    """The same call through the general path: with a path forced (which leaves both native
    forms), a bias that requires grad takes the autograd node (gather._DistinctRowsAttention),
    whose forward runs the same kernels."""
    bias = bias.detach().requires_grad_()
    with torch.enable_grad(), gather.force_path("gather"):
        out, lse = dmattn.attention_topk(q, k, v, bias, keep, return_lse=True, **kw)
    return out.detach(), lse


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("form", ["plain", "gqa_bias_per_kv_head", "batch_broadcast_bias", "fp32_bias", "fp16",
                                  "options", "d64", "unaligned_q", "many_query_tiles"])
@pytest.mark.parametrize("route", ["one_native_call", "two_native_calls"])
def test_inference_form_equals_the_general_path(form, route, nan_poison, monkeypatch):
    """Both of its routes: one native call that allocates through torch (topk_attention), and
    the selection and forward called in turn from Python (a torch that lends no allocator to
    the native side, or a q / k / v the kernels need copied: unaligned_q)."""
    gen = torch.Generator().manual_seed(len(form))
    kw = dict(causal=True)
    args = {}
    if form == "gqa_bias_per_kv_head":
        args = dict(heads=8, heads_kv=2, bias_rows=(2, 2))
    elif form == "batch_broadcast_bias":
        args = dict(bias_rows=(1, 1))
    elif form == "fp32_bias":
        args = dict(bias_dtype=torch.float32)
    elif form == "fp16":
        args = dict(dtype=torch.float16)
    elif form == "options":
        kw = dict(causal=False, window=(300, 40), scale=0.05, softcap=20.0)
    elif form == "d64":
        args = dict(d=64, sq=700)
    elif form == "many_query_tiles":  # every tile reads every kept row, 2048 query rows per kv head: from a copy
        args = dict(sq=1100, heads=8, heads_kv=2)
        kw = dict(causal=False)
    q, k, v, bias = _inputs(gen, **args)
    if form == "unaligned_q":  # 8 bytes past a 16-byte boundary: the kernels take a copy
        q = torch.cat([torch.zeros_like(q[..., :4]), q], dim=-1)[..., 4:]
        assert q.data_ptr() % 16 == 8
    keep = 257
    ref_out, ref_lse = _general(q, k, v, bias, keep, **kw)

    # The inference form must be the one taken: the general path's selection is made to fail;
    # so must the route expected.
    def not_expected(*a, **k):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(gather, "topk_key_set", not_expected)
    if route == "two_native_calls":
        monkeypatch.setattr(topk, "native_allocates", lambda: False)
    elif form != "unaligned_q":
        if not topk.native_allocates():
            pytest.skip("this torch lends no allocator to the native side")
        monkeypatch.setattr(topk, "select_topk_positions", not_expected)
    with torch.no_grad():
        out, lse = dmattn.attention_topk(q, k, v, bias, keep, return_lse=True, **kw)
    only_out = dmattn.attention_topk(q, k, v, bias, keep, **kw)  # (grad mode on, nothing requires grad)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(only_out, ref_out)
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_other_forms_take_the_general_path():
    gen = torch.Generator().manual_seed(0)
    q, k, v, bias = _inputs(gen)
    keep = 100
    assert topk._inference_forward(q, k, v, bias, keep, True, (-1, -1), None, 0.0) is not None
    cases = {
        "grad": (q, k, v, bias.clone().requires_grad_(), keep),
        "all keys kept": (q, k, v, bias, k.shape[1]),
        "bias per query head (H != Hkv)": (q, k, v, torch.randn(2, 4, 1, 1000, device="cuda", dtype=q.dtype), keep),
        "bias per query": (q, k, v, torch.randn(2, 2, 5, 1000, device="cuda", dtype=q.dtype), keep),
        "float64 bias": (q, k, v, bias.double(), keep),
        "strided head dim": (q[..., ::2], k[..., ::2], v[..., ::2], bias, keep),
        "cpu": (q.cpu(), k.cpu(), v.cpu(), bias.cpu(), keep),
    }
    for name, (qq, kk, vv, bb, kp) in cases.items():
        assert topk._inference_forward(qq, kk, vv, bb, kp, True, (-1, -1), None, 0.0) is None, name
    with gather.force_path("dense"):
        assert topk._inference_forward(q, k, v, bias, keep, True, (-1, -1), None, 0.0) is None


def test_inference_form_is_cuda_only():
    """(CPU tensors never take it; the CPU backend's general path is tested elsewhere.)"""
    q = torch.randn(1, 8, 2, 16)
    bias = torch.randn(1, 2, 1, 8)
    assert topk._inference_forward(q, q, q, bias, 3, False, (-1, -1), None, 0.0) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("form", ["plain", "per_query", "hf_cache_layout", "gqa_bias_per_kv_head",
                                  "batch_broadcast_bias", "head_broadcast_bias", "fp32_bias", "fp16", "options",
                                  "d64", "d256", "one_kv_head"])
def test_one_query_runs_on_the_decode_kernel(form, nan_poison, monkeypatch):
    """One query (a decoding step) in the inference form: the kept keys read in place by the
    decode kernel (the query heads of a kv head in one tile), against the float64 reference of
    attention with the selection as a mask; through both routes: the selection and the decode
    kernel called in turn from Python (decode_kernel.gathered_decode) and, where torch lends its
    allocator to the native side, one native call (topk_attention), whose result must be the
    other's bit for bit (the same kernels, the same split count)."""
    from dmattn import decode_kernel

    gen = torch.Generator().manual_seed(len(form))
    kw = dict(causal=True)
    args = dict(sq=1, sk=3001)
    if form == "per_query":
        kw["per_query"] = True
    elif form == "gqa_bias_per_kv_head":
        args.update(heads=8, heads_kv=2, bias_rows=(2, 2))
    elif form == "batch_broadcast_bias":
        args.update(bias_rows=(1, 1))
    elif form == "head_broadcast_bias":
        args.update(bias_rows=(2, 1))
    elif form == "fp32_bias":
        args.update(bias_dtype=torch.float32)
    elif form == "fp16":
        args.update(dtype=torch.float16)
    elif form == "options":
        kw = dict(causal=False, window=(-1, 40), scale=0.05, softcap=20.0)
    elif form in ("d64", "d256"):
        args.update(d=int(form[1:]))
    elif form == "one_kv_head":
        args.update(heads=8, heads_kv=1, bias_rows=(2, 1))
    q, k, v, bias = _inputs(gen, **args)
    if form == "hf_cache_layout":  # transformers' caches: (B, Hkv, Sk, D), seen as (B, Sk, Hkv, D)
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    keep = 700
    calls = []
    run_decode = decode_kernel._run_decode

    def counted(*a, **kwargs):
        calls.append(kwargs.get("key_positions"))
        return run_decode(*a, **kwargs)

    monkeypatch.setattr(decode_kernel, "_run_decode", counted)
    monkeypatch.setattr(topk, "native_allocates", lambda: False)
    with torch.no_grad():
        out, lse = dmattn.attention_topk(q, k, v, bias, keep, return_lse=True, **kw)
    assert len(calls) == 1 and calls[0] is not None, "the decode kernel did not read the kept keys in place"
    monkeypatch.undo()
    per_query = kw.pop("per_query", None)
    check_against_reference(q, k, v, dmattn.dynamic_mask(bias, keep), bias, out, lse, context=form, **kw)

    if not topk.native_allocates():
        return
    monkeypatch.setattr(topk, "select_topk_positions", lambda *a: pytest.fail("the two-call route ran"))
    if per_query:
        kw["per_query"] = True
    with torch.no_grad():
        one_out, one_lse = dmattn.attention_topk(q, k, v, bias, keep, return_lse=True, **kw)
        only_out = dmattn.attention_topk(q, k, v, bias, keep, **kw)  # lse in the workspace's tail
    assert torch.equal(one_out, out) and torch.equal(one_lse, lse), form
    assert torch.equal(only_out, out), form


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_one_query_with_a_left_window_takes_the_general_kernels(monkeypatch):
    """A left window makes the kept keys' positions matter: not the decode kernel's case."""
    from dmattn import decode_kernel

    q, k, v, bias = _inputs(torch.Generator().manual_seed(3), sq=1, sk=2000)
    monkeypatch.setattr(decode_kernel, "_run_decode", lambda *a: pytest.fail("the decode kernel ran"))
    with torch.no_grad():
        out, lse = dmattn.attention_topk(q, k, v, bias, 300, causal=True, window=(900, 0), return_lse=True)
    check_against_reference(q, k, v, dmattn.dynamic_mask(bias, 300), bias, out, lse, causal=True, window=(900, 0))


def test_native_call_names_bad_arguments():
    """topk_attention (the one-call route), topk_attention_backward (the training form's) and
    scatter_key_rows name the argument at fault, as the rest of the native validation does; CPU
    tensors are refused by the selection and the scatter (CUDA only)."""
    from dmattn._lib import lib
    q = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    bias = torch.randn(1, 2, 1, 8, dtype=torch.bfloat16)
    nan = float("nan")
    with pytest.raises(ValueError, match="^q: expected a 4-D tensor"):
        lib().topk_attention(q[0], q, q, bias, 3, None, False, -1, -1, nan, 0.0, 0)
    with pytest.raises(ValueError, match="^k: expected a 4-D tensor"):
        lib().topk_attention(q, q[0], q, bias, 3, None, False, -1, -1, nan, 0.0, 0)
    with pytest.raises(ValueError, match=r"^bias: expected a key-side bias \(rows_b, rows_h, 1, Sk\)"):
        lib().topk_attention(q, q, q, bias[:, :, 0], 3, None, False, -1, -1, nan, 0.0, 0)
    with pytest.raises((ValueError, RuntimeError), match="^bias: "):
        lib().topk_attention(q, q, q, bias, 3, None, False, -1, -1, nan, 0.0, 0)
    # (the training form's call: the same native body, its lse allocated too)
    with pytest.raises(ValueError, match="^q: expected a 4-D tensor"):
        lib().topk_attention_training(q[0], q, q, bias, 3, False, -1, -1, nan, 0.0)
    with pytest.raises(ValueError, match="^k: expected a 4-D tensor"):
        lib().topk_attention_training(q, q[0], q, bias, 3, False, -1, -1, nan, 0.0)
    with pytest.raises(ValueError, match=r"^bias: expected a key-side bias \(rows_b, rows_h, 1, Sk\)"):
        lib().topk_attention_training(q, q, q, bias[:, :, 0], 3, False, -1, -1, nan, 0.0)
    with pytest.raises((ValueError, RuntimeError), match="^bias: "):
        lib().topk_attention_training(q, q, q, bias, 3, False, -1, -1, nan, 0.0)
    positions = torch.zeros(1, 2, 3, dtype=torch.int32)
    kept = torch.zeros(1, 2, 1, 3, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)

    def backward(q_, k_, positions_, kept_):
        lib().topk_attention_backward(q, q_, k_, q, q, lse, positions_, kept_, False, -1, -1, nan, 0.0, q, q, q, None)

    with pytest.raises(ValueError, match="^q: expected a 4-D tensor"):
        backward(q[0], q, positions, kept)
    with pytest.raises(ValueError, match="^k: expected a 4-D tensor"):
        backward(q, q[0], positions, kept)
    with pytest.raises(ValueError, match=r"^positions, kept_bias: expected \(rows_b, rows_h, K\)"):
        backward(q, q, positions[0], kept)
    rows = torch.zeros(1, 3, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^dk_rows: expected a CUDA tensor"):  # (the scatter's glue is CUDA only)
        lib().scatter_key_rows(rows, rows, positions[:1, :1], q, q, None, None)
