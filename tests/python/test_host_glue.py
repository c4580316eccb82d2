"""The host-side glue of dmattn.attention_topk's gather path (dmattn/gather.py, masks.py).

* masks.selection_key orders keys exactly as dynamic_mask selects (ties, signed zeros, -inf,
  finfo.min, masked keys, rows with fewer allowed keys than keep, the 64-bit key for long
  16-bit rows), and topk_key_set's positions equal the compaction of dynamic_mask's set;
* no host synchronization in attention_topk's forward or backward: no ATen op that reads
  tensor values on the host (.item(), bool(t), nonzero, ...) and no Tensor.item / tolist /
  cpu / numpy / __bool__ / __int__ / __float__ / __index__ call (patched to raise), for every
  bias dtype and with a padding mask; dmattn.attention's gather choice keeps its one sync;
* an ATen op budget per call (counted with a TorchDispatchMode), so that the glue does not
  grow back (before the top-k key: 58 ops per forward, 75 per forward + backward).

On the CPU the ops run synchronously anyway; what is checked is that the same calls on CUDA
would not wait for the device (docs/semantics.md, "Gather path").
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dmattn
from dmattn import gather
from dmattn.masks import bias_over_keys, dynamic_mask, selection_key

# ATen ops whose result needs tensor values on the host (a device synchronization on CUDA);
# repeat_interleave with tensor repeats also, unless given its output_size (int repeats
# decompose into expand + clone before dispatch).
SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero",
            "aten::masked_select", "aten::unique_consecutive", "aten::_unique2", "aten::unique_dim",
            "aten::equal", "aten::allclose"}


def _is_sync(func, args, kwargs) -> bool:
    name = func._schema.name
    if name == "aten::repeat_interleave":
        return (kwargs or {}).get("output_size") is None  # a keyword-only argument
    return name in SYNC_OPS


# Tensor methods that read values on the host.
HOST_READS = ["item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"]


class OpLog(TorchDispatchMode):
    """Counts the ATen (and dmattn) ops dispatched while active; raises on a sync op."""

    def __init__(self, forbid_sync=True):
        super().__init__()
        self.ops = collections.Counter()
        self.forbid_sync = forbid_sync
        self.positions = []  # key_positions given to dmattn::fwd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if self.forbid_sync and _is_sync(func, args, kwargs):
            raise AssertionError(f"host synchronization: {name}")
        self.ops[name] += 1
        if name == "dmattn::fwd":
            self.positions.append(args[11] if len(args) > 11 else (kwargs or {}).get("key_positions"))
        return func(*args, **(kwargs or {}))

    @property
    def total(self):
        return sum(self.ops.values())


@pytest.fixture
def no_host_reads(monkeypatch):
    """A function that, once called, makes the Tensor methods that read values on the host
    raise until the test ends (monkeypatch restores them)."""
    def forbid():
        for name in HOST_READS:
            def raiser(self, *args, _name=name, **kwargs):
                raise AssertionError(f"host read: Tensor.{_name}")
            monkeypatch.setattr(torch.Tensor, name, raiser)
    return forbid


def _inputs(dtype, b=2, sq=12, sk=48, h=4, hkv=2, d=16, bias_heads=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(b, sk, hkv, d, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(b, sk, hkv, d, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(b, bias_heads, 1, sk, generator=gen).to(dtype).requires_grad_()
    mask = torch.rand(b, 1, 1, sk, generator=gen) < 0.5
    return q, k, v, bias, mask, torch.randn(q.shape, generator=gen).to(dtype)


def _tied(shape, dtype, gen):
    """Few distinct values: ties, 0.0 and -0.0, -inf, +inf, finfo.min / max, subnormals."""
    values = torch.tensor([0.0, -0.0, 0.5, -0.5, 1.0, float("-inf"), float("inf"),
                           torch.finfo(dtype).min, torch.finfo(dtype).max, torch.finfo(dtype).tiny / 2,
                           -torch.finfo(dtype).tiny / 2], dtype=torch.float64)
    return values[torch.randint(0, len(values), shape, generator=gen)].to(dtype)


# ---- The selection key.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_selection_key_matches_dynamic_mask(dtype):
    gen = torch.Generator().manual_seed(1)
    for trial in range(120):
        rows, sk = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 60, (1,), generator=gen))
        keep = int(torch.randint(1, sk + 1, (1,), generator=gen))
        bias = _tied((rows, sk), dtype, gen) if trial % 2 else torch.randn(rows, sk, generator=gen).to(dtype)
        mask = torch.rand(rows, sk, generator=gen) < 0.4 if trial % 3 else None
        key = selection_key(bias, mask)
        values, index = key.topk(keep, dim=-1, sorted=False)
        kept = values != torch.iinfo(key.dtype).min  # excluded keys fill short rows
        got = torch.zeros(rows, sk, dtype=torch.bool).scatter_(-1, index, kept)
        assert torch.equal(got, dynamic_mask(bias, keep, mask)), f"trial {trial}"
        if mask is None:  # distinct within a row
            assert (key.sort(dim=-1).values.diff(dim=-1) > 0).all()


def test_selection_key_long_rows():
    """More than 2^16 keys: a 16-bit bias gets the 64-bit key (ordered * 2^32 - index)."""
    gen = torch.Generator().manual_seed(2)
    sk = (1 << 16) + 300
    bias = _tied((2, sk), torch.bfloat16, gen)
    key = selection_key(bias, None)
    assert key.dtype == torch.int64
    for keep in (1, 1000, sk - 5):
        got = torch.zeros(2, sk, dtype=torch.bool).scatter_(-1, key.topk(keep, dim=-1).indices, True)
        assert torch.equal(got, dynamic_mask(bias, keep)), keep
    assert selection_key(bias[:, :100], None).dtype == torch.int32
    assert selection_key(bias.double(), None) is None  # float64: dynamic_mask's way


# (B, bias shape, mask shape or None, Hkv, keep): key set heads 1 / Hkv / H, rows with fewer
# allowed keys than keep, keep >= Sk with a mask, a key-broadcast bias.
KEY_SETS = [
    ((2, 4, 1, 40), None, 2, 7),
    ((2, 4, 1, 40), (2, 1, 1, 40), 2, 30),
    ((1, 2, 1, 40), (2, 1, 1, 40), 2, 9),
    ((40,), (2, 4, 1, 40), 4, 5),
    ((2, 4, 1, 40), (2, 4, 1, 40), 2, 100),
    ((2, 1, 1, 1), (2, 1, 1, 40), 2, 6),
    ((4, 1, 40), None, 1, 39),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", range(len(KEY_SETS)))
def test_topk_key_set_positions(dtype, case):
    bias_shape, mask_shape, hkv, keep = KEY_SETS[case]
    gen = torch.Generator().manual_seed(case)
    q = torch.zeros(2, 3, 4, 8)
    k = torch.zeros(2, 40, hkv, 8)
    bias = _tied(bias_shape, dtype, gen)
    mask = None if mask_shape is None else torch.rand(mask_shape, generator=gen) < 0.3
    key_set = gather.topk_key_set(q, k, bias, keep, mask, False)
    selected = dynamic_mask(bias_over_keys(bias, 40), keep, mask)
    kept = gather._key_side_view(selected, 2, 4, hkv, 40)
    expected = gather.compact_positions(kept, min(keep, 40))
    assert key_set.positions.dtype == torch.int32 and key_set.positions.stride(-1) == 1
    assert torch.equal(key_set.positions, expected)
    assert torch.equal(key_set.index, expected.long().clamp_min(0))  # padding reads key 0
    assert key_set.width == min(keep, 40)


# ---- No host synchronization, and the op budget.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("bias_heads", [1, 2, 4])  # key set per batch, per kv head, per query head
def test_attention_topk_no_host_sync(no_host_reads, dtype, with_mask, bias_heads):
    q, k, v, bias, mask, dout = _inputs(dtype, bias_heads=bias_heads)
    log = OpLog()
    with log:
        no_host_reads()
        out = dmattn.attention_topk(q, k, v, bias, 10, mask=mask if with_mask else None, causal=True)
        out.backward(dout)
    assert len(log.positions) == 1 and log.positions[0] is not None  # the gather path ran
    assert log.ops["dmattn::bwd"] == 1
    for t in (q, k, v, bias):
        assert t.grad is not None


def test_attention_mask_gather_has_one_sync():
    """dmattn.attention's own gather choice reads the largest kept count: its one documented
    synchronization (attention_topk knows its width, min(keep, Sk), on the host)."""
    q, k, v, bias, _, dout = _inputs(torch.float32, sk=256)
    mask = torch.rand(2, 4, 1, 256, generator=torch.Generator().manual_seed(3)) < 0.2
    log = OpLog(forbid_sync=False)
    with log:
        dmattn.attention(q, k, v, mask, bias, causal=True).backward(dout)
    assert log.positions[0] is not None
    assert log.ops["aten::_local_scalar_dense"] == 1


# Ops per call at the budget's configuration (fp32, (B, H, 1, Sk) bias, Hkv = H): forward
# without grad, forward + backward with every gradient. Counted: 32 and 44 (torch 2.13); the
# budget leaves room for torch versions that dispatch a view more or less.
OP_BUDGET = {"forward": 40, "forward + backward": 56}


def test_attention_topk_op_budget():
    q, k, v, bias, _, dout = _inputs(torch.float32, h=4, hkv=4)
    with torch.no_grad(), OpLog() as fwd_log:
        dmattn.attention_topk(q, k, v, bias, 10, causal=True)
    with OpLog() as step_log:
        dmattn.attention_topk(q, k, v, bias, 10, causal=True).backward(dout)
    for name, log in (("forward", fwd_log), ("forward + backward", step_log)):
        assert log.total <= OP_BUDGET[name], f"{name}: {log.total} ops > {OP_BUDGET[name]}: {dict(log.ops)}"
    # The selection works on keep ints per row: nothing of dynamic_mask's bool mask over Sk
    # and its compaction (cumsum, scatter), no zero-filled gradient for lse. The backward's one
    # scatter_ is dbias copied back onto the bias's keys.
    for op in ("aten::cumsum", "aten::scatter", "aten::scatter_", "aten::zeros"):
        assert op not in fwd_log.ops, op
    for op in ("aten::cumsum", "aten::scatter", "aten::zeros"):
        assert op not in step_log.ops, op
    assert step_log.ops["aten::scatter_"] <= 1


# ---- The eager autograd of the ops (ops.forward_with_grad, ops.varlen_forward_with_grad).


@pytest.mark.parametrize("gathered", [False, True])
def test_forward_with_grad_equals_registered_autograd(gathered):
    """The Python API's autograd.Function around dmattn::fwd gives what the op's registered
    autograd gives (torch.ops.dmattn.fwd called directly), bitwise, with and without the
    trailing optional arguments."""
    from dmattn import ops
    q, k, v, bias, mask, dout = _inputs(torch.float32, sk=12)
    extra = (torch.tensor([[[0, 3, 5, 7, 9, 10, 11, 13, 17, 18, 19, -1]]], dtype=torch.int32), 20) if gathered else ()
    results = []
    for fn in (ops.forward_with_grad, torch.ops.dmattn.fwd):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
        out, lse = fn(*leaves[:3], mask[..., :12] if not gathered else None, leaves[3], True, -1, -1, None,
                      0.0, False, *extra)
        assert not lse.requires_grad
        results.append([out, lse, *torch.autograd.grad(out, leaves, dout)])
    for got, expected in zip(*results):
        assert torch.equal(got, expected)


def test_varlen_forward_with_grad_equals_registered_autograd():
    from dmattn import ops
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(10, 4, 16, generator=gen) for _ in range(3))
    bias = torch.randn(4, 10, generator=gen)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    dout = torch.randn(10, 4, 16, generator=gen)
    results = []
    for fn in (ops.varlen_forward_with_grad, torch.ops.dmattn.fwd_varlen):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
        out, lse = fn(*leaves[:3], cu, cu, 7, 7, None, leaves[3], True, -1, -1, None, 0.0, False)
        results.append([out, lse, *torch.autograd.grad(out, leaves, dout)])
    for got, expected in zip(*results):
        assert torch.equal(got, expected)
