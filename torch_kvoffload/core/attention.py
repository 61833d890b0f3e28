"""Absorbed MLA attention of one layer of a forward, over rows a backend holds.

* :func:`attend_layer`: a layer's attention of a forward over the backends taking part (a backend's own
  attention, else dense or top-k attention over the keys a backend holds), with its probabilities when asked.
* :func:`select_topk`: the lightning indexer's top-k logical positions of every query over a device
  indexer cache (floating, Hadamard + int8 with per-row scales, or Hadamard + FP8 rows).
* :func:`topk_attention`: sparse MLA attention over the selected rows (``kvoffload::sparse_mla_attention``).
* :func:`dense_attention`: causal attention over every visible row, chunked over queries (models without
  an indexer).
* :func:`dense_probabilities`, :func:`topk_probabilities`, :func:`selected_probabilities`: the softmax
  probabilities those attentions apply (Hugging Face's ``output_attentions``), recomputed from the same
  rows and selection, over each request's logical positions.

Each takes either the forward's real queries (``pad=False``: request ``r``'s ``cu_seqlens_q`` queries are
its last new positions, the query at logical position ``p`` sees rows ``0 .. p``) or its padding queries
that see real tokens (``pad=True``: query ``i`` of batch row ``fwd.pad_row[i]`` sees that request's rows
``0 .. fwd.pad_len[i] - 1``; the indexer runs them as one-query pseudo-requests reusing their request's
block-table row).

Shapes as in :mod:`torch_kvoffload.kv.backend`; outputs ``[N, H, Dc]`` (``[P, H, Dc]`` for the padding
queries) in the queries' dtype; probabilities fp32 ``[N, H, width]`` (``[P, H, width]``), entry ``p`` the
query's weight on its request's logical position ``p`` (0 where it attends to nothing).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from torch_kvoffload.kv.backend import IndexerView, KeyRows, KVBackend, Queries, SelectedRows
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.ops.fp8_attention import dequantize_rows, fp8_sparse_mla_attention
from torch_kvoffload.ops.fp8_indexer import fp8_logits, hadamard_quant_fp8
from torch_kvoffload.ops.indexer import hadamard_quant_int8
from torch_kvoffload.ops.indexer_reference import float_logits, quant_logits, score_matrix
from torch_kvoffload.ops.sparse_attention import sparse_mla_attention

__all__ = [
    "attend_layer", "biased_attention",
    "dense_attention", "dense_probabilities", "select_topk", "selected_probabilities", "topk_attention",
    "topk_probabilities",
]  # fmt: skip

# queries per chunk of the dense attention (bounds the [Q, H, L] score tensor)
_DENSE_CHUNK = 256
# queries per chunk of the probabilities over selected rows (bounds the gathered [Q, K, Dc] rows)
_SELECTED_CHUNK = 64


def _query_rows(fwd: ForwardPlan, pad: bool) -> torch.Tensor:
    """int64 [N] (or [P]): the batch row (request) of each query."""
    return fwd.pad_row if pad else fwd.query_rows()


def select_topk(view: IndexerView, fwd: ForwardPlan, q: Queries, *, pad: bool = False) -> torch.Tensor:
    """Top-k logical positions ``int32 [N, top_k]`` of every query of ``fwd`` (−1 padded); ``pad``: of its
    padding queries, each over its visible rows."""
    assert q.index_q is not None and q.index_weights is not None
    if pad:
        cu = torch.arange(fwd.n_pad + 1, dtype=torch.int32, device=fwd.pad_len.device)
        return view.select(q.index_q, q.index_weights, cu, fwd.pad_len, view.block_table[fwd.pad_row])
    return view.select(q.index_q, q.index_weights, fwd.cu_seqlens_q, fwd.seq_lens_k)


def topk_attention(
    fwd: ForwardPlan, q: Queries, keys: KeyRows, topk: torch.Tensor, *, pad: bool = False
) -> torch.Tensor:
    """Sparse MLA attention of each query over its ``topk`` positions (rows ``keys.starts[request] + p``)."""
    key = ("row_starts", pad, tuple(keys.starts))
    base = fwd.memo.get(key)  # the same for every layer whose keys start alike
    if base is None:
        starts = torch.tensor(keys.starts, dtype=torch.int64, device=topk.device)
        base = fwd.memo[key] = starts[_query_rows(fwd, pad)][:, None].to(torch.int32)
    idx = torch.where(topk >= 0, topk + base, -1)
    if keys.fp8:
        return fp8_sparse_mla_attention(q.q_nope, q.q_pe, keys.kv_c, idx, q.scale)[0]
    return sparse_mla_attention(q.q_nope, q.q_pe, keys.kv_c, keys.k_pe, idx, q.scale)[0]


def _floating(keys: KeyRows, q: Queries) -> KeyRows:
    """``keys`` with FP8 rows dequantized (fp32, exact) for the pure-PyTorch paths; floating ones as they
    are."""
    if not keys.fp8:
        return keys
    kv_c, k_pe = dequantize_rows(keys.kv_c, q.q_nope.shape[-1])
    return KeyRows(kv_c, k_pe, keys.starts)


def _scores(q: Queries, c0: int, c1: int, keys_c: torch.Tensor, keys_pe: torch.Tensor) -> torch.Tensor:
    """fp32 ``[c1 - c0, H, K]`` scaled absorbed scores of queries ``c0 .. c1 - 1`` over fp32 rows shared by
    them (``keys_c [K, Dc]`` / ``keys_pe [K, Dr]``) or their own (``[c1 - c0, K, ·]``)."""
    shared = keys_c.dim() == 2
    eq_c, eq_r = ("qhc,kc->qhk", "qhr,kr->qhk") if shared else ("qhc,qkc->qhk", "qhr,qkr->qhk")
    s = torch.einsum(eq_c, q.q_nope[c0:c1].float(), keys_c)
    return (s + torch.einsum(eq_r, q.q_pe[c0:c1].float(), keys_pe)) * q.scale


def _dense_scores(
    q: Queries, keys_c: torch.Tensor, keys_pe: torch.Tensor, c0: int, c1: int, last: torch.Tensor
) -> torch.Tensor:
    """:func:`_scores` over rows ``keys_c [K, Dc]`` / ``keys_pe [K, Dr]``, ``−inf`` past position
    ``last [c1 - c0]`` of each query."""
    kpos = torch.arange(keys_c.shape[0], device=last.device)
    s = _scores(q, c0, c1, keys_c, keys_pe)
    return s.masked_fill((kpos[None, :] > last[:, None])[:, None, :], -math.inf)


def _dense_groups(
    fwd: ForwardPlan, pad: bool, device: torch.device
) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """``(request, q0, q1, last)`` per request with queries: its queries ``q0 .. q1 - 1`` (real, or padding
    when ``pad``) and the last position ``last int64 [q1 - q0]`` (on ``device``) each sees."""
    if pad:
        counts, lens = torch.bincount(fwd.pad_row, minlength=fwd.B).tolist(), fwd.pad_len.long().to(device)
        q0 = 0
        for r in range(fwd.B):
            q1 = q0 + counts[r]
            if q1 > q0:
                yield r, q0, q1, lens[q0:q1] - 1
            q0 = q1
        return
    cu = fwd.cu_seqlens_q.tolist()
    for r in range(fwd.B):
        if cu[r + 1] > cu[r]:
            yield r, cu[r], cu[r + 1], fwd.old_len[r] + torch.arange(cu[r + 1] - cu[r], device=device)


def _dense_group(
    out: torch.Tensor, q: Queries, keys: KeyRows, base: int, q0: int, q1: int, last: torch.Tensor
) -> None:
    """Queries ``q0 .. q1 - 1`` over rows ``base .. base + max(last)``; query ``i`` sees positions
    ``<= last[i - q0]`` (``last int64 [q1 - q0]``, on the queries' device)."""
    n_keys = int(last.max()) + 1
    keys_c = keys.kv_c[base : base + n_keys].float()
    keys_pe = keys.k_pe[base : base + n_keys].float()
    for c0 in range(q0, q1, _DENSE_CHUNK):
        c1 = min(c0 + _DENSE_CHUNK, q1)
        s = _dense_scores(q, keys_c, keys_pe, c0, c1, last[c0 - q0 : c1 - q0])
        out[c0:c1] = torch.einsum("qhk,kc->qhc", torch.softmax(s, dim=-1), keys_c).to(out.dtype)


def dense_attention(fwd: ForwardPlan, q: Queries, keys: KeyRows, *, pad: bool = False) -> torch.Tensor:
    """Causal attention of each query over its request's visible rows (fp32 softmax): a real query at
    position ``p`` over rows ``0 .. p``, a padding query (``pad``) over rows ``0 .. v - 1``."""
    out = torch.empty_like(q.q_nope)
    for r, q0, q1, last in _dense_groups(fwd, pad, q.q_nope.device):
        _dense_group(out, q, keys, keys.starts[r], q0, q1, last)
    return out


def dense_probabilities(
    fwd: ForwardPlan, q: Queries, keys: KeyRows, width: int, *, pad: bool = False
) -> torch.Tensor:
    """The probabilities :func:`dense_attention` applies: fp32 ``[N, H, width]`` (``width`` at least every
    request's length), each query's softmax over its request's visible positions, 0 past them."""
    out = q.q_nope.new_zeros((q.q_nope.shape[0], q.q_nope.shape[1], width), dtype=torch.float32)
    for r, q0, q1, last in _dense_groups(fwd, pad, q.q_nope.device):
        n_keys = int(last.max()) + 1
        base = keys.starts[r]
        keys_c = keys.kv_c[base : base + n_keys].float()
        keys_pe = keys.k_pe[base : base + n_keys].float()
        for c0 in range(q0, q1, _DENSE_CHUNK):
            c1 = min(c0 + _DENSE_CHUNK, q1)
            s = _dense_scores(q, keys_c, keys_pe, c0, c1, last[c0 - q0 : c1 - q0])
            out[c0:c1, :, :n_keys] = torch.softmax(s, dim=-1)
    return out


def selected_probabilities(q: Queries, rows: SelectedRows, width: int) -> torch.Tensor:
    """The probabilities of sparse MLA attention over selected rows: fp32 ``[N, H, width]``, each query's
    softmax over its rows ``rows.kv_c / rows.k_pe [N, K, ·]`` (scaled absorbed scores), put at their
    logical positions ``rows.positions [N, K]`` (``−1``: no row; ``width`` above every position), 0
    elsewhere. A query with no row gets zeros."""
    n, h = q.q_nope.shape[:2]
    out = q.q_nope.new_zeros((n, h, width + 1), dtype=torch.float32)  # column ``width``: the -1 entries
    for c0 in range(0, n, _SELECTED_CHUNK):
        c1 = min(c0 + _SELECTED_CHUNK, n)
        _selected_chunk(
            out[c0:c1], q, c0, c1, rows.kv_c[c0:c1], rows.k_pe[c0:c1], rows.positions[c0:c1], width
        )
    return out[..., :width]


def _selected_chunk(
    out: torch.Tensor, q: Queries, c0: int, c1: int, kv_c: torch.Tensor, k_pe: torch.Tensor,
    positions: torch.Tensor, width: int,
) -> None:  # fmt: skip
    """Queries ``c0 .. c1 - 1`` over their rows ``kv_c [c, K, Dc]`` / ``k_pe [c, K, Dr]`` at ``positions
    [c, K]``, into ``out [c, H, width + 1]`` (the ``−1`` entries into its last column)."""
    s = _scores(q, c0, c1, kv_c.float(), k_pe.float())
    valid = positions >= 0
    p = torch.softmax(s.masked_fill(~valid[:, None, :], -math.inf), dim=-1)
    at = torch.where(valid, positions.long(), width)[:, None, :].expand(-1, p.shape[1], -1)
    out.scatter_(2, at, torch.where(valid[:, None, :], p, 0.0))


def topk_probabilities(
    fwd: ForwardPlan, q: Queries, keys: KeyRows, topk: torch.Tensor, width: int, *, pad: bool = False
) -> torch.Tensor:
    """The probabilities :func:`topk_attention` applies over the ``topk`` positions (``int32 [N, K]``, −1
    padded): fp32 ``[N, H, width]``, 0 outside each query's selection (see :func:`selected_probabilities`)."""
    starts = torch.tensor(keys.starts, dtype=torch.int64, device=topk.device)
    req = _query_rows(fwd, pad)
    n, h = q.q_nope.shape[:2]
    out = q.q_nope.new_zeros((n, h, width + 1), dtype=torch.float32)
    for c0 in range(0, n, _SELECTED_CHUNK):
        c1 = min(c0 + _SELECTED_CHUNK, n)
        pos = topk[c0:c1].long()
        at = torch.where(pos >= 0, pos + starts[req[c0:c1]][:, None], 0)
        if keys.fp8:  # only the selected rows
            rows_c, rows_pe = dequantize_rows(keys.kv_c[at], q.q_nope.shape[-1])
        else:
            rows_c, rows_pe = keys.kv_c[at], keys.k_pe[at]
        _selected_chunk(out[c0:c1], q, c0, c1, rows_c, rows_pe, pos, width)
    return out[..., :width]


def _biased_scores(fwd: ForwardPlan, view: IndexerView, q: Queries, req: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, W]`` indexer scores of every query (of request ``req [N]``) over its request's positions
    ``0 .. new_len - 1`` (``W = max(new_len)``; ``−inf`` past the request's length) plus ``fwd.bias``, from
    the same cache and formula as :func:`select_topk` (for a quantized cache: the same quantized queries)."""
    assert q.index_q is not None and q.index_weights is not None and fwd.bias is not None
    table = view.block_table
    if view.fmt == "int8":
        q8, qs = hadamard_quant_int8(q.index_q)
        logits = quant_logits(q8, qs, q.index_weights, *view.caches, table)
        q_dev = q8
    elif view.fmt == "fp8_e4m3":
        q_dev = hadamard_quant_fp8(q.index_q)
        logits = fp8_logits(q_dev, q.index_weights, view.caches[0], table)
    else:
        logits = float_logits(q.index_q.to(view.caches[0].dtype), q.index_weights, view.caches[0], table)
        q_dev = q.index_q
    lens = fwd.seq_lens_k
    scores = score_matrix(q_dev, view.caches[0], table, fwd.cu_seqlens_q, lens, lens.long()[req], logits)
    width = max(fwd.new_len)
    return scores[:, :width] + fwd.bias[:, :width]


def biased_attention(fwd: ForwardPlan, q: Queries, keys: KeyRows, view: IndexerView | None) -> torch.Tensor:
    """Attention of a forward with an additive bias (``fwd.bias``, e.g. a custom mask) in place of the
    causal rule, computed as the unmodified Hugging Face attention adds its 4-D mask: each query's scaled
    absorbed scores over every position of its request plus its bias, softmax (fp32), times the latent
    rows. With an indexer (``view``) the bias is added to the indexer's scores too and the attention runs
    over the top ``min(top_k, length)`` positions of that sum, as the unmodified DSA indexer selects.

    A query whose bias is ``−inf`` everywhere gets zeros (SDPA's fully masked row); one whose bias is the
    fp32 minimum everywhere gets the average of every row (a softmax over equal scores: the unmodified DSA
    attention sets the positions its indexer did not select to that minimum too).

    Pure PyTorch, per request: it costs ``[queries, H, length]`` scores (or ``[queries, top_k]`` gathered
    rows) and reads every row, so only forwards that pass a bias take it. Output ``[N, H, Dc]``."""
    assert fwd.bias is not None
    out = torch.empty_like(q.q_nope)
    cu = fwd.cu_seqlens_q.tolist()
    width = max(fwd.new_len)
    req = _query_rows(fwd, False)
    lens = torch.tensor(fwd.new_len, dtype=torch.int64, device=req.device)[req]
    beyond = torch.arange(width, device=req.device)[None, :] >= lens[:, None]  # [N, W]
    bias = fwd.bias[:, :width]
    dead = (torch.isneginf(bias) | beyond).all(dim=-1)  # [N]
    blind = ((bias <= torch.finfo(torch.float32).min / 2) | beyond).all(dim=-1) & ~dead
    if view is None:
        for r in range(fwd.B):
            q0, q1, n = cu[r], cu[r + 1], fwd.new_len[r]
            if q1 == q0:
                continue
            base = keys.starts[r]
            kc, kp = keys.kv_c[base : base + n].float(), keys.k_pe[base : base + n].float()
            for c0 in range(q0, q1, _DENSE_CHUNK):
                c1 = min(c0 + _DENSE_CHUNK, q1)
                s = _scores(q, c0, c1, kc, kp)
                p = torch.softmax(s + fwd.bias[c0:c1, None, :n], dim=-1)  # a blind query: uniform
                p = p.masked_fill(dead[c0:c1, None, None], 0.0)
                out[c0:c1] = torch.einsum("qhk,kc->qhc", p, kc).to(out.dtype)
        return out
    combined = _biased_scores(fwd, view, q, req)  # [N, W]
    k = min(view.top_k, combined.shape[1])
    top = torch.topk(combined, k, dim=-1).indices  # [N, k]
    chosen = combined.gather(1, top)
    valid = chosen > -math.inf  # positions past the request's length are never attended
    starts = torch.tensor(keys.starts, dtype=torch.int64, device=top.device)
    at = torch.where(valid, top + starts[req][:, None], 0)
    for c0 in range(0, top.shape[0], _SELECTED_CHUNK):
        c1 = min(c0 + _SELECTED_CHUNK, top.shape[0])
        kc, kp = keys.kv_c[at[c0:c1]].float(), keys.k_pe[at[c0:c1]].float()  # [c, k, D]
        s = _scores(q, c0, c1, kc, kp)
        chosen_bias = fwd.bias[c0:c1].gather(1, top[c0:c1])
        s = (s + chosen_bias[:, None, :]).masked_fill(~valid[c0:c1, None, :], -math.inf)
        p = torch.softmax(s, dim=-1).masked_fill(dead[c0:c1, None, None], 0.0)
        out[c0:c1] = torch.einsum("qhk,qkc->qhc", p, kc).to(out.dtype)
    for i in blind.nonzero().reshape(-1).tolist():  # every position, not only the selected ones
        r = int(req[i])
        rows = keys.kv_c[keys.starts[r] : keys.starts[r] + fwd.new_len[r]].float()
        out[i] = rows.mean(dim=0).expand_as(out[i]).to(out.dtype)
    return out


def attend_layer(
    layer: int,
    fwd: ForwardPlan,
    backends: Sequence[KVBackend],
    indexer: KVBackend | None,
    q: Queries,
    q_pad: Queries | None,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``layer``'s attention of forward ``fwd`` for its real queries ``q`` and its padding queries ``q_pad``
    that see real tokens: ``(out, out_pad, probs, probs_pad)``.

    The first of ``backends`` (those taking part, in order) whose own ``attend`` gives a result decides it
    (a sparse-offload decode step; no padding queries then); otherwise dense attention (no indexer queries)
    or the top-k attention over the keys of the first backend that has them, selecting with ``indexer``'s
    cache. With ``width`` also the probabilities each query's attention applied (fp32 ``[N, H, width]``,
    from the same rows and the same selection), else ``None`` for them. A forward with a bias
    (``fwd.bias``: no padding queries, no probabilities) runs :func:`biased_attention`.
    """
    for b in backends if fwd.bias is None else ():  # a backend's own attention knows no bias
        res = b.attend(layer, fwd, q)
        if res is not None:
            assert q_pad is None, "a backend's own attention serves decode steps only (no padding)"
            if width is None:
                return res, None, None, None
            rows = b.attended(layer, fwd)
            assert rows is not None, f"{b.name}: attend() gave a result but attended() no rows"
            return res, None, selected_probabilities(q, rows, width), None
    keys = next((k for b in backends if (k := b.keys(layer, fwd)) is not None), None)
    assert keys is not None, "no backend holds the keys of this forward"
    view = None
    if q.index_q is not None:
        assert indexer is not None
        view = indexer.indexer(layer, fwd)
        assert view is not None
    if fwd.bias is not None:
        assert q_pad is None and width is None, "a biased forward has no padding queries nor probabilities"
        return biased_attention(fwd, q, _floating(keys, q), view), None, None, None
    if view is None:
        keys = _floating(keys, q)
        res = dense_attention(fwd, q, keys)
        res_pad = None if q_pad is None else dense_attention(fwd, q_pad, keys, pad=True)
        if width is None:
            return res, res_pad, None, None
        probs_pad = None if q_pad is None else dense_probabilities(fwd, q_pad, keys, width, pad=True)
        return res, res_pad, dense_probabilities(fwd, q, keys, width), probs_pad
    top = select_topk(view, fwd, q)
    res = topk_attention(fwd, q, keys, top)
    probs = None if width is None else topk_probabilities(fwd, q, keys, top, width)
    if q_pad is None:
        return res, None, probs, None
    top_pad = select_topk(view, fwd, q_pad, pad=True)
    res_pad = topk_attention(fwd, q_pad, keys, top_pad, pad=True)
    probs_pad = None if width is None else topk_probabilities(fwd, q_pad, keys, top_pad, width, pad=True)
    return res, res_pad, probs, probs_pad
