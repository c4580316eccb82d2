"""One backward call for profilers (ncu): B=1, H=8, S=4096, D=128 bf16, dense."""
import sys
import torch
import dmattn
b, h, s, d = 1, 8, int(sys.argv[1]) if len(sys.argv) > 1 else 4096, 128
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
for _ in range(2):
    out = dmattn.attention(q, k, v)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
torch.cuda.synchronize()
