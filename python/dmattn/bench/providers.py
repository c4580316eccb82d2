"""The benchmark's providers: for a configuration and its inputs (config.Config, config.Inputs),
each returns a function computing out (B, S, H, D), or None when it cannot run the configuration
(the table then says "not supported")."""

from __future__ import annotations

from typing import Callable, Dict

import torch

from .. import attention, attention_topk, attention_varlen
from .._lib import cuda_available
from .config import Config, Inputs


def _dmattn(cfg: Config, x: Inputs):
    if cfg.packed:
        return _dmattn_packed(cfg, x)
    if cfg.variant == "gated_blocks_skip":  # the drop-in at flash-sparse-attn's defaults: gate skipping
        from ..flash_sparse_attn import flash_gated_attn_func
        return lambda: flash_gated_attn_func(x.q, x.k, x.v, x.alpha, x.delta, is_causal=cfg.causal,
                                             softmax_threshold=0.0)
    if cfg.variant:  # suite fsa; the "threshold" rows compute exactly (dmattn skips no such block)
        gate = None if x.alpha is None else (x.alpha, x.delta)
        return lambda: attention(x.q, x.k, x.v, causal=cfg.causal, gate=gate, windows=x.windows)
    if cfg.bias == "per_key" and 0 < cfg.keep < cfg.seqlen:
        # The whole Doge step: top-k selection from the bias (mask construction) included in
        # the timed call, on the gather path (only the kept keys are read).
        return lambda: attention_topk(x.q, x.k, x.v, x.bias, cfg.keep, causal=cfg.causal)
    return lambda: attention(x.q, x.k, x.v, x.mask, x.bias, causal=cfg.causal)


def _dmattn_packed(cfg: Config, x: Inputs):
    """attention_varlen on the (B * S, H, D) views of the batch (B sequences of S tokens);
    returns out as (B, S, H, D) so that the checks treat it like the dense path's."""
    if x.mask is not None or x.bias is not None:
        return None  # the packed rows have no mask / bias
    b, s, h, d = x.q.shape
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=x.q.device)

    def run():
        q, k, v = (t.reshape(b * s, t.shape[2], d) for t in (x.q, x.k, x.v))
        out = attention_varlen(q, k, v, cu, cu, s, s, causal=cfg.causal)
        return out.view(b, s, h, d)

    return run


def _sdpa_float_mask(x: Inputs, causal: bool):
    """SDPA with the mask, the bias and causality folded into one float mask (its only bias path)."""
    b, s, h, d = x.q.shape
    hkv = x.k.shape[2]

    def run():
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
        if hkv != h:
            k, v = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
        attn = None
        if x.bias is not None or x.mask is not None or causal:
            attn = torch.zeros((), dtype=q.dtype, device=q.device)
            if x.bias is not None:
                attn = attn + x.bias
            allowed = torch.ones((), dtype=torch.bool, device=q.device)
            if x.mask is not None:
                allowed = allowed & x.mask
            if causal:
                allowed = allowed & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            attn = attn.masked_fill(~allowed, float("-inf"))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn)
        return o.transpose(1, 2)

    return run


def _sdpa_backend(backend_name: str):
    def provider(cfg: Config, x: Inputs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        if x.bias is not None and backend_name != "EFFICIENT_ATTENTION":
            return None
        b, s, h, _ = x.q.shape
        if x.bias is not None and b * h * s * s * x.q.element_size() > _MAX_FLOAT_MASK_BYTES:
            return None
        inner = _sdpa_float_mask(x, cfg.causal) if x.bias is not None else None

        def run():
            with sdpa_kernel(backend):
                if inner is not None:
                    return inner()
                q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=cfg.causal, enable_gqa=x.k.shape[2] != x.q.shape[2])
                return o.transpose(1, 2)

        return run

    return provider


