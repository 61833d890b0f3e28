"""FP8 lightning indexer (kvoffload::hadamard_quant_fp8 / fp8_lightning_indexer): the reference kernels
against formulas written out here (a dense Sylvester matrix, DeepSeek's act_quant scale from a float log2,
e4m3fn decoded from its bit fields, float64 scores), the C++ kernel against the reference (bit-identical
rows, equal top-k), agreement with the bf16 indexer, opcheck, compile, errors."""

from __future__ import annotations

import math

import pytest
import torch
from support.fp8_reference import decode_e4m3, hadamard_matrix
from support.op_impls import call_op, requires_cpp, skip_unless_kernel

from torch_kvoffload.ops import (
    fp8_lightning_indexer,
    hadamard_quant_fp8,
    has_kernel,
    lightning_indexer,
    reference_kernel,
)
from torch_kvoffload.ops.fp8_indexer import fp8_indexer_scores_reference

#: The C++ kernel (through the dispatcher on CPU tensors) and the pure-PyTorch reference.
IMPLS = ("dispatch", "reference")
DTYPES = [torch.float32, torch.bfloat16]


def _i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def _split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``uint8 [..., D]`` and float64 scales ``[..., D / 128]`` of indexer rows ``uint8 [..., R]``."""
    d = rows.shape[-1] // 132 * 128
    scales = rows[..., d:].contiguous().view(torch.float32).double()
    return rows[..., :d], scales


def _dequant(rows: torch.Tensor) -> torch.Tensor:
    codes, scales = _split(rows)
    return decode_e4m3(codes) * scales.repeat_interleave(128, dim=-1)


# ------------------------------------------------------------------------------------ hadamard_quant_fp8


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of magnitudes spanning many binades (1e-9 .. 1e9), a zero row, a 1e-30 row (amax below the 1e-4
    floor) and a 1e30 row when there are enough rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 30, (*shape[:-1], 1), generator=g).double())
    flat = x.view(-1, shape[-1])
    if flat.shape[0] >= 4:
        flat[1] = 0.0
        flat[2] *= 1e-30 / flat[2].abs().max()
        flat[3] *= 1e30 / flat[3].abs().max()
    return x.to(dtype)


HADAMARD_SHAPES = [(3, 128), (7, 256), (2, 3, 512), (128,), (1, 4, 1, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", HADAMARD_SHAPES)
def test_hadamard_reference_matches_independent_formula(shape, dtype) -> None:
    x = _inputs(shape, dtype)
    rows = reference_kernel("hadamard_quant_fp8")(x)
    d = shape[-1]
    assert rows.dtype == torch.uint8 and rows.shape == (*shape[:-1], d + 4 * d // 128)
    y = x.double() @ hadamard_matrix(d)  # the rotation, float64
    groups = y.reshape(*shape[:-1], d // 128, 128)
    amax = groups.abs().amax(-1)
    codes, scales = _split(rows)
    # DeepSeek's act_quant (ue8m0): scale = 2 ** ceil(log2(max(amax, 1e-4) / 448)), here from a float64 log2
    # of the float64 rotation (the kernels round in fp32: they could only differ where max(amax, 1e-4) / 448
    # lies within fp32 rounding of a power of two, which random data does not hit).
    expected = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax, 1e-4) / 448)))
    assert torch.equal(scales, expected)
    # Dequantised values are the rotation within e4m3's precision: a normal e4m3 value has 3 mantissa bits,
    # so rounding to nearest is off by at most half an ulp, 2**-4 of the value; below e4m3's normal range
    # (2**-6 in units of the scale) the subnormal step 2**-9 bounds it (half: 2**-10 of the scale). The
    # scale rounds amax / 448 up, so the clamp to 448 cuts at most fp32's rounding of amax * (1 / 448); that
    # and the fp32 rounding of the rotation (log2(D) <= 9 rounded additions per value) lie within 1e-5 of
    # the group's amax.
    scale_v = scales.repeat_interleave(128, dim=-1)
    bound = torch.maximum(y.abs() * 2.0**-4, scale_v * 2.0**-10) + 1e-5 * amax.repeat_interleave(128, dim=-1)
    got = decode_e4m3(codes) * scale_v
    assert bool(((got - y).abs() <= bound).all())
    # the scale is the least power of two >= amax / 448, so a group's largest code lies in [224, 448]
    big = decode_e4m3(codes).reshape(groups.shape).abs().amax(-1)
    assert bool((big[amax > 1e-4] >= 224).all())


def test_hadamard_reference_zero_and_tiny_rows() -> None:
    x = torch.zeros(2, 256)
    x[1] = 1e-30
    rows = reference_kernel("hadamard_quant_fp8")(x)
    codes, scales = _split(rows)
    # amax floored at 1e-4: scale 2**ceil(log2(1e-4 / 448)) = 2**-22; every code 0 (1e-30 * 16 / 2**-22 is
    # far below e4m3's least subnormal)
    assert scales.tolist() == [[2.0**-22] * 2] * 2
    assert bool((codes == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", HADAMARD_SHAPES)
def test_hadamard_cpp_is_bit_identical_to_reference(shape, dtype) -> None:
    skip_unless_kernel("dispatch", "hadamard_quant_fp8")
    x = _inputs(shape, dtype, seed=1)
    got = call_op("dispatch", "hadamard_quant_fp8", x)
    assert torch.equal(got, reference_kernel("hadamard_quant_fp8")(x))


def test_hadamard_cpp_overflow_and_strided_input() -> None:
    skip_unless_kernel("dispatch", "hadamard_quant_fp8")
    # fp32 overflow inside the rotation (inf, then inf - inf = NaN): the same bytes as the reference
    x = torch.randn(4, 128)
    x[0] = 1e38
    x[1, :64], x[1, 64:] = -1e38, 1e38
    x[2, 0] = math.inf
    assert torch.equal(
        call_op("dispatch", "hadamard_quant_fp8", x), reference_kernel("hadamard_quant_fp8")(x)
    )
    wide = torch.randn(5, 512)
    got = call_op("dispatch", "hadamard_quant_fp8", wide[:, ::2])  # read through its strides
    assert torch.equal(got, reference_kernel("hadamard_quant_fp8")(wide[:, ::2].contiguous()))


@pytest.mark.parametrize("shape", [(0, 128), (2, 0, 256)])
def test_hadamard_cpp_no_rows(shape) -> None:
    skip_unless_kernel("dispatch", "hadamard_quant_fp8")
    out = call_op("dispatch", "hadamard_quant_fp8", torch.randn(shape))
    assert out.dtype == torch.uint8 and out.shape == (*shape[:-1], shape[-1] // 128 * 132)


@pytest.mark.parametrize("shape", [(0, 3, 128), (2, 0, 256)])
def test_hadamard_reference_no_rows(shape) -> None:
    out = reference_kernel("hadamard_quant_fp8")(torch.randn(shape))
    assert out.dtype == torch.uint8 and out.shape == (*shape[:-1], shape[-1] // 128 * 132)


# --------------------------------------------------------------------------------- fp8_lightning_indexer


def _case(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    heads: int = 8,
    dim: int = 128,
    block_size: int = 16,
    extra_blocks: int = 3,
    raw: bool = False,
) -> dict[str, torch.Tensor]:
    """Random paged FP8 indexer inputs (positive weights, as DeepSeek's softmax-scaled head weights).
    ``raw``: also the un-quantised fp32 queries ``q`` and keys ``k`` the rows were made from."""
    batch = len(q_lens)
    needed = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max([*needed, 1]) + 1
    num_blocks = sum(needed) + extra_blocks
    perm = torch.randperm(num_blocks).tolist()
    table = torch.full((batch, max_blocks), -1, dtype=torch.int32)  # uncovered entries stay invalid
    for b, n in enumerate(needed):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    t = sum(q_lens)
    q, k = torch.randn(t, heads, dim), torch.randn(num_blocks, block_size, dim)
    c = {
        "q_rows": hadamard_quant_fp8(q),
        "weights": torch.rand(t, heads),
        "k_rows": hadamard_quant_fp8(k),
        "block_table": table,
        "cu_seqlens_q": _i32([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
        "seq_lens_k": _i32(seq_lens),
    }
    if raw:
        c["q"], c["k"] = q, k
    return c


_KEYS = ("q_rows", "weights", "k_rows", "block_table", "cu_seqlens_q", "seq_lens_k")


def _args(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(c[key] for key in _KEYS)


def _dense(c: dict[str, torch.Tensor], top_k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Independent formula: dequantise every row (bit-field decoding), score each visible key in float64
    as Σ_h w · relu(q · k), causal visibility by hand, order by (−score, position)."""
    q, k, w = _dequant(c["q_rows"]), _dequant(c["k_rows"]), c["weights"].double()
    bs = k.shape[1]
    cu, lens = c["cu_seqlens_q"].tolist(), c["seq_lens_k"].tolist()
    all_scores, all_top = [], []
    for b in range(len(lens)):
        nq = cu[b + 1] - cu[b]
        pos = torch.arange(lens[b])
        keys = k[c["block_table"][b, pos // bs].long(), pos % bs]  # [S, D]
        for j in range(nq):
            t = cu[b] + j
            visible = lens[b] - (nq - 1 - j)
            scores = (w[t, :, None] * torch.relu(q[t] @ keys[:visible].T)).sum(0).tolist()
            order = sorted(range(visible), key=lambda s, sc=scores: (-sc[s], s))[:top_k]
            all_scores.append(scores)
            all_top.append(order + [-1] * (top_k - len(order)))
    return all_scores, all_top


SHAPES = [
    # (q_lens, seq_lens, heads, dim, block_size)
    ([1], [37], 8, 128, 16),
    ([3, 1], [40, 17], 8, 256, 8),  # Q > 1 (causal), two groups per row
    ([4, 0, 2], [4, 9, 1], 16, 128, 4),  # a request without queries; a query seeing 0 keys
    ([2, 1, 1], [64, 0, 100], 8, 128, 16),  # a request with seq_len 0
]


@pytest.mark.parametrize("shape", SHAPES)
def test_indexer_reference_matches_dense_formula(shape) -> None:
    q_lens, seq_lens, h, d, bs = shape
    c = _case(q_lens, seq_lens, heads=h, dim=d, block_size=bs)
    scores, visible = fp8_indexer_scores_reference(*_args(c))
    dense_scores, dense_top = _dense(c, 200)
    for t, row in enumerate(dense_scores):
        assert int(visible[t]) == len(row)
        # fp32 accumulation of at most 2 * 128 exact products per head, 16 heads: relative 1e-5 is ample
        torch.testing.assert_close(
            scores[t, : len(row)].double(), torch.tensor(row).double(), rtol=1e-5, atol=1e-4
        )
        assert bool((scores[t, len(row) :] == -math.inf).all())
    for top_k in (1, 8, 200):  # 200: past every visible length (−1 padding)
        got = reference_kernel("fp8_lightning_indexer")(*_args(c), top_k)
        assert got.tolist() == [row[:top_k] for row in dense_top], top_k


@pytest.mark.parametrize("shape", SHAPES)
def test_indexer_cpp_matches_reference(shape) -> None:
    skip_unless_kernel("dispatch", "fp8_lightning_indexer")
    q_lens, seq_lens, h, d, bs = shape
    c = _case(q_lens, seq_lens, heads=h, dim=d, block_size=bs)
    for top_k in (0, 1, 7, 64, 300):
        expected = reference_kernel("fp8_lightning_indexer")(*_args(c), top_k)
        got = call_op("dispatch", "fp8_lightning_indexer", *_args(c), top_k)
        assert got.dtype == torch.int32 and got.shape == (sum(q_lens), top_k)
        assert torch.equal(got, expected), top_k


def test_indexer_cpp_bf16_weights_and_strided_rows() -> None:
    skip_unless_kernel("dispatch", "fp8_lightning_indexer")
    c = _case([2, 3], [50, 33], heads=16)
    c["weights"] = c["weights"].bfloat16()
    expected = reference_kernel("fp8_lightning_indexer")(*_args(c), 24)
    assert torch.equal(call_op("dispatch", "fp8_lightning_indexer", *_args(c), 24), expected)
    # key rows that are a view (one component of a bundle): read through their strides
    bundle = torch.stack([torch.zeros_like(c["k_rows"]), c["k_rows"]], dim=1)  # [nb, 2, bs, R]
    c["k_rows"] = bundle[:, 1]
    assert not c["k_rows"].is_contiguous()
    assert torch.equal(call_op("dispatch", "fp8_lightning_indexer", *_args(c), 24), expected)


def _integer_rows(lead: tuple[int, ...], dim: int) -> torch.Tensor:
    """Indexer rows of small integer codes (-3 .. 3, exact in e4m3fn) and power-of-two scales: every dot
    product, scale product and weighted sum of them is exact in fp32 whatever the order of the additions,
    so every kernel gets the same scores bit for bit (ties included, frequent with such small values)."""
    codes = torch.randint(-3, 4, (*lead, dim)).float().to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.exp2(torch.randint(-2, 2, (*lead, dim // 128)).float())
    return torch.cat([codes, scales.view(torch.uint8).reshape(*lead, 4 * (dim // 128))], dim=-1)


def _integer_case(q_lens, seq_lens, **kw) -> dict[str, torch.Tensor]:
    c = _case(q_lens, seq_lens, **kw)
    dim = c["q_rows"].shape[-1] // 132 * 128
    c["q_rows"] = _integer_rows(c["q_rows"].shape[:2], dim)
    c["k_rows"] = _integer_rows(c["k_rows"].shape[:2], dim)
    c["weights"] = torch.randint(-1, 3, c["weights"].shape).float()
    return c


@pytest.mark.parametrize("shape", SHAPES)
def test_indexer_exact_on_integer_data(shape) -> None:
    """Exact scores: the reference equals the float64 formula, and the C++ kernel the reference, ties
    (equal scores by lower position) included."""
    q_lens, seq_lens, h, d, bs = shape
    c = _integer_case(q_lens, seq_lens, heads=h, dim=d, block_size=bs)
    scores, _ = fp8_indexer_scores_reference(*_args(c))
    dense_scores, dense_top = _dense(c, 300)
    for t, row in enumerate(dense_scores):
        assert scores[t, : len(row)].tolist() == row
    cpp = has_kernel("fp8_lightning_indexer", "CPU")
    for top_k in (1, 7, 64, 300):
        expected = reference_kernel("fp8_lightning_indexer")(*_args(c), top_k)
        assert expected.tolist() == [row[:top_k] for row in dense_top]
        if cpp:
            assert torch.equal(call_op("dispatch", "fp8_lightning_indexer", *_args(c), top_k), expected), (
                top_k
            )


@pytest.mark.parametrize("impl", IMPLS)
def test_indexer_ties_prefer_lower_positions(impl) -> None:
    skip_unless_kernel(impl, "fp8_lightning_indexer")
    # 4 distinct key rows repeated over 70 positions (in several blocks): scores take at most 4 values
    c = _integer_case([2], [70], heads=8)
    c["weights"] = c["weights"].abs()
    table, bs = c["block_table"][0].tolist(), c["k_rows"].shape[1]
    distinct = c["k_rows"][table[0], :4].clone()
    for s in range(70):
        c["k_rows"][table[s // bs], s % bs] = distinct[(s * 7) % 4]
    dense_scores, dense_top = _dense(c, 40)
    assert all(len(set(row)) <= 4 for row in dense_scores)
    assert call_op(impl, "fp8_lightning_indexer", *_args(c), 40).tolist() == dense_top
    # all keys zero: every score 0, the position order
    c["k_rows"].zero_()
    assert call_op(impl, "fp8_lightning_indexer", *_args(c), 8).tolist() == [list(range(8))] * 2


def test_fp8_indexer_agrees_with_bf16_indexer() -> None:
    """Top-16 of 64 keys per query from FP8 rows vs the bf16 ``lightning_indexer`` on the un-quantised
    queries and keys (the rotation is orthogonal, so it preserves every dot product).

    Expected agreement from FP8's precision: rounding to e4m3 (3 mantissa bits) errs by at most 2**-4 of a
    value, RMS about 2.5% over uniformly spread mantissas, so a product q_i k_i is off by ~3.5% RMS and a
    128-wide dot of Gaussians by sqrt(128) * 0.035 ≈ 0.4 against its spread sqrt(128) ≈ 11 (bf16's 2**-9
    adds little). Per head, w · relu(dot) (w ~ U(0, 1)) has spread ≈ 4.0 and noise ≈ 0.16: ~4% of the
    score spread, the ratio the head sum keeps. Keys near the 16th best of 64 (density 64 · φ(0.67) ≈ 20
    per score spread) cross it when the noise exceeds their margin: ≈ 20 · 0.04 · 0.8 ≈ 0.65 swaps per
    query, 0.96 expected overlap. Measured: 0.957-0.982 mean over 32 queries (40 seeds), per-query minimum
    0.875. The bounds (mean 0.9: 2.5x the predicted swaps; any query 0.75) fail on a real regression (a
    wrong scale, a missing or one-sided rotation fall towards the 0.25 of a random pick), not on noise.
    """
    torch.manual_seed(3)
    c = _case([8] * 4, [64] * 4, heads=16, raw=True)
    bf16 = (c["q"].bfloat16(), c["weights"], c["k"].bfloat16(), *_args(c)[3:])
    float_idx = lightning_indexer(*bf16, 16)
    fp8_idx = fp8_lightning_indexer(*_args(c), 16)
    assert float_idx.shape == fp8_idx.shape == (32, 16) and bool((fp8_idx >= 0).all())
    agree = [len(set(a.tolist()) & set(b.tolist())) / 16 for a, b in zip(float_idx, fp8_idx, strict=True)]
    assert sum(agree) / len(agree) >= 0.9 and min(agree) >= 0.75, agree


# -------------------------------------------------------------------------------------- opcheck, compile


def _opcheck_cases():
    c = _case([2, 1], [30, 17], heads=8, dim=256)
    yield "hadamard_quant_fp8", (torch.randn(3, 2, 128),)
    yield "hadamard_quant_fp8", (torch.randn(4, 256).bfloat16(),)
    yield "fp8_lightning_indexer", (*_args(c), 8)


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_opcheck(case) -> None:
    name, args = case
    torch.library.opcheck(getattr(torch.ops.kvoffload, name).default, args)


def test_compile_fullgraph() -> None:
    def step(q, w, k, table, cu, lens):
        return fp8_lightning_indexer(hadamard_quant_fp8(q), w, hadamard_quant_fp8(k), table, cu, lens, 16)

    c = _case([2, 1], [40, 25], raw=True)
    args = (c["q"], c["weights"], c["k"], *_args(c)[3:])
    expected = step(*args)
    got = torch.compile(step, fullgraph=True, backend="inductor")(*args)
    assert torch.equal(got, expected)


# --------------------------------------------------------------------------------------------- errors


def _bad(c: dict, **changes) -> tuple[torch.Tensor, ...]:
    d = dict(c)
    d.update(changes)
    return _args(d)


def _error_cases():
    c = _case([2, 1], [20, 9])  # block_size 16: request 0 covers 2 blocks, request 1 one
    q, w, k, tb = c["q_rows"], c["weights"], c["k_rows"], c["block_table"]
    bad_tb = tb.clone()
    bad_tb[0, 1] = k.shape[0]
    neg_tb = tb.clone()
    neg_tb[1, 0] = -1
    return [
        (_bad(c, q_rows=q.to(torch.int8)), TypeError, "'q_rows' must have dtype torch.uint8"),
        (_bad(c, q_rows=q[0]), ValueError, "'q_rows' must have exactly 3"),
        (_bad(c, weights=w.double()), TypeError, "'weights' must have dtype"),
        (_bad(c, weights=w[:, :2]), ValueError, "'weights' must have shape \\[3, 8\\]"),
        (_bad(c, weights=w[0]), ValueError, "'weights' must have exactly 2"),
        (_bad(c, k_rows=k.view(torch.int8)), TypeError, "'k_rows' must have dtype torch.uint8"),
        (
            _bad(c, q_rows=q[..., :130], k_rows=k[..., :130]),
            ValueError,
            "'q_rows' must hold 132 bytes per 128",
        ),
        (_bad(c, k_rows=torch.cat([k, k], -1)), ValueError, "'k_rows' must have 132 bytes per row"),
        (_bad(c, block_table=tb.long()), TypeError, "'block_table' must have dtype torch.int32"),
        (_bad(c, cu_seqlens_q=_i32([0, 3])), ValueError, "'cu_seqlens_q' must have shape \\[3\\]"),
        (_bad(c, seq_lens_k=_i32([20])), ValueError, "'seq_lens_k' must have shape \\[2\\]"),
        (_bad(c, cu_seqlens_q=_i32([1, 2, 3])), ValueError, "'cu_seqlens_q' entry 0 must be 0"),
        (_bad(c, cu_seqlens_q=_i32([0, 2, 1])), ValueError, "must be non-decreasing"),
        (
            _bad(c, cu_seqlens_q=_i32([0, 1, 2])),
            ValueError,
            "last entry must equal the number of query tokens 3",
        ),
        (_bad(c, seq_lens_k=_i32([20, 100])), ValueError, "'seq_lens_k' entry 1 is 100, expected a value in"),
        (_bad(c, seq_lens_k=_i32([0, 9])), ValueError, "first query would see -1 keys"),
        (_bad(c, block_table=bad_tb), IndexError, "'block_table' entry \\[0, 1\\] is"),
        (_bad(c, block_table=neg_tb), IndexError, "'block_table' entry \\[1, 0\\] is -1"),
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", _error_cases(), ids=lambda c: c[2][:40])
def test_indexer_bad_input_raises(case, impl) -> None:
    args, exc, fragment = case
    before = [a.clone() for a in args]
    with pytest.raises(exc, match=f"kvoffload::fp8_lightning_indexer: .*{fragment}"):
        call_op(impl, "fp8_lightning_indexer", *args, 8)
    assert all(torch.equal(a, b) for a, b in zip(args, before, strict=True)), "an input was modified"


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_top_k_and_hadamard_inputs(impl) -> None:
    c = _case([1], [20])
    with pytest.raises(ValueError, match="kvoffload::fp8_lightning_indexer: argument 'top_k' must be >= 0"):
        call_op(impl, "fp8_lightning_indexer", *_args(c), -1)
    for x, exc, fragment in [
        (torch.randn(3, 64), ValueError, "power-of-two last dim of at least 128"),
        (torch.randn(3, 384), ValueError, "power-of-two last dim of at least 128"),
        (torch.randn(3, 128).double(), TypeError, "'x' must have dtype"),
        (torch.randn(3, 128).half(), TypeError, "'x' must have dtype"),
        (torch.tensor(1.0), ValueError, "'x' must have at least 1 dimensions"),
    ]:
        with pytest.raises(exc, match=f"kvoffload::hadamard_quant_fp8: .*{fragment}"):
            call_op(impl, "hadamard_quant_fp8", x)


@requires_cpp
def test_cpp_kernels_registered() -> None:
    for name in ("hadamard_quant_fp8", "fp8_lightning_indexer"):
        assert has_kernel(name, "CPU") and has_kernel(name, "Meta")
