"""examples/doge_attention.py: the Doge-style layer trains (loss falls, finite gradients, and
the dynamic-bias parameters learn through dmattn's bias gradient)."""

import importlib.util
import math
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "doge_attention.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("doge_attention_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doge_layer_trains(device):
    doge = _load_example()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CUDA kernels: fp16/bf16
    torch.manual_seed(0)
    layer = doge.DogeAttention(hidden_size=32, num_heads=4, num_kv_heads=2, keep=8)
    layer = layer.to(device=device, dtype=dtype)

    # One step by hand: the gradients, before any update.
    x, y = (t.to(device=device, dtype=dtype)
            for t in doge.causal_mean_task(2, 24, 32, torch.Generator().manual_seed(1)))
    torch.nn.functional.mse_loss(layer(x), y).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    for name in ("A", "dt_proj.weight", "dt_proj.bias"):  # the selection is not differentiable,
        grad = layer.get_parameter(name).grad            # the bias in the scores is
        assert grad.abs().sum() > 0, f"{name}: no gradient reaches the dynamic bias"
    layer.zero_grad()

    losses = doge.train(layer, steps=12, batch=4, seq=24, lr=1e-2)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.7 * losses[0], losses
