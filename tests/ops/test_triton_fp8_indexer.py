"""The Triton kernels of the FP8 lightning indexer (kvoffload::hadamard_quant_fp8, fp8_lightning_indexer)
against their pure-PyTorch references: the Hadamard rotation + FP8 quantisation byte for byte, the top-k
position for position (and the scores within fp32 rounding), the argument checks before any launch.

The kernels run on the CPU tensors under ``TRITON_INTERPRET=1``, on CUDA copies of them where a CUDA device
is present (``support.op_impls.run_triton``).
"""

from __future__ import annotations

import math

import pytest
import torch
from support.fp8_reference import hadamard_matrix
from support.op_impls import assert_refused_before_launch, run_triton

from torch_kvoffload.ops import dequantize_index_k_fp8, reference_kernel
from torch_kvoffload.ops import triton as triton_ops
from torch_kvoffload.ops.fp8 import index_row_bytes
from torch_kvoffload.ops.fp8_indexer import fp8_indexer_scores_reference, hadamard_quant_fp8

pytestmark = pytest.mark.skipif(not triton_ops.triton_available(), reason="triton is not importable")

NAN_CODE = 0x7F


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    return run_triton(triton_ops.triton_kernel("hadamard_quant_fp8"), x)


def _indexer(*args) -> torch.Tensor:
    return run_triton(triton_ops.triton_kernel("fp8_lightning_indexer"), *args)


# --------------------------------------------------------------------------------------- hadamard_quant_fp8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 128), (2, 3, 256), (0, 128), (2, 0, 256), (1, 512)])
def test_hadamard_quant_fp8_is_the_reference_byte_for_byte(dtype, shape) -> None:
    x = (torch.randn(shape) * torch.exp2(torch.randint(-12, 12, (*shape[:-1], 1)).float())).to(dtype)
    got = _hadamard(x)
    assert got.dtype == torch.uint8 and got.shape == (*shape[:-1], index_row_bytes(shape[-1]))
    if x.numel():
        # the reference (whose own kernel fails on 0 rows at the time of writing: not compared there)
        assert torch.equal(got, reference_kernel("hadamard_quant_fp8")(x))
        # an independent formula: the dense rotation in float64, within e4m3fn's precision
        d = shape[-1]
        y = (x.double() @ hadamard_matrix(d)).reshape(-1, d)
        back = dequantize_index_k_fp8(got.reshape(-1, got.shape[-1]), torch.float32).double()
        scale = got.reshape(-1, got.shape[-1])[:, d:].contiguous().view(torch.float32).double()
        floor = scale.repeat_interleave(128, dim=1) * 2.0**-10  # half the subnormal step
        assert bool(((back - y).abs() <= y.abs() * 2.0**-4 + floor + 1e-6 * y.abs().amax()).all())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy
