"""dmattn.attention_topk: select the top-k keys from the bias and attend, in one call."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import gather, per_query_path
from ._lib import lib
from ._op_utils import (_cuda_layout, _is_compiling, _no_dispatch_layers, _scale_arg, check_devices,
                        records_no_gradient)
from .decode_kernel import gathered_decode, gathered_decode_splits, native_allocates
from .interface import _parse_options, attention_on
from .masks import bias_over_keys, check_broadcast, check_keep, dynamic_mask
from .ops import _native_supports_key_positions, native_forward, native_glue_available, select_topk_positions

__all__ = ["attention_topk"]


def attention_topk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    keep: int,
    *,
    mask: Optional[Tensor] = None,
    causal: bool = False,
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    per_query: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention restricted, per row of bias/mask, to the ``keep`` keys with the largest bias.

    Same as ``dmattn.attention(q, k, v, dynamic_mask(bias, keep, mask), bias, ...)``: the
    selection is made on the detached bias among the keys ``mask`` allows (ties: lower key
    index), then causal/window apply on top, so with ``causal=True`` an early query whose
    selected keys all lie in its future attends to nothing (out 0, lse -inf). Gradients
    reach q, k, v and the bias (through the attention; the selection has none).
    Arguments and return values as in ``dmattn.attention``; ``bias`` is required.

    When bias and mask have no query dimension (one key set per (batch, head), e.g. a
    (B, H, 1, Sk) bias), the kernels read only the min(keep, Sk) selected keys of each
    (batch, head) (the gather path, no host synchronization; docs/semantics.md, "Gather
    path") where the backend supports it; otherwise the selection becomes a bool mask for the
    dense kernels. Both give the same results.
    """
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected a torch.Tensor (the selection needs it), got {type(bias).__name__}")
    # The usual inference call (a decoding step; a prefill without gradient) goes straight to the
    # tests of its native form, which imply every check below (CUDA tensors of one device, ranks,
    # shapes and dtypes the kernels take, a key-side floating bias): the checks are host time that
    # an idle GPU waits on. The call and its arguments are those the checked route below ends in.
    if mask is None and not deterministic and type(keep) is int and keep > 0 and (
            not per_query or (type(window) is tuple and window == (-1, -1)
                              and (not causal or (type(q) is Tensor and q.dim() == 4 and q.shape[1] == 1)))):
        fast = _inference_forward(q, k, v, bias, keep, causal, window, scale, softcap, return_lse)
        if fast is not None:
            return fast if return_lse else fast[0]
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"k: expected a torch.Tensor, got {type(k).__name__}")
    if k.dim() != 4:
        raise ValueError(f"k: expected rank 4 (B, Sk, Hkv, D), got shape {tuple(k.shape)}")
    check_devices(q=q, k=k, v=v, bias=bias, mask=mask)  # before the selection touches them
    keep = check_keep(keep)
    if per_query and causal:
        if not (isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] == 1):
            return per_query_path.attention_per_query_topk(  # checks its arguments
                q, k, v, bias, keep, mask, window=window, scale=scale, softcap=softcap,
                deterministic=bool(deterministic), return_lse=return_lse)
        # One query (a decoding step): at the causal end it sees every key, so its own key set is
        # the shared one below (the gather path: only the kept keys are read), under the
        # per-query argument rules.
        per_query_path.check_per_query_arguments(q, k, bias, mask, window)
    # per_query without causal: every query sees every key, one key set per (batch, head).
    if mask is None and not deterministic:
        fast = _inference_forward(q, k, v, bias, keep, causal, window, scale, softcap, return_lse)
        if fast is None:
            fast = _training_forward(q, k, v, bias, keep, causal, window, scale, softcap)
        if fast is not None:
            return fast if return_lse else fast[0]
    options = dict(causal=causal, window=window, scale=scale, softcap=softcap,
                   deterministic=deterministic, return_lse=return_lse)
    if isinstance(q, torch.Tensor):
        key_set = gather.topk_key_set(q, k, bias, keep, mask, bool(deterministic))
        if key_set is not None:
            return attention_on(q, k, v, None, bias, key_set, **options)
    # Dense path: the selection as a bool mask; the kernels skip the unselected keys. (The bias's
    # shape checked first: the mask made from it would otherwise be the one an error names.)
    num_keys = k.shape[1]
    if isinstance(q, torch.Tensor) and q.dim() == 4:  # (other q: attention_on names it)
        check_broadcast(bias, "bias", (q.shape[0], q.shape[2], q.shape[1], num_keys), k.shape[2])
    if keep >= num_keys:
        selected = mask  # every allowed key is kept: no new (possibly broadcast-size) mask
    else:
        selected = dynamic_mask(bias_over_keys(bias, num_keys), keep, mask)
    return attention_on(q, k, v, selected, bias, None, **options)


