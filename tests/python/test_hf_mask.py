"""dmattn's transformers mask function (dmattn.integrations.hf_mask): the compact form (None or
the 2D padding mask) exactly where it means the same as sdpa's 4D mask, sdpa's mask otherwise;
and whole tiny Llama models on it against sdpa (chunked prefill, static cache). Skipped where
transformers is not importable."""

import inspect

import pytest
import torch

try:
    import transformers
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import (causal_mask_function, create_causal_mask, sdpa_mask,
                                            sliding_window_causal_mask_function)
    from transformers.utils import is_torch_available
    if not is_torch_available():
        transformers = None
except ImportError:
    transformers = None

pytestmark = pytest.mark.skipif(transformers is None, reason="transformers (with torch support) not installed")

if transformers is not None:
    from dmattn.integrations import transformers as hf_dmattn
    from dmattn.integrations.hf_mask import compact_causal_mask

from dmattn.per_query import visible_keys

B = 2


def _padding(kv_length, left=3):
    pad = torch.ones(B, kv_length, dtype=torch.bool)
    pad[1, :left] = False
    return pad


def _dense(compact, q_length, kv_length):
    """What the attention function makes of a compact mask: causal bottom-right & key mask."""
    allowed = visible_keys(q_length, kv_length, "cpu").expand(B, 1, q_length, kv_length)
    return allowed if compact is None else allowed & compact[:, None, None, :kv_length]


def _sdpa(q_length, kv_length, q_offset, attention_mask, **kw):
    return sdpa_mask(batch_size=B, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     attention_mask=attention_mask, allow_is_causal_skip=False, **kw)


@pytest.mark.parametrize("q_length,past", [(7, 0), (1, 6), (3, 4)], ids=["prefill", "decode", "chunk"])
@pytest.mark.parametrize("padded", [False, True])
def test_compact_form_means_sdpa_mask(q_length, past, padded):
    kv_length = past + q_length
    attention_mask = _padding(kv_length) if padded else None
    got = compact_causal_mask(B, q_length, kv_length, q_offset=past, attention_mask=attention_mask)
    aligned = q_length in (1, kv_length)
    if aligned and not padded:
        assert got is None
    else:  # padding, or a chunk against a cache (None would read as sdpa's top-left skip)
        assert got.dtype == torch.bool and tuple(got.shape) == (B, kv_length)
    assert torch.equal(_dense(got, q_length, kv_length), _sdpa(q_length, kv_length, past, attention_mask))


def test_no_padding_read_without_host_reads(monkeypatch):
    """Telling "no padding" apart reads the mask on the host; where that is not allowed (a CUDA
    graph being captured, torch.compile) the 2D mask is returned as it is, which means the same."""
    import dmattn.integrations.hf_mask as hf_mask
    no_padding = torch.ones(B, 7, dtype=torch.bool)
    assert compact_causal_mask(B, 7, 7, attention_mask=no_padding) is None
    monkeypatch.setattr(hf_mask, "host_reads_allowed", lambda t: False)
    got = compact_causal_mask(B, 7, 7, attention_mask=no_padding)
    assert torch.equal(got, no_padding)


def test_padding_mask_longer_than_keys_and_all_ones():
    longer = torch.ones(B, 9, dtype=torch.long)
    assert compact_causal_mask(B, 6, 6, attention_mask=longer) is None  # no padding among the keys
    longer[0, 7] = 0  # past the keys: no padding that matters
    assert compact_causal_mask(B, 6, 6, attention_mask=longer) is None
    longer[1, 2] = 0
    got = compact_causal_mask(B, 6, 6, attention_mask=longer)
    assert torch.equal(got, longer[:, :6] != 0)


@pytest.mark.parametrize("case", ["sliding", "kv_offset", "static_slots", "tensor_offset", "short_mask",
                                  "no_skip"])
def test_other_patterns_are_sdpa_mask(case):
    q_length, kv_length, q_offset, kv_offset = 5, 5, 0, 0
    kw = dict(mask_function=causal_mask_function, attention_mask=_padding(5))
    if case == "sliding":
        kw["mask_function"] = sliding_window_causal_mask_function(3)
    elif case == "kv_offset":
        kv_offset = 2
        kw["attention_mask"] = _padding(7)
    elif case == "static_slots":  # a static cache: keys past the queries are empty slots
        kv_length = 9
    elif case == "tensor_offset":
        q_offset = torch.tensor(0)
    elif case == "short_mask":
        kv_length, q_offset = 8, 3
        kw["attention_mask"] = _padding(6)
    else:  # the caller needs a materialized mask (not a Doge config)
        kw["allow_is_causal_skip"] = False
    args = dict(batch_size=B, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset, **kw)
    got = compact_causal_mask(**args)
    want = sdpa_mask(**args)
    assert got is not None and got.dim() == 4
    assert torch.equal(got, want)


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def test_create_causal_mask_packed_sequences_stay_4d():
    """Packed sequences (position ids restarting, no 2D mask): sdpa's block-diagonal 4D mask."""
    hf_dmattn.register()
    model = _llama()
    model.set_attn_implementation("dmattn")
    embeds = torch.zeros(1, 6, 32)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])
    # (config, inputs_embeds, attention_mask, cache) positionally: the cache's keyword differs
    # between transformers versions.
    got = create_causal_mask(model.config, embeds, None, None, position_ids=position_ids)
    assert got is not None and got.dim() == 4 and not got[0, 0, 3, 0]  # no attention across sequences
    plain = create_causal_mask(model.config, embeds, None, None, position_ids=torch.arange(6)[None])
    assert plain is None


@pytest.mark.parametrize("padded", [False, True])
def test_llama_chunked_prefill_matches_sdpa(padded):
    """A chunk of queries against a cache (Sk > Sq > 1): the 2D mask, bottom-right causal."""
    hf_dmattn.register()
    model = _llama()
    ids = torch.randint(0, 64, (B, 10))
    pad = torch.ones(B, 10, dtype=torch.long)
    if padded:
        pad[1, :3] = 0
    # The cache's keyword: `cache` in recent transformers, `past_key_values` before.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = {}
    for impl in ("sdpa", "dmattn"):
        model.set_attn_implementation(impl)
        cache = {cache_kw: DynamicCache(config=model.config)}
        with torch.no_grad():
            model(input_ids=ids[:, :6], attention_mask=pad[:, :6], use_cache=True, **cache)
            logits[impl] = model(input_ids=ids[:, 6:], attention_mask=pad, use_cache=True, **cache).logits
    torch.testing.assert_close(logits["dmattn"], logits["sdpa"], atol=1e-5, rtol=1e-5)


def test_llama_static_cache_generate_matches_sdpa():
    """A static cache (tensor offsets, empty slots): sdpa's mask, handed on unchanged."""
    hf_dmattn.register()
    model = _llama()
    ids = torch.randint(0, 64, (B, 8))
    pad = torch.ones(B, 8, dtype=torch.long)
    pad[1, :2] = 0
    tokens = {}
    for impl in ("sdpa", "dmattn"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(input_ids=ids, attention_mask=pad, max_new_tokens=3, do_sample=False,
                                      pad_token_id=0, cache_implementation="static")
    assert torch.equal(tokens["dmattn"], tokens["sdpa"])
