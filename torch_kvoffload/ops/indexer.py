"""Lightning indexer (DeepSeek-V3.2 sparse attention): token scores over a paged key cache and top-k.

``score[t, s] = Σ_h w[t, h] · relu(q[t, h, :] · k[s, :])`` for every key ``s`` visible to query ``t``.
Queries of one request are causal: query ``j`` (0-based) of a request with ``Q`` queries and ``S`` keys
sees the first ``S − (Q − 1 − j)`` keys. ``lightning_indexer`` returns, per query, the logical positions of
the ``top_k`` best keys (descending score, ties by lower position, ``−1`` padding when fewer are
visible); ``lightning_indexer_scores`` returns the score matrix itself.

The int8 path rotates queries and keys by the normalised Hadamard matrix and quantises them per token
(``hadamard_quant_int8``); ``quant_lightning_indexer`` then scores with integer dot products times the
dequant scales, with the same output contract.
"""

from __future__ import annotations

import math

import torch

from torch_kvoffload.ops import _checks
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

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


# ------------------------------------------------------------------------------------------ shared checks


def _check_paging(
    op: str,
    num_tokens: int,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
) -> None:
    """Structure of the request description shared by every indexer op."""
    for arg, t, dim in (("block_table", block_table, 2), ("cu_seqlens_q", cu_seqlens_q, 1)):
        _checks.check_dtype(op, arg, t, (torch.int32,))
        _checks.check_dim(op, arg, t, dim)
    _checks.check_dtype(op, "seq_lens_k", seq_lens_k, (torch.int32,))
    _checks.check_dim(op, "seq_lens_k", seq_lens_k, 1)
    batch = block_table.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        _checks.fail(
            op,
            f"argument 'cu_seqlens_q' must have shape [{batch + 1}] (batch + 1 from 'block_table'), "
            f"got {list(cu_seqlens_q.shape)}",
        )
    if seq_lens_k.shape[0] != batch:
        _checks.fail(
            op,
            f"argument 'seq_lens_k' must have shape [{batch}] (batch from 'block_table'), "
            f"got {list(seq_lens_k.shape)}",
        )


def _check_paging_values(
    op: str,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
) -> None:
    """Value checks of the request description (reads the index tensors)."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    if cu[0] != 0:
        _checks.fail(op, f"argument 'cu_seqlens_q' entry 0 must be 0, got {cu[0]}")
    for b in range(len(lens)):
        if cu[b + 1] < cu[b]:
            _checks.fail(
                op,
                f"argument 'cu_seqlens_q' must be non-decreasing, got entry {b + 1} = {cu[b + 1]} "
                f"< entry {b} = {cu[b]}",
            )
    if cu[-1] != num_tokens:
        _checks.fail(
            op,
            f"argument 'cu_seqlens_q' last entry must equal the number of query tokens {num_tokens}, "
            f"got {cu[-1]}",
        )
    max_blocks = block_table.shape[1]
    capacity = max_blocks * block_size
    table = block_table.tolist()
    for b, s in enumerate(lens):
        if s < 0 or s > capacity:
            _checks.fail(
                op,
                f"argument 'seq_lens_k' entry {b} is {s}, expected a value in [0, {capacity}] "
                f"(max_blocks {max_blocks} x block_size {block_size})",
            )
        q = cu[b + 1] - cu[b]
        if s - (q - 1) < 0 and q > 0:
            _checks.fail(
                op,
                f"argument 'seq_lens_k' entry {b} is {s}, but request {b} has {q} query tokens: the first "
                f"query would see {s - (q - 1)} keys (need seq_len_k >= num_queries - 1)",
            )
        for j in range((s + block_size - 1) // block_size):
            blk = table[b][j]
            if blk < 0 or blk >= num_blocks:
                _checks.fail(
                    op,
                    f"argument 'block_table' entry [{b}, {j}] is {blk}, expected a value in [0, {num_blocks})",
                    IndexError,
                )


def _check_top_k(op: str, top_k: int) -> None:
    if top_k < 0:
        _checks.fail(op, f"argument 'top_k' must be >= 0, got {top_k}")


def _visible_lengths(cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 ``[T]``: how many keys each query token sees (causal inside its request)."""
    cu = cu_seqlens_q.to(torch.int64)
    q_lens = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(
        torch.arange(q_lens.shape[0], device=cu.device), q_lens, output_size=num_tokens
    )
    j = torch.arange(num_tokens, device=cu.device) - cu[:-1][req]
    return seq_lens_k.to(torch.int64)[req] - (q_lens[req] - 1 - j)


