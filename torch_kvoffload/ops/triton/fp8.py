"""Triton kernels of the FP8 row ops: ``quantize_kv_fp8``, ``dequantize_kv_fp8``, ``quantize_index_k_fp8``,
``dequantize_index_k_fp8`` (formats in :mod:`torch_kvoffload.ops.fp8`).

An indexer row is a latent row without RoPE values (``D`` fp8 values, then ``D / 128`` fp32 scales), so
one quantize kernel and one dequantize kernel serve both formats; ``INDEXER`` selects the scale formula.

Grid ``(row blocks, T + 1)``: program ``(b, t)`` handles ``BLOCK_R`` rows, tile ``t < T`` (128 values and
their scale) or, for ``t == T``, the rows' RoPE values (no such programs when ``Dr == 0``). The first grid
axis is capped (``MAX_ROW_PROGRAMS``); a program strides over the row blocks beyond it.

Bytes: the kernels read and write the ``uint8`` rows byte by byte. An fp8 code is a byte; a scale's four
bytes and a bf16 value's two are split from (or assembled into) their bit patterns in little-endian
(native) order. So no part of a row needs to be aligned (with an odd ``Dr`` every other row's scales sit
at an odd address), and any row stride works.

Every conversion that involves fp8 or bf16 is integer bit manipulation, so the bytes are the same under
the Triton interpreter (whose fp32 → bf16 cast truncates, and whose fp32 → fp8 cast rounds ties away from
zero and reads ``0x7F`` as 480) and on any device, with or without native fp8 support, and equal to
torch's ``.to()`` (the reference's):

* fp32 → ``e4m3fn``: round to nearest even; saturating (``|x| >= 480``, a rounding past 448 and infinity
  give ±448), NaN → ``0x7F`` with its sign: ``c10::detail::fp8e4m3fn_from_fp32_value``. The saturation is
  also the indexer's clamp to ``[-448, 448]``;
* fp32 → bf16: round to nearest even;
* ``e4m3fn`` → fp32 and bf16 → fp32 exactly (a NaN code → ``0x7FF00000`` with its sign, as torch).

NaN bits follow torch's x86 CPU kernels (the reference's, AVX2 checked): a NaN becomes bf16 ``0xFFFF``
(``0x7FC0`` from fp16 input), fp16 keeps its sign and top payload bits (quiet), and a NaN product of a
code and its scale is the scale's NaN (quiet), else the code's, else (infinity times zero) ``0xFFC00000``.
These are set from bits, not left to the device's multiply or fp16 conversion (which give canonical
NaNs). torch's scalar CPU path (``ATEN_CPU_CAPABILITY=default``) gives other NaN bits than its vectorised
one; only NaN bits depend on that.

The scale ``2 ** ceil(log2 v)`` comes from ``v``'s exponent and mantissa bits. A tile's ``amax`` is the
integer maximum of its values' magnitude bits (the bits of the float maximum); a tile holding an infinity
or a NaN gets scale 1, as the reference's ``frexp`` gives it. Values are multiplied by the exact
reciprocal of their power-of-two scale (the same rounding as the reference's division); ``amax / 448`` is
``div_rn`` (IEEE). fp16 ↔ fp32 conversions are native (exact one way, round to nearest even the other, as
numpy under the interpreter). Codes take their sign from the input's bits.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from torch_kvoffload.ops.fp8 import (
    AMAX_FLOOR,
    FP8_MAX,
    TILE,
    index_row_bytes,
    kv_row_bytes,
    validate_dequantize_index_k_fp8,
    validate_dequantize_kv_fp8,
    validate_quantize_index_k_fp8,
    validate_quantize_kv_fp8,
)
from torch_kvoffload.ops.triton import device_guard, require_launchable

__all__ = [
    "KERNELS",
    "triton_dequantize_index_k_fp8",
    "triton_dequantize_kv_fp8",
    "triton_quantize_index_k_fp8",
    "triton_quantize_kv_fp8",
]

#: Rows per program.
BLOCK_R = 16
#: Programs along the rows (grid axis 0); each strides over the row blocks beyond.
MAX_ROW_PROGRAMS = 65535
#: RoPE values per step of a RoPE program.
MAX_BLOCK_PE = 128

#: Element kinds of the float tensors (a constexpr of the kernels).
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
F32: tl.constexpr = tl.constexpr(0)
BF16: tl.constexpr = tl.constexpr(1)
F16: tl.constexpr = tl.constexpr(2)
#: bf16 NaN bits torch's CPU ``.to(torch.bfloat16)`` gives (x86): from fp32 (vectorised), from fp16.
BF16_NAN: tl.constexpr = tl.constexpr(0xFFFF)
BF16_NAN_FROM_F16: tl.constexpr = tl.constexpr(0x7FC0)

#: The fp32 constants of the scale formulas, as exactly representable values: the floor ``1e-4`` and
#: ``1 / 448`` rounded to fp32 as the reference rounds them, and 448.
FLOOR: tl.constexpr = tl.constexpr(float(torch.tensor(AMAX_FLOOR, dtype=torch.float32)))
INV_MAX: tl.constexpr = tl.constexpr(float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)))
FP8_MAX_F32: tl.constexpr = tl.constexpr(float(FP8_MAX))


# ------------------------------------------------------------------------------------ bit helpers


@triton.jit
def _to_f32(x, KIND: tl.constexpr):
    """A loaded fp32 / bf16 / fp16 block as fp32 (exact)."""
    if KIND == BF16:
        bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    elif KIND == F16:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _sign_bit(x, KIND: tl.constexpr):
    """The sign bit of a loaded fp32 / bf16 / fp16 block as ``0x80`` or 0 (uint32), from its bits."""
    if KIND == F32:
        return (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    else:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) >> 8) & 0x80


@triton.jit
def _bf16_bits(f, NAN: tl.constexpr):
    """bf16 bits (in a uint32) of fp32 ``f``, rounding to nearest even; NaN → ``NAN``."""
    b = f.to(tl.uint32, bitcast=True)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where((b & 0x7FFFFFFF) > 0x7F800000, NAN, rounded)


@triton.jit
def _fp8_code(qa):
    """``e4m3fn`` code (in a uint32, no sign) of the magnitude with fp32 bits ``qa`` (uint32, sign bit
    clear), as torch converts: round to nearest even, saturating (``>= 480``, a rounding up past 448 and
    infinity give 448, ``0x7E``), NaN → ``0x7F`` (``c10::detail::fp8e4m3fn_from_fp32_value``)."""
    # normal codes (qa >= 2^-6): drop 20 mantissa bits, rounding half to even, rebias 127 → 7
    normal = tl.minimum((qa - (120 << 23) + 0x7FFFF + ((qa >> 20) & 1)) >> 20, 0x7E)
    # subnormal codes (multiples of 2^-9): the significand shifted right, rounding half to even
    exp = (qa >> 23).to(tl.int32)
    shift = tl.minimum(141 - exp, 31).to(tl.uint32)  # >= 21 below 2^-6
    mant = (qa & 0x7FFFFF) | 0x800000
    one = tl.full(qa.shape, 1, tl.uint32)
    half = one << (shift - 1)
    rem = mant & ((half << 1) - 1)
    sub = mant >> shift
    sub = sub + ((rem > half) | ((rem == half) & ((sub & 1) == 1))).to(tl.uint32)
    code = tl.where(qa < (121 << 23), sub, normal)
    code = tl.where(qa >= 0x43F00000, 0x7E, code)
    return tl.where(qa > 0x7F800000, 0x7F, code)


@triton.jit
def _fp8_to_f32(c):
    """fp32 value of ``e4m3fn`` codes ``c`` (uint32 holding a byte), exactly; NaN codes → NaN."""
    sign = (c & 0x80) << 24
    exp = (c >> 3) & 0xF
    man = c & 0x7
    normal = ((exp + 120) << 23) | (man << 20)
    sub = (man.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)  # man * 2^-9, exact
    mag = tl.where(exp == 0, sub, normal)
    mag = tl.where((c & 0x7F) == 0x7F, 0x7FF00000, mag)
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_float(ptrs, f, mask, KIND: tl.constexpr):
    """Store fp32 ``f`` into a tensor of kind ``KIND``, rounding to nearest even."""
    if KIND == BF16:
        tl.store(ptrs, _bf16_bits(f, BF16_NAN).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    elif KIND == F16:
        # a NaN keeps its sign and top payload bits, quiet (x86's vcvtps2ph, torch's vectorised path)
        b = f.to(tl.uint32, bitcast=True)
        nan = (((b >> 16) & 0x8000) | 0x7E00 | ((b >> 13) & 0x3FF)).to(tl.uint16).to(tl.float16, bitcast=True)
        tl.store(ptrs, tl.where((b & 0x7FFFFFFF) > 0x7F800000, nan, f.to(tl.float16)), mask=mask)
    else:
        tl.store(ptrs, f, mask=mask)


@triton.jit
def _quantize_tiles(xf, sign, INDEXER: tl.constexpr):
    """``e4m3fn`` codes (uint32, ``sign`` or-ed in) and fp32 scale bits (uint32 ``[R]``) of the fp32
    tiles ``xf [R, 128]``: the latent-row scale formula, or the indexer's when ``INDEXER``. ``sign``
    (``0x80`` or 0 per value) is the sign bit of the values ``xf`` came from."""
    mag = xf.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    amax_bits = tl.max(mag, axis=1)  # the float max of the magnitudes, as bits (NaN above inf)
    amax = amax_bits.to(tl.float32, bitcast=True)
    if INDEXER:
        v = tl.maximum(amax, FLOOR) * INV_MAX
    else:
        v = tl.maximum(tl.math.div_rn(amax, FP8_MAX_F32), FLOOR)
    vb = v.to(tl.uint32, bitcast=True)
    # 2 ** ceil(log2 v) as its biased exponent; a tile with an inf / NaN gets scale 1 (frexp's)
    biased = ((vb >> 23) & 0xFF) + ((vb & 0x7FFFFF) != 0).to(tl.uint32)
    biased = tl.where(amax_bits >= 0x7F800000, 127, biased)
    inv = ((254 - biased) << 23).to(tl.float32, bitcast=True)  # 1 / scale, exact
    q = xf * inv[:, None]
    # the sign comes from the input (x times a positive scale keeps it, NaN included); the
    # conversion saturates, which is also the indexer's clamp to [-448, 448]
    qa = q.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    return _fp8_code(qa) | sign, biased << 23


# ---------------------------------------------------------------------------------------- kernels


@triton.jit
def _quantize_kernel(
    x_ptr,
    pe_ptr,
    out_ptr,
    N,
    x_s0,
    x_s1,
    pe_s0,
    pe_s1,
    out_s0,
    T,
    Dr,
    X_KIND: tl.constexpr,
    PE_KIND: tl.constexpr,
    INDEXER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_PE: tl.constexpr,
):
    t = tl.program_id(1)
    num_blocks = tl.cdiv(N, BLOCK_R)
    lane = tl.arange(0, BLOCK_R).to(tl.int64)
    j = tl.arange(0, 128).to(tl.int64)
    scale_col = T * 128  # first scale byte of the row
    for rb in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
        r = lane + rb * BLOCK_R
        rmask = r < N
        if t < T:
            cols = t.to(tl.int64) * 128 + j
            x = tl.load(x_ptr + r[:, None] * x_s0 + cols[None, :] * x_s1, mask=rmask[:, None], other=0.0)
            code, scale_bits = _quantize_tiles(_to_f32(x, X_KIND), _sign_bit(x, X_KIND), INDEXER)
            row = out_ptr + r * out_s0
            tl.store(row[:, None] + cols[None, :], code.to(tl.uint8), mask=rmask[:, None])
            s = row + scale_col + t * 4
            tl.store(s, (scale_bits & 0xFF).to(tl.uint8), mask=rmask)
            tl.store(s + 1, ((scale_bits >> 8) & 0xFF).to(tl.uint8), mask=rmask)
            tl.store(s + 2, ((scale_bits >> 16) & 0xFF).to(tl.uint8), mask=rmask)
            tl.store(s + 3, ((scale_bits >> 24) & 0xFF).to(tl.uint8), mask=rmask)
        else:  # the RoPE values as bf16, byte 2 i + 1 the high byte of value i
            pe_col = scale_col + T * 4
            for c0 in range(0, 2 * Dr, 2 * BLOCK_PE):
                b = c0 + tl.arange(0, 2 * BLOCK_PE).to(tl.int64)
                m = rmask[:, None] & (b < 2 * Dr)[None, :]
                x = tl.load(pe_ptr + r[:, None] * pe_s0 + (b // 2)[None, :] * pe_s1, mask=m, other=0.0)
                if PE_KIND == BF16:
                    h = x.to(tl.uint16, bitcast=True).to(tl.uint32)
                else:
                    h = _bf16_bits(x.to(tl.float32), BF16_NAN if PE_KIND == F32 else BF16_NAN_FROM_F16)
                byte = tl.where((b % 2 == 0)[None, :], h & 0xFF, (h >> 8) & 0xFF)
                tl.store(out_ptr + r[:, None] * out_s0 + pe_col + b[None, :], byte.to(tl.uint8), mask=m)


@triton.jit
def _dequantize_kernel(
    rows_ptr,
    x_ptr,
    pe_ptr,
    N,
    rows_s0,
    rows_s1,
    x_s0,
    pe_s0,
    T,
    Dr,
    KIND: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_PE: tl.constexpr,
):
    t = tl.program_id(1)
    num_blocks = tl.cdiv(N, BLOCK_R)
    lane = tl.arange(0, BLOCK_R).to(tl.int64)
    j = tl.arange(0, 128).to(tl.int64)
    scale_col = T * 128
    for rb in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
        r = lane + rb * BLOCK_R
        rmask = r < N
        row = rows_ptr + r * rows_s0
        if t < T:
            cols = t.to(tl.int64) * 128 + j
            c = tl.load(row[:, None] + cols[None, :] * rows_s1, mask=rmask[:, None], other=0).to(tl.uint32)
            s = row + (scale_col + t * 4).to(tl.int64) * rows_s1
            sb = tl.load(s, mask=rmask, other=0).to(tl.uint32)
            sb |= tl.load(s + rows_s1, mask=rmask, other=0).to(tl.uint32) << 8
            sb |= tl.load(s + 2 * rows_s1, mask=rmask, other=0).to(tl.uint32) << 16
            sb |= tl.load(s + 3 * rows_s1, mask=rmask, other=0).to(tl.uint32) << 24
            f = _fp8_to_f32(c)
            v = f * sb.to(tl.float32, bitcast=True)[:, None]
            # a NaN product gets the reference's bits (x86), set here rather than left to a device's
            # canonical NaN: the scale's NaN made quiet, else the code's, else (inf times 0) the default
            sa = (sb & 0x7FFFFFFF)[:, None]
            v = tl.where((sa == 0x7F800000) & ((c & 0x7F) == 0), 0xFFC00000, v.to(tl.uint32, bitcast=True))
            v = tl.where((c & 0x7F) == 0x7F, f.to(tl.uint32, bitcast=True), v)
            v = tl.where(sa > 0x7F800000, (sb | 0x400000)[:, None], v).to(tl.float32, bitcast=True)
            _store_float(x_ptr + r[:, None] * x_s0 + cols[None, :], v, rmask[:, None], KIND)
        else:
            pe = row + (scale_col + T * 4).to(tl.int64) * rows_s1
            for c0 in range(0, Dr, BLOCK_PE):
                i = c0 + tl.arange(0, BLOCK_PE).to(tl.int64)
                m = rmask[:, None] & (i < Dr)[None, :]
                lo = tl.load(pe[:, None] + (2 * i)[None, :] * rows_s1, mask=m, other=0).to(tl.uint32)
                hi = tl.load(pe[:, None] + (2 * i + 1)[None, :] * rows_s1, mask=m, other=0).to(tl.uint32)
                h = lo | (hi << 8)
                dst = pe_ptr + r[:, None] * pe_s0 + i[None, :]
                if KIND == BF16:
                    tl.store(dst, h.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m)
                else:
                    _store_float(dst, (h << 16).to(tl.float32, bitcast=True), m, KIND)


# ---------------------------------------------------------------------------------------- launchers


def _check_byte_order(op: str) -> None:
    if sys.byteorder != "little":  # the scales and RoPE bytes are split in little-endian order
        raise RuntimeError(f"kvoffload::{op}: the Triton kernel assumes a little-endian host")


def _grid(n: int, programs_per_block: int) -> tuple[int, int]:
    return (min(triton.cdiv(n, BLOCK_R), MAX_ROW_PROGRAMS), programs_per_block)


def _block_pe(rope: int) -> int:
    return min(MAX_BLOCK_PE, triton.next_power_of_2(max(rope, 1)))


def _launch_quantize(x: torch.Tensor, pe: torch.Tensor | None, out: torch.Tensor, indexer: bool) -> None:
    N, width = x.shape
    tiles = width // TILE
    rope = 0 if pe is None else pe.shape[1]
    if N == 0:
        return
    if pe is None or rope == 0:
        pe_arg, pe_s0, pe_s1, pe_kind = x, 0, 0, _KIND[x.dtype]  # never read
    else:
        pe_arg, pe_s0, pe_s1, pe_kind = pe, pe.stride(0), pe.stride(1), _KIND[pe.dtype]
    with device_guard(x.device):
        _quantize_kernel[_grid(N, tiles + (1 if rope else 0))](
            x,
            pe_arg,
            out,
            N,
            x.stride(0),
            x.stride(1),
            pe_s0,
            pe_s1,
            out.stride(0),
            tiles,
            rope,
            X_KIND=_KIND[x.dtype],
            PE_KIND=pe_kind,
            INDEXER=indexer,
            BLOCK_R=BLOCK_R,
            BLOCK_PE=_block_pe(rope),
        )


def _launch_dequantize(rows: torch.Tensor, x: torch.Tensor, pe: torch.Tensor | None, tiles: int) -> None:
    N = rows.shape[0]
    rope = 0 if pe is None else pe.shape[1]
    if N == 0:
        return
    pe_arg, pe_s0 = (x, 0) if pe is None or rope == 0 else (pe, pe.stride(0))
    with device_guard(rows.device):
        _dequantize_kernel[_grid(N, tiles + (1 if rope else 0))](
            rows,
            x,
            pe_arg,
            N,
            rows.stride(0),
            rows.stride(1),
            x.stride(0),
            pe_s0,
            tiles,
            rope,
            KIND=_KIND[x.dtype],
            BLOCK_R=BLOCK_R,
            BLOCK_PE=_block_pe(rope),
        )


def triton_quantize_kv_fp8(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Triton ``quantize_kv_fp8``: latent rows ``uint8 [N, Dc + 4 Dc / 128 + 2 Dr]`` (op contract)."""
    validate_quantize_kv_fp8(kv_c, k_pe)
    op = "quantize_kv_fp8"
    require_launchable(op, kv_c.device)
    _check_byte_order(op)
    N, Dc = kv_c.shape
    out = torch.empty((N, kv_row_bytes(Dc, k_pe.shape[1])), dtype=torch.uint8, device=kv_c.device)
    _launch_quantize(kv_c, k_pe, out, indexer=False)
    return out