_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _inference_forward(q, k, v, bias, keep: int, causal, window, scale, softcap,
                       want_lse: bool = True) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """(out, lse) of the shared-set gather path in its usual inference form, or None where the
    call is not that form (the general path then runs, and reports any error). lse may be None
    when not want_lse.

    The form: no gradient to record, and _native_form. The calls are those the general path
    ends in (gather.topk_key_set's selection kernel, which also writes the bias rows, then the
    forward kernel reading the kept K / V rows in place: gather._distinct_rows_forward's
    "indexed" mode), with the same arguments, so the results are the same bits; what is left out
    are the general path's layers of checks and dispatch, host time that an idle GPU waits on at
    these sizes. Where torch lends its allocator to the native side (decode_kernel.native_allocates)
    and q / k / v need no copy for the kernels, both calls and every allocation are one native
    call (``topk_attention``, which reads the kept rows from a gathered copy instead where every
    query tile reads all of them: the same bits, docs/design.md "Indexed keys"). One query (a
    decoding step) without a left window runs on the decode kernel instead, reading the kept K / V
    rows in place once per kv head, not once per query head (in one native call too, or
    decode_kernel.gathered_decode); results equal to floating-point summation order."""
    # (the gradient test first: a training call leaves at once for _training_forward)
    if not records_no_gradient(q, k, v, bias) or not _native_form(q, k, v, bias, keep):
        return None
    batch, _, heads, _ = q.shape
    num_keys = k.shape[1]
    bias_batch, bias_heads = bias.shape[0], bias.shape[1]
    left, right, scale, softcap = _parse_options(window, scale, softcap)
    # One query without a left window (a decoding step; at the causal end it sees every kept
    # key): the decode kernel, where it takes these shapes.
    splits = gathered_decode_splits(q, k, keep) if left < 0 else 0
    if native_allocates() and _rows_as_they_are(q) and _rows_as_they_are(k) and _rows_as_they_are(v):
        lse = q.new_empty((batch, heads, q.shape[1]), dtype=torch.float32) if want_lse else None
        out = lib().topk_attention(q, k, v, bias, keep, lse, bool(causal), left, right, _scale_arg(scale), softcap,
                                   splits)
        return out, lse
    positions = bias.new_empty((bias_batch, bias_heads, keep), dtype=torch.int32)
    kept_bias = bias.new_empty((bias_batch, bias_heads, 1, keep))
    select_topk_positions(bias, keep, positions, kept_bias)
    if splits:
        return gathered_decode(q, k, v, positions, kept_bias, scale, softcap, splits, want_lse)
    return native_forward(q, k, v, None, kept_bias, bool(causal), left, right, scale, softcap, positions, num_keys,
                          None, positions)


def _native_form(q, k, v, bias, keep: int) -> bool:
    """Whether attention_topk's arguments are the form its native calls take (inference and
    training): no path forced and indexed keys on, eager mode on plain tensors, CUDA, 16-bit
    q / k / v with unit stride along D, a (1 or B, 1 or Hkv, 1, Sk) bias of a 16/32-bit float
    dtype, no mask (the caller's test), keep < Sk."""
    if gather.path_forced() or not gather.INDEXED_KEYS:
        return False
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and type(bias) is Tensor):
        return False
    if not (q.is_cuda and k.is_cuda and v.is_cuda and bias.is_cuda):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or bias.dim() != 4:
        return False
    batch, _, heads, head_dim = q.shape
    num_keys, heads_kv = k.shape[1], k.shape[2]
    bias_batch, bias_heads, bias_rows, bias_keys = bias.shape
    if (k.shape[0] != batch or k.shape[3] != head_dim or v.shape != k.shape or q.numel() == 0
            or heads_kv == 0 or heads % heads_kv or keep >= num_keys):
        return False
    if bias_rows != 1 or bias_keys != num_keys or bias_batch not in (1, batch) or bias_heads not in (1, heads_kv):
        return False
    if not (q.dtype in _SIXTEEN_BIT and k.dtype == q.dtype and v.dtype == q.dtype
            and bias.dtype in (q.dtype, torch.float32)):
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    device = q.get_device()
    if k.get_device() != device or v.get_device() != device or bias.get_device() != device:
        return False
    # (_plain_eager with the tensors' types tested above)
    return (not _is_compiling() and _no_dispatch_layers() and native_glue_available()
            and _native_supports_key_positions("cuda"))


