"""The FP8 lightning indexer: DeepSeek-V3.2's indexer path with FP8 queries and keys.

As DeepSeek's inference code does, the queries and keys are rotated by the normalised Hadamard matrix and
quantised to the 132-byte indexer rows of :mod:`torch_kvoffload.ops.fp8` (``e4m3fn`` values, one fp32
power-of-two scale per 128), and scores are computed from the FP8 values:

``score[t, s] = Σ_h w[t, h] · relu(Σ_g dot(q[t, h, g], k[s, g]) · q_scale[t, h, g] · k_scale[s, g])``

with ``g`` the 128-wide groups of the head dim (one for DeepSeek's 128), the dot products of the ``e4m3fn``
values accumulated in fp32. Multiplying by a power-of-two scale is exact, so kernels differ from the
reference only in the order of a dot product's additions. Output contract (visible keys, top-k order,
``−1`` padding) as :func:`~torch_kvoffload.ops.indexer.lightning_indexer`.

Ops (each with a fake kernel, the reference below, a C++ CPU kernel and a Triton kernel):
``hadamard_quant_fp8(x [..., D]) -> uint8 [..., D + 4 * D / 128]`` and
``fp8_lightning_indexer(q_rows uint8 [T, H, R], weights [T, H], k_rows uint8 [num_blocks, block_size, R],
block_table, cu_seqlens_q, seq_lens_k, top_k) -> int32 [T, top_k]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops import indexer_reference as ref
from torch_kvoffload.ops._indexer_checks import _check_paging, _check_paging_of, _check_top_k
from torch_kvoffload.ops._registry import define_op
from torch_kvoffload.ops.fp8 import TILE, index_row_bytes, quantize_index_groups
from torch_kvoffload.ops.indexer import _visible_lengths, hadamard_norm

__all__ = [
    "fp8_indexer_scores_reference",
    "fp8_lightning_indexer",
    "fp8_logits",
    "hadamard_quant_fp8",
    "index_head_dim_of",
    "validate_fp8_lightning_indexer",
    "validate_fp8_lightning_indexer_structure",
    "validate_hadamard_quant_fp8",
]


def index_head_dim_of(op: str, arg: str, row_bytes: int) -> int:
    """The head dim ``D`` of indexer rows of ``row_bytes`` bytes (``D + 4 * D / 128``); ``ValueError``
    naming ``op`` / ``arg`` when no ``D`` gives that width."""
    if row_bytes <= 0 or row_bytes % (TILE + 4):
        _checks.fail(
            op,
            f"argument '{arg}' must hold {TILE + 4} bytes per {TILE} indexer values ({TILE} fp8 values and an "
            f"fp32 scale) in its last dim, got {row_bytes}",
        )
    return row_bytes // (TILE + 4) * TILE


def _split_rows(rows: torch.Tensor, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 codes ``[..., G, 128]`` and fp32 scales ``[..., G]`` of indexer rows ``uint8 [..., R]``."""
    lead = rows.shape[:-1]
    flat = rows.reshape(-1, rows.shape[-1])
    codes = flat[:, :D].contiguous().view(torch.float8_e4m3fn).float()
    scales = flat[:, D:].contiguous().view(torch.float32)
    return codes.reshape(*lead, D // TILE, TILE), scales.reshape(*lead, D // TILE)


# --------------------------------------------------------------------------------------- hadamard_quant_fp8


def validate_hadamard_quant_fp8(x: torch.Tensor) -> None:
    """Every check of ``hadamard_quant_fp8`` (float dtype, power-of-two last dim, a multiple of 128)."""
    op = "hadamard_quant_fp8"
    _checks.check_dtype(op, "x", x, (torch.float32, torch.bfloat16))
    _checks.check_dim(op, "x", x, 1, at_least=True)
    d = x.shape[-1]
    if d < TILE or d & (d - 1):
        _checks.fail(
            op,
            f"argument 'x' must have a power-of-two last dim of at least {TILE} (the Hadamard rotation, one "
            f"fp32 scale per {TILE} values), got shape {list(x.shape)}",
        )


def _hadamard_fp8_fake(x: torch.Tensor) -> torch.Tensor:
    validate_hadamard_quant_fp8(x)
    return x.new_empty((*x.shape[:-1], index_row_bytes(x.shape[-1])), dtype=torch.uint8)


def _hadamard_fp8_reference(x: torch.Tensor) -> torch.Tensor:
    validate_hadamard_quant_fp8(x)
    d = x.shape[-1]
    y = ref.fwht(x.float().reshape(-1, d)) * hadamard_norm(d)
    return quantize_index_groups(y).reshape(*x.shape[:-1], index_row_bytes(d))


_hadamard_fp8_op = define_op(
    "hadamard_quant_fp8",
    "(Tensor x) -> Tensor",
    fake=_hadamard_fp8_fake,
    reference=_hadamard_fp8_reference,
)


def hadamard_quant_fp8(x: torch.Tensor) -> torch.Tensor:
    """Rotate by the normalised Hadamard matrix, then quantise to FP8 indexer rows.

    ``y = x @ (H_D / √D)`` in fp32 (the fast Walsh–Hadamard transform of ``hadamard_quant_int8``, same
    additions in the same order), then each 128-wide group of ``y`` quantised as
    :func:`~torch_kvoffload.ops.fp8.quantize_index_k_fp8` does (DeepSeek's ``act_quant``, power-of-two
    scale).

    Parameters
    ----------
    x : Tensor
        ``[..., D]`` fp32 or bf16, ``D`` a power of two and at least 128.

    Returns
    -------
    Tensor
        ``uint8 [..., D + 4 * D / 128]``: per row the ``e4m3fn`` values, then the fp32 scales.

    Example
    -------
    >>> hadamard_quant_fp8(torch.randn(4, 2, 128)).shape
    torch.Size([4, 2, 132])
    """
    return _hadamard_fp8_op(x)


# ------------------------------------------------------------------------------------ fp8_lightning_indexer


def _fp8_structure(op, q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k) -> None:
    _checks.check_dtype(op, "q_rows", q_rows, (torch.uint8,))
    _checks.check_dim(op, "q_rows", q_rows, 3)
    _checks.check_dtype(op, "weights", weights, (torch.float32, torch.bfloat16))
    _checks.check_dim(op, "weights", weights, 2)
    _checks.check_dtype(op, "k_rows", k_rows, (torch.uint8,))
    _checks.check_dim(op, "k_rows", k_rows, 3)
    index_head_dim_of(op, "q_rows", q_rows.shape[2])
    if list(weights.shape) != list(q_rows.shape[:2]):
        _checks.fail(
            op, f"argument 'weights' must have shape {list(q_rows.shape[:2])} ([T, H] of 'q_rows'), "
            f"got {list(weights.shape)}",
        )  # fmt: skip
    if k_rows.shape[2] != q_rows.shape[2]:
        _checks.fail(
            op,
            f"argument 'k_rows' must have {q_rows.shape[2]} bytes per row (as 'q_rows'), "
            f"got shape {list(k_rows.shape)}",
        )
    _check_paging(op, q_rows.shape[0], block_table, cu_seqlens_q, seq_lens_k)
    for arg, t in (("weights", weights), ("k_rows", k_rows)):
        if t.device != q_rows.device:
            _checks.fail(op, f"argument '{arg}' must be on {q_rows.device} (as 'q_rows'), got {t.device}")


def validate_fp8_lightning_indexer_structure(
    q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k
) -> None:
    """The structural checks of ``fp8_lightning_indexer`` (shapes, dtypes, devices; no value read): what a
    caller launching the kernels without a host synchronisation checks first."""
    _fp8_structure("fp8_lightning_indexer", q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k)


def validate_fp8_lightning_indexer(
    q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k, top_k
) -> None:
    """Every check of ``fp8_lightning_indexer`` (``top_k``, structure, then the request's values)."""
    op = "fp8_lightning_indexer"
    _check_top_k(op, top_k)
    _fp8_structure(op, q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k)
    _check_paging_of(op, q_rows.shape[0], k_rows, block_table, cu_seqlens_q, seq_lens_k)


def fp8_logits(q_rows, weights, k_rows, block_table) -> Callable[[int, int, int, int], torch.Tensor]:
    """``logits_fn`` of :func:`~torch_kvoffload.ops.indexer_reference.score_matrix` for FP8 rows (the
    module docstring's formula)."""
    D = index_head_dim_of("fp8_lightning_indexer", "q_rows", q_rows.shape[-1])

    def fn(b: int, t0: int, t1: int, length: int) -> torch.Tensor:
        qc, qs = _split_rows(q_rows[t0:t1], D)  # [Q, H, G, 128], [Q, H, G]
        kc, ks = _split_rows(ref.gather_keys(k_rows, block_table, b, length), D)  # [S, G, 128], [S, G]
        dots = torch.einsum("thgd,sgd->thsg", qc, kc)
        logits = (dots * qs[:, :, None, :] * ks[None, None, :, :]).sum(dim=-1)
        return (weights[t0:t1].float()[:, :, None] * logits.relu()).sum(dim=1)

    return fn


def fp8_indexer_scores_reference(
    q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated fp32 scores ``[T, max_blocks * block_size]`` (``−inf`` where not visible) and the visible
    lengths ``[T]`` of ``fp8_lightning_indexer``'s formula."""
    validate_fp8_lightning_indexer(q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k, 0)
    visible = _visible_lengths(cu_seqlens_q.cpu(), seq_lens_k.cpu(), q_rows.shape[0])
    fn = fp8_logits(q_rows, weights, k_rows, block_table)
    scores = ref.score_matrix(q_rows, k_rows, block_table, cu_seqlens_q, seq_lens_k, visible, fn)
    return scores, visible


def _fp8_indexer_fake(q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k, top_k):
    op = "fp8_lightning_indexer"
    _fp8_structure(op, q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k)
    _check_top_k(op, top_k)
    return q_rows.new_empty((q_rows.shape[0], top_k), dtype=torch.int32)


def _fp8_indexer_reference(q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k, top_k):
    _check_top_k("fp8_lightning_indexer", top_k)
    scores, visible = fp8_indexer_scores_reference(
        q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k
    )
    return ref.topk_from_scores(scores, visible, top_k)


_fp8_indexer_op = define_op(
    "fp8_lightning_indexer",
    "(Tensor q_rows, Tensor weights, Tensor k_rows, Tensor block_table, Tensor cu_seqlens_q, "
    "Tensor seq_lens_k, int top_k) -> Tensor",
    fake=_fp8_indexer_fake,
    reference=_fp8_indexer_reference,
)


def fp8_lightning_indexer(
    q_rows: torch.Tensor,
    weights: torch.Tensor,
    k_rows: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Top-k key positions per query token from FP8 indexer rows (see the module docstring).

    Parameters
    ----------
    q_rows : Tensor
        ``uint8 [T, H, R]`` (from :func:`hadamard_quant_fp8`), ``R = D + 4 * D / 128``.
    weights : Tensor
        ``[T, H]`` fp32 or bf16.
    k_rows : Tensor
        ``uint8 [num_blocks, block_size, R]`` paged key rows (from :func:`hadamard_quant_fp8`).
    block_table, cu_seqlens_q, seq_lens_k, top_k
        As :func:`~torch_kvoffload.ops.indexer.lightning_indexer`.

    Returns
    -------
    Tensor
        ``int32 [T, top_k]`` logical key positions, best first, ``−1`` padded.
    """
    return _fp8_indexer_op(q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k, top_k)
