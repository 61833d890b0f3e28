"""Lightning indexer (DeepSeek-V3.2 sparse attention): token scores over a paged key cache and top-k.

``score[t, s] = Σ_h w[t, h] · relu(q[t, h, :] · k[s, :])`` for every key ``s`` visible to query ``t``.
Queries of one request are causal: query ``j`` (0-based) of a request with ``Q`` queries and ``S`` keys
sees the first ``S − (Q − 1 − j)`` keys. ``lightning_indexer`` returns, per query, the logical positions of
the ``top_k`` best keys (descending score, ties by lower position, ``−1`` padding when fewer are
visible); ``lightning_indexer_scores`` returns the score matrix itself.

The int8 path rotates queries and keys by the normalised Hadamard matrix and quantises them per token
(``hadamard_quant_int8``); ``quant_lightning_indexer`` then scores with integer dot products times the
dequant scales, with the same output contract.

The argument checks live in :mod:`torch_kvoffload.ops._indexer_checks` and the formulas of the reference
kernels in :mod:`torch_kvoffload.ops.indexer_reference`. This module defines the ops (schema, fake and
reference kernel, typed wrapper) and what every kernel of them shares: the validators (``validate_*``),
which keys a query sees (:func:`_visible_lengths`) and the rounding of the Hadamard scale
(:func:`hadamard_norm`).
"""

from __future__ import annotations

import math

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops import indexer_reference as ref
from torch_kvoffload.ops._indexer_checks import (
    _check_paging_of,
    _check_top_k,
    _hadamard_structure,
    _indexer_structure,
    _quant_structure,
    _validate_quant,
)
from torch_kvoffload.ops._registry import define_op

__all__ = [
    "hadamard_quant_int8",
    "lightning_indexer",
    "lightning_indexer_scores",
    "quant_lightning_indexer",
    "validate_hadamard_quant_int8",
    "validate_lightning_indexer",
    "validate_lightning_indexer_scores",
    "validate_quant_lightning_indexer",
]