def triton_dequantize_kv_fp8(
    rows: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``dequantize_kv_fp8``: ``(kv_c [N, Dc], k_pe [N, Dr])`` in ``dtype`` (op contract)."""
    tiles, rope = validate_dequantize_kv_fp8(rows, kv_lora_rank, dtype)
    op = "dequantize_kv_fp8"
    require_launchable(op, rows.device)
    _check_byte_order(op)
    N = rows.shape[0]
    kv_c = torch.empty((N, kv_lora_rank), dtype=dtype, device=rows.device)
    k_pe = torch.empty((N, rope), dtype=dtype, device=rows.device)
    _launch_dequantize(rows, kv_c, k_pe, tiles)
    return kv_c, k_pe


def triton_quantize_index_k_fp8(k: torch.Tensor) -> torch.Tensor:
    """Triton ``quantize_index_k_fp8``: indexer rows ``uint8 [N, D + 4 D / 128]`` (op contract)."""
    validate_quantize_index_k_fp8(k)
    op = "quantize_index_k_fp8"
    require_launchable(op, k.device)
    _check_byte_order(op)
    N, D = k.shape
    out = torch.empty((N, index_row_bytes(D)), dtype=torch.uint8, device=k.device)
    _launch_quantize(k, None, out, indexer=True)
    return out


def triton_dequantize_index_k_fp8(rows: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton ``dequantize_index_k_fp8``: keys ``[N, D]`` in ``dtype`` (op contract)."""
    D = validate_dequantize_index_k_fp8(rows, dtype)
    op = "dequantize_index_k_fp8"
    require_launchable(op, rows.device)
    _check_byte_order(op)
    k = torch.empty((rows.shape[0], D), dtype=dtype, device=rows.device)
    _launch_dequantize(rows, k, None, D // TILE)
    return k


KERNELS = {
    "dequantize_index_k_fp8": triton_dequantize_index_k_fp8,
    "dequantize_kv_fp8": triton_dequantize_kv_fp8,
    "quantize_index_k_fp8": triton_quantize_index_k_fp8,
    "quantize_kv_fp8": triton_quantize_kv_fp8,
}
