"""FP8 KV rows: DeepSeek's latent-row format (FlashMLA's ``V32_FP8Sparse``) and its indexer-key format.

**Latent row** (``kv_lora_rank`` ``Dc`` a multiple of 128, RoPE width ``Dr``): ``Dc + 4 * Dc / 128 + 2 * Dr``
bytes, 656 for DeepSeek's 512 + 64:

* bytes ``[0, Dc)``: the latent values as ``float8_e4m3fn``, tile ``t`` (values ``128 t .. 128 t + 127``)
  divided by its scale;
* bytes ``[Dc, Dc + 4 T)``: the ``T = Dc / 128`` scales, fp32 (native byte order);
* bytes ``[Dc + 4 T, ...)``: the RoPE values as bf16, not quantized.

A tile's scale is ``2 ** ceil(log2(max(amax / 448, 1e-4)))`` (``amax`` its largest magnitude, in fp32; 448
is the largest ``e4m3fn`` value), a power of two as FlashMLA's reference quantization computes it, so a row
written here reads there. Values are divided by it in fp32 (exact: a power of two) and converted to
``e4m3fn`` rounding to nearest even; a quotient never exceeds 448.

**Indexer row** (``index_head_dim`` ``D`` a multiple of 128): ``D + 4 * D / 128`` bytes, 132 for 128: the
keys as ``e4m3fn`` (group ``g`` divided by its scale), then the ``D / 128`` fp32 scales. A group's scale is
DeepSeek's ``act_quant`` with its power-of-two (``ue8m0``) scale format: ``2 ** ceil(log2(max(amax, 1e-4) *
(1 / 448)))``, the quotient clamped to ``[-448, 448]``.

Dequantizing multiplies each value by its scale in fp32 (exact) and converts to the requested dtype.
``ceil(log2(v))`` is taken exactly (from the float's exponent and mantissa), as DeepSeek's kernels do.

Ops (each with a fake kernel, the reference below, a C++ CPU kernel and a Triton kernel):
``quantize_kv_fp8(kv_c [N, Dc], k_pe [N, Dr]) -> uint8 [N, row]``,
``dequantize_kv_fp8(rows uint8 [N, row], kv_lora_rank, dtype) -> (kv_c [N, Dc], k_pe [N, Dr])``,
``quantize_index_k_fp8(k [N, D]) -> uint8 [N, row]``,
``dequantize_index_k_fp8(rows uint8 [N, row], dtype) -> k [N, D]``.
"""

from __future__ import annotations

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops._registry import define_op

__all__ = [
    "FP8_MAX",
    "TILE",
    "dequantize_index_k_fp8",
    "dequantize_kv_fp8",
    "index_row_bytes",
    "kv_row_bytes",
    "quantize_index_groups",
    "quantize_index_k_fp8",
    "quantize_kv_fp8",
    "validate_dequantize_index_k_fp8",
    "validate_dequantize_kv_fp8",
    "validate_quantize_index_k_fp8",
    "validate_quantize_kv_fp8",
]

#: Values per scale (a tile of the latent row, a group of the indexer keys).
TILE = 128
#: The largest finite ``float8_e4m3fn`` value.
FP8_MAX = 448.0
#: The least scale numerator: FlashMLA clamps ``amax / 448``, DeepSeek's ``act_quant`` clamps ``amax``.
AMAX_FLOOR = 1e-4

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def kv_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one latent row: ``Dc`` fp8 values, ``Dc / 128`` fp32 scales, ``Dr`` bf16 RoPE values."""
    return kv_lora_rank + 4 * (kv_lora_rank // TILE) + 2 * rope_dim


def index_row_bytes(index_head_dim: int) -> int:
    """Bytes of one indexer row: ``D`` fp8 values and ``D / 128`` fp32 scales."""
    return index_head_dim + 4 * (index_head_dim // TILE)


def _check_width(op: str, arg: str, width: int, what: str) -> None:
    if width <= 0 or width % TILE:
        _checks.fail(
            op,
            f"the {what} of '{arg}' must be a positive multiple of {TILE} (one fp32 scale per {TILE} values), "
            f"got {width}",
        )


def _check_float_rows(op: str, arg: str, t: torch.Tensor) -> None:
    _checks.check_dim(op, arg, t, 2)
    _checks.check_dtype(op, arg, t, _FLOATS)


def _check_byte_rows(op: str, t: torch.Tensor) -> None:
    _checks.check_dim(op, "rows", t, 2)
    _checks.check_dtype(op, "rows", t, (torch.uint8,))


def _check_out_dtype(op: str, dtype: torch.dtype) -> None:
    if dtype not in _FLOATS:
        _checks.fail(op, f"'dtype' must be one of {[str(d) for d in _FLOATS]}, got {dtype}", TypeError)


def _bytes_as(rows: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[lo, hi)`` of each row as ``dtype`` values, copied into fresh storage (aligned for the wider
    type whatever the rows' offset and strides)."""
    if hi == lo:
        return rows.new_empty((rows.shape[0], 0), dtype=dtype)
    return rows[:, lo:hi].clone(memory_format=torch.contiguous_format).view(dtype)