def _visible_lengths(cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 ``[T]``: how many keys each query token sees (causal inside its request)."""
    cu = cu_seqlens_q.to(torch.int64)
    q_lens = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(
        torch.arange(q_lens.shape[0], device=cu.device), q_lens, output_size=num_tokens
    )
    j = torch.arange(num_tokens, device=cu.device) - cu[:-1][req]
    return seq_lens_k.to(torch.int64)[req] - (q_lens[req] - 1 - j)


def hadamard_norm(d: int) -> float:
    """The fp32 normalisation factor ``1/√d`` of the Hadamard rotation (as the kernels round it)."""
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


def validate_lightning_indexer_scores(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k) -> None:
    """Every check of ``lightning_indexer_scores`` (structure, then the request description's values)."""
    op = "lightning_indexer_scores"
    _indexer_structure(op, q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)
    _check_paging_of(op, q.shape[0], k_cache, block_table, cu_seqlens_q, seq_lens_k)


def validate_lightning_indexer(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k) -> None:
    """Every check of ``lightning_indexer`` (structure, ``top_k``, then the request description's values)."""
    op = "lightning_indexer"
    _indexer_structure(op, q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)
    _check_top_k(op, top_k)
    _check_paging_of(op, q.shape[0], k_cache, block_table, cu_seqlens_q, seq_lens_k)


def validate_hadamard_quant_int8(x: torch.Tensor) -> None:
    """Every check of ``hadamard_quant_int8`` (dtype, power-of-two last dim, finite values)."""
    op = "hadamard_quant_int8"
    _hadamard_structure(op, x)
    if x.numel() and not bool(torch.isfinite(x).all()):
        _checks.fail(op, "argument 'x' must be finite, got NaN or infinity")


def validate_quant_lightning_indexer(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k, top_k
) -> None:
    """Every check of ``quant_lightning_indexer`` (``top_k``, structure, then the request's values)."""
    _check_top_k("quant_lightning_indexer", top_k)
    _validate_quant(
        q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
    )


# --------------------------------------------------------------------------------- lightning_indexer_scores


def _indexer_scores_fake(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k):
    _indexer_structure("lightning_indexer_scores", q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)
    return q.new_empty((q.shape[0], block_table.shape[1] * k_cache.shape[1]), dtype=torch.float32)


def _indexer_scores_reference(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k):
    validate_lightning_indexer_scores(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)
    visible = _visible_lengths(cu_seqlens_q.cpu(), seq_lens_k.cpu(), q.shape[0])
    fn = ref.float_logits(q, weights, k_cache, block_table)
    return ref.score_matrix(q, k_cache, block_table, cu_seqlens_q, seq_lens_k, visible, fn)


_INDEXER_ARGS = (
    "Tensor q, Tensor weights, Tensor k_cache, Tensor block_table, Tensor cu_seqlens_q, Tensor seq_lens_k"
)


_indexer_scores_op = define_op(
    "lightning_indexer_scores",
    f"({_INDEXER_ARGS}) -> Tensor",
    fake=_indexer_scores_fake,
    reference=_indexer_scores_reference,
)


def lightning_indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
) -> torch.Tensor:
    """Lightning-indexer score matrix over a paged key cache.

    Parameters
    ----------
    q : Tensor
        ``[T, H, D]`` fp32 or bf16: indexer queries of all requests, concatenated.
    weights : Tensor
        ``[T, H]``, dtype of ``q`` or fp32: per-head weights.
    k_cache : Tensor
        ``[num_blocks, block_size, D]``, dtype of ``q``: paged indexer keys.
    block_table : Tensor
        ``int32 [B, max_blocks]``: request ``b``'s logical block ``j`` is physical block ``block_table[b, j]``
        (only the blocks covering ``seq_lens_k[b]`` are read and must be valid).
    cu_seqlens_q : Tensor
        ``int32 [B + 1]``: query tokens of request ``b`` are rows ``cu[b] .. cu[b+1]-1`` (``cu[0] = 0``,
        ``cu[B] = T``).
    seq_lens_k : Tensor
        ``int32 [B]``: keys of request ``b`` (at most ``max_blocks * block_size``, at least ``Q_b - 1``).

    Returns
    -------
    Tensor
        ``fp32 [T, max_blocks * block_size]``: ``score[t, s] = Σ_h w[t,h] · relu(q[t,h] · k[s])`` accumulated
        in fp32 for the keys query ``t`` sees (query ``j`` of ``Q`` sees ``S − (Q−1−j)`` keys), ``−inf`` past.

    Raises ``ValueError`` / ``TypeError`` / ``IndexError`` naming the argument on bad shapes, dtypes,
    lengths or block-table entries.

    Example
    -------
    >>> q, w = torch.randn(1, 4, 32), torch.randn(1, 4)
    >>> k = torch.randn(8, 16, 32)
    >>> s = lightning_indexer_scores(q, w, k, torch.tensor([[3, 5]], dtype=torch.int32),
    ...                              torch.tensor([0, 1], dtype=torch.int32), torch.tensor([20], dtype=torch.int32))
    >>> s.shape
    torch.Size([1, 32])
    """
    return _indexer_scores_op(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)


# ---------------------------------------------------------------------------------------- lightning_indexer


def _indexer_fake(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k):
    op = "lightning_indexer"
    _indexer_structure(op, q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)
    _check_top_k(op, top_k)
    return q.new_empty((q.shape[0], top_k), dtype=torch.int32)


def _indexer_reference(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k):
    validate_lightning_indexer(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k)
    visible = _visible_lengths(cu_seqlens_q.cpu(), seq_lens_k.cpu(), q.shape[0])
    fn = ref.float_logits(q, weights, k_cache, block_table)
    scores = ref.score_matrix(q, k_cache, block_table, cu_seqlens_q, seq_lens_k, visible, fn)
    return ref.topk_from_scores(scores, visible, top_k)


_indexer_op = define_op(
    "lightning_indexer",
    f"({_INDEXER_ARGS}, int top_k) -> Tensor",
    fake=_indexer_fake,
    reference=_indexer_reference,
)


def lightning_indexer(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Top-k key positions per query token by lightning-indexer score.

    Arguments as :func:`lightning_indexer_scores`, plus ``top_k >= 0``.

    Returns
    -------
    Tensor
        ``int32 [T, top_k]``: logical key positions (``0 .. seq_len_k - 1`` within the request) in descending
        score, equal scores by lower position first; when a query sees fewer than ``top_k`` keys the row ends
        with ``−1`` padding.

    Example
    -------
    >>> q, w = torch.randn(2, 4, 32), torch.randn(2, 4)
    >>> k = torch.randn(8, 16, 32)
    >>> idx = lightning_indexer(q, w, k, torch.tensor([[3, 5]], dtype=torch.int32),
    ...                         torch.tensor([0, 2], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), 8)
    >>> idx.shape, idx.dtype
    (torch.Size([2, 8]), torch.int32)
    """
    return _indexer_op(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k)


# -------------------------------------------------------------------------------------- hadamard_quant_int8


def _hadamard_fake(x):
    _hadamard_structure("hadamard_quant_int8", x)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _hadamard_reference(x):
    validate_hadamard_quant_int8(x)
    return ref.quantize_rows(ref.fwht(x.float()) * hadamard_norm(x.shape[-1]))


_hadamard_op = define_op(
    "hadamard_quant_int8",
    "(Tensor x) -> (Tensor, Tensor)",
    fake=_hadamard_fake,
    reference=_hadamard_reference,
)


def hadamard_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate by the normalised Hadamard matrix, then quantise each row to int8 with a dynamic scale.

    ``y = x @ (H_D / √D)`` (Sylvester ``H_D``, symmetric), computed in fp32 with a fast Walsh–Hadamard
    transform; ``scale = amax(|y|) / 127`` per row; ``q = clamp(round(y / scale), −127, 127)`` with
    round-half-to-even (as :func:`torch.round`). A zero row gets ``scale = 0`` and ``q = 0``.

    Parameters
    ----------
    x : Tensor
        ``[..., D]`` fp32 or bf16, ``D`` a power of two, finite.

    Returns
    -------
    (Tensor, Tensor)
        ``int8 [..., D]`` quantised values and ``fp32 [...]`` scales; ``q * scale`` approximates ``y``
        within ``scale / 2`` per element.

    Example
    -------
    >>> q, s = hadamard_quant_int8(torch.randn(4, 128))
    >>> q.dtype, s.shape
    (torch.int8, torch.Size([4]))
    """
    return _hadamard_op(x)


# ---------------------------------------------------------------------------------- quant_lightning_indexer


def _quant_fake(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k, top_k
):
    op = "quant_lightning_indexer"
    _quant_structure(
        op, q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
    )
    _check_top_k(op, top_k)
    return q_int8.new_empty((q_int8.shape[0], top_k), dtype=torch.int32)


def quant_indexer_scores_reference(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated fp32 int8-path scores ``[T, max_blocks * block_size]`` (``−inf`` where not visible) and
    the visible lengths ``[T]``: ``Σ_h w[t,h] · relu(dot_int(q[t,h], k[s]) · q_scale[t,h] · k_scale[s])``."""
    _validate_quant(
        q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
    )
    visible = _visible_lengths(cu_seqlens_q.cpu(), seq_lens_k.cpu(), q_int8.shape[0])
    fn = ref.quant_logits(q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table)
    scores = ref.score_matrix(q_int8, k_int8_cache, block_table, cu_seqlens_q, seq_lens_k, visible, fn)
    return scores, visible


def _quant_reference(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k, top_k
):
    _check_top_k("quant_lightning_indexer", top_k)
    scores, visible = quant_indexer_scores_reference(
        q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
    )
    return ref.topk_from_scores(scores, visible, top_k)


_quant_op = define_op(
    "quant_lightning_indexer",
    "(Tensor q_int8, Tensor q_scale, Tensor weights, Tensor k_int8_cache, Tensor k_scale_cache, "
    "Tensor block_table, Tensor cu_seqlens_q, Tensor seq_lens_k, int top_k) -> Tensor",
    fake=_quant_fake,
    reference=_quant_reference,
)


def quant_lightning_indexer(
    q_int8: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    k_int8_cache: torch.Tensor,
    k_scale_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Top-k key positions per query token from int8 (Hadamard-rotated) queries and keys.

    ``score[t, s] = Σ_h w[t,h] · relu(dot_int32(q[t,h], k[s]) · q_scale[t,h] · k_scale[s])``; output contract
    as :func:`lightning_indexer`.

    Parameters
    ----------
    q_int8 : Tensor
        ``int8 [T, H, D]`` (from :func:`hadamard_quant_int8`).
    q_scale : Tensor
        ``fp32 [T, H]``.
    weights : Tensor
        ``[T, H]`` fp32 or bf16.
    k_int8_cache : Tensor
        ``int8 [num_blocks, block_size, D]`` paged keys.
    k_scale_cache : Tensor
        ``fp32 [num_blocks, block_size]`` per-key dequant scales.
    block_table, cu_seqlens_q, seq_lens_k, top_k
        As :func:`lightning_indexer`.

    Returns
    -------
    Tensor
        ``int32 [T, top_k]`` logical key positions, ``−1`` padded.

    Example
    -------
    >>> qi, qs = hadamard_quant_int8(torch.randn(1, 4, 128))
    >>> ki, ks = hadamard_quant_int8(torch.randn(8, 16, 128))
    >>> idx = quant_lightning_indexer(qi, qs, torch.rand(1, 4), ki, ks, torch.tensor([[2, 6]], dtype=torch.int32),
    ...                               torch.tensor([0, 1], dtype=torch.int32), torch.tensor([30], dtype=torch.int32), 8)
    """
    return _quant_op(
        q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k, top_k
    )
