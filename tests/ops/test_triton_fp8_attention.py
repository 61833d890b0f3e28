"""The Triton kernel of kvoffload::fp8_sparse_mla_attention (sparse MLA attention over FP8 latent rows)
against the op's pure-PyTorch reference and, through it, sparse_mla_attention over the dequantized rows:
random rows across shapes (split and unsplit rows, Dc 128 / 384 / 512, Dr 0 / 16 / 64, -1 padding and
duplicates), tokens without a valid index, no rows, rows no query selects holding NaN / inf, strided
inputs, and the argument checks before any launch.

The kernel runs on the CPU tensors under ``TRITON_INTERPRET=1``, on CUDA copies of them where a CUDA device
is present (``support.op_impls.run_triton``).
"""

from __future__ import annotations

import math

import pytest
import torch
from support.op_impls import assert_refused_before_launch, run_triton

from torch_kvoffload.ops import dequantize_kv_fp8, reference_kernel
from torch_kvoffload.ops import triton as triton_ops
from torch_kvoffload.ops.fp8 import kv_row_bytes

pytestmark = pytest.mark.skipif(not triton_ops.triton_available(), reason="triton is not importable")

OP = "fp8_sparse_mla_attention"
LSE_TOL = {"atol": 1e-4, "rtol": 1e-5}


def _tol(dtype: torch.dtype) -> dict[str, float]:
    """The tolerances of the sparse_mla_attention Triton tests."""
    return {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1.6e-2}


def _attend(*args):
    return run_triton(triton_ops.triton_kernel(OP), *args)


