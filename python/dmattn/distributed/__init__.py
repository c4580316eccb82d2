"""Context parallelism over torch.distributed: ``dmattn.attention`` on a sequence spread across
the ranks of a process group (gloo on CPU, NCCL on GPU).

    import dmattn.distributed as dd
    q, k, v = (dd.shard_sequence(x, 1) for x in (q_full, k_full, v_full))   # zigzag layout
    out = dd.ring_attention(q, k, v, bias=dd.shard_sequence(key_bias, -1), causal=True)

Layouts (``layout.py``): rank r of W holds S_local = S / W positions; "zigzag" (default):
chunks r and 2W-1-r of 2W chunks, which balances causal work; "contiguous": chunk r of W.

Why the results are exact (the tests compare every output and gradient with single-process
dmattn on the whole sequence):

* ring (``ring.py``): under causal, a query chunk sees a prefix of any rank's key chunks (local
  order is global order): chunks wholly before it, then at most its own (diagonal) chunk. One
  call over that prefix with dmattn's bottom-right aligned causal mask is exactly that rule, so
  every step's calls cover every allowed (query, key) pair once and no other. Partial outputs
  merge by their lse (a softmax over a union of key sets), and the backward op, given the
  merged out and lse (``forward_stats``), returns each block's exact share of the gradients.
* allgather (``allgather.py``): the queries of a chunk starting at global position g run
  against the gathered keys [0, g + n) in global order; bottom-right alignment (offset g) makes
  "key j <= query i + g" the causal rule. Doge's per-query top-k (``keep``) ranks, for query i,
  the keys it sees (j <= its global position); all of them lie in [0, g + n), so the selection
  is the single-process one.
"""

from .api import ring_attention, shard_sequence, unshard_sequence
from .layout import (contiguous_shard, contiguous_unshard, sequence_positions, zigzag_shard,
                     zigzag_unshard)

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "zigzag_shard", "zigzag_unshard",
           "contiguous_shard", "contiguous_unshard", "sequence_positions"]
