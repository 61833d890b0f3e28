"""``fp8_scatter_copy_sparse_mla_attention``: Copy-SFA over FP8 latent rows (reference, C++ and Triton).

The expectation is written out here, independently of the library: the missed rows' bytes copied one by
one in Python, then dense MLA attention over the hot rows decoded from their bytes (e4m3 codes from their
bit fields, the fp32 scales and bf16 RoPE values read from the row)."""

from __future__ import annotations

import math

import pytest
import torch
from support.fp8_reference import decode_e4m3
from support.op_impls import call_op, skip_unless_kernel
from support.references import dense_mla_attention

from torch_kvoffload.ops import (
    fp8_scatter_copy_sparse_mla_attention,
    fp8_sparse_mla_attention,
    quantize_kv_fp8,
)
from torch_kvoffload.ops.fp8 import kv_row_bytes

OP = "fp8_scatter_copy_sparse_mla_attention"
SHAPES = [
    # (R, H, Dc, Dr, C, K)
    (2, 16, 512, 64, 64, 32),  # DeepSeek's widths: 656-byte rows
    (3, 4, 128, 16, 16, 12),
    (1, 5, 256, 0, 10, 10),  # no RoPE part
]


def _rows(n: int, dc: int, dr: int, g: torch.Generator) -> torch.Tensor:
    """``n`` FP8 rows of values with varied magnitudes per tile."""
    kv = torch.randn(n, dc, generator=g) * torch.rand(1, dc, generator=g) * 6
    return quantize_kv_fp8(kv, torch.randn(n, dr, generator=g))


