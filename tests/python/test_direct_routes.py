"""The decode direct routes (docs/decode.md, "Host time": attention_with_kvcache's, dmattn.attention's,
the transformers integration's decoding step and attention_topk's native form) hand the native
call exactly the arguments their checked routes do, and leave it for the checked route where
the call is not theirs (a gradient to record, an int cache_seqlens, another dtype, too many
rows). On the CPU: a child process makes its CPU tensors pass for CUDA ones (is_cuda,
get_device) and stands a recorder in for the native library, so the routes' Python runs as on
a GPU and every native call is recorded (tensors by shape, dtype and which input they are).
The GPU tests compare the routes' results bit for bit (test_kvcache.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(r"""
    import json, math, sys
    import torch
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.Tensor.get_device = lambda self: 0
    torch.cuda.current_device = lambda: 0
    import dmattn
    import dmattn._op_utils as op_utils
    import dmattn.decode as decode
    import dmattn.decode_kernel as decode_kernel
    import dmattn.interface as interface
    import dmattn.kvcache as kvcache
    import dmattn.topk as topk

    calls = []
    named = {}

    def describe(x):
        if isinstance(x, torch.Tensor):
            for name, t in named.items():
                if x is t:
                    return name
            return ["tensor", list(x.shape), str(x.dtype)]
        if isinstance(x, float) and math.isnan(x):
            return "nan"
        return x

    class Native:
        def decode_attention(self, *args):
            calls.append(["decode_attention"] + [describe(x) for x in args])
            return args[0].clone()
        def topk_attention(self, *args):
            calls.append(["topk_attention"] + [describe(x) for x in args])
            return args[0].clone()
        def decode_splits(self, *args):
            return 4

    native = Native()
    for module in (decode_kernel, topk):
        module.lib = lambda: native
    decode_kernel.native_allocates = lambda: True
    topk.native_allocates = lambda: True
    decode_kernel.check_cuda_index = lambda index: None
    op_utils.check_cuda_device = lambda device: None
    interface.decode_enabled = lambda: True
    topk.native_glue_available = lambda: True
    topk._native_supports_key_positions = lambda device: True
    topk.gathered_decode_splits = lambda q, k, keep: 4

    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    q = torch.randn(2, 1, 8, 64, generator=g).to(bf16)
    q4 = torch.randn(2, 4, 8, 64, generator=g).to(bf16)
    k = torch.randn(2, 96, 2, 64, generator=g).to(bf16)
    v = torch.randn(2, 96, 2, 64, generator=g).to(bf16)
    k_hf = k.transpose(1, 2).contiguous().transpose(1, 2)  # transformers' (B, Hkv, S, D) seen as (B, S, Hkv, D)
    lens = torch.tensor([96, 40], dtype=torch.int32)
    bias = torch.randn(2, 8, 1, 96, generator=g).to(bf16)
    key_bias = torch.randn(2, 2, 1, 96, generator=g).to(bf16)
    mask = torch.rand(2, 1, 1, 96, generator=g) > 0.3
    # 256 keys, about 1 in 8 kept: the checked route would gather them (one host synchronization)
    k_long = torch.randn(2, 256, 2, 64, generator=g).to(bf16)
    v_long = torch.randn(2, 256, 2, 64, generator=g).to(bf16)
    sparse_mask = torch.rand(2, 1, 1, 256, generator=g) > 0.875
    named.update(q=q, q4=q4, k=k, v=v, k_hf=k_hf, lens=lens, bias=bias, key_bias=key_bias, mask=mask,
                 k_long=k_long, v_long=v_long, sparse_mask=sparse_mask)

    def run(fn, direct):
        # direct False: the checked route (the direct routes' tests answer "not mine")
        saved = decode_kernel.direct_decode_splits
        if not direct:
            refuse = lambda *args, **kwargs: 0
            for module in (decode_kernel, decode, interface, kvcache):
                module.direct_decode_splits = refuse
            topk_form, topk._native_form = topk._native_form, lambda *args: False
        calls.clear()
        try:
            result = fn()
            outcome = "none" if result is None else "ran"
        except Exception as e:  # the checked route of a call this process cannot run
            outcome = type(e).__name__
        finally:
            if not direct:
                for module in (decode_kernel, decode, interface, kvcache):
                    module.direct_decode_splits = saved
                topk._native_form = topk_form
        return [outcome, list(calls)]

    cases = {
        "kvcache": lambda: dmattn.attention_with_kvcache(q, k, v, cache_seqlens=lens, causal=False),
        "kvcache lse bias window": lambda: dmattn.attention_with_kvcache(
            q4, k, v, cache_seqlens=lens, bias=bias, window=(17, 0), scale=0.3, softcap=5.0, return_lse=True),
        "kvcache mask": lambda: dmattn.attention_with_kvcache(q, k, v, cache_seqlens=lens, mask=mask),
        "kvcache hf layout": lambda: dmattn.attention_with_kvcache(q, k_hf, k_hf, cache_seqlens=lens),
        "attention": lambda: dmattn.attention(q, k, v),
        "attention bias lse": lambda: dmattn.attention(q4, k, v, bias=bias, causal=True, return_lse=True),
        "attention mask": lambda: dmattn.attention(q, k, v, mask),
        "flash_dmattn_func mask bias": lambda: dmattn.flash_dmattn_func(q4, k, v, mask, bias, is_causal=True),
        "attention sparse mask": lambda: dmattn.attention(q, k_long, v_long, sparse_mask),
        "decode_step": lambda: decode.decode_step(q, k_hf, k_hf, None, None, True, None, 0.0),
        "decode_step mask bias": lambda: decode.decode_step(q4, k, v, mask, bias, False, 0.5, 3.0),
        "topk step": lambda: dmattn.attention_topk(q, k, v, key_bias, 32, causal=True, per_query=True),
    }
    results = {}
    with torch.no_grad():
        for name, fn in cases.items():
            results[name] = [run(fn, True), run(fn, False)]
    # Calls that are not the direct routes': what their tests answer (the split count; none where
    # a test before them declines), recorded around direct_decode_splits.
    answers = []
    real_splits = decode_kernel.direct_decode_splits
    def recorded(*args, **kwargs):
        answers.append(real_splits(*args, **kwargs))
        return answers[-1]
    for module in (decode_kernel, decode, interface, kvcache):
        module.direct_decode_splits = recorded
    def answered(fn):
        answers.clear()
        run(fn, True)
        return list(answers)
    qg = q.clone().requires_grad_()
    results["gradient"] = answered(lambda: dmattn.attention_with_kvcache(qg, k, v, cache_seqlens=lens))
    results["gradient, attention"] = answered(lambda: dmattn.attention(qg, k, v))
    with torch.no_grad():
        results["int lengths"] = answered(lambda: dmattn.attention_with_kvcache(q, k, v, cache_seqlens=96))
        results["float32"] = answered(lambda: dmattn.attention_with_kvcache(q.float(), k.float(), v.float(),
                                                                            cache_seqlens=lens))
        q_many = torch.randn(2, 40, 8, 64, generator=g).to(bf16)
        results["rows"] = answered(lambda: decode.decode_step(q_many, k, v, None, None, True, None, 0.0))
        results["subclass"] = answered(lambda: dmattn.attention_with_kvcache(
            torch.nn.Parameter(q, requires_grad=False), k, v, cache_seqlens=lens))
        results["usual"] = answered(lambda: dmattn.attention_with_kvcache(q, k, v, cache_seqlens=lens))
        import dmattn.gather as gather
        with gather.force_path("gather"):
            results["path forced"] = answered(lambda: dmattn.attention(q, k_long, v_long, sparse_mask))
    json.dump(results, sys.stdout)
