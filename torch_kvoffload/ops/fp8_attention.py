"""Sparse MLA attention over FP8 latent rows (DeepSeek's 656-byte rows, FlashMLA's ``V32_FP8Sparse``).

``fp8_sparse_mla_attention(q_nope, q_pe, kv_rows, indices, scale)`` is
:func:`~torch_kvoffload.ops.sparse_attention.sparse_mla_attention` over the rows of ``kv_rows`` (``uint8 [N,
Dc + 4 * Dc / 128 + 2 * Dr]``, the format of :mod:`torch_kvoffload.ops.fp8`) dequantized: each selected
row's latent values are its ``e4m3fn`` codes times its tile's power-of-two scale, its RoPE values the bf16
ones kept in it. Dequantized values are exact in fp32 and bf16 (a code has four significant bits), so the
op equals ``sparse_mla_attention(q_nope, q_pe, *dequantize_kv_fp8(kv_rows, Dc, q_nope.dtype), indices,
scale)``; kernels dequantize only the rows they read. Rows move as bytes; dequantization happens where
the attention reads them.

Op (a fake kernel, the reference below, a C++ CPU kernel and a Triton kernel):
``fp8_sparse_mla_attention(q_nope [T, H, Dc], q_pe [T, H, Dr], kv_rows uint8 [N, R], indices int32 [T, K],
scale) -> (out [T, H, Dc] in q_nope's dtype, lse fp32 [T, H])``.
"""

from __future__ import annotations

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops import sparse_attention_reference as ref
from torch_kvoffload.ops._registry import define_op
from torch_kvoffload.ops.fp8 import TILE, kv_row_bytes
from torch_kvoffload.ops.sparse_attention import _check_index_range, _check_queries

__all__ = ["dequantize_rows", "fp8_sparse_mla_attention", "validate_fp8_sparse_mla_attention"]

OP = "fp8_sparse_mla_attention"


def check_fp8_queries(op: str, q_nope: torch.Tensor, q_pe: torch.Tensor) -> None:
    """Queries of an op over FP8 latent rows: those of sparse MLA attention, ``Dc`` a multiple of 128."""
    _check_queries(op, q_nope, q_pe)
    dc = q_nope.shape[-1]
    if dc % TILE or dc == 0:
        _checks.fail(
            op,
            f"argument 'q_nope' must have a latent width (Dc) that is a positive multiple of {TILE} (one fp32 "
            f"scale per {TILE} values of an FP8 row), got shape {list(q_nope.shape)}",
        )


def check_fp8_rows(op: str, arg: str, rows: torch.Tensor, dims: int, q_nope, q_pe) -> None:
    """``rows``: ``uint8`` FP8 latent rows of the queries' widths, ``dims`` dims."""
    dc, dr = q_nope.shape[-1], q_pe.shape[-1]
    _checks.check_dtype(op, arg, rows, (torch.uint8,))
    _checks.check_dim(op, arg, rows, dims)
    want = kv_row_bytes(dc, dr)
    if rows.shape[-1] != want:
        _checks.fail(
            op,
            f"argument '{arg}' must have {want} bytes per row (Dc {dc} fp8 values, {dc // TILE} fp32 scales, "
            f"Dr {dr} bf16 RoPE values), got shape {list(rows.shape)}",
        )


def _structure(q_nope, q_pe, kv_rows, indices) -> None:
    check_fp8_queries(OP, q_nope, q_pe)
    check_fp8_rows(OP, "kv_rows", kv_rows, 2, q_nope, q_pe)
    _checks.check_dtype(OP, "indices", indices, (torch.int32,))
    _checks.check_dim(OP, "indices", indices, 2)
    if indices.shape[0] != q_nope.shape[0]:
        _checks.fail(
            OP,
            f"argument 'indices' must have {q_nope.shape[0]} rows (T of 'q_nope'), got shape {list(indices.shape)}",
        )
    for arg, t in (("q_pe", q_pe), ("kv_rows", kv_rows), ("indices", indices)):
        if t.device != q_nope.device:
            _checks.fail(OP, f"argument '{arg}' must be on {q_nope.device} (as 'q_nope'), got {t.device}")


def validate_fp8_sparse_mla_attention(q_nope, q_pe, kv_rows, indices) -> None:
    """Every check of ``fp8_sparse_mla_attention`` (structure, then the indices' range)."""
    _structure(q_nope, q_pe, kv_rows, indices)
    _check_index_range(OP, "indices", indices, kv_rows.shape[0])


def dequantize_rows(rows: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(kv_c [..., Dc], k_pe [..., Dr])`` of FP8 latent rows ``uint8 [..., R]`` (exact)."""
    lead, width = rows.shape[:-1], rows.shape[-1]
    flat = rows.reshape(-1, width)
    dc, tiles = kv_lora_rank, kv_lora_rank // TILE
    codes = flat[:, :dc].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, tiles, TILE)
    scales = flat[:, dc : dc + 4 * tiles].contiguous().view(torch.float32)
    kv_c = (codes * scales[..., None]).reshape(*lead, dc)
    k_pe = flat[:, dc + 4 * tiles :].contiguous().view(torch.bfloat16).float()
    k_pe = k_pe.reshape(*lead, (width - dc - 4 * tiles) // 2)
    return kv_c, k_pe


def _fake(q_nope, q_pe, kv_rows, indices, scale):
    _structure(q_nope, q_pe, kv_rows, indices)
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty(q_nope.shape[:2], dtype=torch.float32)


def _reference(q_nope, q_pe, kv_rows, indices, scale):
    validate_fp8_sparse_mla_attention(q_nope, q_pe, kv_rows, indices)
    idx = indices.to(torch.int64)
    valid = idx >= 0
    if kv_rows.shape[0] == 0:  # nothing to gather from: every index is −1
        gathered = kv_rows.new_zeros((*idx.shape, kv_rows.shape[1]))
    else:
        gathered = kv_rows[idx.clamp(min=0)]
    rows_c, rows_pe = dequantize_rows(gathered, q_nope.shape[-1])
    return ref.attend(q_nope, q_pe, rows_c, rows_pe, valid, scale)


_op = define_op(
    OP,
    "(Tensor q_nope, Tensor q_pe, Tensor kv_rows, Tensor indices, float scale) -> (Tensor, Tensor)",
    fake=_fake,
    reference=_reference,
)


def fp8_sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_rows: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention over the FP8 latent rows selected by ``indices`` (see the module docstring).

    Parameters
    ----------
    q_nope : Tensor
        ``[T, H, Dc]`` fp32 or bf16, ``Dc`` a multiple of 128.
    q_pe : Tensor
        ``[T, H, Dr]``, dtype of ``q_nope``.
    kv_rows : Tensor
        ``uint8 [N, Dc + 4 * Dc / 128 + 2 * Dr]``: FP8 latent rows (656 bytes for 512 + 64).
    indices : Tensor
        ``int32 [T, K]``: rows attended by token ``t``; ``−1`` entries are skipped.
    scale : float
        Softmax scale.

    Returns
    -------
    (Tensor, Tensor)
        ``out [T, H, Dc]`` in ``q_nope``'s dtype and ``lse fp32 [T, H]``, as
        :func:`~torch_kvoffload.ops.sparse_attention.sparse_mla_attention`.
    """
    return _op(q_nope, q_pe, kv_rows, indices, scale)
