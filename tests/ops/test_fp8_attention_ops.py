"""kvoffload::fp8_sparse_mla_attention (sparse MLA attention over FP8 latent rows): the reference kernel
against a float64 formula over rows dequantized here (e4m3fn decoded from its bit fields) and, bit for bit,
against sparse_mla_attention over dequantize_kv_fp8's rows (the op's contract); the FP8 error against
attention over the unquantized rows; the C++ kernel against the reference and, bit for bit, against the
sparse_mla_attention C++ kernel over the dequantized rows; errors, opcheck, compile."""

from __future__ import annotations

import math

import pytest
import torch
from support.fp8_reference import decode_e4m3
from support.op_impls import call_op, requires_cpp, skip_unless_kernel

from torch_kvoffload.ops import (
    dequantize_kv_fp8,
    fp8_sparse_mla_attention,
    has_kernel,
    quantize_kv_fp8,
    reference_kernel,
    sparse_mla_attention,
)

OP = "fp8_sparse_mla_attention"
#: The C++ kernel (through the dispatcher on CPU tensors) and the pure-PyTorch reference.
IMPLS = ("dispatch", "reference")
DTYPES = [torch.float32, torch.bfloat16]


def _i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    """The tolerances of the sparse_mla_attention C++ kernel against its reference."""
    return {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1.6e-2}


LSE_TOL = {"atol": 1e-4, "rtol": 1e-5}


