"""NaN in, NaN out (docs/semantics.md, "Masked positions and empty rows" and "Numerical
guarantees"): a NaN in q, k, v or the bias reaches the outputs and gradients it touches, on
every path (dense, packed varlen, the gathered top-k path, the per-query top-k path), and
everything it does not touch stays finite and equal to the NaN-free result.

* a NaN in q row i: out row i and lse_i NaN; backward: dq row i, and dk / dv of the keys row i
  attends, NaN;
* a NaN in the k (v) row of key j: every row attending j has a NaN out (k: and lse) and dq;
  dk_j is NaN; rows that cannot see j (causal, before it) stay finite with a NaN k; with a NaN
  v, lse and dv are untouched (neither depends on v);
* a NaN in an allowed bias element (i, j): out row i, lse_i, dq row i and dbias row i NaN;
  a NaN in a key-side bias at key j: every row attending j;
* +inf in q or v is not hidden either: the rows it reaches are NaN or Inf (or +-finfo.max,
  where CUDA's 16-bit stores saturate an Inf);
* top-k: a NaN in the bias is selected (it ranks as +inf, whatever its sign), on the dense, the
  gather and the per-query paths.
What the contract leaves open (a NaN in a position a row does not attend, which kernels that
compute a partially masked tile multiply by 0) is not checked. Finite inputs giving finite
results (empty rows, -inf / finfo.min biases, saturation) are test_edge_cases.py's.

Every test with the ``device`` fixture also runs on CUDA (gpu marker) when a GPU is visible,
there with both backward paths (DMATTN_BWD_EXACT=0 / 1).
"""

from __future__ import annotations

import pytest
import torch

import dmattn
from dmattn import gather, per_query_path
from reference import (BWD_FACTOR, FWD_FACTOR, allowed_window, check_close, dbias_abs_scale, expand_operand,
                       run_reference)

NAN = float("nan")
INF = float("inf")


@pytest.fixture
def device(device_bwd_path):
    """conftest.py's `device`, with each CUDA backward path as its own variant."""
    return device_bwd_path


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _skip_unsupported(device, dtype):
    if device == "cuda" and dtype not in (torch.bfloat16, torch.float16):
        pytest.skip("CUDA takes float16 / bfloat16")


# Dense problem: batch 1, query head 3 (kv head 1) carries the NaN; Sk spans several key blocks.
B, SQ, SK, H, HKV = 2, 40, 150, 4, 2
# Head dims: on an H100, 128 and 256 take the Hopper kernels (the warp-specialized forward; the
# Hopper backward, at 256 for plain scores only), 32 the others. 128 and 256 only where a GPU is visible (the CPU code
# does not depend on them).
HEAD_DIMS = pytest.mark.parametrize("d", [32] + ([128, 256] if torch.cuda.is_available() else []),
                                    ids=lambda d: f"d{d}")
ROW = 17   # query row of the NaN (sees keys <= 127 when causal: off = 110)
KEY = 120  # key row of the NaN (causal: rows >= 10 see it)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _rows_have_nan(name, got, rows):
    """Every row (all dims but the last) selected by ``rows`` holds at least one NaN."""
    missing = rows & ~torch.isnan(got).any(-1)
    assert not missing.any(), (
        f"{name}: no NaN in rows {missing.nonzero()[:4].tolist()} (of {int(rows.sum())} expected)")


def _check_rows(name, got, ref, low, nan_rows, open_rows=None, factor=FWD_FACTOR, floor_scale=None):
    """got (dmattn's) against the reference on the NaN-free inputs (ref: float64, low: the
    low-precision baseline), by rows = all dims but the last: rows in ``nan_rows`` hold a NaN,
    rows in ``open_rows`` (which the contract leaves open) are not checked, every other row is
    finite and within the suite's tolerance of the reference."""
    got = got.detach().cpu()
    nan_rows = nan_rows.expand(got.shape[:-1])
    _rows_have_nan(name, got, nan_rows)
    keep = ~nan_rows
    if open_rows is not None:
        keep &= ~open_rows.expand(got.shape[:-1])
    check_close(name, got[keep], ref[keep], None if low is None else low[keep], factor,
                floor_scale=None if floor_scale is None else floor_scale[keep])