def test_hadamard_quant_fp8_edge_values() -> None:
    d = 256  # 1/sqrt(256) = 1/16 exactly
    x = torch.zeros(9, d)
    x[1] = -0.0  # rotates to +0 / -0 entries: the codes keep the sign, the scale is the floor's
    x[2, 0] = 448.0 * 16  # rotates to 448 everywhere: scale exactly 1, codes 448 (0x7E), no rounding up
    x[3, 0] = 448.0 * 16 * (1 + 2.0**-20)  # just above: scale 2
    x[4] = torch.randn(d) * 1e30  # huge finite values
    x[5] = torch.randn(d) * 1e-30  # below the amax floor: subnormal and zero codes
    x[6, 5] = math.inf  # rotates to ±inf everywhere: scale 1, codes ±448
    x[7, :2] = 3e38  # the first butterfly overflows to inf, then ±inf spreads (never inf − inf)
    x[8] = torch.randn(d).clamp(-1, 1) * 2.0**-126  # subnormal inputs
    got = _hadamard(x)
    want = reference_kernel("hadamard_quant_fp8")(x)
    assert torch.equal(got, want)
    scales = got[:, d:].contiguous().view(torch.float32)
    assert got[0, :d].eq(0).all() and scales[2].tolist() == [1.0, 1.0] and scales[3].tolist() == [2.0, 2.0]
    assert got[2, :d].eq(0x7E).all() and scales[6].tolist() == [1.0, 1.0]
    assert set(got[6, :d].tolist()) == {0x7E, 0xFE}
    # the same through a bf16 input and through a strided one (every other column of a wider tensor)
    assert torch.equal(_hadamard(x.bfloat16()), reference_kernel("hadamard_quant_fp8")(x.bfloat16()))
    wide = torch.randn(4, 2 * d)
    assert torch.equal(_hadamard(wide[:, ::2]), reference_kernel("hadamard_quant_fp8")(wide[:, ::2]))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_hadamard_quant_fp8_nan_rows() -> None:
    """A NaN in the rotated row (a NaN input, inf − inf) gives NaN codes and scale 1 as the reference; only
    the NaN's sign bit is the device's (see the kernel module), so codes are compared without it there."""
    d = 128
    x = torch.randn(3, d)
    x[0, 3] = math.nan
    x[1, :] = math.inf  # inf − inf in the butterflies
    got = _hadamard(x)
    want = reference_kernel("hadamard_quant_fp8")(x)
    nan = (want[:, :d] & 0x7F) == NAN_CODE
    assert nan[0].all() and nan[1].any() and not nan[2].any()
    assert torch.equal(got[:, :d] & 0x7F, want[:, :d] & 0x7F)
    assert torch.equal(got[:, :d][~nan], want[:, :d][~nan]) and torch.equal(got[:, d:], want[:, d:])


# ------------------------------------------------------------------------------------ fp8_lightning_indexer


