"""attention_topk's training form (topk._training_forward): with a gradient to record, a shared
key set on CUDA runs as one autograd node over two native calls (the selection and the forward;
the backward and the scatter of dK, dV, dbias to full size). Its results must be the general
path's (gather._DistinctRowsAttention, the same kernels and arguments): the output, lse, dK, dV
and a per-(batch, head) dbias bit for bit; dQ, and a dbias reduced over batch or heads, up to
the order of their atomic additions. Every other form must still reach the general path."""

import pytest
import torch

import dmattn
from dmattn import gather, topk
from dmattn.masks import dynamic_mask
from reference import check_against_reference

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]

FORMS = {
    "plain": {},
    "non_causal": dict(kw=dict(causal=False)),
    "gqa_bias_per_kv_head": dict(heads=8, heads_kv=2, bias_rows=(2, 2)),
    "gqa_bias_shared": dict(heads=8, heads_kv=2, bias_rows=(2, 1)),
    "batch_broadcast_bias": dict(bias_rows=(1, 2)),
    "fp32_bias": dict(bias_dtype=torch.float32),
    "fp16": dict(dtype=torch.float16),
    "options": dict(kw=dict(causal=False, window=(300, 40), scale=0.05, softcap=20.0)),
    "d64": dict(d=64, sq=700),
    "d256": dict(d=256, sq=300, sk=600),
    # no causal mask or window, 2048 query rows per kv head and more: the forward reads the kept
    # rows from a gathered copy
    "many_query_tiles": dict(sq=1100, heads=8, heads_kv=2, bias_rows=(2, 2), kw=dict(causal=False)),
    "many_query_tiles_options": dict(sq=2100, heads=2, heads_kv=2, bias_rows=(1, 2),
                                     kw=dict(causal=False, scale=0.05, softcap=20.0)),
}


def _inputs(gen, *, batch=2, sq=333, sk=1000, heads=4, heads_kv=2, d=128, dtype=torch.bfloat16, bias_rows=(2, 2),
            bias_dtype=None, kw=None):
    q = torch.randn(batch, sq, heads, d, generator=gen).to("cuda", dtype)
    k = torch.randn(batch, sk, heads_kv, d, generator=gen).to("cuda", dtype)
    v = torch.randn(batch, sk, heads_kv, d, generator=gen).to("cuda", dtype)
    bias = torch.randn(*bias_rows, 1, sk, generator=gen).to("cuda", bias_dtype or dtype)
    dout = torch.randn(batch, sq, heads, d, generator=gen).to("cuda", dtype)
    return (q, k, v, bias), dout, dict(causal=True) if kw is None else kw


def _step(inputs, dout, keep, kw, wants=(True, True, True, True)):
    """(out, lse, dq, dk, dv, dbias) of one attention_topk forward + backward; the inputs that
    ``wants`` leaves out do not require grad (their gradient: None)."""
    leaves = [t.detach().requires_grad_(w) for t, w in zip(inputs, wants)]
    out, lse = dmattn.attention_topk(*leaves, keep, return_lse=True, **kw)
    grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dout)
    it = iter(grads)
    return (out.detach(), lse, *[next(it) if t.requires_grad else None for t in leaves])


def _general(inputs, dout, keep, kw, wants=(True, True, True, True)):
    with gather.force_path("gather"):  # (a forced path leaves both native forms)
        return _step(inputs, dout, keep, kw, wants)


def _only_training_form(monkeypatch):
    """The general path's selection made to fail: only the training form can succeed."""
    def not_expected(*a, **k):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(gather, "topk_key_set", not_expected)
    if not topk.native_allocates():
        pytest.skip("this torch lends no allocator to the native side")


def _assert_same(got, want, reduced_dbias: bool):
    names = ("out", "lse", "dq", "dk", "dv", "dbias")
    for name, a, b in zip(names, got, want):
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if name == "dq" or (name == "dbias" and reduced_dbias):  # (summed with atomics)
            torch.testing.assert_close(a, b, msg=name)
        else:
            assert torch.equal(a, b), name
        assert torch.isfinite(a).all(), name


@pytest.mark.parametrize("form", list(FORMS))
def test_training_form_equals_the_general_path(form, monkeypatch, nan_poison):
    gen = torch.Generator().manual_seed(len(form))
    args = dict(FORMS[form])
    inputs, dout, kw = _inputs(gen, **args)
    keep = 257
    want = _general(inputs, dout, keep, kw)
    _only_training_form(monkeypatch)
    got = _step(inputs, dout, keep, kw)
    bias_rows = args.get("bias_rows", (2, 2))
    reduced = bias_rows[0] < 2 or bias_rows[1] < inputs[0].shape[2]
    _assert_same(got, want, reduced)


@pytest.mark.parametrize("wants", [(True, False, False, False), (False, False, False, True), (True, True, True, False),
                                   (False, True, False, False)])