def _close_rows(name, got, clean, nan_rows, open_rows=None):
    """As _check_rows, against the same call on the NaN-free inputs: equal up to the
    summation order of atomics (CUDA gradients)."""
    got, clean = got.detach().cpu().double(), clean.detach().cpu().double()
    nan_rows = nan_rows.expand(got.shape[:-1])
    _rows_have_nan(name, got, nan_rows)
    keep = ~nan_rows
    if open_rows is not None:
        keep &= ~open_rows.expand(got.shape[:-1])
    a, b = got[keep], clean[keep]
    assert not torch.isnan(a).any(), f"{name}: NaN in {int(torch.isnan(a).any(-1).sum())} rows it must not reach"
    assert torch.equal(torch.isinf(a), torch.isinf(b)), f"{name}: Inf pattern differs from the NaN-free call"
    fin = torch.isfinite(b)
    if fin.any():
        err = float((a[fin] - b[fin]).abs().max())
        tol = 2 ** -6 * max(1.0, float(b[fin].abs().max()))
        assert err <= tol, f"{name}: differs from the NaN-free call by {err:.3e} > {tol:.3e}"


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _run(fn, q, k, v, bias, dout, **kw):
    """fn(q, k, v, bias=leaf, return_lse=True, **kw) forward and backward: out, lse and the
    gradients by name (dbias when the bias is given)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    leaf = None if bias is None else bias.detach().clone().requires_grad_()
    out, lse = fn(q, k, v, leaf, return_lse=True, **kw)
    out.backward(dout)
    res = {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if leaf is not None:
        res["dbias"] = leaf.grad
    return res


def _attention(q, k, v, bias, *, mask=None, **kw):
    return dmattn.attention(q, k, v, mask, bias, **kw)


def _dense_case(device, dtype, operands, gen, d):
    """q, k, v, dout, mask, bias of the dense problem. operands: "none"; "bias" (B, H, Sq, Sk)
    in q's dtype with a few -inf; "bias32" the same in fp32; "mask_bias" a (B, 1, Sq, Sk) mask
    with that bias in q's dtype; "mask_bias32" a (B, 1, Sq, Sk) mask and a (1, H, 1, Sk) fp32
    bias (reduced over batch and queries in dbias)."""
    q, k, v, dout = (_randn(s, dtype, device, gen) for s in
                     ((B, SQ, H, d), (B, SK, HKV, d), (B, SK, HKV, d), (B, SQ, H, d)))
    mask = bias = None
    if operands in ("bias", "bias32", "mask_bias"):
        bias = torch.randn(B, H, SQ, SK, generator=gen)
        bias = bias.masked_fill(torch.rand(B, H, SQ, SK, generator=gen) < 0.05, -INF)
        bias = bias.to(torch.float32 if operands == "bias32" else dtype).to(device)
    if operands == "mask_bias":
        mask = (torch.rand(B, 1, SQ, SK, generator=gen) < 0.8).to(device)
    elif operands == "mask_bias32":
        mask = (torch.rand(B, 1, SQ, SK, generator=gen) < 0.8).to(device)
        bias = torch.randn(1, H, 1, SK, generator=gen).to(device)
    return q, k, v, dout, mask, bias


def _allowed(mask, bias, causal):
    """(B, H, Sq, Sk) bool: which keys each row attends."""
    allowed = allowed_window(SQ, SK, causal, (-1, -1)).expand(B, H, SQ, SK)
    if mask is not None:
        allowed = allowed & expand_operand(mask.cpu(), B, H, HKV, SQ, SK)
    if bias is not None:
        allowed = allowed & (expand_operand(bias.cpu(), B, H, HKV, SQ, SK) != -INF)
    return allowed


def _kv_rows(pairs):
    """(B, H, Sq, Sk) pairs -> (B, Sk, Hkv) keys: any over the queries of each kv head's query heads."""
    return pairs.any(2).view(B, HKV, H // HKV, SK).any(2).transpose(1, 2)


def _bias_rows(per_row, bias):
    """(B, H, Sq) row flags -> the rows (all dims but keys) of ``bias``'s shape, any over the
    dimensions along which it is broadcast."""
    rows = per_row
    for dim, size in enumerate(bias.shape[:-1]):
        if size == 1:
            rows = rows.any(dim, keepdim=True)
    return rows


def _reference(q, k, v, mask, bias, dout, causal):
    """The float64 reference and the low-precision baseline on NaN-free inputs, plus the
    floor scale of a reduced dbias (reference.check_against_reference's)."""
    kw = dict(causal=causal, dout=dout.cpu(), bias_grad=bias is not None)
    args = [t.cpu() for t in (q, k, v)] + [None if mask is None else mask.cpu(),
                                           None if bias is None else bias.cpu()]
    ref, low = run_reference(*args, upcast=True, **kw), run_reference(*args, upcast=False, **kw)
    if bias is not None:
        ref.grads["bias_floor"] = dbias_abs_scale(*args, causal=causal, window=(-1, -1), scale=None,
                                                  softcap=0.0, dout=dout.cpu())
    return ref, low


def _check_dense(res, ref, low, nan):
    """res: dmattn's results; ref / low: the reference on the NaN-free inputs; nan: per output,
    (rows with a NaN, rows left open or None)."""
    names = {"out": ("out", FWD_FACTOR), "lse": ("lse", FWD_FACTOR), "dq": ("q", BWD_FACTOR),
             "dk": ("k", BWD_FACTOR), "dv": ("v", BWD_FACTOR), "dbias": ("bias", BWD_FACTOR)}
    for name, (nan_rows, open_rows) in nan.items():
        key, factor = names[name]
        got, floor = res[name], None
        if name == "lse":  # (B, H, Sq) scalars: one-element rows
            r, lo = ref.lse.unsqueeze(-1), low.lse.unsqueeze(-1)
            got = got.unsqueeze(-1)
        elif name == "out":
            r, lo = ref.out, low.out
        else:
            r, lo = ref.grads[key], low.grads[key]
            if name == "dbias":
                floor = ref.grads["bias_floor"]
        _check_rows(name, got, r, lo, nan_rows, open_rows, factor, floor_scale=floor)


# ---------------------------------------------------------------------------------------------
# Dense attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("operands", ["none", "bias", "bias32", "mask_bias", "mask_bias32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@HEAD_DIMS
def test_nan_in_q_row(device, dtype, d, causal, operands, nan_poison):
    _skip_unsupported(device, dtype)
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout, mask, bias = _dense_case(device, dtype, operands, gen, d)
    if mask is not None:
        mask[1, 0, ROW, :8] = True  # the row attends something
    ref, low = _reference(q, k, v, mask, bias, dout, causal)
    q_nan = q.clone()
    q_nan[1, ROW, 3, 5] = NAN
    res = _run(_attention, q_nan, k, v, bias, dout, mask=mask, causal=causal)

    row = torch.zeros(B, H, SQ, dtype=torch.bool)
    row[1, 3, ROW] = True
    allowed = _allowed(mask, bias, causal)
    attended = _kv_rows(allowed & row[..., None])  # keys the NaN row attends
    # Keys of kv head 1 (batch 1) the row does not attend: left open (same tiles).
    kv_open = torch.zeros(B, SK, HKV, dtype=torch.bool)
    kv_open[1, :, 1] = True
    nan = {"out": (row.transpose(1, 2), None), "lse": (row, None), "dq": (row.transpose(1, 2), None),
           "dk": (attended, kv_open), "dv": (attended, kv_open)}
    if bias is not None:
        nan["dbias"] = (_bias_rows(row, bias), None)
    _check_dense(res, ref, low, nan)


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("operands", ["none", "bias", "bias32", "mask_bias", "mask_bias32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@HEAD_DIMS
def test_nan_in_k_or_v_row(device, dtype, d, which, causal, operands, nan_poison):
    _skip_unsupported(device, dtype)
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout, mask, bias = _dense_case(device, dtype, operands, gen, d)
    if mask is not None:
        mask[1, 0, 20:, KEY] = True  # attended by rows 20.. (and maybe some before)
    if bias is not None and bias.shape[-2] != 1:
        bias[1, 2:, 20:, KEY] = 0.5
    ref, low = _reference(q, k, v, mask, bias, dout, causal)
    kv = {"k": k.clone(), "v": v.clone()}
    kv[which][1, KEY, 1, 4] = NAN
    res = _run(_attention, q, kv["k"], kv["v"], bias, dout, mask=mask, causal=causal)

    allowed = _allowed(mask, bias, causal)
    group = torch.zeros(B, H, SQ, dtype=torch.bool)
    group[1, 2:] = True  # the query heads of kv head 1 in batch 1
    attends = group & allowed[..., KEY]
    # Rows of the group that do not attend the key: only the causally excluded ones (their
    # score is replaced by -inf) are guaranteed finite, and only with a NaN in k (a NaN v row
    # is multiplied by their P = 0 where a kernel computes the tile).
    causal_before = group & ~allowed_window(SQ, SK, causal, (-1, -1))[:, KEY].view(1, 1, SQ)
    open_rows = group & ~attends & (~causal_before if which == "k" else True)
    key_row = torch.zeros(B, SK, HKV, dtype=torch.bool)
    key_row[1, KEY, 1] = True
    kv_group = torch.zeros(B, SK, HKV, dtype=torch.bool)
    kv_group[1, :, 1] = True
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, H, Sq) -> (B, Sq, H)
    nan = {"out": (t(attends), t(open_rows)),
           # lse and dv do not depend on v
           "lse": (attends, open_rows) if which == "k" else (torch.zeros(B, H, SQ, dtype=torch.bool), None),
           "dq": (t(attends), t(group & ~attends)),  # (dS = 0 times the NaN row: left open)
           "dk": (key_row, kv_group),
           "dv": (key_row, kv_group) if which == "k" else (torch.zeros(B, SK, HKV, dtype=torch.bool), None)}
    if bias is not None:
        nan["dbias"] = (_bias_rows(attends, bias), _bias_rows(group, bias))
    _check_dense(res, ref, low, nan)


@pytest.mark.parametrize("shape", ["element", "element32", "key"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@HEAD_DIMS
def test_nan_in_bias(device, dtype, d, shape, causal, nan_poison):
    """A NaN bias element (i, j) (full (B, H, Sq, Sk) bias, q's dtype or fp32) or a NaN in a
    key-side (B, H, 1, Sk) fp32 bias at key j."""
    _skip_unsupported(device, dtype)
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout, _, _ = _dense_case(device, dtype, "none", gen, d)
    if shape in ("element", "element32"):
        bias = torch.randn(B, H, SQ, SK, generator=gen).to(dtype if shape == "element" else torch.float32).to(device)
        where = (1, 3, ROW, 60)
    else:
        bias = torch.randn(B, H, 1, SK, generator=gen).to(device)
        where = (1, 3, 0, KEY)
    ref, low = _reference(q, k, v, None, bias, dout, causal)
    bias_nan = bias.clone()
    bias_nan[where] = NAN
    res = _run(_attention, q, k, v, bias_nan, dout, causal=causal)

    allowed = _allowed(None, bias, causal)
    head = torch.zeros(B, H, SQ, dtype=torch.bool)
    head[1, 3] = True
    if shape != "key":
        rows = torch.zeros(B, H, SQ, dtype=torch.bool)
        rows[1, 3, ROW] = True
        open_rows = None
    else:
        rows = head & allowed[..., KEY]
        open_rows = head & ~rows
    attended = _kv_rows(allowed & rows[..., None])
    kv_open = torch.zeros(B, SK, HKV, dtype=torch.bool)
    kv_open[1, :, 1] = True
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    nan = {"out": (t(rows), None if open_rows is None else t(open_rows)), "lse": (rows, open_rows),
           "dq": (t(rows), t(head)), "dk": (attended, kv_open), "dv": (attended, kv_open),
           "dbias": (_bias_rows(rows, bias), _bias_rows(head, bias))}
    _check_dense(res, ref, low, nan)


@pytest.mark.parametrize("which", ["q", "v"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@HEAD_DIMS
def test_inf_input_is_not_hidden(device, dtype, d, which):
    """+inf in q row i (non-causal: some score is +inf) or in a v row: the rows it reaches are
    NaN or Inf (a 16-bit CUDA output saturates Inf to +-finfo.max), never an ordinary value or
    an empty row's 0."""
    _skip_unsupported(device, dtype)
    gen = torch.Generator().manual_seed(4)
    q, k, v, _, _, _ = _dense_case(device, dtype, "none", gen, d)
    t = {"q": q, "v": v}[which]
    if which == "q":
        t[1, ROW, 3, 5] = INF
    else:
        t[1, KEY, 1, 4] = INF
    out, lse = dmattn.attention(q, k, v, return_lse=True)
    out = out.cpu()
    infinite = ~torch.isfinite(out)
    if device == "cuda":
        infinite |= out.abs() == torch.finfo(dtype).max
    if which == "q":
        assert infinite[1, ROW, 3].any() and not torch.isfinite(lse[1, 3, ROW])
        out[1, ROW, 3] = 0
    else:
        assert infinite[1, :, 2:, 4].all(), "every row attending the key"
        out[1, :, 2:] = 0
    assert torch.isfinite(out).all(), "the other rows stay finite"


# ---------------------------------------------------------------------------------------------
# Packed variable-length batches
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@HEAD_DIMS
def test_nan_varlen(device, dtype, d, causal, nan_poison):
    """One NaN source per sequence (sequences are independent): bias at a key of sequence 0,
    q row of sequence 2, k row of sequence 3 (causal: seen by its last rows only), v row of
    sequence 4. Sequence 1 (no queries) and every row the NaN does not reach equal the NaN-free
    call."""
    _skip_unsupported(device, dtype)
    lens_q, lens_k = [23, 0, 70, 9, 16], [30, 4, 70, 130, 16]
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(),  # noqa: E731
                                   dtype=torch.int32, device=device)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    q0, k0 = cu_q.tolist(), cu_k.tolist()
    tq, tk = sum(lens_q), sum(lens_k)
    gen = torch.Generator().manual_seed(5)
    q, dout = _randn((tq, H, d), dtype, device, gen), _randn((tq, H, d), dtype, device, gen)
    k, v = _randn((tk, HKV, d), dtype, device, gen), _randn((tk, HKV, d), dtype, device, gen)
    bias = torch.randn(HKV, tk, generator=gen).to(device)

    def call(q, k, v, bias, **kw):
        return dmattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), None, bias, **kw)

    clean = _run(call, q, k, v, bias, dout, causal=causal)
    qn, kn, vn, bn = q.clone(), k.clone(), v.clone(), bias.clone()
    bn[1, k0[0] + 5] = NAN             # sequence 0, heads 2, 3
    qn[q0[2] + 40, 1, 7] = NAN         # sequence 2, head 1
    kn[k0[3] + 129, 0, 3] = NAN        # sequence 3, heads 0, 1 (causal: rows >= 8 see key 129)
    vn[k0[4] + 2, 1, 0] = NAN          # sequence 4, heads 2, 3 (causal: rows >= 2)
    res = _run(call, qn, kn, vn, bn, dout, causal=causal)

    rows = torch.zeros(tq, H, dtype=torch.bool)  # rows the NaN reaches: out, lse, dq
    rows[q0[0]:q0[1], 2:] = True  # key 5 of 30: seen by every row (causal: off 7)
    rows[q0[2] + 40, 1] = True
    rows[q0[3] + (8 if causal else 0):q0[4], :2] = True
    rows[q0[4] + (2 if causal else 0):q0[5], 2:] = True
    lse_rows = rows.clone()
    lse_rows[q0[4]:q0[5]] = False  # lse does not depend on v
    # Left open (see the dense tests): out of the rows before the NaN v row (P = 0 times it);
    # dq of the rows of sequences 3 and 4 that do not see the NaN key (dS = 0 times it).
    out_open = torch.zeros(tq, H, dtype=torch.bool)
    out_open[q0[4]:q0[5], 2:] = True
    dq_open = out_open.clone()
    dq_open[q0[3]:q0[4], :2] = True
    # dk, dv, dbias of the kv head / bias row of each NaN sequence's heads.
    keys_open = torch.zeros(tk, HKV, dtype=torch.bool)
    keys_open[k0[0]:k0[1], 1] = keys_open[k0[2]:k0[3], 0] = True
    keys_open[k0[3]:k0[4], 0] = keys_open[k0[4]:k0[5], 1] = True
    _close_rows("out", res["out"], clean["out"], rows, out_open)
    _close_rows("lse", res["lse"].unsqueeze(-1), clean["lse"].unsqueeze(-1), lse_rows.T)
    _close_rows("dq", res["dq"], clean["dq"], rows, dq_open)
    nan_k = torch.zeros(tk, HKV, dtype=torch.bool)
    nan_k[k0[3] + 129, 0] = True  # dk of the NaN key
    _close_rows("dk", res["dk"], clean["dk"], nan_k, keys_open)
    _close_rows("dv", res["dv"], clean["dv"], torch.zeros(tk, HKV, dtype=torch.bool), keys_open)
    nan_b = torch.zeros(HKV, tk, dtype=torch.bool)
    nan_b[1, k0[0] + 5] = True  # dbias of the NaN bias element
    _close_rows("dbias", res["dbias"].unsqueeze(-1), clean["dbias"].unsqueeze(-1), nan_b, keys_open.T)


# ---------------------------------------------------------------------------------------------
# Top-k: the gather path, the dense path, per-query
# ---------------------------------------------------------------------------------------------

S_TOPK, KEEP = 150, 24
TOPK_ROW = 130  # sees the NaN key too (causal), so that it attends something whatever is kept
# (path, causal): the gather and the dense path of a shared key set, the per-query interval path
# and its dense fallback (per_query=True is causal).
TOPK_CASES = [("gather", False), ("gather", True), ("dense", False), ("dense", True),
              ("per_query", True), ("per_query_dense", True)]


def _topk_call(path, causal):
    def call(q, k, v, bias, **kw):
        return dmattn.attention_topk(q, k, v, bias, KEEP, causal=causal, per_query=path.startswith("per_query"),
                                     **kw)

    def run(*args, **kw):
        saved = per_query_path._forced_dense
        per_query_path._forced_dense = path == "per_query_dense"
        try:
            with gather.force_path({"gather": "gather", "dense": "dense"}.get(path)):
                return _run(call, *args, **kw)
        finally:
            per_query_path._forced_dense = saved

    return run


@pytest.mark.parametrize("source", ["q", "k", "v", "bias", "minus_nan_bias"])
@pytest.mark.parametrize("path,causal", TOPK_CASES, ids=[f"{p}-{'causal' if c else 'full'}" for p, c in TOPK_CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@HEAD_DIMS
def test_nan_topk(device, dtype, d, path, causal, source):
    """One key set per (batch, head) from a (B, H, 1, S) bias (per_query: a key set per query,
    always causal). The NaN key carries the largest bias of its row (a NaN bias, of either
    sign, ranks as +inf), so it is kept wherever it is visible, in the NaN-free call alike."""
    _skip_unsupported(device, dtype)
    s = S_TOPK
    gen = torch.Generator().manual_seed(6)
    q, dout = _randn((B, s, H, d), dtype, device, gen), _randn((B, s, H, d), dtype, device, gen)
    k, v = _randn((B, s, HKV, d), dtype, device, gen), _randn((B, s, HKV, d), dtype, device, gen)
    bias = torch.randn(B, H, 1, s, generator=gen).to(dtype).to(device)
    bias[:, :, :, KEY] = 50.0
    run = _topk_call(path, causal)
    clean = run(q, k, v, bias, dout)
    args = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "bias": bias.clone()}
    rows = torch.zeros(B, s, H, dtype=torch.bool)  # (B, S, H): rows the NaN reaches
    heads = torch.zeros(B, s, H, dtype=torch.bool)  # the query heads it is in
    if source == "q":
        args["q"][1, TOPK_ROW, 3, 5] = NAN
        rows[1, TOPK_ROW, 3] = heads[1, :, 3] = True
    else:
        h = [3] if source.endswith("bias") else [2, 3]
        if source.endswith("bias"):
            args["bias"][1, 3, 0, KEY] = -NAN if source == "minus_nan_bias" else NAN
        else:
            args[source][1, KEY, 1, 4] = NAN
        rows[1, KEY if causal else 0:, h] = heads[1, :, h] = True
    res = run(args["q"], args["k"], args["v"], args["bias"], dout)
    # Rows before the NaN key (causal) keep exactly their NaN-free keys: out and lse finite,
    # except that a NaN v row may meet their P = 0; dq left open (dS = 0 times the row).
    out_open = heads & ~rows if source == "v" else None
    _close_rows("out", res["out"], clean["out"], rows, out_open)
    lse_rows = rows if source != "v" else torch.zeros_like(rows)  # lse does not depend on v
    _close_rows("lse", res["lse"].unsqueeze(-1), clean["lse"].unsqueeze(-1), lse_rows.transpose(1, 2))
    _close_rows("dq", res["dq"], clean["dq"], rows, heads & ~rows)
    kv_open = torch.zeros(B, s, HKV, dtype=torch.bool)
    kv_open[1, :, 1] = True
    for name in ("dk", "dv"):
        _close_rows(name, res[name], clean[name], torch.zeros_like(kv_open), kv_open)
    db_open = torch.zeros(B, H, 1, dtype=torch.bool)
    db_open[1, 2:] = True
    _close_rows("dbias", res["dbias"], clean["dbias"], torch.zeros_like(db_open), db_open)


@pytest.mark.parametrize("negative", [False, True], ids=["nan", "minus_nan"])
def test_dynamic_mask_selects_nan_as_inf(device, negative):
    """In the selection a NaN bias (either sign) ranks as +inf: it is kept, ties going to the
    lower index as for any value; a NaN never empties a row's selection."""
    bias = torch.tensor([[0.5, -1.0, NAN, 2.0, INF, NAN, 0.0, 1.0]])
    if negative:
        bias[0, 2] = -bias[0, 2].abs()  # the sign bit set (x86's default NaN is negative)
        bias[0, 5] = -bias[0, 5].abs()
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        b = bias.to(dtype).to(device)
        for keep, expected in ((1, [2]), (2, [2, 4]), (3, [2, 4, 5]), (4, [2, 3, 4, 5])):
            got = dmattn.dynamic_mask(b, keep)[0].nonzero().flatten().tolist()
            assert got == expected, f"{dtype} keep {keep}: {got} != {expected}"
        mask = torch.tensor([[True, True, False, True, True, True, True, True]], device=device)
        got = dmattn.dynamic_mask(b, 2, mask)[0].nonzero().flatten().tolist()
        assert got == [4, 5], f"{dtype}: a masked NaN is never selected: {got}"