def _rows_as_they_are(x: Tensor) -> bool:
    """_cuda_layout(x) is x for a CUDA tensor that holds elements (_native_form's): the usual
    contiguous, 16-byte aligned tensor with a head dim of 8k by three tests, anything else by
    _cuda_layout's own."""
    return (x.is_contiguous() and x.data_ptr() % 16 == 0 and x.shape[-1] % 8 == 0) or _cuda_layout(x) is x


def _training_forward(q, k, v, bias, keep: int, causal, window, scale,
                      softcap) -> Optional[Tuple[Tensor, Tensor]]:
    """(out, lse) of the shared-set gather path with a gradient to record, as one autograd node
    over two native calls (_TopkTrainingStep), or None where the call is not that form (the
    general path then runs, and reports any error).

    The form: a gradient to record, _native_form, torch lending its allocator to the native side
    (decode_kernel.native_allocates) and q / k / v needing no copy for the kernels. The forward is
    ``topk_attention_training`` (the selection, then the forward over the kept rows), the
    backward ``topk_attention_backward`` (the backward over the kept rows, then dK, dV and dbias
    written at full size by one kernel), with the arguments the general path's autograd node
    (gather._DistinctRowsAttention, "indexed" mode) passes, so the same bits; left out are the
    general path's layers of checks, dispatch and allocations in Python, host time on the GPU's
    critical path at these sizes (the forward kernel waited for it after the selection)."""
    # (the gradient test first: an inference call that is not the inference form leaves at once,
    # without the form's tests again)
    if records_no_gradient(q, k, v, bias) or not _native_form(q, k, v, bias, keep) or not native_allocates():
        return None
    if not (_rows_as_they_are(q) and _rows_as_they_are(k) and _rows_as_they_are(v)):
        return None
    left, right, scale, softcap = _parse_options(window, scale, softcap)
    options = (bool(causal), left, right, _scale_arg(scale), softcap)
    # The native call first: the GPU starts on the selection while the autograd node is recorded.
    # (its results reach the node in a tuple, which autograd does not look into: out and lse are
    # then the node's own outputs, as if made in its forward, rather than inputs returned as-is,
    # which autograd would return as views)
    results = tuple(lib().topk_attention_training(q, k, v, bias, keep, *options))
    return _TopkTrainingStep.apply(q, k, v, bias, results, options)


class _TopkTrainingStep(torch.autograd.Function):
    """attention_topk's training form (_training_forward): forward and backward each one native
    call that allocates its scratch through torch. The forward's call is made before the node
    (topk_attention_training: out, lse and the selection's positions and kept bias), which only
    records them; the positions and kept bias are saved for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, bias, results, options):
        out, lse, positions, kept_bias = results
        ctx.save_for_backward(q, k, v, kept_bias, out, lse, positions)
        ctx.options = options
        ctx.bias_shape = bias.shape
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # out did not reach the loss
            return (None,) * len(ctx.needs_input_grad)
        q, k, v, kept_bias, out, lse, positions = ctx.saved_tensors
        dout = _cuda_layout(dout if dout.stride(-1) == 1 else dout.contiguous())
        dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
        want_dbias = ctx.needs_input_grad[3]
        dbias = kept_bias.new_empty(ctx.bias_shape) if want_dbias else None
        lib().topk_attention_backward(dout, q, k, v, out, lse, positions, kept_bias, *ctx.options, dq, dk, dv, dbias)
        needs = ctx.needs_input_grad
        return dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, dbias, None, None
