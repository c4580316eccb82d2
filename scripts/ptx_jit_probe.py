"""One process's first dmattn calls on the GPU, timed: what a GPU that runs the build's PTX
(JIT-compiled by the CUDA driver at first use, then cached) pays in a fresh process. Run by
scripts/ptx_jit_check.sh, once with an empty driver cache and once with the cache it filled.

    python3 scripts/ptx_jit_probe.py [--dtype bf16|fp16] [--head-dim 64|128|256] [--tag NAME]

Prints the GPU's kernel path (dmattn.info's prediction and the driver's own account), whether
the one-time PtxJitWarning came, and one JSON line: seconds for import, the first forward +
backward (a dense and a biased + masked call: the plain and general kernels, and the backward's),
the same calls again, and the largest error against a float32 reference."""

import argparse
import json
import time

t_start = time.perf_counter()
import torch  # noqa: E402

import dmattn  # noqa: E402
from dmattn import _lib  # noqa: E402

t_import = time.perf_counter() - t_start


def reference(q, k, v, mask, bias):
    """float32 attention on (B, S, H, D) tensors (boolean mask: True keeps)."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    s = qf @ kf.transpose(-1, -2) / q.shape[-1] ** 0.5
    if bias is not None:
        s = s + bias.float()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(1, 2)


def calls(dtype, d):
    """A dense call and a biased, masked, causal one, forward and backward; their largest error
    against the reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, h = 2, 384, 4
    worst = 0.0
    for extras in (False, True):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
                   for _ in range(3))
        mask = (torch.rand(b, 1, s, s, device="cuda", generator=g) > 0.2) if extras else None
        bias = torch.randn(b, h, 1, s, device="cuda", dtype=dtype, generator=g) if extras else None
        out = dmattn.attention(q, k, v, mask, bias)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad)), "non-finite output"
        ref = reference(q.detach(), k.detach(), v.detach(), mask, bias)
        worst = max(worst, (out.float() - ref).abs().max().item())
    return worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tag", default="probe")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16

    index = torch.cuda.current_device()
    path = _lib.device_kernel_path(index)
    print(f"{args.tag}: cuda:{index} {torch.cuda.get_device_name(index)}: {path or 'NOT supported'}; "
          f"driver: {_lib.kernel_code(index)}", flush=True)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        err = calls(dtype, args.head_dim)
        first = time.perf_counter() - t0
    warned = any(issubclass(w.category, _lib.PtxJitWarning) for w in caught)
    t0 = time.perf_counter()
    calls(dtype, args.head_dim)
    again = time.perf_counter() - t0
    print(json.dumps({"tag": args.tag, "dtype": args.dtype, "head_dim": args.head_dim, "path": path,
                      "import_s": round(t_import, 2), "first_calls_s": round(first, 2),
                      "same_calls_again_s": round(again, 2), "max_abs_err": err,
                      "jit_warning": warned}), flush=True)
    assert err < 0.05, f"max abs error {err} against the float32 reference"


if __name__ == "__main__":
    main()