""")


def _routes():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_direct_routes_call_the_native_decode_as_the_checked_routes():
    results = _routes()
    for name in ("kvcache", "kvcache lse bias window", "kvcache mask", "kvcache hf layout", "attention",
                 "attention bias lse", "attention mask", "flash_dmattn_func mask bias", "attention sparse mask",
                 "decode_step", "decode_step mask bias"):
        (direct, direct_calls), (checked, checked_calls) = results[name]
        assert direct == "ran" and len(direct_calls) == 1, (name, direct, direct_calls)
        if name in ("attention", "attention mask", "attention sparse mask", "flash_dmattn_func mask bias"):
            # (dmattn::fwd's body always asks for the lse; the direct route, without return_lse
            # -- flash_dmattn_func's without return_attn_probs -- leaves it to the native call's
            # workspace)
            rows = 4 if name.startswith("flash_dmattn_func") else 1  # (q4: four query rows)
            assert checked_calls[0][4] == ["tensor", [2, 8, rows], "torch.float32"] and direct_calls[0][4] is None
            checked_calls[0][4] = None
        assert direct_calls == checked_calls, (name, direct_calls, checked_calls)
    # attention_topk's checked route ends in the general gather path (the same bits, other calls):
    # its native form's one call, argument by argument (q, k, v, bias, keep, lse, causal, window,
    # scale (NaN: the default), softcap, the decode kernel's splits).
    (direct, direct_calls), _ = results["topk step"]
    assert direct_calls == [["topk_attention", "q", "k", "v", "key_bias", 32, None, True, -1, -1, "nan", 0.0, 4]]
    # The inputs reach the native call as they are (no copy of the usual layouts).
    kvcache_call = results["kvcache"][0][1][0]
    assert kvcache_call[1:4] == ["q", "k", "v"] and kvcache_call[12] == "lens", kvcache_call
    assert results["kvcache hf layout"][0][1][0][2:4] == ["k_hf", "k_hf"]
    assert results["decode_step"][0][1][0][2:4] == ["k_hf", "k_hf"]
    # A mask that keeps few of many keys: the decode kernel reads it in place on both routes (one
    # native call; no host synchronization to count the kept keys, which a gather would need).
    (direct, direct_calls), _ = results["attention sparse mask"]
    assert direct == "ran" and len(direct_calls) == 1, direct_calls
    assert direct_calls[0][1:6] == ["q", "k_long", "v_long", None, "sparse_mask"], direct_calls


def test_direct_routes_leave_other_calls():
    results = _routes()
    # (the direct route's split count: 0, or no answer where an earlier test declined)
    for name in ("gradient", "gradient, attention", "int lengths", "float32", "rows", "subclass", "path forced"):
        assert not any(results[name]), (name, results[name])
    assert results["usual"] == [4]
