"""FP8 KV rows (kvoffload::quantize_kv_fp8 / dequantize_kv_fp8 / quantize_index_k_fp8 /
dequantize_index_k_fp8): every kernel against formulas written out here from FlashMLA's and DeepSeek's
published quantization, round-trip error within FP8's precision, opcheck, compile, errors.

The independent formulas: FlashMLA's ``V32_FP8Sparse`` (``tests/quant.py`` there) takes a tile's scale as
``2 ** ceil(log2(max(amax / 448, 1e-4)))`` with a float ``log2``; DeepSeek's ``act_quant`` with the ``ue8m0``
scale format takes ``2 ** ceil(log2(max(amax, 1e-4) * (1 / 448)))`` from the float's exponent and mantissa
bits. Written here with other operations than the reference kernel's (a float log2, integer bit fields).
"""

from __future__ import annotations

import pytest
import torch
from support.op_impls import call_op, skip_unless_kernel

from torch_kvoffload import ops
from torch_kvoffload.ops.fp8 import index_row_bytes, kv_row_bytes

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
# (N, Dc, Dr) of latent rows; (N, D) of indexer rows
KV_SHAPES = [(0, 128, 16), (1, 512, 64), (7, 256, 16), (33, 128, 0)]
INDEX_SHAPES = [(0, 128), (1, 128), (9, 256), (40, 128)]


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows whose magnitudes span many binades (scales from tiny to large), a zero row, an exact
    power of two times 448 as a row's amax."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(-20, 12, (shape[0], 1), generator=g).float()
    )
    if shape[0] > 2 and shape[1]:
        x[1] = 0.0
        x[2, 0] = 448.0 * 2.0**-3  # amax / 448 exactly a power of two: no rounding up
    return x.to(dtype)