def _rows(n: int, dc: int, dr: int) -> torch.Tensor:
    """FP8 latent rows written byte by byte: every finite e4m3fn code (subnormals and -0 included, not the
    NaN codes), power-of-two tile scales 2**-12 .. 2**-6 and bf16 RoPE values, some of them subnormal."""
    codes = torch.randint(0, 256, (n, dc))
    codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes).to(torch.uint8)
    scales = torch.exp2(torch.randint(-12, -5, (n, dc // 128)).float())
    rope = torch.randn(n, dr)
    rope = torch.where(torch.rand(n, dr) < 0.1, rope * 2.0**-130, rope).bfloat16()  # bf16 subnormals
    return torch.cat([codes, scales.view(torch.uint8), rope.view(torch.uint8)], dim=1)


def _case(t, h, dc, dr, n, k, dtype, pad=0.2):
    """Queries, rows and indices with ``-1`` padding and repeated rows (drawn with replacement)."""
    q_nope = torch.randn(t, h, dc).to(dtype)
    q_pe = torch.randn(t, h, dr).to(dtype)
    rows = _rows(n, dc, dr)
    idx = torch.randint(0, max(n, 1), (t, k))
    idx = torch.where(torch.rand(t, k) < pad, -1, idx) if n else torch.full((t, k), -1)
    return q_nope, q_pe, rows, idx.to(torch.int32)


def _check(args, scale, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _attend(*args, scale)
    want_out, want_lse = reference_kernel(OP)(*args, scale)
    q_nope = args[0]
    assert out.dtype == dtype and out.shape == q_nope.shape
    assert lse.dtype == torch.float32 and lse.shape == q_nope.shape[:2]
    torch.testing.assert_close(out, want_out, **_tol(dtype))
    torch.testing.assert_close(lse, want_lse, **LSE_TOL)
    return out, lse


CASES = [
    # T, H, Dc, Dr, N, K, query dtype
    (1, 16, 512, 64, 300, 64, torch.bfloat16),  # DeepSeek widths; the rows split in two, then merged
    (2, 16, 512, 64, 90, 24, torch.float32),  # one row tile: no split
    (3, 4, 128, 16, 50, 20, torch.float32),
    (2, 20, 384, 16, 40, 150, torch.float32),  # Dc not a power of two; two head blocks; five row tiles
    (2, 5, 128, 64, 30, 70, torch.bfloat16),  # H not a multiple of 4 (one 16-head block)
    (3, 3, 128, 0, 12, 9, torch.bfloat16),  # no RoPE part
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "T{}-H{}-Dc{}-Dr{}-N{}-K{}-{}".format(*c[:6], str(c[6])[6:])
)
def test_matches_the_reference(case) -> None:
    t, h, dc, dr, n, k, dtype = case
    args = _case(t, h, dc, dr, n, k, dtype)
    scale = 1 / math.sqrt(dc + dr)
    out, lse = _check(args, scale, dtype)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse[(args[3] >= 0).any(1)]).all())
    # the op's contract: sparse_mla_attention over the dequantized rows
    kv_c, k_pe = dequantize_kv_fp8(args[2], dc, dtype)
    s_out, s_lse = reference_kernel("sparse_mla_attention")(args[0], args[1], kv_c, k_pe, args[3], scale)
    torch.testing.assert_close(out, s_out, **_tol(dtype))
    torch.testing.assert_close(lse, s_lse, **LSE_TOL)


def test_duplicates_attend_twice_and_padding_is_skipped() -> None:
    q_nope, q_pe, rows, _ = _case(1, 2, 128, 16, 5, 1, torch.float32)
    twice = torch.tensor([[1, 1, 3, -1]], dtype=torch.int32)
    o2, l2 = _attend(q_nope, q_pe, rows, twice, 0.1)
    o3, l3 = _attend(q_nope, q_pe, rows, twice[:, :3].contiguous(), 0.1)
    torch.testing.assert_close(o2, o3, **_tol(torch.float32))
    torch.testing.assert_close(l2, l3, **LSE_TOL)
    # log(2 e^{s1} + e^{s3}) over the dequantized rows
    kv_c, k_pe = dequantize_kv_fp8(rows, 128, torch.float32)
    s = (q_nope[0] @ kv_c.T + q_pe[0] @ k_pe.T) * 0.1
    torch.testing.assert_close(l2[0], torch.logsumexp(torch.stack([s[:, 1], s[:, 1], s[:, 3]]), 0), **LSE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_without_rows(dtype) -> None:
    """A token whose indices are all -1 gets out 0 and lse -inf (with and without split rows); so does
    every token for K = 0 and for N = 0 rows; T = 0 gives empty outputs."""
    q_nope, q_pe, rows, idx = _case(3, 4, 128, 16, 40, 100, dtype)
    idx[1] = -1
    out, lse = _check((q_nope, q_pe, rows, idx), 0.2, dtype)
    assert bool((out[1] == 0).all()) and bool((lse[1] == -math.inf).all())
    assert bool(torch.isfinite(lse[[0, 2]]).all())
    for r, ix in [(rows, idx[:, :0]), (rows[:0], torch.full((3, 5), -1, dtype=torch.int32))]:
        out, lse = _attend(q_nope, q_pe, r, ix, 0.2)
        assert out.dtype == dtype and bool((out == 0).all()) and bool((lse == -math.inf).all())
    out, lse = _attend(q_nope[:0], q_pe[:0], rows, idx[:0], 0.2)
    assert out.shape == (0, 4, 128) and lse.shape == (0, 4)


def test_unselected_rows_never_reach_the_output() -> None:
    """Rows no query selects (row 0 included, where a -1 entry would point) hold NaN codes, infinite and
    NaN scales and NaN RoPE values: nothing of them reaches the output."""
    dc, dr = 128, 16
    q_nope, q_pe, rows, _ = _case(4, 3, dc, dr, 12, 5, torch.float32)
    idx = torch.tensor([[-1] * 5, [3, -1, 5, -1, 3], [-1, -1, -1, -1, 7], [4, 5, 6, 7, 8]], dtype=torch.int32)
    for i in set(range(12)) - {3, 4, 5, 6, 7, 8}:
        rows[i, i] = 0x7F  # a NaN code
        rows[i, dc : dc + 4] = torch.tensor([math.inf if i % 2 else math.nan]).view(torch.uint8)
        rows[i, dc + 4 :] = torch.full((dr,), math.nan).bfloat16().view(torch.uint8)
    out, lse = _check((q_nope, q_pe, rows, idx), 0.25, torch.float32)
    assert bool((out[0] == 0).all()) and bool((lse[0] == -math.inf).all())
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse[1:]).all())


def test_a_selected_nan_code_poisons_its_token_only() -> None:
    """A NaN code in a selected row makes its token's output NaN in the NaN's column and its lse not
    finite, as in the reference; the other token is unaffected. (The reference gives lse NaN and zero
    weights, so only that column is NaN; the kernel's sum of weights is NaN, which it reports as no
    valid row, lse -inf, as the sparse_mla_attention kernels do, and its output is NaN throughout.)"""
    q_nope, q_pe, rows, _ = _case(2, 4, 128, 16, 6, 3, torch.float32)
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    rows[4, 17] = 0xFF  # -NaN
    out, lse = _attend(q_nope, q_pe, rows, idx, 0.3)
    want_out, want_lse = reference_kernel(OP)(q_nope, q_pe, rows, idx, 0.3)
    assert not bool(lse[1].isfinite().any()) and bool(want_lse[1].isnan().all())
    assert bool(out[1, :, 17].isnan().all()) and bool(want_out[1, :, 17].isnan().all())
    torch.testing.assert_close(out[0], want_out[0], **_tol(torch.float32))
    torch.testing.assert_close(lse[0], want_lse[0], **LSE_TOL)


def test_strided_inputs() -> None:
    """Rows inside a wider byte buffer at an odd offset (no alignment: scales and RoPE values at odd
    addresses), queries as transposed views, indices as a column slice."""
    dc, dr, n = 256, 8, 20
    q_nope, q_pe, rows, idx = _case(3, 6, dc, dr, n, 40, torch.float32)
    buffer = torch.zeros(n, kv_row_bytes(dc, dr) + 7, dtype=torch.uint8)
    buffer[:, 3 : 3 + rows.shape[1]] = rows
    strided_rows = buffer[:, 3 : 3 + rows.shape[1]]
    qn = q_nope.transpose(0, 1).contiguous().transpose(0, 1)
    qp = q_pe.transpose(0, 1).contiguous().transpose(0, 1)
    wide_idx = torch.stack([idx, idx], dim=2).reshape(3, -1)[:, ::2]
    assert not strided_rows.is_contiguous() and strided_rows.storage_offset() % 2 == 1
    assert not qn.is_contiguous() and not wide_idx.is_contiguous()
    out, lse = _attend(qn, qp, strided_rows, wide_idx, 0.2)
    want_out, want_lse = reference_kernel(OP)(q_nope, q_pe, rows, idx, 0.2)
    torch.testing.assert_close(out, want_out, **_tol(torch.float32))
    torch.testing.assert_close(lse, want_lse, **LSE_TOL)


def test_unchecked_launch_into_given_outputs() -> None:
    from torch_kvoffload.ops.triton.fp8_attention import launch_fp8_sparse_mla_attention

    q_nope, q_pe, rows, idx = _case(2, 4, 128, 16, 30, 80, torch.bfloat16)
    out = torch.full((4, 2, 128), 7.0, dtype=torch.bfloat16).transpose(0, 1)  # a strided view
    lse = torch.full((2, 4), 7.0)
    run_triton(launch_fp8_sparse_mla_attention, q_nope, q_pe, rows, idx, 0.2, out, lse)
    want_out, want_lse = reference_kernel(OP)(q_nope, q_pe, rows, idx, 0.2)
    torch.testing.assert_close(out, want_out, **_tol(torch.bfloat16))
    torch.testing.assert_close(lse, want_lse, **LSE_TOL)


# --------------------------------------------------------------------------------------------- arguments


def _bad_cases():
    q_nope, q_pe, rows, idx = _case(2, 4, 128, 16, 10, 5, torch.float32, pad=0.0)
    ok = (q_nope, q_pe, rows, idx, 0.1)

    def with_(i, v):
        return (*ok[:i], v, *ok[i + 1 :])

    oob = idx.clone()
    oob[1, 2] = 10
    neg = idx.clone()
    neg[0, 4] = -2
    yield "row width", with_(2, rows[:, :-2])
    yield (
        "Dc not a multiple of 128",
        (torch.randn(2, 4, 64), q_pe, torch.zeros(10, 64 + 32, dtype=torch.uint8), idx, 0.1),
    )
    yield "index out of range", with_(3, oob)
    yield "index below -1", with_(3, neg)
    yield "rows not bytes", with_(2, rows.view(torch.int8))
    yield "int64 indices", with_(3, idx.long())
    yield "indices rows", with_(3, idx[:1])
    yield "fp16 queries", with_(0, q_nope.half())
    yield "query dtypes differ", with_(1, q_pe.bfloat16())


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
def test_bad_input_raises_as_the_reference_before_any_launch(case, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_kvoffload.ops.triton import fp8_attention as module

    assert_refused_before_launch(OP, case[1], monkeypatch, module, ("launch_fp8_sparse_mla_attention",))


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = _case(2, 4, 128, 16, 10, 5, torch.float32)
    with pytest.raises(RuntimeError, match=f"kvoffload::{OP}: the Triton kernel got CPU"):
        triton_ops.triton_kernel(OP)(*args, 0.1)
