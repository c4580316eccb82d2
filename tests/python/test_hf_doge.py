"""transformers' Doge with attn_implementation="dmattn" (dmattn.integrations.doge): the same
logits, loss, gradients and generated tokens as HF's eager path, on dmattn.attention_topk
(per_query=True) without any (Sq, Sk) tensor, without host synchronization and without graph
breaks. CPU, fp32, tiny configs; skipped where transformers (with Doge) is not importable.

Token ids are distinct within a sequence: Doge's first-layer dt_states depend on the token
alone (values carry no position), so a repeated token ties exactly, and HF's torch.topk leaves
the order of ties unspecified where dmattn keeps the lower key index.
"""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import transformers
    from transformers.models.doge import modeling_doge
    from transformers.utils import is_torch_available
    if not is_torch_available():
        transformers = None
except ImportError:
    transformers = None

pytestmark = pytest.mark.skipif(transformers is None,
                                reason="transformers with Doge (and torch support) not installed")

if transformers is not None:
    from dmattn.integrations import doge as dmattn_doge
    from dmattn.integrations import transformers as hf_dmattn

VOCAB, SEQ, KEEP, BATCH = 128, 24, 8, 2
TOL = dict(atol=2e-5, rtol=1e-4)


def _model(is_moe=False, **overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  keep_window_size=KEEP, is_moe=is_moe, tie_word_embeddings=False)
    if is_moe:
        config.update(num_experts=16, num_experts_per_tok=2)
    config.update(overrides)
    model = transformers.DogeForCausalLM(transformers.DogeConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".A"):  # zero at init (dt_states all 1: ties); random, non-zero
                p.copy_(torch.randn_like(p) + torch.sign(torch.randn_like(p)))
    return model


def _batch(left_pad):
    """Distinct token ids per sequence; sequence 1 left-padded by ``left_pad`` tokens. Labels
    ignore the padding and the first real token (the loss would read its prediction from the
    last padded row, whose output is a convention: eager averages, dmattn gives 0)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(VOCAB, generator=g)[:SEQ] for _ in range(BATCH)])
    pad = torch.ones(BATCH, SEQ, dtype=torch.long)
    pad[1, :left_pad] = 0
    labels = ids.masked_fill(pad == 0, -100)
    labels[1, left_pad] = -100
    return ids, pad, labels


def _run(model, impl, ids, pad, labels):
    model.set_attn_implementation(impl)
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=pad, labels=labels, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.fixture(autouse=True)
def _registered():
    hf_dmattn.register()


@pytest.mark.parametrize("left_pad", [0, 5], ids=["no_padding", "left_padding"])
@pytest.mark.parametrize("is_moe", [False, True], ids=["mlp", "moe"])
def test_forward_backward_match_eager(left_pad, is_moe):
    if is_moe and left_pad:
        # HF's CDMoE mixes router logits across tokens (its own note), so padded rows, which
        # differ by convention (eager averages, dmattn gives 0), reach real tokens there.
        pytest.skip("CDMoE routing mixes padded rows into real tokens")
    model = _model(is_moe=is_moe).train()
    ids, pad, labels = _batch(left_pad)
    try:
        logits_e, loss_e, grads_e = _run(model, "eager", ids, pad, labels)
    except TypeError as err:  # transformers 5.17's decoder layer takes CDMoE's tuple as a tensor
        if not is_moe:
            raise
        pytest.skip(f"this transformers' Doge MoE fails with eager attention too: {err}")
    logits_d, loss_d, grads_d = _run(model, "dmattn", ids, pad, labels)
    real = pad.bool()
    torch.testing.assert_close(logits_d[real], logits_e[real], **TOL)
    torch.testing.assert_close(loss_d, loss_e, **TOL)
    assert grads_d.keys() == grads_e.keys()
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_d[name], g, **TOL, msg=name)
    assert any(n.endswith(".A") and g.abs().sum() > 0 for n, g in grads_d.items())  # through the bias


@pytest.mark.parametrize("left_pad", [0, 3], ids=["no_padding", "left_padding"])
def test_generate_matches_eager(left_pad):
    """Greedy decoding with a cache: each step (Sq = 1) selects among all the cache's keys."""
    model = _model().eval()
    ids, pad, _ = _batch(left_pad)
    ids, pad = ids[:, :12], pad[:, :12]  # 12 + 6 new tokens: more than KEEP keys in every step
    tokens = {}
    for impl in ("eager", "dmattn"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=ids, attention_mask=pad, max_new_tokens=6, do_sample=False,
                                      pad_token_id=0)
    assert torch.equal(tokens["dmattn"], tokens["eager"])


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("left_pad", [0, 5], ids=["no_padding", "left_padding"])
def test_no_query_by_key_tensor(monkeypatch, left_pad):
    """HF's dense dynamic mask is never built and attention_topk gets the key-side bias and key
    mask; outside attention_topk (whose reference path is replaced by a stub here) no op
    returns a tensor with two dimensions of the sequence length."""
    calls = []

    def stub(q, k, v, bias, keep, **kwargs):
        calls.append(dict(bias=tuple(bias.shape), keep=keep, mask=None if kwargs["mask"] is None
                          else tuple(kwargs["mask"].shape), **{n: kwargs[n] for n in ("causal", "per_query")}))
        return q * 1.0

    def refuse(*args, **kwargs):
        raise AssertionError("prepare_dynamic_mask called: a (B, H, Sq, Sk) mask")

    monkeypatch.setattr(dmattn_doge, "attention_topk", stub)
    monkeypatch.setattr(modeling_doge.DogeAttention, "prepare_dynamic_mask", refuse)
    model = _model().eval()
    model.set_attn_implementation("dmattn")
    ids, pad, _ = _batch(left_pad)
    with torch.no_grad(), _Shapes() as record:
        model(input_ids=ids, attention_mask=pad, use_cache=False)
    assert len(calls) == 2
    mask_shape = (BATCH, 1, 1, SEQ) if left_pad else None
    for call in calls:
        assert call == dict(bias=(BATCH, 2, 1, SEQ), keep=KEEP, mask=mask_shape, causal=True, per_query=True)
    square = [(op, s) for op, s in record.shapes if sum(d == SEQ for d in s) >= 2]
    assert not square, square


def test_sliding_window_falls_back_once(monkeypatch):
    """A sliding window is no interval pattern: HF's own Doge path (through the attention
    function with its float mask), announced once, still matching eager."""
    monkeypatch.setattr(dmattn_doge, "_warned", False)
    model = _model(sliding_window=6).eval()
    ids, pad, _ = _batch(4)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=pad, use_cache=False).logits
    model.set_attn_implementation("dmattn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=pad, use_cache=False).logits
    fallbacks = [w for w in caught if "not plain causal" in str(w.message)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    real = pad.bool()
    torch.testing.assert_close(got[real], want[real], **TOL)


def test_other_implementations_run_hf_forward(monkeypatch):
    """The hook only answers to dmattn's names: sdpa / eager run HF's forward untouched."""
    called = []
    monkeypatch.setattr(dmattn_doge, "attention_topk", lambda *a, **k: called.append(1))
    model = _model().eval()
    ids, pad, _ = _batch(3)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=pad, use_cache=False)
    assert not called


@pytest.mark.parametrize("name", ["llama", "doge"])
def test_no_graph_breaks(name):
    """torch._dynamo.explain over a whole tiny model with left padding: one graph, no break
    (no host synchronization in the mask function, the attention function or the Doge hook)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = _model()
    model.set_attn_implementation("dmattn")
    model.eval()
    ids, pad, _ = _batch(5)
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=pad, use_cache=False)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1