def _flashmla_kv_rows(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """FlashMLA's V32_FP8Sparse bytes of each token (its published formula, float log2)."""
    Dc = kv_c.shape[1]
    codes, scales = [], []
    for t in range(Dc // 128):
        tile = kv_c[:, 128 * t : 128 * (t + 1)].float()
        inv = tile.abs().max(dim=-1).values / 448.0
        inv = torch.pow(2, torch.clamp_min(inv, 1e-4).log2().ceil())
        scales.append(inv)
        codes.append((tile / inv[:, None]).to(torch.float8_e4m3fn))
    nope = torch.cat(codes, dim=1).view(torch.uint8)
    scale = torch.stack(scales, dim=1).contiguous().view(torch.uint8)
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([nope, scale, rope], dim=1)


def _pow2_ceil_bits(v: torch.Tensor) -> torch.Tensor:
    """DeepSeek's ``fast_round_scale``: ``2 ** ceil(log2 v)`` from fp32 ``v``'s exponent and mantissa bits."""
    bits = v.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    up = exponent - 127 + ((bits & ((1 << 23) - 1)) != 0).int()
    return ((up + 127) << 23).view(torch.float32)


def _deepseek_index_rows(k: torch.Tensor) -> torch.Tensor:
    """DeepSeek's act_quant (block 128, scale format ue8m0) of indexer keys: fp8 values, then fp32 scales."""
    N, D = k.shape
    groups = k.float().reshape(N, D // 128, 128)
    amax = torch.clamp_min(groups.abs().amax(dim=-1), 1e-4)
    scale = _pow2_ceil_bits(amax * torch.tensor(1 / 448.0, dtype=torch.float32))
    codes = torch.clamp(groups / scale[..., None], -448.0, 448.0).to(torch.float8_e4m3fn).reshape(N, D)
    return torch.cat([codes.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)


def _cpu(x):
    return tuple(t.cpu() for t in x) if isinstance(x, tuple) else x.cpu()


# --------------------------------------------------------------------------------------------- formats


def test_row_sizes_are_deepseeks() -> None:
    assert kv_row_bytes(512, 64) == 656 and index_row_bytes(128) == 132
    assert kv_row_bytes(128, 16) == 128 + 4 + 32


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", KV_SHAPES)
def test_latent_rows_are_flashmlas_bytes_and_read_back_within_fp8_precision(any_impl, shape, dtype) -> None:
    op_impl = any_impl
    skip_unless_kernel(op_impl, "quantize_kv_fp8")
    N, Dc, Dr = shape
    kv_c, k_pe = _values((N, Dc), dtype), _values((N, Dr), dtype, seed=1)
    rows = _cpu(call_op(op_impl, "quantize_kv_fp8", kv_c, k_pe))
    assert rows.dtype == torch.uint8 and rows.shape == (N, kv_row_bytes(Dc, Dr))
    assert torch.equal(rows, _flashmla_kv_rows(kv_c, k_pe))
    got_c, got_pe = _cpu(call_op(op_impl, "dequantize_kv_fp8", rows, Dc, torch.float32))
    assert got_c.dtype == torch.float32 and got_c.shape == (N, Dc) and got_pe.shape == (N, Dr)
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself; below the normal range
    # (2^-6 times the scale) the subnormal step 2^-9 times the scale bounds it (half of it: 2^-10)
    x = kv_c.float()
    scale = rows[:, Dc : Dc + 4 * (Dc // 128)].contiguous().view(torch.float32).repeat_interleave(128, dim=1)
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert bool(((got_c - x).abs() <= bound).all())
    # RoPE values are kept in bf16: 8 significant bits
    assert torch.equal(got_pe, k_pe.to(torch.bfloat16).float())


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", INDEX_SHAPES)
def test_indexer_rows_are_deepseeks_act_quant_and_read_back_within_fp8_precision(
    op_impl, shape, dtype
) -> None:
    skip_unless_kernel(op_impl, "quantize_index_k_fp8")
    N, D = shape
    k = _values((N, D), dtype, seed=2)
    rows = _cpu(call_op(op_impl, "quantize_index_k_fp8", k))
    assert rows.dtype == torch.uint8 and rows.shape == (N, index_row_bytes(D))
    assert torch.equal(rows, _deepseek_index_rows(k))
    got = _cpu(call_op(op_impl, "dequantize_index_k_fp8", rows, torch.float32))
    scale = rows[:, D:].contiguous().view(torch.float32).repeat_interleave(128, dim=1)
    bound = torch.maximum(k.float().abs() * 2.0**-4, scale * 2.0**-10)
    assert bool(((got - k.float()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", FLOATS)
def test_dequantized_values_are_exact_in_every_dtype(any_impl, dtype) -> None:
    """An fp8 value times a power of two is exact in fp32, bf16 and fp16 (within their exponent range):
    dequantizing to ``dtype`` equals dequantizing to fp32 and rounding."""
    op_impl = any_impl
    skip_unless_kernel(op_impl, "dequantize_kv_fp8")
    kv_c = torch.randn(6, 256) * 4
    k_pe = torch.randn(6, 16)
    rows = ops.quantize_kv_fp8(kv_c, k_pe)
    c32, pe32 = ops.dequantize_kv_fp8(rows, 256, torch.float32)
    c, pe = _cpu(call_op(op_impl, "dequantize_kv_fp8", rows, 256, dtype))
    assert c.dtype == dtype and torch.equal(c.float(), c32) and torch.equal(pe, pe32.to(dtype))
    k = ops.quantize_index_k_fp8(torch.randn(5, 128))
    want = ops.dequantize_index_k_fp8(k, torch.float32)
    assert torch.equal(_cpu(call_op(op_impl, "dequantize_index_k_fp8", k, dtype)).float(), want)


def test_non_contiguous_inputs(any_impl) -> None:
    op_impl = any_impl
    skip_unless_kernel(op_impl, "quantize_kv_fp8")
    wide = torch.randn(9, 700)
    kv_c, k_pe = wide[:, 3:515], wide[:, 600:664]  # column slices: row stride 700
    rows = _cpu(call_op(op_impl, "quantize_kv_fp8", kv_c, k_pe))
    assert torch.equal(rows, _flashmla_kv_rows(kv_c, k_pe))
    k = torch.randn(256, 11).t()  # [11, 256], column-major
    assert torch.equal(_cpu(call_op(op_impl, "quantize_index_k_fp8", k)), _deepseek_index_rows(k))
    padded = torch.zeros(11, 300, dtype=torch.uint8)
    padded[:, :264] = ops.quantize_index_k_fp8(k)
    got = _cpu(call_op(op_impl, "dequantize_index_k_fp8", padded[:, :264], torch.float32))
    assert torch.equal(got, ops.dequantize_index_k_fp8(padded[:, :264].clone(), torch.float32))


# -------------------------------------------------------------------------------------- opcheck, compile


def _opcheck_cases():
    kv_c, k_pe = torch.randn(5, 256), torch.randn(5, 16)
    rows = ops.quantize_kv_fp8(kv_c, k_pe)
    k = torch.randn(4, 128, dtype=torch.bfloat16)
    yield "quantize_kv_fp8", (kv_c, k_pe)
    yield "quantize_kv_fp8", (kv_c.bfloat16(), k_pe.bfloat16())
    yield "dequantize_kv_fp8", (rows, 256, torch.bfloat16)
    yield "quantize_index_k_fp8", (k,)
    yield "dequantize_index_k_fp8", (ops.quantize_index_k_fp8(k), torch.float32)


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_opcheck(case) -> None:
    name, args = case
    torch.library.opcheck(getattr(torch.ops.kvoffload, name).default, args)


def test_compile_fullgraph() -> None:
    def roundtrip(kv_c, k_pe, k):
        c, pe = ops.dequantize_kv_fp8(ops.quantize_kv_fp8(kv_c, k_pe), kv_c.shape[1], torch.float32)
        return c, pe, ops.dequantize_index_k_fp8(ops.quantize_index_k_fp8(k), torch.float32)

    args = (torch.randn(6, 512), torch.randn(6, 64), torch.randn(6, 128))
    want = roundtrip(*args)
    got = torch.compile(roundtrip, fullgraph=True, backend="inductor")(*args)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_fake_kernels_give_the_output_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        rows = ops.quantize_kv_fp8(torch.empty(3, 512), torch.empty(3, 64))
        assert rows.shape == (3, 656) and rows.dtype == torch.uint8
        c, pe = ops.dequantize_kv_fp8(rows, 512, torch.bfloat16)
        assert c.shape == (3, 512) and pe.shape == (3, 64) and c.dtype == torch.bfloat16
        k = ops.quantize_index_k_fp8(torch.empty(2, 128))
        assert k.shape == (2, 132)
        assert ops.dequantize_index_k_fp8(k, torch.float16).shape == (2, 128)


# --------------------------------------------------------------------------------------------- errors

_BAD = [
    ("quantize_kv_fp8", (torch.randn(2, 100), torch.randn(2, 16)), ValueError, "multiple of 128"),
    ("quantize_kv_fp8", (torch.randn(2, 128), torch.randn(3, 16)), ValueError, "as many rows"),
    ("quantize_kv_fp8", (torch.randn(2, 128, 1), torch.randn(2, 16)), ValueError, "exactly 2 dimensions"),
    ("quantize_kv_fp8", (torch.ones(2, 128, dtype=torch.int32), torch.randn(2, 16)), TypeError, "dtype"),
    ("dequantize_kv_fp8", (torch.zeros(2, 100, dtype=torch.uint8), 128, torch.float32), ValueError, "cannot hold"),
    ("dequantize_kv_fp8", (torch.zeros(2, 133, dtype=torch.uint8), 128, torch.float32), ValueError, "whole bf16"),
    ("dequantize_kv_fp8", (torch.zeros(2, 164, dtype=torch.uint8), 100, torch.float32), ValueError, "multiple of 128"),
    ("dequantize_kv_fp8", (torch.zeros(2, 164, dtype=torch.uint8), 128, torch.int32), TypeError, "'dtype'"),
    ("dequantize_kv_fp8", (torch.zeros(2, 164), 128, torch.float32), TypeError, "torch.uint8"),
    ("quantize_index_k_fp8", (torch.randn(2, 64),), ValueError, "multiple of 128"),
    ("quantize_index_k_fp8", (torch.randn(2),), ValueError, "exactly 2 dimensions"),
    ("dequantize_index_k_fp8", (torch.zeros(2, 130, dtype=torch.uint8), torch.float32), ValueError, "132 bytes"),
    ("dequantize_index_k_fp8", (torch.zeros(2, 132, dtype=torch.uint8), torch.int8), TypeError, "'dtype'"),
]  # fmt: skip


@pytest.mark.parametrize("case", _BAD, ids=lambda c: f"{c[0]}-{c[3]}")
def test_bad_input_raises_naming_the_op_and_argument(case, any_impl) -> None:
    name, args, exc, match = case
    with pytest.raises(exc, match=match) as info:
        call_op(any_impl, name, *args)
    assert f"kvoffload::{name}:" in str(info.value)