def _exact_pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(v))`` for positive normal fp32 ``v``, exactly (from the exponent and mantissa)."""
    mantissa, exponent = torch.frexp(v)  # v = mantissa * 2 ** exponent, mantissa in [0.5, 1)
    up = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(v), up)


# --------------------------------------------------------------------------------------- latent rows


def validate_quantize_kv_fp8(kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Every check of ``quantize_kv_fp8``."""
    op = "quantize_kv_fp8"
    _check_float_rows(op, "kv_c", kv_c)
    _check_float_rows(op, "k_pe", k_pe)
    _check_width(op, "kv_c", kv_c.shape[1], "width (kv_lora_rank)")
    if k_pe.shape[0] != kv_c.shape[0]:
        _checks.fail(op, f"'kv_c' and 'k_pe' must have as many rows, got {kv_c.shape[0]} and {k_pe.shape[0]}")
    if k_pe.device != kv_c.device:
        _checks.fail(op, f"'kv_c' and 'k_pe' must be on one device, got {kv_c.device} and {k_pe.device}")


def _quantize_kv_fp8_fake(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    validate_quantize_kv_fp8(kv_c, k_pe)
    return kv_c.new_empty((kv_c.shape[0], kv_row_bytes(kv_c.shape[1], k_pe.shape[1])), dtype=torch.uint8)


def _quantize_kv_fp8_reference(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    validate_quantize_kv_fp8(kv_c, k_pe)
    N, Dc = kv_c.shape
    if N == 0:
        return _quantize_kv_fp8_fake(kv_c, k_pe)
    tiles = kv_c.float().reshape(N, Dc // TILE, TILE)
    amax = tiles.abs().amax(dim=-1)  # [N, T]
    scale = _exact_pow2_ceil(torch.clamp_min(amax / FP8_MAX, AMAX_FLOOR))
    codes = (tiles / scale[..., None]).to(torch.float8_e4m3fn).reshape(N, Dc)
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([codes.view(torch.uint8), scale.contiguous().view(torch.uint8), rope], dim=1)


_quantize_kv_fp8_op = define_op(
    "quantize_kv_fp8",
    "(Tensor kv_c, Tensor k_pe) -> Tensor",
    fake=_quantize_kv_fp8_fake,
    reference=_quantize_kv_fp8_reference,
)


def quantize_kv_fp8(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Latent rows in DeepSeek's FP8 format (see the module docstring).

    Parameters
    ----------
    kv_c : Tensor
        ``[N, Dc]`` fp32 / bf16 / fp16, ``Dc`` a multiple of 128.
    k_pe : Tensor
        ``[N, Dr]`` fp32 / bf16 / fp16 on ``kv_c``'s device (stored as bf16).

    Returns ``uint8 [N, Dc + 4 * Dc / 128 + 2 * Dr]`` on their device (656 bytes a row for 512 + 64).
    ``ValueError`` / ``TypeError`` naming the argument otherwise.
    """
    return _quantize_kv_fp8_op(kv_c, k_pe)


def _kv_widths(op: str, rows: torch.Tensor, kv_lora_rank: int) -> tuple[int, int]:
    """``(T, Dr)`` of rows of width ``rows.shape[1]`` holding ``kv_lora_rank`` latent values."""
    _check_width(op, "kv_lora_rank", kv_lora_rank, "value")
    tiles = kv_lora_rank // TILE
    rest = rows.shape[1] - kv_lora_rank - 4 * tiles
    if rest < 0 or rest % 2:
        _checks.fail(
            op,
            f"'rows' of {rows.shape[1]} bytes cannot hold {kv_lora_rank} fp8 values, {tiles} fp32 scales and "
            "whole bf16 RoPE values",
        )
    return tiles, rest // 2


def validate_dequantize_kv_fp8(rows: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype) -> tuple[int, int]:
    """Every check of ``dequantize_kv_fp8``; returns ``(tiles, rope_dim)``."""
    op = "dequantize_kv_fp8"
    _check_byte_rows(op, rows)
    _check_out_dtype(op, dtype)
    return _kv_widths(op, rows, kv_lora_rank)


def _dequantize_kv_fp8_fake(
    rows: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    _, rope = validate_dequantize_kv_fp8(rows, kv_lora_rank, dtype)
    N = rows.shape[0]
    return rows.new_empty((N, kv_lora_rank), dtype=dtype), rows.new_empty((N, rope), dtype=dtype)


def _dequantize_kv_fp8_reference(
    rows: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    tiles, rope = validate_dequantize_kv_fp8(rows, kv_lora_rank, dtype)
    N, Dc = rows.shape[0], kv_lora_rank
    codes = _bytes_as(rows, 0, Dc, torch.float8_e4m3fn).float().reshape(N, tiles, TILE)
    scale = _bytes_as(rows, Dc, Dc + 4 * tiles, torch.float32)
    kv_c = (codes * scale[..., None]).reshape(N, Dc).to(dtype)
    k_pe = _bytes_as(rows, Dc + 4 * tiles, rows.shape[1], torch.bfloat16).reshape(N, rope).to(dtype)
    return kv_c, k_pe


_dequantize_kv_fp8_op = define_op(
    "dequantize_kv_fp8",
    "(Tensor rows, int kv_lora_rank, ScalarType dtype) -> (Tensor, Tensor)",
    fake=_dequantize_kv_fp8_fake,
    reference=_dequantize_kv_fp8_reference,
)


def dequantize_kv_fp8(
    rows: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_c [N, Dc], k_pe [N, Dr])`` in ``dtype`` from latent rows ``uint8 [N, row]`` of
    :func:`quantize_kv_fp8` (``Dr`` from the row width); ``ValueError`` / ``TypeError`` otherwise."""
    return _dequantize_kv_fp8_op(rows, kv_lora_rank, dtype)


# -------------------------------------------------------------------------------------- indexer rows


def validate_quantize_index_k_fp8(k: torch.Tensor) -> None:
    """Every check of ``quantize_index_k_fp8``."""
    op = "quantize_index_k_fp8"
    _check_float_rows(op, "k", k)
    _check_width(op, "k", k.shape[1], "width (index_head_dim)")


def _quantize_index_k_fp8_fake(k: torch.Tensor) -> torch.Tensor:
    validate_quantize_index_k_fp8(k)
    return k.new_empty((k.shape[0], index_row_bytes(k.shape[1])), dtype=torch.uint8)


def _quantize_index_k_fp8_reference(k: torch.Tensor) -> torch.Tensor:
    validate_quantize_index_k_fp8(k)
    if k.shape[0] == 0:
        return _quantize_index_k_fp8_fake(k)
    return quantize_index_groups(k.float())


def quantize_index_groups(y: torch.Tensor) -> torch.Tensor:
    """The indexer-row quantization of fp32 ``y [N, D]`` (``D`` a multiple of 128, checked by the caller):
    ``uint8 [N, D + 4 * D / 128]`` (see the module docstring)."""
    N, D = y.shape
    if N == 0:
        return y.new_empty((0, index_row_bytes(D)), dtype=torch.uint8)
    groups = y.reshape(N, D // TILE, TILE)
    amax = torch.clamp_min(groups.abs().amax(dim=-1), AMAX_FLOOR)
    scale = _exact_pow2_ceil(amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
    codes = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(N, D)
    return torch.cat([codes.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)


_quantize_index_k_fp8_op = define_op(
    "quantize_index_k_fp8",
    "(Tensor k) -> Tensor",
    fake=_quantize_index_k_fp8_fake,
    reference=_quantize_index_k_fp8_reference,
)


def quantize_index_k_fp8(k: torch.Tensor) -> torch.Tensor:
    """Indexer keys ``[N, D]`` (fp32 / bf16 / fp16, ``D`` a multiple of 128) as FP8 rows ``uint8 [N, D + 4 *
    D / 128]`` (132 bytes for 128; see the module docstring); ``ValueError`` / ``TypeError`` otherwise."""
    return _quantize_index_k_fp8_op(k)


def validate_dequantize_index_k_fp8(rows: torch.Tensor, dtype: torch.dtype) -> int:
    """Every check of ``dequantize_index_k_fp8``; returns ``D``."""
    op = "dequantize_index_k_fp8"
    _check_byte_rows(op, rows)
    _check_out_dtype(op, dtype)
    width = rows.shape[1]
    if width <= 0 or width % (TILE + 4):
        _checks.fail(
            op,
            f"'rows' must be {TILE + 4} bytes per {TILE} keys ({TILE} fp8 values and an fp32 scale), got "
            f"{width} bytes",
        )
    return width // (TILE + 4) * TILE


def _dequantize_index_k_fp8_fake(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    D = validate_dequantize_index_k_fp8(rows, dtype)
    return rows.new_empty((rows.shape[0], D), dtype=dtype)


def _dequantize_index_k_fp8_reference(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    D = validate_dequantize_index_k_fp8(rows, dtype)
    N, groups = rows.shape[0], D // TILE
    codes = _bytes_as(rows, 0, D, torch.float8_e4m3fn).float().reshape(N, groups, TILE)
    scale = _bytes_as(rows, D, rows.shape[1], torch.float32)
    return (codes * scale[..., None]).reshape(N, D).to(dtype)


_dequantize_index_k_fp8_op = define_op(
    "dequantize_index_k_fp8",
    "(Tensor rows, ScalarType dtype) -> Tensor",
    fake=_dequantize_index_k_fp8_fake,
    reference=_dequantize_index_k_fp8_reference,
)


def dequantize_index_k_fp8(rows: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Indexer keys ``[N, D]`` in ``dtype`` from rows ``uint8 [N, D + 4 * D / 128]`` of
    :func:`quantize_index_k_fp8`; ``ValueError`` / ``TypeError`` otherwise."""
    return _dequantize_index_k_fp8_op(rows, dtype)
