"""Absorbed MLA attention of one layer of a forward, over rows a backend holds.

* :func:`select_topk`: the lightning indexer's top-k logical positions of every query over a device
  indexer cache (floating, or Hadamard + int8 with per-row scales).
* :func:`topk_attention`: sparse MLA attention over the selected rows (``kvoffload::sparse_mla_attention``).
* :func:`dense_attention`: causal attention over every visible row, chunked over queries (models without
  an indexer).

Each takes either the forward's real queries (``pad=False``: request ``r``'s ``cu_seqlens_q`` queries are
its last new positions, the query at logical position ``p`` sees rows ``0 .. p``) or its padding queries
that see real tokens (``pad=True``: query ``i`` of batch row ``fwd.pad_row[i]`` sees that request's rows
``0 .. fwd.pad_len[i] - 1``; the indexer runs them as one-query pseudo-requests reusing their request's
block-table row).

Shapes as in :mod:`torch_kvoffload.core.kv_backend`; outputs ``[N, H, Dc]`` (``[P, H, Dc]`` for the padding
queries) in the queries' dtype.
"""

from __future__ import annotations

import math

import torch

from torch_kvoffload.core.forward import ForwardPlan
from torch_kvoffload.core.kv_backend import IndexerView, KeyRows, Queries
from torch_kvoffload.ops.indexer import hadamard_quant_int8, lightning_indexer, quant_lightning_indexer
from torch_kvoffload.ops.sparse_attention import sparse_mla_attention

__all__ = ["dense_attention", "select_topk", "topk_attention"]

# queries per chunk of the dense attention (bounds the [Q, H, L] score tensor)
_DENSE_CHUNK = 256


def _query_rows(fwd: ForwardPlan, pad: bool) -> torch.Tensor:
    """int64 [N] (or [P]): the batch row (request) of each query."""
    if pad:
        return fwd.pad_row
    counts = fwd.cu_seqlens_q[1:].long() - fwd.cu_seqlens_q[:-1].long()
    return torch.repeat_interleave(torch.arange(fwd.B, device=counts.device), counts)


def select_topk(view: IndexerView, fwd: ForwardPlan, q: Queries, *, pad: bool = False) -> torch.Tensor:
    """Top-k logical positions ``int32 [N, top_k]`` of every query of ``fwd`` (−1 padded); ``pad``: of its
    padding queries, each over its visible rows."""
    assert q.index_q is not None and q.index_weights is not None
    if pad:
        n = fwd.n_pad
        cu = torch.arange(n + 1, dtype=torch.int32, device=fwd.pad_len.device)
        args = (view.block_table[fwd.pad_row], cu, fwd.pad_len)
    else:
        args = (view.block_table, fwd.cu_seqlens_q, fwd.seq_lens_k)
    if view.quantized:
        q8, qs = hadamard_quant_int8(q.index_q)
        return quant_lightning_indexer(q8, qs, q.index_weights, *view.caches, *args, view.top_k)
    keys = view.caches[0]
    return lightning_indexer(q.index_q.to(keys.dtype), q.index_weights, keys, *args, view.top_k)


def topk_attention(
    fwd: ForwardPlan, q: Queries, keys: KeyRows, topk: torch.Tensor, *, pad: bool = False
) -> torch.Tensor:
    """Sparse MLA attention of each query over its ``topk`` positions (rows ``keys.starts[request] + p``)."""
    starts = torch.tensor(keys.starts, dtype=torch.int64, device=topk.device)
    req = _query_rows(fwd, pad)
    idx = torch.where(topk >= 0, topk.long() + starts[req][:, None], -1).to(torch.int32)
    return sparse_mla_attention(q.q_nope, q.q_pe, keys.kv_c, keys.k_pe, idx, q.scale)[0]


def _dense_group(
    out: torch.Tensor, q: Queries, keys: KeyRows, base: int, q0: int, q1: int, last: torch.Tensor
) -> None:
    """Queries ``q0 .. q1 - 1`` over rows ``base .. base + max(last)``; query ``i`` sees positions
    ``<= last[i - q0]`` (``last int64 [q1 - q0]``, on the queries' device)."""
    n_keys = int(last.max()) + 1
    keys_c = keys.kv_c[base : base + n_keys].float()
    keys_pe = keys.k_pe[base : base + n_keys].float()
    kpos = torch.arange(n_keys, device=last.device)
    for c0 in range(q0, q1, _DENSE_CHUNK):
        c1 = min(c0 + _DENSE_CHUNK, q1)
        s = torch.einsum("qhc,kc->qhk", q.q_nope[c0:c1].float(), keys_c)
        s = (s + torch.einsum("qhr,kr->qhk", q.q_pe[c0:c1].float(), keys_pe)) * q.scale
        s = s.masked_fill((kpos[None, :] > last[c0 - q0 : c1 - q0, None])[:, None, :], -math.inf)
        out[c0:c1] = torch.einsum("qhk,kc->qhc", torch.softmax(s, dim=-1), keys_c).to(out.dtype)


def dense_attention(fwd: ForwardPlan, q: Queries, keys: KeyRows, *, pad: bool = False) -> torch.Tensor:
    """Causal attention of each query over its request's visible rows (fp32 softmax): a real query at
    position ``p`` over rows ``0 .. p``, a padding query (``pad``) over rows ``0 .. v - 1``."""
    out = torch.empty_like(q.q_nope)
    dev = q.q_nope.device
    if pad:
        counts, lens = torch.bincount(fwd.pad_row, minlength=fwd.B).tolist(), fwd.pad_len.long()
        q0 = 0
        for r in range(fwd.B):
            q1 = q0 + counts[r]
            if q1 > q0:
                _dense_group(out, q, keys, keys.starts[r], q0, q1, lens[q0:q1] - 1)
            q0 = q1
        return out
    cu = fwd.cu_seqlens_q.tolist()
    for r in range(fwd.B):
        if cu[r + 1] > cu[r]:
            last = fwd.old_len[r] + torch.arange(cu[r + 1] - cu[r], device=dev)
            _dense_group(out, q, keys, keys.starts[r], cu[r], cu[r + 1], last)
    return out
