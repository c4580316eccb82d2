"""dmattn.flash_sparse_attn, the drop-in for flash-sparse-attn 2.0's API: every function against
the dmattn call it maps onto and the float64 reference (reference.py), gradients included;
window_sizes conversion and the default-window heuristic; preallocated outputs; errors. The GPU
tests at the end compare with flash-sparse-attn itself where it is installed."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import pytest
import torch

import dmattn
from dmattn import flash_sparse_attn as fsa
from reference import BWD_FACTOR, FWD_FACTOR, check_close, run_reference

FAMILIES = ["dense", "sparse", "gated"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _no_threshold_warning(monkeypatch):
    # The exactness warning is once per process; the tests that look at it reset the flag.
    monkeypatch.setattr(fsa, "_warned_exact", True)


def _inputs(b, sq, sk, h, hkv, d, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dtype).to(device)  # noqa: E731
    return dict(q=mk(b, sq, h, d), k=mk(b, sk, hkv, d), v=mk(b, sk, hkv, d), alpha=mk(b, sq, h, s=3.0),
                delta=mk(b, sk, hkv, s=1.5), dout=mk(b, sq, h, d))


def _ws(rows, device="cpu"):
    """flash-sparse-attn's window_sizes, rows [sink, left, right, near]."""
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _ours(ws):
    """The same windows in dmattn's convention [sink, near, gap, far]."""
    return None if ws is None else ws[:, [0, 3, 2, 1]].contiguous()


def _fn(family, form=""):
    return getattr(fsa, f"flash_{family}_attn{form}_func")


def _leaves(x, names):
    return [x[n].detach().clone().requires_grad_() for n in names]


def _check(got, ref, low, context=""):
    """got / ref / low: dicts name -> tensor (out, lse, dq, ...); the FlashAttention rule."""
    for name, t in got.items():
        factor = FWD_FACTOR if name in ("out", "lse") else BWD_FACTOR
        check_close(name, t, ref[name], None if low is None else low[name], factor, context=context)


def _reference(x, *, gated, gate_fn="logsigmoid", windows=None, causal=False, grads=True):
    """run_reference of a batched case, as dicts for _check (upcast and low precision)."""
    res = []
    for upcast in (True, False):
        r = run_reference(x["q"], x["k"], x["v"], causal=causal, dout=x["dout"] if grads else None, upcast=upcast,
                          gate=(x["alpha"], x["delta"]) if gated else None, gate_fn=gate_fn, windows=windows)
        d = dict(out=r.out, lse=r.lse)
        d.update({f"d{n}": g for n, g in r.grads.items()})
        res.append(d)
    return res


# ---------------------------------------------------------------------------------------------
# The API itself
# ---------------------------------------------------------------------------------------------

_TUNING = "is_split_kv is_split_qo pack_gqa num_splits"
_TAIL = "out lse is_autotune tile_mn skip_checks return_lse"


def _expected_parameters(family, form):
    """flash-sparse-attn 2.0's parameter names, in order, for one function."""
    qkv = "query key value" + (" alpha delta" if family == "gated" else "")
    thresholds = {"dense": "", "sparse": "softmax_threshold",
                  "gated": "softmax_threshold gate_threshold is_logsigmoid_gate"}[family]
    adapt = " is_adapt_gate" if family == "gated" and "kvcache" not in form else ""
    scales = "softmax_scale query_scale key_scale value_scale window_sizes"
    if form == "":
        s = f"{qkv} is_causal {scales} {thresholds}{adapt} is_local is_quant {_TUNING} page_table seqused_k {_TAIL}"
    elif form == "_varlen":
        s = (f"{qkv} cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k is_causal {scales} {thresholds}{adapt} "
             f"is_local is_quant {_TUNING} seqused_q seqused_k {_TAIL}")
    elif form == "_with_kvcache":
        s = (f"{qkv} {scales} {thresholds} is_local is_quant num_splits page_table gather_kv_indices seqused_k "
             f"{_TAIL}")
    else:
        s = (f"{qkv} cu_seqlens_k max_seqlen_k {scales} {thresholds} is_local is_quant seqused_k gather_kv_indices "
             f"num_splits {_TAIL}")
    return s.split()


