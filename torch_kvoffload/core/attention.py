"""Absorbed MLA attention of one layer of a forward, over rows a backend holds.

* :func:`select_topk`: the lightning indexer's top-k logical positions of every query over a device
  indexer cache (floating, or Hadamard + int8 with per-row scales).
* :func:`topk_attention`: sparse MLA attention over the selected rows (``kvoffload::sparse_mla_attention``).
* :func:`dense_attention`: causal attention over every visible row, chunked over queries (models without
  an indexer).

Shapes as in :mod:`torch_kvoffload.core.kv_backend`; outputs ``[N, H, Dc]`` in the queries' dtype.
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


def select_topk(view: IndexerView, fwd: ForwardPlan, q: Queries) -> torch.Tensor:
    """Top-k logical positions ``int32 [N, top_k]`` of every query of ``fwd`` (−1 padded)."""
    assert q.index_q is not None and q.index_weights is not None
    args = (view.block_table, fwd.cu_seqlens_q, fwd.seq_lens_k)
    if view.quantized:
        q8, qs = hadamard_quant_int8(q.index_q)
        return quant_lightning_indexer(q8, qs, q.index_weights, *view.caches, *args, view.top_k)
    keys = view.caches[0]
    return lightning_indexer(q.index_q.to(keys.dtype), q.index_weights, keys, *args, view.top_k)


def topk_attention(fwd: ForwardPlan, q: Queries, keys: KeyRows, topk: torch.Tensor) -> torch.Tensor:
    """Sparse MLA attention of each query over its ``topk`` positions (rows ``keys.starts[request] + p``)."""
    starts = torch.tensor(keys.starts, dtype=torch.int64, device=topk.device)
    req = torch.repeat_interleave(
        torch.arange(fwd.B, device=topk.device), fwd.cu_seqlens_q[1:].long() - fwd.cu_seqlens_q[:-1].long()
    )
    idx = torch.where(topk >= 0, topk.long() + starts[req][:, None], -1).to(torch.int32)
    return sparse_mla_attention(q.q_nope, q.q_pe, keys.kv_c, keys.k_pe, idx, q.scale)[0]


def dense_attention(fwd: ForwardPlan, q: Queries, keys: KeyRows) -> torch.Tensor:
    """Causal attention of each query over its request's rows ``0 .. position`` (fp32 softmax)."""
    qn, qp = q.q_nope, q.q_pe
    out = torch.empty_like(qn)
    cu = fwd.cu_seqlens_q.tolist()
    for r in range(fwd.B):
        old, new, base = fwd.old_len[r], fwd.new_len[r], keys.starts[r]
        keys_c = keys.kv_c[base : base + new].float()
        keys_pe = keys.k_pe[base : base + new].float()
        kpos = torch.arange(new, device=qn.device)
        for q0 in range(cu[r], cu[r + 1], _DENSE_CHUNK):
            q1 = min(q0 + _DENSE_CHUNK, cu[r + 1])
            qpos = old + torch.arange(q0 - cu[r], q1 - cu[r], device=qn.device)
            s = torch.einsum("qhc,kc->qhk", qn[q0:q1].float(), keys_c)
            s = (s + torch.einsum("qhr,kr->qhk", qp[q0:q1].float(), keys_pe)) * q.scale
            s = s.masked_fill((kpos[None, :] > qpos[:, None])[:, None, :], -math.inf)
            out[q0:q1] = torch.einsum("qhk,kc->qhc", torch.softmax(s, dim=-1), keys_c).to(out.dtype)
    return out
