"""Pure-PyTorch formulas of the lightning-indexer ops on validated inputs: the golden model that the
reference kernels of :mod:`torch_kvoffload.ops.indexer` run (after its checks) and the C++ / Triton
kernels are tested against.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = [
    "float_logits",
    "fwht",
    "gather_keys",
    "quant_logits",
    "quantize_rows",
    "score_matrix",
    "topk_from_scores",
]


def gather_keys(cache: torch.Tensor, block_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Rows ``0..length-1`` of request ``b`` from a paged cache ``[num_blocks, block_size, ...]``."""
    bs = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table[b].to(device=cache.device, dtype=torch.int64)[pos // bs]
    return cache[blocks, pos % bs]


def score_matrix(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    visible: torch.Tensor,
    logits_fn: Callable[[int, int, int, int], torch.Tensor],
) -> torch.Tensor:
    """fp32 score matrix ``[T, max_blocks * block_size]`` of validated inputs, ``−inf`` past the
    ``visible [T]`` keys of each query (``T = q.shape[0]``, the scores on ``q``'s device).

    ``logits_fn(b, t0, t1, S)`` gives request ``b``'s fp32 ``[t1 - t0, S]`` scores of queries
    ``t0 .. t1 - 1`` over its ``S`` keys (:func:`float_logits`, :func:`quant_logits`).
    """
    num_tokens = q.shape[0]
    block_size = k_cache.shape[1]
    width = block_table.shape[1] * block_size
    scores = torch.full((num_tokens, width), -math.inf, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    for b in range(len(lens)):
        t0, t1 = cu[b], cu[b + 1]
        if t1 == t0 or lens[b] == 0:
            continue
        rows = logits_fn(b, t0, t1, lens[b])  # [Q, S] fp32
        mask = torch.arange(lens[b])[None, :] < visible[t0:t1, None]
        scores[t0:t1, : lens[b]] = torch.where(mask.to(q.device), rows, -math.inf)
    return scores


def float_logits(q, weights, k_cache, block_table) -> Callable[[int, int, int, int], torch.Tensor]:
    """``logits_fn`` of :func:`score_matrix` for fp32 / bf16 queries and keys: ``Σ_h w · relu(q · k)``."""

    def fn(b: int, t0: int, t1: int, length: int) -> torch.Tensor:
        keys = gather_keys(k_cache, block_table, b, length).float()  # [S, D]
        logits = torch.einsum("thd,sd->ths", q[t0:t1].float(), keys)
        return (weights[t0:t1].float()[:, :, None] * logits.relu()).sum(dim=1)

    return fn


def quant_logits(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table
) -> Callable[[int, int, int, int], torch.Tensor]:
    """``logits_fn`` of :func:`score_matrix` for int8 queries and keys:
    ``Σ_h w · relu(dot_int(q, k) · q_scale · k_scale)`` (the integer dot products exact)."""

    def fn(b: int, t0: int, t1: int, length: int) -> torch.Tensor:
        keys = gather_keys(k_int8_cache, block_table, b, length).to(torch.int32)  # [S, D]
        ks = gather_keys(k_scale_cache, block_table, b, length)  # [S]
        dots = torch.einsum("thd,sd->ths", q_int8[t0:t1].to(torch.int32), keys)  # exact
        logits = dots.float() * q_scale[t0:t1, :, None] * ks[None, None, :]
        return (weights[t0:t1].float()[:, :, None] * logits.relu()).sum(dim=1)

    return fn


def topk_from_scores(scores: torch.Tensor, visible: torch.Tensor, top_k: int) -> torch.Tensor:
    """Positions of the ``top_k`` best visible scores per row (ties by lower position), ``−1`` padded."""
    num_tokens, width = scores.shape
    out = torch.full((num_tokens, top_k), -1, dtype=torch.int32, device=scores.device)
    k = min(top_k, width)
    if k == 0 or num_tokens == 0:
        return out
    # A stable descending sort keeps equal scores in position order; invisible keys hold −inf and sit
    # after every visible key (which all have lower positions), so they only appear as padding.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    order = torch.where(order < visible[:, None].to(order.device), order, -1)
    out[:, :k] = order.to(torch.int32)
    return out


def fwht(y: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh–Hadamard transform over the last dim (Sylvester order), fp32.

    Stage ``h`` (1, 2, 4, ...) replaces each pair ``(a, b)`` at distance ``h`` by ``(a + b, a − b)``: the
    same additions, in the same order, as the C++ kernel, so both round identically.
    """
    d = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < d:
        v = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return y


def quantize_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 quantisation of fp32 ``y [..., D]``: ``q = clamp(round(y / scale), −127, 127)`` with
    ``scale = amax(|y|) / 127``; returns ``(int8 q, fp32 scale [...])``."""
    amax = y.abs().amax(dim=-1) if y.numel() else y.new_zeros(y.shape[:-1])
    scale = amax / 127.0
    # A zero row has scale 0: its quantised values are 0 (dequantising gives the exact zero row back).
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(y / safe[..., None]).clamp_(-127, 127)
    return q.to(torch.int8), scale