def _case(
    H: int, D: int, block_size: int, lens: list[int], q_lens: list[int], w_dtype=torch.float32, spare=1
):
    """FP8 rows of random queries and keys through ``hadamard_quant_fp8``, and a shuffled block table."""
    B, T = len(lens), sum(q_lens)
    max_blocks = max(1, -(-max(lens) // block_size)) + spare
    nb = B * max_blocks + 3
    q_rows = hadamard_quant_fp8(torch.randn(T, H, D))
    k_rows = hadamard_quant_fp8(torch.randn(nb, block_size, D) * torch.rand(nb, block_size, 1) * 4)
    w = torch.randn(T, H).to(w_dtype)
    table = torch.randperm(nb)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return q_rows, w, k_rows, table, cu, torch.tensor(lens, dtype=torch.int32)


INDEXER_CASES = [
    # H, D, block_size, seq_lens_k, queries per request, top_k, weights dtype
    (8, 128, 16, [70, 33, 0], [3, 2, 0], 20, torch.float32),  # several requests, Q > 1, an empty one
    (16, 256, 8, [45, 0, 12], [1, 1, 4], 64, torch.bfloat16),  # seq_len 0 with a query; top_k > visible
    (12, 128, 64, [150], [2], 100, torch.float32),  # H not a power of two; several key tiles
    (8, 128, 4, [5, 9], [1, 1], 40, torch.float32),  # top_k beyond the width: padded
]


@pytest.mark.parametrize("case", INDEXER_CASES)
def test_fp8_lightning_indexer_topk_is_the_reference(case) -> None:
    from torch_kvoffload.ops.triton.fp8_indexer import fp8_indexer_scores

    H, D, bs, lens, q_lens, top_k, w_dtype = case
    args = _case(H, D, bs, lens, q_lens, w_dtype)
    got = _indexer(*args, top_k)
    want = reference_kernel("fp8_lightning_indexer")(*args, top_k)
    assert got.dtype == torch.int32 and got.shape == (sum(q_lens), top_k)
    assert torch.equal(got, want)
    # the scores it ranks: the reference's up to the order of the fp32 additions, −inf past each query's keys
    scores = run_triton(fp8_indexer_scores, *args)
    want_scores, _ = fp8_indexer_scores_reference(*args)
    assert torch.equal(torch.isinf(scores), torch.isinf(want_scores))
    torch.testing.assert_close(
        scores, want_scores, rtol=1e-5, atol=1e-5 * float(want_scores.abs().nan_to_num(0, 0, 0).amax())
    )


def test_fp8_lightning_indexer_strided_rows_chunks_and_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows read through their strides (a wider key buffer, a query tensor at an odd offset), scores
    buffered one or two tokens at a time, a key with a NaN code ranked first (NaN kept through relu)."""
    from torch_kvoffload.ops.triton import indexer as triton_indexer

    q_rows, w, k_rows, table, cu, lens = _case(8, 128, 16, [40, 21], [3, 2], spare=0)
    k_rows[table[0, 1], 3, 17] = NAN_CODE  # key position 16 + 3 of request 0
    wide = torch.zeros(*k_rows.shape[:2], k_rows.shape[2] + 5, dtype=torch.uint8)
    wide[:, :, 1 : 1 + k_rows.shape[2]] = k_rows
    flat = torch.zeros(q_rows.numel() + 1, dtype=torch.uint8)
    flat[1:] = q_rows.flatten()
    odd_q = flat[1:].view(q_rows.shape)
    monkeypatch.setattr(triton_indexer, "SCORE_BUFFER", 2 * table.shape[1] * 16 - 1)
    strided = (odd_q, w, wide[:, :, 1 : 1 + k_rows.shape[2]], table, cu, lens, 12)
    got = _indexer(*strided)
    want = reference_kernel("fp8_lightning_indexer")(q_rows, w, k_rows, table, cu, lens, 12)
    assert torch.equal(got, want)
    assert got[:3, 0].tolist() == [19, 19, 19]  # the NaN score first, as the reference's descending sort


def test_fp8_lightning_indexer_empty_outputs() -> None:
    q_rows, w, k_rows, table, cu, lens = _case(8, 128, 16, [20], [2])
    assert _indexer(q_rows, w, k_rows, table, cu, lens, 0).shape == (2, 0)
    none = (q_rows[:0], w[:0], k_rows, table, torch.zeros(2, dtype=torch.int32), lens * 0)
    assert _indexer(*none, 5).shape == (0, 5)


# --------------------------------------------------------------------------------------------- arguments


def _bad_cases():
    q_rows, w, k_rows, table, cu, lens = _case(8, 128, 16, [20, 30], [1, 2])
    ok = (q_rows, w, k_rows, table, cu, lens, 4)

    def with_(i, v):
        return (*ok[:i], v, *ok[i + 1 :])

    yield "hadamard_quant_fp8", (torch.randn(3, 64),)
    yield "hadamard_quant_fp8", (torch.randn(3, 384),)
    yield "hadamard_quant_fp8", (torch.randn(3, 128).half(),)
    yield "hadamard_quant_fp8", (torch.tensor(1.0),)
    yield "fp8_lightning_indexer", with_(6, -1)
    yield "fp8_lightning_indexer", with_(0, q_rows.view(torch.int8))
    yield "fp8_lightning_indexer", with_(0, q_rows[:, :, :130])
    yield "fp8_lightning_indexer", with_(1, w[:, :4])
    yield "fp8_lightning_indexer", with_(1, w.half())
    yield "fp8_lightning_indexer", with_(2, torch.zeros(*k_rows.shape[:2], 264, dtype=torch.uint8))
    yield "fp8_lightning_indexer", with_(3, table.long())
    yield "fp8_lightning_indexer", with_(4, torch.tensor([0, 1, 2], dtype=torch.int32))
    yield "fp8_lightning_indexer", with_(5, torch.tensor([20, 10_000], dtype=torch.int32))
    yield "fp8_lightning_indexer", with_(3, torch.full_like(table, k_rows.shape[0]))


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
def test_bad_input_raises_as_the_reference_before_any_launch(case, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_kvoffload.ops.triton import fp8_indexer as module

    name, args = case
    assert_refused_before_launch(
        name, args, monkeypatch, module, ("_launch_scores", "launch_hadamard_quant_fp8")
    )


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="kvoffload::hadamard_quant_fp8: the Triton kernel got CPU"):
        triton_ops.triton_kernel("hadamard_quant_fp8")(torch.randn(2, 128))
    args = _case(8, 128, 16, [20], [1])
    with pytest.raises(RuntimeError, match="kvoffload::fp8_lightning_indexer: the Triton kernel got CPU"):
        triton_ops.triton_kernel("fp8_lightning_indexer")(*args, 4)