def test_training_form_with_some_inputs_requiring_grad(wants, monkeypatch, nan_poison):
    gen = torch.Generator().manual_seed(sum(wants))
    inputs, dout, kw = _inputs(gen)
    want = _general(inputs, dout, 300, kw, wants)
    _only_training_form(monkeypatch)
    got = _step(inputs, dout, 300, kw, wants)
    _assert_same(got, want, reduced_dbias=False)


def test_training_form_against_the_float64_reference(monkeypatch):
    """The dense masked attention of dynamic_mask's selection, in float64: every gradient."""
    gen = torch.Generator().manual_seed(5)
    inputs, dout, kw = _inputs(gen, sq=200, sk=500, heads=4, heads_kv=2, bias_rows=(2, 2))
    _only_training_form(monkeypatch)
    out, lse, dq, dk, dv, dbias = _step(inputs, dout, 120, kw)
    q, k, v, bias = inputs
    mask = dynamic_mask(bias, 120)
    check_against_reference(q, k, v, mask, bias, out, lse, {"q": dq, "k": dk, "v": dv, "bias": dbias}, dout=dout,
                            context="attention_topk training form", **kw)


_FORCED_COPY_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
import test_topk_training as t
cases = {{"causal": {{}}, "window_softcap": dict(kw=dict(causal=False, window=(300, 40), softcap=20.0)),
          "gqa_bias_per_kv_head": dict(heads=8, heads_kv=2, bias_rows=(2, 2), kw=dict(causal=False)),
          "many_query_tiles": dict(sq=1100, heads=8, heads_kv=2, bias_rows=(2, 1), kw=dict(causal=False))}}
for name, args in cases.items():
    gen = torch.Generator().manual_seed(len(name))
    inputs, dout, kw = t._inputs(gen, **args)
    want = t._general(inputs, dout, 257, kw)
    got = t._step(inputs, dout, 257, kw)  # (the native training form: nothing forces the path)
    bias_rows = args.get("bias_rows", (2, 2))
    t._assert_same(got, want, bias_rows[0] < 2 or bias_rows[1] < inputs[0].shape[2])
print("same")
"""


@pytest.mark.parametrize("copy", ["0", "1"])
def test_forced_kept_rows_copy_equals_the_general_path(copy):
    """DMATTN_TOPK_ROWS_COPY forces the forward's kept rows from a gathered copy (1) or in place
    (0) whatever the shapes (read once per process: a fresh one). Either must give the general
    path's bits, under a causal mask and window too, where the positions decide."""
    import os
    import subprocess
    import sys
    if not topk.native_allocates():
        pytest.skip("this torch lends no allocator to the native side")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, DMATTN_TOPK_ROWS_COPY=copy)
    run = subprocess.run([sys.executable, "-c", _FORCED_COPY_SCRIPT.format(tests=tests)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("same"), run.stderr[-3000:]


def test_keep_one_with_a_broadcast_bias():
    """One kept key per (batch, head), a bias shared by the heads: the kept bias is (B, 1, 1, 1),
    whose gradient the kernels still reduce over heads (both paths)."""
    gen = torch.Generator().manual_seed(11)
    inputs, dout, kw = _inputs(gen, sq=64, sk=300, heads=4, heads_kv=4, bias_rows=(2, 1))
    for path in (None, "gather"):
        with gather.force_path(path):
            out, lse, dq, dk, dv, dbias = _step(inputs, dout, 1, dict(causal=False))
        assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv, dbias))
        # One key: the softmax is 1 on it whatever its bias, so the bias's gradient (and dK) is
        # zero up to rounding, and every other key's rows of dK and dV are zero.
        assert dbias.abs().max() < 1e-2
        assert (dv.float().abs().sum(dim=(2, 3)) > 0).sum() == 2
        assert (dk.float().abs().sum(dim=(2, 3)) > 0).sum() <= 2


def test_other_forms_take_the_general_path():
    gen = torch.Generator().manual_seed(0)
    (q, k, v, bias), _, _ = _inputs(gen)
    q = q.requires_grad_()
    keep = 100
    assert topk._training_forward(q, k, v, bias, keep, True, (-1, -1), None, 0.0) is not None
    cases = {
        "all keys kept": (q, k, v, bias, k.shape[1]),
        "bias per query head (H != Hkv)": (q, k, v, torch.randn(2, 4, 1, 1000, device="cuda", dtype=q.dtype), keep),
        "bias per query": (q, k, v, torch.randn(2, 2, 5, 1000, device="cuda", dtype=q.dtype), keep),
        "float64 bias": (q, k, v, bias.double(), keep),
        "strided head dim": (q[..., ::2], k[..., ::2], v[..., ::2], bias, keep),
        "cpu": (q.detach().cpu().requires_grad_(), k.cpu(), v.cpu(), bias.cpu(), keep),
    }
    for name, (qq, kk, vv, bb, kp) in cases.items():
        assert topk._training_forward(qq, kk, vv, bb, kp, True, (-1, -1), None, 0.0) is None, name
    with gather.force_path("gather"):
        assert topk._training_forward(q, k, v, bias, keep, True, (-1, -1), None, 0.0) is None
