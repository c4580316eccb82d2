"""deterministic=True: bitwise-identical gradients across runs (and thread counts on CPU)."""

import pytest
import torch

import dmattn

CONFIGS = [
    # B, Sq, Sk, H, Hkv, D, dtype, bias shape, causal, window
    (2, 70, 130, 4, 2, 32, torch.float32, (2, 4, 70, 130), True, (-1, -1)),
    (2, 65, 65, 8, 2, 24, torch.bfloat16, (1, 1, 1, 65), False, (16, 4)),
    (3, 33, 97, 6, 1, 64, torch.float16, (3, 1, 33, 1), False, (-1, -1)),   # MQA, key-broadcast
    (1, 129, 129, 4, 4, 16, torch.float32, (4, 129, 129), True, (-1, -1)),
    (2, 40, 50, 4, 2, 16, torch.bfloat16, (2, 2, 1, 50), True, (-1, -1)),   # head dim = Hkv
]


def _grads(cfg, device, threads=None):
    b, sq, sk, h, hkv, d, dtype, bshape, causal, window = cfg
    if device == "cuda":
        dtype = torch.bfloat16 if dtype == torch.float32 else dtype
        d = max(8, (d + 7) // 8 * 8)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype).to(device).requires_grad_()
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype).to(device).requires_grad_()
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype).to(device).requires_grad_()
    bias = torch.randn(bshape, generator=g).to(dtype).to(device).requires_grad_()
    mask = (torch.rand(b, 1, sq, sk, generator=g) < 0.8).to(device)
    dout = torch.randn(b, sq, h, d, generator=g).to(dtype).to(device)
    prev = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        out = dmattn.attention(q, k, v, mask, bias, causal=causal, window=window, deterministic=True)
        out.backward(dout)
    finally:
        torch.set_num_threads(prev)
    return [out.detach(), q.grad, k.grad, v.grad, bias.grad]


@pytest.mark.parametrize("idx", range(len(CONFIGS)), ids=lambda i: f"cfg{i}")
def test_deterministic_bitwise(device, idx):
    first = _grads(CONFIGS[idx], device)
    for _ in range(3):
        again = _grads(CONFIGS[idx], device)
        for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], first, again):
            assert torch.equal(a, b), f"{name} differs between runs with deterministic=True"


@pytest.mark.parametrize("idx", [0, 2])
def test_deterministic_across_thread_counts_cpu(idx):
    one = _grads(CONFIGS[idx], "cpu", threads=1)
    two = _grads(CONFIGS[idx], "cpu", threads=2)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], one, two):
        assert torch.equal(a, b), f"{name} depends on the thread count with deterministic=True"


@pytest.mark.gpu
def test_deterministic_bitwise_gpu_large():
    cfg = (2, 1024, 1024, 16, 4, 128, torch.bfloat16, (2, 16, 1, 1024), True, (-1, -1))
    first = _grads(cfg, "cuda")
    for _ in range(2):
        for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], first, _grads(cfg, "cuda")):
            assert torch.equal(a, b), name