@pytest.mark.parametrize("form", ["", "_varlen", "_with_kvcache", "_varlen_with_kvcache"])
@pytest.mark.parametrize("family", FAMILIES)
def test_signatures_are_flash_sparse_attns(family, form):
    params = inspect.signature(_fn(family, form)).parameters
    assert list(params) == _expected_parameters(family, form)
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    assert defaults.get("is_causal", False) is False and defaults["return_lse"] is False
    assert defaults["is_autotune"] is True and defaults["is_local"] is False and defaults["is_quant"] is False
    assert defaults.get("softmax_threshold") is None and defaults.get("gate_threshold") is None
    assert defaults.get("is_logsigmoid_gate", True) is True and defaults.get("is_adapt_gate", True) is True
    assert all(v is None for n, v in defaults.items() if n in ("softmax_scale", "window_sizes", "out", "lse"))


def test_import_is_cheap_and_does_not_need_the_peer():
    code = ("import sys, dmattn; from dmattn import flash_sparse_attn; "
            "from dmattn.flash_sparse_attn import flash_gated_attn_func; "
            "print('triton' in sys.modules, 'flash_sparse_attn' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["False", "False"], res.stdout + res.stderr
    assert set(fsa.__all__) >= {f"flash_{f}_attn{m}_func" for f in FAMILIES
                                for m in ("", "_varlen", "_with_kvcache", "_varlen_with_kvcache")}


# ---------------------------------------------------------------------------------------------
# Batched
# ---------------------------------------------------------------------------------------------

WINDOW_ROWS = [None, [[2, 5, 3, 4], [0, 7, 1, 2]]]  # per kv head, [sink, left, right, near]


@pytest.mark.parametrize("window_rows", WINDOW_ROWS, ids=["no-windows", "windows"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_matches_dmattn_and_reference(nan_poison, family, dtype, causal, window_rows):
    x = _inputs(2, 29, 37, 4, 2, 16, dtype)
    gated = family == "gated"
    names = ["q", "k", "v"] + (["alpha", "delta"] if gated else [])
    ws = None if window_rows is None else _ws(window_rows)
    leaves = _leaves(x, names)
    kw = dict(is_causal=causal, window_sizes=ws, return_lse=True)
    out, lse = _fn(family)(*leaves, **kw)
    out.backward(x["dout"])
    assert out.shape == x["q"].shape and lse.shape == (2, 4, 29) and lse.dtype == torch.float32
    got = dict(out=out, lse=lse, **{f"d{n}": t.grad for n, t in zip(names, leaves)})

    direct = _leaves(x, names)
    gate = tuple(direct[3:]) if gated else None
    d_out, d_lse = dmattn.attention(*direct[:3], causal=causal, gate=gate, windows=_ours(ws), return_lse=True)
    d_out.backward(x["dout"])
    torch.testing.assert_close(out, d_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, d_lse, rtol=0, atol=0)
    for n, t in zip(names, direct):
        torch.testing.assert_close(got[f"d{n}"], t.grad, rtol=0, atol=0)

    ref, low = _reference(x, gated=gated, windows=_ours(ws), causal=causal)
    _check(got, ref, low, context=f"{family} {dtype} causal={causal} windows={window_rows}")


def test_linear_gate_and_gate_dtype_float32():
    x = _inputs(1, 17, 23, 2, 1, 8, torch.bfloat16)
    x["alpha"], x["delta"] = x["alpha"].float(), x["delta"].float()
    leaves = _leaves(x, ["q", "k", "v", "alpha", "delta"])
    out = fsa.flash_gated_attn_func(*leaves, is_causal=True, is_logsigmoid_gate=False)
    out.backward(x["dout"])
    assert leaves[3].grad.dtype == torch.float32
    ref, low = _reference(x, gated=True, gate_fn="linear", causal=True)
    _check(dict(out=out, dalpha=leaves[3].grad, ddelta=leaves[4].grad), ref, low)


def test_single_query_turns_causal_off_like_flash_sparse_attn():
    x = _inputs(2, 1, 9, 2, 2, 8, torch.float32)
    for family in FAMILIES:
        args = [x["q"], x["k"], x["v"]] + ([x["alpha"], x["delta"]] if family == "gated" else [])
        torch.testing.assert_close(_fn(family)(*args, is_causal=True), _fn(family)(*args, is_causal=False),
                                   rtol=0, atol=0)


def test_tuning_arguments_are_ignored():
    x = _inputs(1, 16, 16, 2, 2, 16, torch.float32)
    args = (x["q"], x["k"], x["v"], x["alpha"], x["delta"])
    plain = fsa.flash_gated_attn_func(*args, is_causal=True, softmax_threshold=0.0, gate_threshold=0.0)
    tuned = fsa.flash_gated_attn_func(*args, is_causal=True, softmax_threshold=0.0, gate_threshold=0.0,
                                      is_adapt_gate=False, is_split_kv=True, is_split_qo=True, pack_gqa=True,
                                      num_splits=4, is_autotune=False, tile_mn=(128, 64), skip_checks=True)
    torch.testing.assert_close(tuned, plain, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# window_sizes and is_local
# ---------------------------------------------------------------------------------------------

WINDOW_CASES = [
    # (Sq, Sk, H, Hkv, window_sizes rows [sink, left, right, near])
    (20, 30, 4, 2, [[3, 4, 2, 5], [0, 6, 0, 3]]),  # GQA: one row per kv head
    (30, 20, 2, 1, [[100, 0, 0, 0]]),  # sink > Sk: plain causal (queries before the keys: empty rows)
    (24, 24, 2, 2, [[0, 5, 3, 0], [2, 4, 0, 0]]),  # near = 0: the band (and the sinks) only
    (16, 16, 4, 4, [[1, 4, 3, 2], [0, 0, 0, 16], [5, 0, 0, 0], [0, 0, 0, 0]]),  # the last: every row empty
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"{c[0]}x{c[1]}-h{c[2]}-{len(c[4])}rows")
def test_window_sizes_columns_are_reordered(case):
    sq, sk, h, hkv, rows = case
    ws = _ws(rows)
    converted = fsa._windows(ws, False, sk, h, hkv, ws.device)
    assert converted.dtype == torch.int32 and converted.is_contiguous()
    assert converted.tolist() == [[s, n, r, l] for s, l, r, n in rows]  # [sink, near, gap = right, far = left]
    x = _inputs(2, sq, sk, h, hkv, 8, torch.float32)
    leaves = _leaves(x, ["q", "k", "v"])
    out, lse = fsa.flash_dense_attn_func(*leaves, window_sizes=ws, return_lse=True)
    out.backward(x["dout"])
    ref, low = _reference(x, gated=False, windows=converted)
    _check(dict(out=out, lse=lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad), ref, low,
           context=str(case))


def test_window_sizes_heuristic_bands():
    # 8192 keys, 4 kv heads: sink 64 and near 1024 for all, the 7104 distances beyond in 4 bands.
    assert fsa.window_sizes_heuristic(8192, 4).tolist() == [
        [64, 1776, 0, 1024], [64, 1776, 1776, 1024], [64, 1776, 3552, 1024], [64, 1776, 5328, 1024]]
    # equal areas: edges at span * (1 - sqrt(1 - h / 4)), truncated
    assert fsa.window_sizes_heuristic(8192, 4, equal_bandwidth=False)[:, 1:3].tolist() == [
        [951, 0], [1129, 951], [1472, 2080], [3552, 3552]]  # edges 0, 951, 2080, 3552, 7104
    # tensor parallelism: rank 1 of 2 holds global kv heads 2 and 3 of 4
    assert torch.equal(fsa.window_sizes_heuristic(8192, 2, num_heads_kv_global=4, tp_rank=1, tp_size=2),
                       fsa.window_sizes_heuristic(8192, 4)[2:])
    # few keys: the near window takes them all, no sink, no band
    short = fsa.window_sizes_heuristic(100, 2, device="cpu")
    assert short.dtype == torch.int32 and short.tolist() == [[0, 0, 0, 100]] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_is_local_uses_the_heuristic(family):
    sk = 1200  # > sink 64 + near 1024: two kv heads share the 112 distances beyond (56 each)
    x = _inputs(1, 8, sk, 4, 2, 16, torch.float32)
    heuristic = fsa.window_sizes_heuristic(sk, 2)
    assert heuristic.tolist() == [[64, 56, 0, 1024], [64, 56, 56, 1024]]
    args = [x["q"], x["k"], x["v"]] + ([x["alpha"], x["delta"]] if family == "gated" else [])
    local = _fn(family)(*args, is_local=True)
    torch.testing.assert_close(local, _fn(family)(*args, window_sizes=heuristic), rtol=0, atol=0)
    ref, low = _reference(x, gated=family == "gated", windows=_ours(heuristic), grads=False)
    _check(dict(out=local), ref, low)
    assert not torch.equal(local, _fn(family)(*args, is_causal=True)), "the bands must leave keys out"


# ---------------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------------


def _packed(lens_q, lens_k, h, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dtype)  # noqa: E731
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    tq, tk = sum(lens_q), sum(lens_k)
    return dict(q=mk(tq, h, d), k=mk(tk, hkv, d), v=mk(tk, hkv, d), alpha=mk(tq, h, s=3.0), delta=mk(tk, hkv, s=1.5),
                dout=mk(tq, h, d), cu_q=cu(lens_q), cu_k=cu(lens_k))


def _varlen_reference(x, *, gated, causal, windows):
    """The reference per sequence, packed back: dicts for _check (upcast and low precision)."""
    cu_q, cu_k = x["cu_q"].tolist(), x["cu_k"].tolist()
    res = []
    for upcast in (True, False):
        parts = {}
        for b in range(len(cu_q) - 1):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            seq = {n: x[n][None, r] for n, r in (("q", rq), ("k", rk), ("v", rk), ("alpha", rq), ("delta", rk),
                                                  ("dout", rq))}
            r = run_reference(seq["q"], seq["k"], seq["v"], causal=causal, dout=seq["dout"], upcast=upcast,
                              gate=(seq["alpha"], seq["delta"]) if gated else None, windows=windows)
            for n, t in [("out", r.out[0]), ("lse", r.lse[0]), *((f"d{n}", g[0]) for n, g in r.grads.items())]:
                parts.setdefault(n, []).append(t)
        res.append({n: torch.cat(ts, dim=1 if n == "lse" else 0) for n, ts in parts.items()})
    return res


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_with_an_empty_sequence(nan_poison, family, dtype):
    lens_q, lens_k = [5, 0, 13, 7], [7, 4, 13, 0]  # an empty query set, then an empty key set
    x = _packed(lens_q, lens_k, 4, 2, 16, dtype)
    gated = family == "gated"
    names = ["q", "k", "v"] + (["alpha", "delta"] if gated else [])
    ws = _ws([[1, 4, 2, 3], [0, 5, 0, 0]])
    leaves = _leaves(x, names)
    args = leaves[:3] + leaves[3:] + [x["cu_q"], x["cu_k"], max(lens_q), max(lens_k)]
    out, lse = _fn(family, "_varlen")(*args, is_causal=True, window_sizes=ws, return_lse=True)
    out.backward(x["dout"])
    assert lse.shape == (4, sum(lens_q)), "varlen lse is (num_heads, total_q)"
    got = dict(out=out, lse=lse, **{f"d{n}": t.grad for n, t in zip(names, leaves)})
    assert (lse[:, -lens_q[3]:] == float("-inf")).all() and (out[-lens_q[3]:] == 0).all()

    direct = _leaves(x, names)
    d_out, d_lse = dmattn.attention_varlen(*direct[:3], x["cu_q"], x["cu_k"], max(lens_q), max(lens_k),
                                           causal=True, gate=tuple(direct[3:]) if gated else None,
                                           windows=_ours(ws), return_lse=True)
    d_out.backward(x["dout"])
    torch.testing.assert_close(out, d_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, d_lse, rtol=0, atol=0)
    for n, t in zip(names, direct):
        torch.testing.assert_close(got[f"d{n}"], t.grad, rtol=0, atol=0)

    ref, low = _varlen_reference(x, gated=gated, causal=True, windows=_ours(ws))
    _check(got, ref, low, context=f"{family} {dtype}")


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------


def _decode_reference(q, keys, values, lengths, *, alpha=None, delta=None, windows=None, gate_fn="logsigmoid"):
    """Each row's one query against its first lengths[b] keys (contiguous (B, Sk, Hkv, D)): the
    reference as dicts out (B, H, D), lse (B, H), upcast and low precision."""
    res = []
    for upcast in (True, False):
        outs, lses = [], []
        for b, n in enumerate(lengths):
            r = run_reference(q[b:b + 1, None], keys[b:b + 1, :n], values[b:b + 1, :n], upcast=upcast,
                              gate=None if alpha is None else (alpha[b:b + 1, None], delta[b:b + 1, :n]),
                              gate_fn=gate_fn, windows=windows)
            outs.append(r.out[0, 0])
            lses.append(r.lse[0, :, 0])
        res.append(dict(out=torch.stack(outs), lse=torch.stack(lses)))
    return res


def _pages(keys, page_size, seed=0):
    """A contiguous cache (B, Sk, ...) as shuffled pages (num_pages, page_size, ...) + page_table."""
    b, sk = keys.shape[:2]
    per_row = sk // page_size
    perm = torch.randperm(b * per_row, generator=torch.Generator().manual_seed(seed))
    table = perm.view(b, per_row).to(torch.int32)
    pages = torch.empty((b * per_row, page_size) + keys.shape[2:], dtype=keys.dtype)
    pages[perm] = keys.reshape((b * per_row, page_size) + keys.shape[2:])
    return pages, table


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("window_rows", WINDOW_ROWS, ids=["no-windows", "windows"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_kvcache(nan_poison, family, dtype, window_rows, paged):
    b, sk, h, hkv, d = 3, 24, 4, 2, 16
    x = _inputs(b, 1, sk, h, hkv, d, dtype)
    q, alpha = x["q"][:, 0], x["alpha"][:, 0]  # (B, H, D), (B, H)
    lengths = [24, 9, 0]
    seqused_k = torch.tensor(lengths, dtype=torch.int32)
    ws = None if window_rows is None else _ws(window_rows)
    k, v, delta, table = x["k"], x["v"], x["delta"], None
    if paged:
        (k, table), (v, _), (delta, _) = _pages(k, 4), _pages(v, 4), _pages(delta, 4)
    gated = family == "gated"
    args = [q, k, v] + ([alpha, delta] if gated else [])
    out, lse = _fn(family, "_with_kvcache")(*args, window_sizes=ws, page_table=table, seqused_k=seqused_k,
                                            return_lse=True)
    assert out.shape == (b, h, d) and lse.shape == (b, h) and out.dtype == dtype
    assert (lse[2] == float("-inf")).all() and (out[2] == 0).all()
    if not gated and ws is None:  # the direct call
        d_out, d_lse = dmattn.attention_with_kvcache(q[:, None], k, v, cache_seqlens=seqused_k, block_table=table,
                                                     return_lse=True)
        torch.testing.assert_close(out, d_out[:, 0], rtol=0, atol=0)
        torch.testing.assert_close(lse, d_lse[..., 0], rtol=0, atol=0)
    ref, low = _decode_reference(q, x["k"], x["v"], lengths, alpha=alpha if gated else None,
                                 delta=x["delta"] if gated else None, windows=_ours(ws))
    _check(dict(out=out, lse=lse), ref, low, context=f"{family} {dtype} windows={window_rows} paged={paged}")
    if gated:  # the gate as a bias equals dmattn's own gate on each row
        for r, n in enumerate(lengths[:2]):
            own = dmattn.attention(q[r:r + 1, None], x["k"][r:r + 1, :n], x["v"][r:r + 1, :n],
                                   gate=(alpha[r:r + 1, None], x["delta"][r:r + 1, :n]), windows=_ours(ws))
            torch.testing.assert_close(out[r], own[0, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_gate_in_float64(paged):
    """The kvcache forms' gate (a bias of the cache call) in float64 for float64 inputs: equal to
    dmattn's own gate to float64 rounding, not float32's."""
    b, sk, h, hkv, d = 2, 24, 4, 2, 16
    x = _inputs(b, 1, sk, h, hkv, d, torch.float64)
    q, alpha = x["q"][:, 0], x["alpha"][:, 0] * 4
    lengths = [24, 11]
    k, v, delta, table = x["k"], x["v"], x["delta"] * 4, None
    if paged:
        (k, table), (v, _), (delta, _) = _pages(k, 4), _pages(v, 4), _pages(delta, 4)
    out = fsa.flash_gated_attn_with_kvcache_func(q, k, v, alpha, delta, page_table=table,
                                                 seqused_k=torch.tensor(lengths, dtype=torch.int32))
    for r, n in enumerate(lengths):
        own = dmattn.attention(q[r:r + 1, None], x["k"][r:r + 1, :n], x["v"][r:r + 1, :n],
                               gate=(alpha[r:r + 1, None], x["delta"][r:r + 1, :n] * 4))
        torch.testing.assert_close(out[r], own[0, 0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_kvcache_with_an_empty_sequence(family):
    lens = [6, 0, 11]
    x = _packed([1, 1, 1], lens, 4, 2, 16, torch.bfloat16)
    q, alpha = x["q"], x["alpha"]  # (B, H, D), (B, H): one query per sequence
    ws = _ws([[1, 2, 1, 3], [0, 3, 2, 1]])
    gated = family == "gated"
    args = [q, x["k"], x["v"]] + ([alpha, x["delta"]] if gated else [])
    out, lse = _fn(family, "_varlen_with_kvcache")(*args, x["cu_k"], max(lens), window_sizes=ws, return_lse=True)
    assert out.shape == (3, 4, 16) and lse.shape == (3, 4)
    assert (lse[1] == float("-inf")).all() and (out[1] == 0).all()

    def pad(t):  # the packed keys as a (B, max_len) cache
        rows = zip(x["cu_k"][:-1].tolist(), x["cu_k"][1:].tolist())
        return torch.stack([torch.nn.functional.pad(t[s:e], [0, 0] * (t.dim() - 1) + [0, max(lens) - (e - s)])
                            for s, e in rows])

    ref, low = _decode_reference(q, pad(x["k"]), pad(x["v"]), lens, alpha=alpha if gated else None,
                                 delta=pad(x["delta"]) if gated else None, windows=_ours(ws))
    _check(dict(out=out, lse=lse), ref, low, context=family)
    # seqused_k: fewer keys of each sequence (from its start)
    used = torch.tensor([4, 0, 7], dtype=torch.int32)
    out_u = _fn(family, "_varlen_with_kvcache")(*args, x["cu_k"], max(lens), window_sizes=ws, seqused_k=used)
    ref, low = _decode_reference(q, pad(x["k"]), pad(x["v"]), used.tolist(), alpha=alpha if gated else None,
                                 delta=pad(x["delta"]) if gated else None, windows=_ours(ws))
    _check(dict(out=out_u), ref, low, context=f"{family} seqused_k")
    # no keys at all (max_seqlen_k still an upper bound > 0): every row empty
    none = [x["k"][:0], x["v"][:0]] + ([alpha, x["delta"][:0]] if gated else [])
    out_0, lse_0 = _fn(family, "_varlen_with_kvcache")(q, *none, torch.zeros(4, dtype=torch.int32), 5,
                                                       return_lse=True)
    assert (out_0 == 0).all() and (lse_0 == float("-inf")).all()


def test_batched_paged_forward_only():
    """page_table / seqused_k in the batched functions: attention_with_kvcache, several queries,
    causal aligned with each row's length, under no_grad."""
    b, sq, sk, h, hkv, d = 2, 5, 16, 2, 1, 8
    x = _inputs(b, sq, sk, h, hkv, d, torch.float32)
    (k, table), (v, _), (delta, _) = _pages(x["k"], 4), _pages(x["v"], 4), _pages(x["delta"], 4)
    lengths = [16, 7]
    used = torch.tensor(lengths, dtype=torch.int32)
    ws = _ws([[1, 3, 2, 2]])
    with torch.no_grad():
        out = fsa.flash_gated_attn_func(x["q"], k, v, x["alpha"], delta, is_causal=True, window_sizes=ws,
                                        page_table=table, seqused_k=used)
    for r, n in enumerate(lengths):
        ref = run_reference(x["q"][r:r + 1], x["k"][r:r + 1, :n], x["v"][r:r + 1, :n], causal=True,
                            gate=(x["alpha"][r:r + 1], x["delta"][r:r + 1, :n]), windows=_ours(ws))
        check_close("out", out[r:r + 1], ref.out, None, FWD_FACTOR)
    leaves = _leaves(x, ["q"])
    with pytest.raises(NotImplementedError, match="page_table / seqused_k.*forward"):
        fsa.flash_dense_attn_func(leaves[0], k, v, page_table=table)


# ---------------------------------------------------------------------------------------------
# Preallocated outputs, thresholds, errors
# ---------------------------------------------------------------------------------------------


def test_out_and_lse_preallocated():
    x = _inputs(2, 9, 11, 2, 2, 8, torch.float32)
    out, lse = torch.full_like(x["q"], float("nan")), torch.full((2, 2, 9), float("nan"))
    res = fsa.flash_dense_attn_func(x["q"], x["k"], x["v"], is_causal=True, out=out, lse=lse, return_lse=True)
    assert res[0] is out and res[1] is lse
    expect, expect_lse = dmattn.attention(x["q"], x["k"], x["v"], causal=True, return_lse=True)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    torch.testing.assert_close(lse, expect_lse, rtol=0, atol=0)
    # gradients flow through the preallocated out
    q = x["q"].clone().requires_grad_()
    fsa.flash_dense_attn_func(q, x["k"], x["v"], out=torch.empty_like(x["q"])).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    # kvcache and varlen layouts
    qd = x["q"][:, 0]
    out_d, lse_d = torch.empty_like(qd), torch.empty(2, 2)
    res = fsa.flash_dense_attn_with_kvcache_func(qd, x["k"], x["v"], out=out_d, lse=lse_d, return_lse=True)
    assert res[0] is out_d and res[1] is lse_d and torch.isfinite(lse_d).all()
    with pytest.raises(ValueError, match="lse: expected a preallocated tensor of shape \\(2, 2, 9\\)"):
        fsa.flash_dense_attn_func(x["q"], x["k"], x["v"], lse=torch.empty(2, 9, 2))


def test_threshold_warning_once_and_not_for_exact(monkeypatch):
    x = _inputs(1, 8, 8, 2, 2, 8, torch.float32)
    qkv = (x["q"], x["k"], x["v"])
    monkeypatch.setattr(fsa, "_warned_exact", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fsa.flash_dense_attn_func(*qkv)  # no threshold at all
        fsa.flash_sparse_attn_func(*qkv, softmax_threshold=0.0)
        fsa.flash_gated_attn_func(*qkv, x["alpha"], x["delta"], softmax_threshold=0.0, gate_threshold=0.0)
        assert not seen, [str(w.message) for w in seen]
        exact = fsa.flash_sparse_attn_func(*qkv)  # flash-sparse-attn's default threshold skips blocks
        fsa.flash_sparse_attn_func(*qkv, softmax_threshold=1.0)
        fsa.flash_gated_attn_func(*qkv, x["alpha"], x["delta"], gate_threshold=0.5)
    assert len(seen) == 1 and "exactly" in str(seen[0].message) and seen[0].filename == __file__
    torch.testing.assert_close(exact, dmattn.attention(*qkv), rtol=0, atol=0)


def test_errors_name_the_argument():
    x = _inputs(2, 8, 8, 2, 2, 16, torch.float32)
    qkv = (x["q"], x["k"], x["v"])
    with pytest.raises(NotImplementedError, match="fp8"):
        fsa.flash_dense_attn_func(*qkv, is_quant=True)
    with pytest.raises(NotImplementedError, match="query_scale"):
        fsa.flash_sparse_attn_func(*qkv, query_scale=torch.ones(1))
    with pytest.raises(NotImplementedError, match="fp8"):
        fsa.flash_gated_attn_with_kvcache_func(x["q"][:, 0], x["k"], x["v"], x["alpha"][:, 0], x["delta"],
                                               is_quant=True)
    p = _packed([3, 5], [3, 5], 2, 2, 16, torch.float32)
    varlen = (p["q"], p["k"], p["v"], p["cu_q"], p["cu_k"], 5, 5)
    with pytest.raises(NotImplementedError, match="seqused_q"):
        fsa.flash_dense_attn_varlen_func(*varlen, seqused_q=torch.tensor([3, 5], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="seqused_k"):
        fsa.flash_sparse_attn_varlen_func(*varlen, seqused_k=torch.tensor([3, 5], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="gather_kv_indices"):
        fsa.flash_dense_attn_with_kvcache_func(x["q"][:, 0], x["k"], x["v"],
                                               gather_kv_indices=torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="window_sizes: expected dtype int32"):
        fsa.flash_dense_attn_func(*qkv, window_sizes=torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="window_sizes: expected shape"):
        fsa.flash_dense_attn_func(*qkv, window_sizes=torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="window_sizes: expected shape"):
        fsa.flash_dense_attn_varlen_func(*varlen, window_sizes=torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="window_sizes"):
        fsa.flash_dense_attn_func(*qkv, window_sizes=[[0, 1, 2, 3]])
    with pytest.raises(TypeError, match="softmax_threshold"):
        fsa.flash_sparse_attn_func(*qkv, softmax_threshold="1.0")
    with pytest.raises(ValueError, match="gate_threshold"):
        fsa.flash_gated_attn_func(*qkv, x["alpha"], x["delta"], gate_threshold=float("nan"))
    with pytest.raises(TypeError, match="is_causal"):
        fsa.flash_dense_attn_func(*qkv, is_causal="yes")
    with pytest.raises(TypeError, match="alpha"):
        fsa.flash_gated_attn_func(*qkv, None, x["delta"])
    with pytest.raises(ValueError, match="alpha: expected shape \\(batch, num_heads\\)"):
        fsa.flash_gated_attn_with_kvcache_func(x["q"][:, 0], x["k"], x["v"], x["alpha"], x["delta"])
    with pytest.raises(ValueError, match="query: expected a 3-D tensor"):
        fsa.flash_dense_attn_with_kvcache_func(*qkv)
    with pytest.raises(TypeError, match="page_table"):
        fsa.flash_dense_attn_with_kvcache_func(x["q"][:, 0], x["k"], x["v"], page_table=torch.zeros(2, 2))
    # the cache call's checks, in this module's names (seqused_k, page_table, key, value, query)
    q1 = x["q"][:, 0]
    with pytest.raises(ValueError, match="^seqused_k: expected 0 <= seqused_k"):
        fsa.flash_dense_attn_with_kvcache_func(q1, x["k"], x["v"], seqused_k=torch.tensor([9, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^page_table: the pages the rows read must lie in \[0, 4\) \(key's"):
        fsa.flash_dense_attn_with_kvcache_func(q1, x["k"].view(4, 4, 2, 16), x["v"].view(4, 4, 2, 16),
                                               page_table=torch.tensor([[0, 1], [2, 7]], dtype=torch.int32))
    with pytest.raises(TypeError, match="^value: expected query's dtype"):
        fsa.flash_dense_attn_with_kvcache_func(q1, x["k"], x["v"].double())
    # The varlen cache's lengths against max_seqlen_k and key's rows (checked on the CPU; they read
    # clamped rows before): the error names cu_seqlens_k, the argument given.
    cache = (p["q"][:2], p["k"], p["v"])
    for cu, max_k in (([0, 3, 8], 4), ([0, 3, 10], 7), ([0, 5, 3], 5)):
        with pytest.raises(ValueError, match="^cu_seqlens_k: "):
            fsa.flash_dense_attn_varlen_with_kvcache_func(*cache, torch.tensor(cu, dtype=torch.int32), max_k)


# ---------------------------------------------------------------------------------------------
# Against flash-sparse-attn itself (CUDA, where it is installed)
# ---------------------------------------------------------------------------------------------


def _peer():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    try:
        import flash_sparse_attn
    except Exception as e:  # not installed, or no Triton for this GPU
        pytest.skip(f"flash-sparse-attn is not importable ({type(e).__name__})")
    return flash_sparse_attn


@pytest.mark.gpu
def test_signatures_equal_the_peers():
    peer = _peer()
    for name in fsa.__all__:
        if name.startswith("flash_"):
            theirs = inspect.signature(getattr(peer, name)).parameters
            ours = inspect.signature(getattr(fsa, name)).parameters
            assert [(n, p.default) for n, p in ours.items()] == [(n, p.default) for n, p in theirs.items()], name


PEER_CASES = [
    # (family, causal, window_sizes rows or None); S = 512
    ("dense", False, None),
    ("dense", True, None),
    ("sparse", True, None),
    # windows with sinks and the gate (dmattn's sm80-class CUDA kernels):
    ("dense", True, [[16, 64, 128, 64], [0, 128, 32, 96]]),
    ("gated", True, None),
    ("gated", False, None),
    ("gated", True, [[16, 64, 128, 64], [0, 128, 32, 96]]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PEER_CASES, ids=lambda c: f"{c[0]}-{'causal' if c[1] else 'full'}"
                         f"{'-windows' if c[2] else ''}")
def test_matches_flash_sparse_attn(case):
    """Exact mode on both sides (thresholds 0.0: flash-sparse-attn's skip tests compare against
    log2(0) = -inf and never pass), forward and every gradient, within bf16 tolerance."""
    peer = _peer()
    family, causal, rows = case
    x = _inputs(2, 512, 512, 4, 2, 64, torch.bfloat16, device="cuda")
    ws = None if rows is None else _ws(rows, "cuda")
    names = ["q", "k", "v"] + (["alpha", "delta"] if family == "gated" else [])
    kw = dict(is_causal=causal, window_sizes=ws, return_lse=True)
    if family != "dense":
        kw["softmax_threshold"] = 0.0
    if family == "gated":
        kw["gate_threshold"] = 0.0
    results = []
    for fn, extra in ((_fn(family), {}), (getattr(peer, f"flash_{family}_attn_func"),
                                         dict(is_autotune=False, tile_mn=(128, 64)))):
        leaves = _leaves(x, names)
        out, lse = fn(*leaves, **kw, **extra)
        out.backward(x["dout"])
        results.append(dict(out=out, lse=lse, **{f"d{n}": t.grad for n, t in zip(names, leaves)}))
    ours, theirs = results
    for name in theirs:
        a, b = ours[name].float(), theirs[name].float()
        assert a.shape == b.shape, name
        fin = torch.isfinite(b)
        assert torch.equal(fin, torch.isfinite(a)), f"{name}: -inf rows differ"
        scale = max(b[fin].abs().max().item(), 1e-6)
        err = (a[fin] - b[fin]).abs().max().item() / scale
        assert err <= (1e-2 if name in ("out", "lse") else 3e-2), f"{name}: relative error {err:.2e} {case}"