def _gather_keys(cache: torch.Tensor, block_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Rows ``0..length-1`` of request ``b`` from a paged cache ``[num_blocks, block_size, ...]``."""
    bs = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table[b].to(device=cache.device, dtype=torch.int64)[pos // bs]
    return cache[blocks, pos % bs]


def _topk_from_scores(scores: torch.Tensor, visible: torch.Tensor, top_k: int) -> torch.Tensor:
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


# --------------------------------------------------------------------------- lightning_indexer_scores


def _indexer_structure(
    op: str,
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
) -> None:
    _checks.check_dtype(op, "q", q, FLOAT_DTYPES)
    _checks.check_dim(op, "q", q, 3)
    _checks.check_dim(op, "weights", weights, 2)
    _checks.check_dim(op, "k_cache", k_cache, 3)
    if weights.dtype not in (q.dtype, torch.float32):
        _checks.fail(
            op,
            f"argument 'weights' must have dtype {q.dtype} (as 'q') or torch.float32, got {weights.dtype}",
            TypeError,
        )
    _checks.check_same_dtype(op, "q", q, "k_cache", k_cache)
    if tuple(weights.shape) != tuple(q.shape[:2]):
        _checks.fail(
            op,
            f"argument 'weights' must have shape {list(q.shape[:2])} ([T, H] of 'q'), got {list(weights.shape)}",
        )
    if k_cache.shape[2] != q.shape[2]:
        _checks.fail(
            op,
            f"argument 'k_cache' must have head dim {q.shape[2]} (as 'q'), got shape {list(k_cache.shape)}",
        )
    _check_paging(op, q.shape[0], block_table, cu_seqlens_q, seq_lens_k)
    for arg, t in (("weights", weights), ("k_cache", k_cache)):
        if t.device != q.device:
            _checks.fail(op, f"argument '{arg}' must be on {q.device} (as 'q'), got {t.device}")


def _indexer_scores_impl(
    op: str,
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    logits_fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 score matrix ``[T, max_blocks * block_size]`` and the visible lengths ``[T]`` of validated
    inputs."""
    num_tokens = q.shape[0]
    block_size = k_cache.shape[1]
    width = block_table.shape[1] * block_size
    scores = torch.full((num_tokens, width), -math.inf, dtype=torch.float32, device=q.device)
    visible = _visible_lengths(cu_seqlens_q.cpu(), seq_lens_k.cpu(), num_tokens)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    for b in range(len(lens)):
        t0, t1 = cu[b], cu[b + 1]
        if t1 == t0 or lens[b] == 0:
            continue
        rows = logits_fn(b, t0, t1, lens[b])  # [Q, S] fp32
        mask = torch.arange(lens[b])[None, :] < visible[t0:t1, None]
        scores[t0:t1, : lens[b]] = torch.where(mask.to(q.device), rows, -math.inf)
    return scores, visible


def _check_paging_of(op: str, num_tokens: int, k_cache: torch.Tensor, block_table, cu_seqlens_q, seq_lens_k):
    _check_paging_values(
        op, num_tokens, k_cache.shape[0], k_cache.shape[1], block_table, cu_seqlens_q, seq_lens_k
    )


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


def _float_logits(q, weights, k_cache, block_table):
    def fn(b: int, t0: int, t1: int, length: int) -> torch.Tensor:
        keys = _gather_keys(k_cache, block_table, b, length).float()  # [S, D]
        logits = torch.einsum("thd,sd->ths", q[t0:t1].float(), keys)
        return (weights[t0:t1].float()[:, :, None] * logits.relu()).sum(dim=1)

    return fn


def _indexer_scores_fake(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k):
    _indexer_structure("lightning_indexer_scores", q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)
    return q.new_empty((q.shape[0], block_table.shape[1] * k_cache.shape[1]), dtype=torch.float32)


def _indexer_scores_reference(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k):
    op = "lightning_indexer_scores"
    validate_lightning_indexer_scores(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)
    fn = _float_logits(q, weights, k_cache, block_table)
    return _indexer_scores_impl(op, q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, fn)[0]


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


# ----------------------------------------------------------------------------------- lightning_indexer


def _indexer_fake(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k):
    op = "lightning_indexer"
    _indexer_structure(op, q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)
    _check_top_k(op, top_k)
    return q.new_empty((q.shape[0], top_k), dtype=torch.int32)


def _indexer_reference(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k):
    op = "lightning_indexer"
    validate_lightning_indexer(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k)
    fn = _float_logits(q, weights, k_cache, block_table)
    scores, visible = _indexer_scores_impl(op, q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, fn)
    return _topk_from_scores(scores, visible, top_k)


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


# --------------------------------------------------------------------------------- hadamard_quant_int8


def _hadamard_structure(op: str, x: torch.Tensor) -> None:
    _checks.check_dtype(op, "x", x, FLOAT_DTYPES)
    _checks.check_dim(op, "x", x, 1, at_least=True)
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        _checks.fail(op, f"argument 'x' must have a power-of-two last dim, got shape {list(x.shape)}")


def hadamard_norm(d: int) -> float:
    """The fp32 normalisation factor ``1/√d`` of the Hadamard rotation (as the kernels round it)."""
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


def _fwht(y: torch.Tensor) -> torch.Tensor:
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


def _hadamard_fake(x):
    _hadamard_structure("hadamard_quant_int8", x)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def validate_hadamard_quant_int8(x: torch.Tensor) -> None:
    """Every check of ``hadamard_quant_int8`` (dtype, power-of-two last dim, finite values)."""
    op = "hadamard_quant_int8"
    _hadamard_structure(op, x)
    if x.numel() and not bool(torch.isfinite(x).all()):
        _checks.fail(op, "argument 'x' must be finite, got NaN or infinity")


def _hadamard_reference(x):
    validate_hadamard_quant_int8(x)
    xf = x.float()
    y = _fwht(xf) * hadamard_norm(x.shape[-1])
    amax = y.abs().amax(dim=-1) if y.numel() else y.new_zeros(y.shape[:-1])
    scale = amax / 127.0
    # A zero row has scale 0: its quantised values are 0 (dequantising gives the exact zero row back).
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(y / safe[..., None]).clamp_(-127, 127)
    return q.to(torch.int8), scale


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


# ----------------------------------------------------------------------------- quant_lightning_indexer


def _quant_structure(
    op, q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
) -> None:
    _checks.check_dtype(op, "q_int8", q_int8, (torch.int8,))
    _checks.check_dim(op, "q_int8", q_int8, 3)
    _checks.check_dtype(op, "q_scale", q_scale, (torch.float32,))
    _checks.check_dtype(op, "weights", weights, (torch.float32, torch.bfloat16))
    _checks.check_dtype(op, "k_int8_cache", k_int8_cache, (torch.int8,))
    _checks.check_dim(op, "k_int8_cache", k_int8_cache, 3)
    _checks.check_dtype(op, "k_scale_cache", k_scale_cache, (torch.float32,))
    _checks.check_dim(op, "k_scale_cache", k_scale_cache, 2)
    th = list(q_int8.shape[:2])
    for arg, t in (("q_scale", q_scale), ("weights", weights)):
        if list(t.shape) != th:
            _checks.fail(
                op, f"argument '{arg}' must have shape {th} ([T, H] of 'q_int8'), got {list(t.shape)}"
            )
    if k_int8_cache.shape[2] != q_int8.shape[2]:
        _checks.fail(
            op,
            f"argument 'k_int8_cache' must have head dim {q_int8.shape[2]} (as 'q_int8'), "
            f"got shape {list(k_int8_cache.shape)}",
        )
    if list(k_scale_cache.shape) != list(k_int8_cache.shape[:2]):
        _checks.fail(
            op,
            f"argument 'k_scale_cache' must have shape {list(k_int8_cache.shape[:2])} ([num_blocks, block_size] "
            f"of 'k_int8_cache'), got {list(k_scale_cache.shape)}",
        )
    _check_paging(op, q_int8.shape[0], block_table, cu_seqlens_q, seq_lens_k)
    for arg, t in (
        ("q_scale", q_scale),
        ("weights", weights),
        ("k_int8_cache", k_int8_cache),
        ("k_scale_cache", k_scale_cache),
    ):
        if t.device != q_int8.device:
            _checks.fail(op, f"argument '{arg}' must be on {q_int8.device} (as 'q_int8'), got {t.device}")


def _quant_fake(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k, top_k
):
    op = "quant_lightning_indexer"
    _quant_structure(
        op, q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
    )
    _check_top_k(op, top_k)
    return q_int8.new_empty((q_int8.shape[0], top_k), dtype=torch.int32)


def _validate_quant(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
) -> None:
    op = "quant_lightning_indexer"
    _quant_structure(
        op, q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
    )
    _check_paging_of(op, q_int8.shape[0], k_int8_cache, block_table, cu_seqlens_q, seq_lens_k)


def validate_quant_lightning_indexer(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k, top_k
) -> None:
    """Every check of ``quant_lightning_indexer`` (``top_k``, structure, then the request's values)."""
    _check_top_k("quant_lightning_indexer", top_k)
    _validate_quant(
        q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
    )


def quant_indexer_scores_reference(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated fp32 int8-path scores ``[T, max_blocks * block_size]`` (``−inf`` where not visible) and
    the visible lengths ``[T]``: ``Σ_h w[t,h] · relu(dot_int(q[t,h], k[s]) · q_scale[t,h] · k_scale[s])``."""
    op = "quant_lightning_indexer"
    _validate_quant(
        q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
    )

    def fn(b: int, t0: int, t1: int, length: int) -> torch.Tensor:
        keys = _gather_keys(k_int8_cache, block_table, b, length).to(torch.int32)  # [S, D]
        ks = _gather_keys(k_scale_cache, block_table, b, length)  # [S]
        dots = torch.einsum("thd,sd->ths", q_int8[t0:t1].to(torch.int32), keys)  # exact
        logits = dots.float() * q_scale[t0:t1, :, None] * ks[None, None, :]
        return (weights[t0:t1].float()[:, :, None] * logits.relu()).sum(dim=1)

    return _indexer_scores_impl(op, q_int8, weights, k_int8_cache, block_table, cu_seqlens_q, seq_lens_k, fn)


def _quant_reference(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k, top_k
):
    _check_top_k("quant_lightning_indexer", top_k)
    scores, visible = quant_indexer_scores_reference(
        q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
    )
    return _topk_from_scores(scores, visible, top_k)


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
