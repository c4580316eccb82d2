"""One backward call for profilers (ncu): B=1, H=8, D=128 bf16.
Usage: bwd_prof_case.py [S=4096] [dense|bias]  (bias: a (B,H,S,S) bf16 bias with gradient)."""
import sys
import torch
import dmattn
b, h, d = 1, 8, 128
s = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
kind = sys.argv[2] if len(sys.argv) > 2 else "dense"
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
bias = torch.randn(b, h, s, s, device="cuda", dtype=torch.bfloat16, requires_grad=True) if kind == "bias" else None
inputs = (q, k, v) + ((bias,) if bias is not None else ())
for _ in range(2):
    out = dmattn.attention(q, k, v, bias=bias)
    torch.autograd.grad(out, inputs, torch.randn_like(out))
torch.cuda.synchronize()
