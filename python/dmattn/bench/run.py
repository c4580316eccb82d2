"""One configuration through every provider that supports it: forward and fwd+bwd times (each
call from an idle GPU, and calls back to back), peak memory, and the check of dmattn's row
(run_config).
"""

from __future__ import annotations

import re
from typing import Callable, List, Optional

import torch

from . import report
from .check import check
from .config import Config, Inputs, Row, make_inputs
from .providers import providers_for
from .timing import back_to_back_ms, time_ms


def fwd_bwd(run: Callable, x: Inputs) -> Callable[[], List[torch.Tensor]]:
    leaves = x.leaves()

    def step():
        out = run()
        return torch.autograd.grad(out, leaves, x.dout)

    return step


def run_config(cfg: Config, device: str, warmup: int, iters: int, providers: Optional[str] = None,
               fwd_only: bool = False, log: Callable[[str], None] = lambda line: None) -> List[Row]:
    x = make_inputs(cfg, device)
    rows: List[Row] = []
    dm_grads = None
    peer_grads = None
    dm_row = None
    for name, provider in providers_for(device).items():
        if providers and name != "dmattn" and not re.search(providers, name):
            continue
        if cfg.packed and name != "dmattn":
            continue  # the packed rows compare dmattn with itself (its dense row)
        row = Row(cfg.name, name)
        try:
            run = provider(cfg, x)
            if run is None:
                row.note = "not supported"
                rows.append(row)
                continue
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                row.fwd_ms = time_ms(lambda: run(), device, warmup, iters)
                row.fwd_b2b_ms = back_to_back_ms(lambda: run(), iters, device)
            row.fwd_tflops = cfg.flops(False) / (row.fwd_ms * 1e-3) / 1e12
            if fwd_only:
                if name == "dmattn":
                    dm_row = (row, run)
                rows.append(row)
                continue
            step = fwd_bwd(run, x)
            row.fwdbwd_ms = time_ms(step, device, warmup, iters)
            row.fwdbwd_b2b_ms = back_to_back_ms(step, iters, device)
            if device == "cuda":
                row.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30
            row.fwdbwd_tflops = cfg.flops(True) / (row.fwdbwd_ms * 1e-3) / 1e12
            if name == "dmattn":
                dm_grads = step()
                dm_row = (row, run)
            elif peer_grads is None and not getattr(run, "approximate", False):
                peer_grads = step()  # (not from a peer that skips blocks: its gradients differ by design)
        except Exception as e:  # a peer that fails is reported, not fatal
            row.note = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"
            if name == "dmattn" and row.fwd_ms == row.fwd_ms:
                dm_row = (row, run)  # the forward ran: still check it
        log(f"    {name}: fwd {report.fmt(row.fwd_ms, '.2f')} ms, fwd+bwd {report.fmt(row.fwdbwd_ms, '.2f')} ms "
            f"(back to back {report.fmt(row.fwd_b2b_ms, '.2f')} / {report.fmt(row.fwdbwd_b2b_ms, '.2f')})"
            + (f" ({row.note})" if row.note else ""))
        rows.append(row)
    if dm_row is not None:
        row, run = dm_row
        with torch.no_grad():
            out = run()
        row.check = check(cfg, x, out, dm_grads, peer_grads)
    return rows