def _row_bytes(dc: int, dr: int) -> int:
    return dc + 4 * (dc // 128) + 2 * dr


def _random_rows(n: int, dc: int, dr: int, g: torch.Generator) -> torch.Tensor:
    """FP8 latent rows written byte by byte, independently of quantize_kv_fp8: every finite e4m3fn code
    (subnormals, -0 included; not the NaN codes 0x7F / 0xFF), power-of-two tile scales 2**-12 .. 2**-6
    (values up to 448 * 2**-6 = 7) and bf16 RoPE values."""
    codes = torch.randint(0, 256, (n, dc), generator=g, dtype=torch.int64)
    codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes).to(torch.uint8)
    scales = torch.exp2(torch.randint(-12, -5, (n, dc // 128), generator=g).float())
    rope = torch.randn(n, dr, generator=g).bfloat16()
    return torch.cat([codes, scales.view(torch.uint8), rope.view(torch.uint8)], dim=1)


def _dequant64(rows: torch.Tensor, dc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(kv_c [N, Dc], k_pe [N, Dr])`` of FP8 latent rows, decoded here (not by the library)."""
    tiles = dc // 128
    scales = rows[:, dc : dc + 4 * tiles].contiguous().view(torch.float32).double()
    kv_c = decode_e4m3(rows[:, :dc]) * scales.repeat_interleave(128, dim=1)
    k_pe = rows[:, dc + 4 * tiles :].contiguous().view(torch.bfloat16).double()
    return kv_c, k_pe


def _dense64(q_nope, q_pe, kv_c, k_pe, indices, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of each token over its listed rows (``-1`` skipped, duplicates attended twice):
    ``out [T, H, Dc]`` (0 without a valid index) and ``lse [T, H]`` (-inf then)."""
    t_count, heads, dc = q_nope.shape
    out = torch.zeros(t_count, heads, dc, dtype=torch.float64)
    lse = torch.full((t_count, heads), -math.inf, dtype=torch.float64)
    for t in range(t_count):
        sel = torch.tensor([i for i in indices[t].tolist() if i >= 0], dtype=torch.long)
        if sel.numel():
            c, pe = kv_c[sel], k_pe[sel]
            s = (q_nope[t].double() @ c.T + q_pe[t].double() @ pe.T) * scale
            out[t] = torch.softmax(s, dim=-1) @ c
            lse[t] = torch.logsumexp(s, dim=-1)
    return out, lse


def _case(t, h, dc, dr, n, k, dtype, *, seed=0, pad=0.2):
    """Queries, random FP8 rows and indices with duplicates (drawn with replacement) and ``-1`` padding
    (every index ``-1`` when ``n == 0``)."""
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(t, h, dc, generator=g).to(dtype)
    q_pe = torch.randn(t, h, dr, generator=g).to(dtype)
    rows = _random_rows(n, dc, dr, g)
    idx = torch.randint(0, max(n, 1), (t, k), generator=g)
    idx = torch.where((torch.rand(t, k, generator=g) < pad) | (n == 0), -1, idx)
    return q_nope, q_pe, rows, idx.to(torch.int32), 1 / math.sqrt(dc + dr)


SHAPES = [
    # (T, H, Dc, Dr, N, K)
    (1, 16, 512, 64, 300, 64),
    (3, 4, 128, 16, 50, 20),
    (5, 6, 256, 16, 33, 7),  # H not a multiple of 4
    (2, 1, 128, 64, 10, 5),
    (4, 3, 512, 16, 17, 1),
    (3, 16, 256, 64, 500, 300),  # several 32-row chunks (online softmax rescaling)
    (3, 4, 256, 64, 0, 6),  # no rows: every index -1
]


# --------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_float64_formula(shape, dtype) -> None:
    """Against the float64 formula over the rows decoded here. The reference attends in fp32: a score is a
    576-term fp32 dot product (relative error ~1e-6 of the sum of |products| at these magnitudes), a value a
    softmax-weighted fp32 sum, so 1e-5 of the largest row value (atol) and 1e-4 relative cover the fp32
    rounding; bf16 outputs are also rounded once to 8 significant bits (relative 2**-9, rtol 2**-8)."""
    q_nope, q_pe, rows, idx, scale = _case(*shape, dtype)
    out, lse = reference_kernel(OP)(q_nope, q_pe, rows, idx, scale)
    assert out.dtype == dtype and out.shape == q_nope.shape
    assert lse.dtype == torch.float32 and lse.shape == q_nope.shape[:2]
    kv_c, k_pe = _dequant64(rows, shape[2])
    f_out, f_lse = _dense64(q_nope, q_pe, kv_c, k_pe, idx, scale)
    amax = kv_c.abs().max().item() if kv_c.numel() else 1.0
    rtol = 1e-4 if dtype == torch.float32 else 2.0**-8
    torch.testing.assert_close(out.double(), f_out, atol=1e-5 * amax, rtol=rtol)
    torch.testing.assert_close(lse.double(), f_lse, **LSE_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_sparse_attention_over_dequantized_rows(shape, dtype) -> None:
    """The op's contract: sparse_mla_attention over dequantize_kv_fp8's rows in the query dtype, bit for
    bit (dequantized values are exact in fp32 and bf16)."""
    q_nope, q_pe, rows, idx, scale = _case(*shape, dtype)
    got = reference_kernel(OP)(q_nope, q_pe, rows, idx, scale)
    kv_c, k_pe = dequantize_kv_fp8(rows, shape[2], dtype)
    expected = reference_kernel("sparse_mla_attention")(q_nope, q_pe, kv_c, k_pe, idx, scale)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_error_within_e4m3_precision(impl) -> None:
    """The op over quantize_kv_fp8's rows against fp32 attention over the unquantized rows.

    e4m3fn keeps 3 mantissa bits: rounding to nearest errs by at most half an ulp, 2**-4 of a value (its
    tile's scale, a power of two, adds no error); below e4m3's normal range (2**-6 in units of the scale)
    the error is at most 2**-10 of the scale. RoPE values are rounded to bf16 (2**-9). The error reaches
    the output twice, each about 2.7% RMS (the RMS relative rounding error of Gaussian rows, from the
    uniform rounding of spread mantissas): (a) out = sum_i p_i v_i averages values each off by that much;
    (b) a score s_i = scale * q . k_i moves by scale * sqrt(D) * 2.7% = 2.7% (unit Gaussians, scale =
    D**-0.5), which reweights the p_i and moves out by up to about as much of its norm. Independent, they
    add to at most about sqrt(2) * 2.7% = 3.8% normwise relative error per (token, head). Measured over 6
    seeds and K = 64 .. 2048: mean 0.027 - 0.036, the largest single (token, head) 0.062. Asserted: mean
    <= 0.05, each <= 2**-3 (twice the per-value bound). lse: log-sum-exp is 1-Lipschitz in the largest
    score change, so |d lse| <= max_i |d s_i| <= scale * sum_d |q_d| * (2**-4 |k_id| + 2**-10 tile scale)
    (2**-9 |k_pe| for RoPE): a strict bound, asserted (measured |d lse| 0.002 - 0.027, bounds near 1).
    """
    skip_unless_kernel(impl, OP)
    for t, h, dc, dr, n, k in [
        (4, 16, 512, 64, 4096, 2048),
        (8, 16, 512, 64, 1000, 64),
        (8, 8, 256, 16, 300, 128),
    ]:
        kv_c, k_pe = torch.randn(n, dc), torch.randn(n, dr)
        rows = quantize_kv_fp8(kv_c, k_pe)
        q_nope, q_pe = torch.randn(t, h, dc), torch.randn(t, h, dr)
        idx = torch.randint(-1, n, (t, k), dtype=torch.int32)
        idx[:, 0] = 0  # every token attends something
        scale = (dc + dr) ** -0.5
        out, lse = call_op(impl, OP, q_nope, q_pe, rows, idx, scale)
        f_out, f_lse = sparse_mla_attention(q_nope, q_pe, kv_c, k_pe, idx, scale)
        rel = (out - f_out).norm(dim=-1) / f_out.norm(dim=-1)
        assert rel.mean() <= 0.05 and rel.max() <= 2.0**-3, (rel.mean(), rel.max())
        tile_scale = rows[:, dc : dc + 4 * (dc // 128)].contiguous().view(torch.float32)
        err_c = 2.0**-4 * kv_c.abs() + 2.0**-10 * tile_scale.repeat_interleave(128, dim=1)  # [N, Dc]
        err_pe = 2.0**-9 * k_pe.abs()
        for i in range(t):
            sel = idx[i][idx[i] >= 0].long()
            ds = (q_nope[i].abs() @ err_c[sel].T + q_pe[i].abs() @ err_pe[sel].T) * scale  # [H, k]
            assert bool(((lse[i] - f_lse[i]).abs() <= ds.amax(dim=-1) + 1e-4).all())


# --------------------------------------------------------------------------------------- C++ kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cpp_matches_reference(shape, dtype) -> None:
    """Within the sparse_mla_attention C++ kernel's tolerances of the reference, and bit-identical to that
    kernel over the dequantized rows (the same attention core over the same fp32 rows)."""
    skip_unless_kernel("dispatch", OP)
    args = _case(*shape, dtype, seed=1)
    out, lse = call_op("dispatch", OP, *args)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert lse.dtype == torch.float32 and lse.shape == args[0].shape[:2]
    ref_out, ref_lse = reference_kernel(OP)(*args)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
    q_nope, q_pe, rows, idx, scale = args
    kv_c, k_pe = dequantize_kv_fp8(rows, shape[2], dtype)
    s_out, s_lse = call_op("dispatch", "sparse_mla_attention", q_nope, q_pe, kv_c, k_pe, idx, scale)
    assert torch.equal(out, s_out) and torch.equal(lse, s_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpp_production_shape(dtype) -> None:
    """DeepSeek shape: 16 heads, 656-byte rows (Dc 512, Dr 64), 2048 selected rows of 4096."""
    skip_unless_kernel("dispatch", OP)
    q_nope, q_pe, rows, _, scale = _case(2, 16, 512, 64, 4096, 1, dtype, seed=2)
    assert rows.shape[1] == 656
    idx = torch.stack([torch.randperm(4096)[:2048] for _ in range(2)]).to(torch.int32)
    idx[:, ::20] = -1
    out, lse = call_op("dispatch", OP, q_nope, q_pe, rows, idx, scale)
    ref_out, ref_lse = reference_kernel(OP)(q_nope, q_pe, rows, idx, scale)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL)


def test_cpp_reads_unaligned_strided_rows() -> None:
    """Rows that are a view into a byte arena (odd row stride, odd offset: the fp32 scales and bf16 RoPE
    values unaligned) read through their strides; last-dim strided rows through a contiguous copy."""
    skip_unless_kernel("dispatch", OP)
    q_nope, q_pe, rows, idx, scale = _case(3, 4, 256, 16, 40, 12, torch.float32, seed=3)
    expected = call_op("dispatch", OP, q_nope, q_pe, rows, idx, scale)
    arena = torch.zeros(40, rows.shape[1] + 3, dtype=torch.uint8)
    arena[:, 1 : rows.shape[1] + 1] = rows
    view = arena[:, 1 : rows.shape[1] + 1]
    assert view.stride(0) % 2 and view.storage_offset() % 2
    got = call_op("dispatch", OP, q_nope, q_pe, view, idx, scale)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    spread = torch.zeros(40, rows.shape[1], 2, dtype=torch.uint8)
    spread[..., 0] = rows
    got = call_op("dispatch", OP, q_nope, q_pe, spread[..., 0], idx, scale)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# ------------------------------------------------------------------------------------- both kernels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_duplicates_padding_and_tokens_without_rows(impl, dtype) -> None:
    skip_unless_kernel(impl, OP)
    q_nope, q_pe, rows, _, scale = _case(3, 4, 128, 16, 6, 1, dtype, seed=4)

    def fn(ix):
        return call_op(impl, OP, q_nope, q_pe, rows, ix, scale)

    # row 1 listed twice == a dense gather of [1, 1, 3]; -1 entries change nothing (the C++ kernel skips
    # them: bit-identical; the reference masks them: its einsum then sums in another order); a token of
    # -1 entries only gets out 0, lse -inf
    o2, l2 = fn(_i32([[1, 1, 3, -1], [-1, -1, -1, -1], [5, -1, 0, 2]]))
    o3, l3 = fn(_i32([[1, 1, 3], [-1, -1, -1], [5, 0, 2]]))
    torch.testing.assert_close(o2, o3)
    torch.testing.assert_close(l2, l3)
    if impl == "dispatch":
        assert torch.equal(o2, o3) and torch.equal(l2, l3)
    assert bool((o2[1] == 0).all()) and bool((l2[1] == -math.inf).all())
    kv_c, k_pe = _dequant64(rows, 128)
    s = (q_nope[0].double() @ kv_c.T + q_pe[0].double() @ k_pe.T) * scale
    expected = torch.logsumexp(torch.stack([s[:, 1], s[:, 1], s[:, 3]]), 0)
    torch.testing.assert_close(l2[0].double(), expected, **LSE_TOL)
    # no rows at all (N = 0, every index -1)
    out, lse = call_op(impl, OP, q_nope, q_pe, rows[:0], torch.full((3, 2), -1, dtype=torch.int32), scale)
    assert out.dtype == dtype and bool((out == 0).all()) and bool((lse == -math.inf).all())


# The reference fails on a gather of no rows: dequantize_rows reshapes it with -1 (ambiguous for 0 elements).
@pytest.mark.parametrize("impl", ["dispatch", "reference"])
def test_no_tokens_and_no_indices(impl) -> None:
    skip_unless_kernel(impl, OP)
    q_nope, q_pe, rows, idx, scale = _case(3, 4, 256, 16, 10, 6, torch.bfloat16, seed=5)
    out, lse = call_op(impl, OP, q_nope, q_pe, rows, idx[:, :0], scale)  # K = 0
    assert out.shape == (3, 4, 256) and bool((out == 0).all()) and bool((lse == -math.inf).all())
    out, lse = call_op(impl, OP, q_nope[:0], q_pe[:0], rows, idx[:0], scale)  # T = 0
    assert out.shape == (0, 4, 256) and out.dtype == torch.bfloat16 and lse.shape == (0, 4)


@pytest.mark.parametrize("impl", IMPLS)
def test_unselected_rows_never_reach_the_output(impl) -> None:
    """Rows no query selects (row 0 included, which a -1 entry must not read) are all 0xFF bytes: NaN
    codes, NaN scales, NaN RoPE values."""
    skip_unless_kernel(impl, OP)
    q_nope, q_pe, rows, _, scale = _case(4, 3, 128, 16, 12, 1, torch.float32, seed=6)
    idx = _i32([[-1, -1, -1, -1, -1], [3, -1, 5, -1, 3], [-1, -1, -1, -1, 7], [4, 5, 6, 7, 8]])
    clean = rows.clone()
    for i in set(range(12)) - {3, 4, 5, 6, 7, 8}:
        rows[i] = 0xFF
    out, lse = call_op(impl, OP, q_nope, q_pe, rows, idx, scale)
    assert bool((out[0] == 0).all()) and bool((lse[0] == -math.inf).all())
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse[1:]).all())
    expected = call_op(impl, OP, q_nope, q_pe, clean, idx, scale)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


# --------------------------------------------------------------------------------------------- errors


def _error_cases():
    q_nope, q_pe, rows, idx, _ = _case(2, 4, 256, 16, 10, 5, torch.float32, seed=7)
    oob = idx.clone()
    oob[1, 2] = 10
    neg = idx.clone()
    neg[0, 4] = -2
    base = (q_nope, q_pe, rows, idx, 0.1)

    def w(**changes):
        names = ("q_nope", "q_pe", "kv_rows", "indices")
        return (*(changes.get(n, a) for n, a in zip(names, base, strict=False)), 0.1)

    wide = torch.cat([rows, rows[:, :4]], dim=1)
    return [
        (w(kv_rows=wide), ValueError, "'kv_rows' must have 296 bytes per row \\(Dc 256 fp8 values, 2 fp32 "),
        (w(kv_rows=rows[:, :-2]), ValueError, "'kv_rows' must have 296 bytes per row"),
        (
            w(q_nope=q_nope[..., :192], kv_rows=rows[:, 64:]),
            ValueError,
            "latent width \\(Dc\\) that is a positive",
        ),
        (w(q_nope=q_nope[..., :0]), ValueError, "'q_nope' must have a latent width \\(Dc\\)"),
        (w(q_nope=q_nope.half(), q_pe=q_pe.half()), TypeError, "'q_nope' must have dtype torch.float32 or"),
        (w(q_pe=q_pe.bfloat16()), TypeError, "'q_nope' and 'q_pe' must have the same dtype"),
        (w(q_nope=q_nope[0]), ValueError, "'q_nope' must have exactly 3 dimensions"),
        (w(q_pe=q_pe[:, :2]), ValueError, "'q_pe' must have shape \\[2, 4, Dr\\]"),
        (
            w(kv_rows=rows.view(torch.int8)),
            TypeError,
            "'kv_rows' must have dtype torch.uint8, got torch.int8",
        ),
        (w(kv_rows=rows[None]), ValueError, "'kv_rows' must have exactly 2 dimensions"),
        (w(indices=idx.long()), TypeError, "'indices' must have dtype torch.int32"),
        (w(indices=idx[0]), ValueError, "'indices' must have exactly 2 dimensions"),
        (w(indices=idx[:1]), ValueError, "'indices' must have 2 rows \\(T of 'q_nope'\\)"),
        (
            w(indices=oob),
            IndexError,
            "'indices' entry \\[1, 2\\] is 10, expected -1 or a value in \\[0, 10\\)",
        ),
        (w(indices=neg), IndexError, "'indices' entry \\[0, 4\\] is -2"),
        # the order of the checks: Dc before the rows' dtype, the row width before the indices' dtype,
        # structure before the indices' range
        (w(q_nope=q_nope[..., :100], kv_rows=rows.view(torch.int8)), ValueError, "latent width"),
        (w(kv_rows=wide, indices=idx.long()), ValueError, "'kv_rows' must have 296 bytes"),
        (w(kv_rows=wide, indices=oob), ValueError, "'kv_rows' must have 296 bytes"),
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", _error_cases(), ids=lambda c: c[2][:40])
def test_bad_input_raises(case, impl) -> None:
    args, exc, fragment = case
    with pytest.raises(exc, match=f"kvoffload::{OP}: .*{fragment}"):
        call_op(impl, OP, *args)


@pytest.mark.parametrize("arg", [1, 2, 3])
def test_tensors_on_another_device_raise(arg) -> None:
    """Checked with a meta tensor: by the fake kernel (the dispatcher picks it), the reference and the C++
    kernel called directly."""
    args = list(_case(2, 4, 128, 16, 10, 5, torch.float32, seed=8))
    name = ("q_nope", "q_pe", "kv_rows", "indices")[arg]
    args[arg] = args[arg].to("meta")
    fragment = f"kvoffload::{OP}: argument '{name}' must be on cpu \\(as 'q_nope'\\), got meta"
    runs = [lambda: torch.ops.kvoffload.fp8_sparse_mla_attention(*args), lambda: reference_kernel(OP)(*args)]
    if has_kernel(OP, "CPU"):
        cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
        runs.append(lambda: torch.ops.kvoffload.fp8_sparse_mla_attention.default.redispatch(cpu, *args))
    for run in runs:
        with pytest.raises(ValueError, match=fragment):
            run()


@requires_cpp
def test_cpp_kernel_registered() -> None:
    assert has_kernel(OP, "CPU") and has_kernel(OP, "Meta")


# -------------------------------------------------------------------------------------- opcheck, compile


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype) -> None:
    torch.library.opcheck(
        torch.ops.kvoffload.fp8_sparse_mla_attention.default, _case(3, 4, 128, 16, 20, 6, dtype)
    )


def test_compile_fullgraph() -> None:
    def step(q_nope, q_pe, kv_c, k_pe, idx):
        out, lse = fp8_sparse_mla_attention(q_nope, q_pe, quantize_kv_fp8(kv_c, k_pe), idx, 0.1)
        return out, lse

    q_nope, q_pe, _, idx, _ = _case(3, 4, 128, 16, 20, 6, torch.float32, seed=9)
    args = (q_nope, q_pe, torch.randn(20, 128), torch.randn(20, 16), idx)
    expected = step(*args)
    got = torch.compile(step, fullgraph=True, backend="inductor")(*args)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