def _flex(cfg: Config, x: Inputs):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, s, h, d = x.q.shape
    # Every configuration recompiles flex_attention (its score_mod / mask_mod close over new
    # tensors). Without a reset, a long run reaches dynamo's recompile limit and flex_attention
    # silently falls back to its eager path, which materializes (B, H, S, S) scores: a peer
    # timed that way is slow or out of memory for reasons that are the benchmark's, not Flex's.
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    bias, mask, causal = x.bias, x.mask, cfg.causal

    def mask_mod(bi, hi, qi, ki):
        ok = qi >= 0
        if causal:
            ok = ok & (qi >= ki)
        if mask is not None:
            ok = ok & mask[bi, hi, 0, ki]
        return ok

    score_mod = None
    if bias is not None:
        if bias.shape[2] == 1:
            def score_mod(score, bi, hi, qi, ki):
                return score + bias[bi, hi, 0, ki]
        else:
            def score_mod(score, bi, hi, qi, ki):
                return score + bias[bi, hi, qi, ki]
    block_mask = None
    if causal or mask is not None:
        # _compile=True builds the block mask without materializing (B, H, S, S) scores (the
        # eager build sorts more than INT_MAX elements at B=2, H=16, S=8192 and fails).
        try:
            block_mask = create_block_mask(mask_mod, b, h, s, s, device=x.q.device, _compile=True)
        except TypeError:
            block_mask = create_block_mask(mask_mod, b, h, s, s, device=x.q.device)

    def run():
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
        o = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask,
                     enable_gqa=x.k.shape[2] != x.q.shape[2])
        return o.transpose(1, 2)

    return run


def _flash_dmattn(cfg: Config, x: Inputs):
    """flash-dmattn's CUDA function, when that package is importable (it has no PyPI wheels for
    every torch; docs/perf.md gives its figures measured separately on the same GPU model)."""
    try:
        from flash_dmattn import flash_dmattn_func as peer  # type: ignore
    except Exception:
        return None
    b, s, h, d = x.q.shape
    mask = x.mask
    if cfg.causal is False and mask is None and x.bias is None:
        return lambda: peer(x.q, x.k, x.v)
    return lambda: peer(x.q, x.k, x.v, attn_mask=mask, attn_bias=x.bias, is_causal=cfg.causal)


FSA_TILES = (128, 64)


def _flash_sparse_attn(cfg: Config, x: Inputs):
    """flash-sparse-attn's Triton functions, when that package is importable, with a fixed launch
    configuration (no autotuning inside the timed calls). Gated and windowed rows run it exactly
    (thresholds 0.0), like dmattn; the threshold rows let it skip blocks (softmax_threshold=1.0),
    so its gradients are not the check's reference there."""
    try:
        import flash_sparse_attn as peer  # type: ignore
    except Exception:
        return None
    if x.mask is not None or x.bias is not None:
        return None
    tuning = dict(is_causal=cfg.causal, is_autotune=False, tile_mn=FSA_TILES)
    if cfg.variant in ("gated", "gated_blocks"):
        return lambda: peer.flash_gated_attn_func(x.q, x.k, x.v, x.alpha, x.delta, softmax_threshold=0.0,
                                                  gate_threshold=0.0, **tuning)
    if cfg.variant == "gated_blocks_skip":  # its default gate_threshold (1 / Sk, adaptive): skipping
        def run_skip():
            return peer.flash_gated_attn_func(x.q, x.k, x.v, x.alpha, x.delta, softmax_threshold=0.0, **tuning)

        run_skip.approximate = True
        return run_skip
    if cfg.variant == "threshold":
        def run():
            return peer.flash_sparse_attn_func(x.q, x.k, x.v, softmax_threshold=1.0, **tuning)

        run.approximate = True
        return run
    window_sizes = None
    if x.windows is not None:  # dmattn's [sink, near, gap, far] as flash-sparse-attn's [sink, left, right, near]
        window_sizes = x.windows[:, [0, 3, 2, 1]].contiguous()
    return lambda: peer.flash_dense_attn_func(x.q, x.k, x.v, window_sizes=window_sizes, **tuning)


def _plain(provider: Callable) -> Callable:
    """A peer without gated attention, windows with sinks or a sparse softmax: not the fsa suite's
    variants."""
    return lambda cfg, x: None if cfg.variant else provider(cfg, x)


_MAX_FLOAT_MASK_BYTES = 24 * 2**30  # SDPA's only bias path materializes (B, H, S, S)


def providers_for(device: str) -> Dict[str, Callable]:
    if device == "cpu":
        return {"dmattn": _dmattn, "sdpa (cpu, float mask)": _plain(lambda c, x: _sdpa_float_mask(x, c.causal))}
    table = {}
    if cuda_available():
        table["dmattn"] = _dmattn
    table["sdpa flash (FA2)"] = _plain(_sdpa_backend("FLASH_ATTENTION"))
    table["sdpa cudnn"] = _plain(_sdpa_backend("CUDNN_ATTENTION"))
    table["sdpa mem-efficient"] = _plain(_sdpa_backend("EFFICIENT_ATTENTION"))
    table["flex (compiled)"] = _plain(_flex)
    table["flash-dmattn"] = _plain(_flash_dmattn)
    table[f"flash-sparse-attn (is_autotune=False, tile_mn={FSA_TILES})"] = _flash_sparse_attn
    return table