def _case(r, h, dc, dr, cap, k, dtype, *, block_size=8, blocks_per_row=5, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    width = kv_row_bytes(dc, dr)
    num_blocks = r * blocks_per_row + 2
    host = _rows(num_blocks * block_size, dc, dr, g).view(num_blocks, block_size, width)
    table = (
        torch.randperm(num_blocks, generator=g)[: r * blocks_per_row].view(r, blocks_per_row).to(torch.int32)
    )
    hot = _rows(r * cap, dc, dr, g).view(r, cap, width)
    m = max(1, k // 3)
    miss_tokens = torch.full((r, m), -1, dtype=torch.int32)
    miss_slots = torch.full((r, m), -1, dtype=torch.int32)
    counts = torch.randint(0, m + 1, (r,), dtype=torch.int32, generator=g)
    slots = torch.full((r, k), -1, dtype=torch.int32)
    for i in range(r):
        n = int(counts[i])
        miss_tokens[i, :n] = torch.randperm(blocks_per_row * block_size, generator=g)[:n].to(torch.int32)
        perm = torch.randperm(cap, generator=g)
        miss_slots[i, :n] = perm[:n].to(torch.int32)
        attend = torch.cat([perm[:n], perm[n : n + (k - n) // 2]])  # the new slots and some resident ones
        slots[i, : attend.numel()] = attend[torch.randperm(attend.numel(), generator=g)].to(torch.int32)
    return {
        "q_nope": torch.randn(r, h, dc, generator=g).to(dtype),
        "q_pe": torch.randn(r, h, dr, generator=g).to(dtype),
        "host_rows": host,
        "block_table": table,
        "hot_rows": hot,
        "miss_tokens": miss_tokens,
        "miss_slots": miss_slots,
        "miss_count": counts,
        "slots": slots,
        "scale": 1 / math.sqrt(dc + dr),
        "out": torch.full((r, h, dc), 7.0).to(dtype),
        "lse": torch.full((r, h), 7.0),
    }


def _clone(c: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.items()}


def _decode(rows: torch.Tensor, dc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 latent and RoPE values of FP8 rows ``uint8 [N, W]`` read from their bytes."""
    tiles = dc // 128
    codes = decode_e4m3(rows[:, :dc]).view(-1, tiles, 128)
    scales = rows[:, dc : dc + 4 * tiles].contiguous().view(torch.float32).double()
    rope = rows[:, dc + 4 * tiles :].contiguous().view(torch.bfloat16).double()
    return (codes * scales[..., None]).view(-1, dc), rope


def _expected(c: dict) -> dict:
    """The copies one by one, then dense attention over the decoded hot rows."""
    e = _clone(c)
    bs = c["host_rows"].shape[1]
    for r, n in enumerate(c["miss_count"].tolist()):
        for i in range(n):
            tok, slot = int(c["miss_tokens"][r, i]), int(c["miss_slots"][r, i])
            e["hot_rows"][r, slot] = c["host_rows"][int(c["block_table"][r, tok // bs]), tok % bs]
    rows, cap, width = e["hot_rows"].shape
    dc = c["q_nope"].shape[-1]
    kv_c, k_pe = _decode(e["hot_rows"].view(rows * cap, width), dc)
    flat = torch.where(c["slots"] >= 0, c["slots"] + torch.arange(rows, dtype=torch.int32)[:, None] * cap, -1)
    out, lse = dense_mla_attention(c["q_nope"], c["q_pe"], kv_c.float(), k_pe.float(), flat, c["scale"])
    e["out"], e["lse"] = out.to(c["q_nope"].dtype), lse
    return e


def _check(got: dict, want: dict, dtype: torch.dtype) -> None:
    assert torch.equal(got["hot_rows"], want["hot_rows"])  # the bytes, exactly
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["out"], want["out"], **tol)
    torch.testing.assert_close(got["lse"], want["lse"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_copies_the_missed_bytes_then_attends_over_the_decoded_rows(shape, dtype, any_impl) -> None:
    c = _case(*shape, dtype)
    got = _clone(c)
    call_op(any_impl, OP, **got)
    _check(got, _expected(c), dtype)


def test_the_kernels_equal_the_reference(op_impl) -> None:
    """The C++ kernel runs fp8_sparse_mla_attention's core over the hot rows: bitwise its result; Triton
    agrees with the reference within fp32 rounding (sums of 144 products in another order)."""
    skip_unless_kernel(op_impl, OP)
    c = _case(3, 4, 128, 16, 16, 12, torch.float32, seed=3)
    ref, got = _clone(c), _clone(c)
    call_op("reference", OP, **ref)
    call_op(op_impl, OP, **got)
    assert torch.equal(got["hot_rows"], ref["hot_rows"])
    if op_impl == "dispatch":
        rows, cap, width = ref["hot_rows"].shape
        idx = torch.where(
            c["slots"] >= 0, c["slots"] + torch.arange(rows, dtype=torch.int32)[:, None] * cap, -1
        )
        out, lse = fp8_sparse_mla_attention(
            c["q_nope"], c["q_pe"], ref["hot_rows"].view(-1, width), idx, c["scale"]
        )
        assert torch.equal(got["out"], out) and torch.equal(got["lse"], lse)
    torch.testing.assert_close(got["out"], ref["out"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["lse"], ref["lse"], rtol=1e-5, atol=1e-5)


def test_entries_past_miss_count_are_ignored_and_strided_buffers_work(any_impl) -> None:
    c = _case(2, 4, 128, 16, 12, 8, torch.float32, seed=4)
    c["miss_tokens"][:, -1] = 10_000  # past miss_count: never read (checked only up to the count)
    c["miss_count"] = torch.clamp(c["miss_count"], max=c["miss_tokens"].shape[1] - 1)
    want = _expected(c)
    got = _clone(c)
    wide = torch.zeros(2, 12, got["hot_rows"].shape[-1] + 8, dtype=torch.uint8)
    wide[..., :-8] = got["hot_rows"]
    got["hot_rows"] = wide[..., :-8]  # rows not contiguous with each other
    got["out"] = torch.zeros(4, 2, 128).transpose(0, 1)  # a strided output
    got["out"].fill_(7.0)
    call_op(any_impl, OP, **got)
    _check(got, want, torch.float32)
    assert bool((wide[..., -8:] == 0).all())  # nothing written outside the rows


def _bad(case: str, c: dict) -> str:
    """Makes ``c`` bad in one way; returns what the error names."""
    if case == "host_dtype":
        c["host_rows"] = c["host_rows"].to(torch.int8)
        return "host_rows"
    if case == "row_bytes":
        c["hot_rows"] = c["hot_rows"][..., :-2]
        return "hot_rows"
    if case == "dc":
        c["q_nope"], c["out"] = c["q_nope"][..., :96], c["out"][..., :96]
        return "multiple of 128"
    if case == "token":
        c["miss_count"][0] = 1
        c["miss_tokens"][0, 0] = 10_000
        return "miss_tokens"
    if case == "duplicate":
        c["miss_count"][0] = 2
        c["miss_tokens"][0, :2] = torch.tensor([0, 1])
        c["miss_slots"][0, :2] = 3
        return "more than once"
    if case == "slots":
        c["slots"][1, 0] = 99
        return "slots"
    c["lse"] = c["lse"][:, :1]
    return "lse"


@pytest.mark.parametrize("case", ["host_dtype", "row_bytes", "dc", "token", "duplicate", "slots", "lse"])
def test_bad_input_raises_and_leaves_state_untouched(case, any_impl) -> None:
    c = _case(2, 4, 128, 16, 8, 6, torch.float32, seed=5)
    needle = _bad(case, c)
    before = _clone(c)
    with pytest.raises((ValueError, TypeError, IndexError), match=needle):
        call_op(any_impl, OP, **c)
    for name in ("hot_rows", "out", "lse"):
        assert torch.equal(c[name], before[name]), name
    good = _case(2, 4, 128, 16, 8, 6, torch.float32, seed=5)  # and a good call then runs
    got = _clone(good)
    call_op(any_impl, OP, **got)
    _check(got, _expected(good), torch.float32)


def test_opcheck() -> None:
    c = _case(2, 4, 128, 16, 8, 6, torch.bfloat16, seed=6)
    torch.library.opcheck(
        torch.ops.kvoffload.fp8_scatter_copy_sparse_mla_attention.default, tuple(c.values())
    )


def test_compile_fullgraph() -> None:
    c = _case(2, 4, 128, 16, 8, 6, torch.float32, seed=7)
    want = _expected(c)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(
        q_nope, q_pe, host_rows, block_table, hot_rows, miss_tokens, miss_slots, miss_count, slots, out, lse
    ):
        fp8_scatter_copy_sparse_mla_attention(
            q_nope,
            q_pe,
            host_rows,
            block_table,
            hot_rows,
            miss_tokens,
            miss_slots,
            miss_count,
            slots,
            0.1,
            out,
            lse,
        )
        return out * 2

    got = _clone(c)
    doubled = step(*(got[k] for k in ("q_nope", "q_pe", "host_rows", "block_table", "hot_rows", "miss_tokens",
                                       "miss_slots", "miss_count", "slots", "out", "lse")))  # fmt: skip
    assert torch.equal(got["hot_rows"], want["hot_rows"])
    c2 = {**c, "scale": 0.1}
    torch.testing.assert_close(doubled, 2 * _expected(c2)["out"], rtol=1e-4, atol=1e-4)
