"""kvoffload::sparse_mla_attention and kvoffload::scatter_copy_sparse_mla_attention (Copy-SFA)."""

from __future__ import annotations

import math

import pytest
import torch
from support.op_impls import call_op, requires_cpp, skip_unless_kernel
from support.references import dense_mla_attention

from torch_kvoffload.ops import (
    copy_rows,
    reference_kernel,
    scatter_copy_sparse_mla_attention,
    sparse_mla_attention,
)
from torch_kvoffload.ops.triton import interpreting

DTYPES = [torch.float32, torch.bfloat16]
SPARSE = "sparse_mla_attention"
COPY_SFA = "scatter_copy_sparse_mla_attention"


def _impl(impl: str, name: str):
    """Op ``name`` as run by ``impl`` (a value of the conftest ``op_impl`` / ``any_impl`` fixtures)."""
    return lambda *args, **kwargs: call_op(impl, name, *args, **kwargs)


def _skip_interpreted_at_scale(op_impl: str) -> None:
    """Production shapes are too slow for the Triton interpreter (seconds per call); the smaller shapes
    run the same code paths (several row tiles, split rows and their merge)."""
    if op_impl == "triton" and interpreting():
        pytest.skip("production shape: too slow under the Triton interpreter")


def _i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1.6e-2}


def _sparse_case(t, h, dc, dr, n, k, dtype, *, pad: float = 0.2, dup: bool = True):
    q_nope = torch.randn(t, h, dc).to(dtype)
    q_pe = torch.randn(t, h, dr).to(dtype)
    kv_c = torch.randn(n, dc).to(dtype)
    k_pe = torch.randn(n, dr).to(dtype)
    idx = (
        torch.randint(0, max(n, 1), (t, k)) if dup else torch.stack([torch.randperm(n)[:k] for _ in range(t)])
    )
    idx = torch.where(torch.rand(t, k) < pad, -1, idx).to(torch.int32) if n else torch.full((t, k), -1)
    return q_nope, q_pe, kv_c, k_pe, idx.to(torch.int32)


SHAPES = [
    # (T, H, Dc, Dr, N, K)
    (1, 16, 512, 64, 300, 64),
    (3, 4, 64, 16, 50, 20),
    (5, 6, 40, 8, 33, 7),  # Dc not a multiple of 16, H not a multiple of 4
    (2, 1, 16, 0, 10, 5),  # no rope part
    (4, 3, 24, 5, 17, 1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_and_formula(dtype, shape, op_impl) -> None:
    skip_unless_kernel(op_impl, SPARSE)
    args = _sparse_case(*shape, dtype)
    scale = 1 / math.sqrt(shape[2] + shape[3])
    out, lse = call_op(op_impl, SPARSE, *args, scale)
    ref_out, ref_lse = reference_kernel("sparse_mla_attention")(*args, scale)
    assert out.dtype == dtype and out.shape == args[0].shape
    assert lse.dtype == torch.float32 and lse.shape == args[0].shape[:2]
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    f_out, f_lse = dense_mla_attention(*args, scale)
    for o, name in ((out, "kernel"), (ref_out, "reference kernel")):
        torch.testing.assert_close(o, f_out, **_tol(dtype), msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(lse, f_lse, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ref_lse, f_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_production_shape(dtype, op_impl) -> None:
    """DeepSeek shape: 16 heads, Dc 512, Dr 64, 2048 selected rows."""
    skip_unless_kernel(op_impl, SPARSE)
    _skip_interpreted_at_scale(op_impl)
    args = _sparse_case(2, 16, 512, 64, 4096, 2048, dtype, pad=0.05, dup=False)
    scale = 576**-0.5
    out, lse = call_op(op_impl, SPARSE, *args, scale)
    ref_out, ref_lse = reference_kernel("sparse_mla_attention")(*args, scale)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_duplicates_attend_twice_and_padding_is_skipped(any_impl: str) -> None:
    q_nope, q_pe, kv_c, k_pe, _ = _sparse_case(1, 2, 8, 4, 5, 1, torch.float32)
    twice = _i32([[1, 1, 3, -1]])
    gathered = _i32([[1, 3, -1, -1]])
    fn = _impl(any_impl, SPARSE)
    o2, l2 = fn(q_nope, q_pe, kv_c, k_pe, twice, 0.3)
    # Row 1 listed twice == a dense gather of [1, 1, 3]; the −1 changes nothing.
    o3, l3 = fn(q_nope, q_pe, kv_c, k_pe, _i32([[1, 1, 3]]), 0.3)
    torch.testing.assert_close(o2, o3)
    torch.testing.assert_close(l2, l3)
    o1, _ = fn(q_nope, q_pe, kv_c, k_pe, gathered, 0.3)
    assert not torch.allclose(o1, o2)
    # log(2 e^{s1} + e^{s3}) = lse over {1, 3} shifted by the extra e^{s1}
    s = (q_nope[0] @ kv_c.T + q_pe[0] @ k_pe.T) * 0.3
    torch.testing.assert_close(l2[0], torch.logsumexp(torch.stack([s[:, 1], s[:, 1], s[:, 3]]), 0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_without_valid_index(dtype, any_impl: str) -> None:
    q_nope, q_pe, kv_c, k_pe, idx = _sparse_case(3, 4, 16, 8, 10, 6, dtype)
    idx[1] = -1
    fn = _impl(any_impl, SPARSE)
    out, lse = fn(q_nope, q_pe, kv_c, k_pe, idx, 0.2)
    assert bool((out[1] == 0).all()) and bool((lse[1] == -math.inf).all())
    assert bool(torch.isfinite(lse[0]).all()) and bool(torch.isfinite(out).all())
    # K = 0 and N = 0
    for kv, pe, ix in [
        (kv_c, k_pe, idx[:, :0]),
        (kv_c[:0], k_pe[:0], torch.full((3, 2), -1, dtype=torch.int32)),
    ]:
        out, lse = fn(q_nope, q_pe, kv, pe, ix, 0.2)
        assert bool((out == 0).all()) and bool((lse == -math.inf).all())


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", DTYPES)
def test_unselected_rows_never_reach_the_output(poison: float, dtype, any_impl: str) -> None:
    """Rows no query selects (row 0 included, which a ``-1`` entry must not read) hold NaN / ±inf: a query
    whose indices are all ``-1`` gets out = 0 and lse = -inf, a partially ``-1`` query equals the formula
    over its selected rows only, for every kernel."""
    q_nope, q_pe, kv_c, k_pe, _ = _sparse_case(4, 3, 16, 8, 12, 5, dtype)
    idx = _i32([[-1, -1, -1, -1, -1], [3, -1, 5, -1, 3], [-1, -1, -1, -1, 7], [4, 5, 6, 7, 8]])
    selected = {3, 4, 5, 6, 7, 8}
    for i in range(kv_c.shape[0]):
        if i not in selected:
            kv_c[i, i % kv_c.shape[1]] = poison
            k_pe[i, i % k_pe.shape[1]] = poison
    assert not torch.isfinite(kv_c[0]).all()
    out, lse = _impl(any_impl, SPARSE)(q_nope, q_pe, kv_c, k_pe, idx, 0.25)
    f_out, f_lse = dense_mla_attention(q_nope, q_pe, kv_c, k_pe, idx, 0.25)
    assert bool((out[0] == 0).all()) and bool((lse[0] == -math.inf).all())
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse[1:]).all())
    torch.testing.assert_close(out, f_out, **_tol(dtype))
    torch.testing.assert_close(lse, f_lse, atol=1e-4, rtol=1e-5)
    # the same op then runs on clean rows, with other shapes
    args = _sparse_case(2, 5, 24, 4, 9, 3, dtype)
    out, lse = _impl(any_impl, SPARSE)(*args, 0.2)
    f_out, f_lse = dense_mla_attention(*args, 0.2)
    torch.testing.assert_close(out, f_out, **_tol(dtype))
    torch.testing.assert_close(lse, f_lse, atol=1e-4, rtol=1e-5)


def test_empty_tokens_and_strided_rows(op_impl) -> None:
    fn = _impl(op_impl, SPARSE)
    q_nope, q_pe, kv_c, k_pe, idx = _sparse_case(0, 4, 16, 8, 10, 6, torch.float32)
    out, lse = fn(q_nope, q_pe, kv_c, k_pe, idx, 0.2)
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)
    # kv_c / k_pe as views of one [N, Dc + Dr] latent cache, as MLA stores them.
    q_nope, q_pe, _, _, idx = _sparse_case(3, 4, 16, 8, 10, 6, torch.float32)
    cache = torch.randn(10, 24)
    kv_c, k_pe = cache[:, :16], cache[:, 16:]
    out, lse = fn(q_nope, q_pe, kv_c, k_pe, idx, 0.2)
    ref = reference_kernel("sparse_mla_attention")(
        q_nope, q_pe, kv_c.contiguous(), k_pe.contiguous(), idx, 0.2
    )
    torch.testing.assert_close(out, ref[0], **_tol(torch.float32))
    torch.testing.assert_close(lse, ref[1], atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------------------- Copy-SFA


def _copy_sfa_case(r, h, dc, dr, cap, k, dtype, *, block_size=8, blocks_per_row=6, miss_frac=0.3):
    num_blocks = r * blocks_per_row + 2
    host_c = torch.randn(num_blocks, block_size, dc).to(dtype)
    host_pe = torch.randn(num_blocks, block_size, dr).to(dtype)
    table = torch.randperm(num_blocks)[: r * blocks_per_row].view(r, blocks_per_row).to(torch.int32)
    hot_c = torch.randn(r, cap, dc).to(dtype)
    hot_pe = torch.randn(r, cap, dr).to(dtype)
    m = max(1, int(k * miss_frac))
    miss_tokens = torch.full((r, m), -1, dtype=torch.int32)
    miss_slots = torch.full((r, m), -1, dtype=torch.int32)
    counts = torch.randint(0, m + 1, (r,), dtype=torch.int32)
    slots = torch.full((r, k), -1, dtype=torch.int32)
    for i in range(r):
        n = int(counts[i])
        miss_tokens[i, :n] = torch.randperm(blocks_per_row * block_size)[:n].to(torch.int32)
        perm = torch.randperm(cap)
        miss_slots[i, :n] = perm[:n].to(torch.int32)
        # attend the freshly loaded slots plus some resident ones, with −1 padding at the end
        attend = torch.cat([perm[:n], perm[n : n + (k - n) // 2]])
        slots[i, : attend.numel()] = attend[torch.randperm(attend.numel())].to(torch.int32)
    q_nope = torch.randn(r, h, dc).to(dtype)
    q_pe = torch.randn(r, h, dr).to(dtype)
    out = torch.full((r, h, dc), 7.0).to(dtype)
    lse = torch.full((r, h), 7.0)
    return {
        "q_nope": q_nope,
        "q_pe": q_pe,
        "host_kv_c": host_c,
        "host_k_pe": host_pe,
        "block_table": table,
        "hot_kv_c": hot_c,
        "hot_k_pe": hot_pe,
        "miss_tokens": miss_tokens,
        "miss_slots": miss_slots,
        "miss_count": counts,
        "slots": slots,
        "scale": 1 / math.sqrt(dc + dr),
        "out": out,
        "lse": lse,
    }


def _clone(c: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.items()}


def _composed(c: dict) -> None:
    """copy_rows of the valid misses + sparse_mla_attention over the hot buffers: Copy-SFA's definition."""
    bs, cap = c["host_kv_c"].shape[1], c["hot_kv_c"].shape[1]
    src, dst = [], []
    for r, n in enumerate(c["miss_count"].tolist()):
        for i in range(n):
            tok, slot = int(c["miss_tokens"][r, i]), int(c["miss_slots"][r, i])
            src.append(int(c["block_table"][r, tok // bs]) * bs + tok % bs)
            dst.append(r * cap + slot)
    src_t, dst_t = torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)
    copy_rows(c["host_kv_c"], c["hot_kv_c"], src_t, dst_t)
    copy_rows(c["host_k_pe"], c["hot_k_pe"], src_t, dst_t)
    rows = c["slots"].shape[0]
    flat = torch.where(c["slots"] >= 0, c["slots"] + torch.arange(rows, dtype=torch.int32)[:, None] * cap, -1)
    out, lse = sparse_mla_attention(
        c["q_nope"],
        c["q_pe"],
        c["hot_kv_c"].reshape(rows * cap, -1),
        c["hot_k_pe"].reshape(rows * cap, -1),
        flat.to(torch.int32),
        c["scale"],
    )
    c["out"].copy_(out)
    c["lse"].copy_(lse)


COPY_SHAPES = [
    # (R, H, Dc, Dr, C, K)
    (2, 16, 512, 64, 64, 32),
    (3, 4, 32, 8, 16, 12),
    (1, 5, 24, 4, 10, 10),
    (4, 2, 16, 0, 8, 3),
]


def _assert_copy_sfa_matches(got: dict, expected: dict, op_impl: str, dtype: torch.dtype) -> None:
    """The copies are exact; the C++ kernel runs the same attention as ``sparse_mla_attention`` (bitwise
    equal), another kernel agrees within rounding."""
    for name in ("hot_kv_c", "hot_k_pe"):
        assert torch.equal(got[name], expected[name]), name
    if op_impl == "dispatch" and got["out"].device.type == "cpu":
        assert torch.equal(got["out"], expected["out"]) and torch.equal(got["lse"], expected["lse"])
    torch.testing.assert_close(got["out"], expected["out"], **_tol(dtype))
    torch.testing.assert_close(got["lse"], expected["lse"], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", COPY_SHAPES)
def test_copy_sfa_equals_copy_rows_then_sparse_attention(dtype, shape, op_impl) -> None:
    skip_unless_kernel(op_impl, COPY_SFA)
    c = _copy_sfa_case(*shape, dtype)
    expected = _clone(c)
    _composed(expected)
    got = _clone(c)
    call_op(op_impl, COPY_SFA, **got)
    _assert_copy_sfa_matches(got, expected, op_impl, dtype)
    # the attention itself against the independent dense reference, over the updated hot buffers
    rows, cap = got["slots"].shape[0], got["hot_kv_c"].shape[1]
    flat = torch.where(
        got["slots"] >= 0, got["slots"] + torch.arange(rows, dtype=torch.int32)[:, None] * cap, -1
    )
    d_out, d_lse = dense_mla_attention(
        c["q_nope"], c["q_pe"], got["hot_kv_c"].reshape(rows * cap, -1), got["hot_k_pe"].reshape(rows * cap, -1),
        flat, c["scale"],
    )  # fmt: skip
    torch.testing.assert_close(got["out"], d_out, **_tol(dtype))
    torch.testing.assert_close(got["lse"], d_lse, atol=1e-4, rtol=1e-5)
    # The reference kernel agrees (its attention is plain PyTorch, so within rounding).
    ref = _clone(c)
    reference_kernel("scatter_copy_sparse_mla_attention")(**ref)
    for name in ("hot_kv_c", "hot_k_pe"):
        assert torch.equal(ref[name], expected[name]), name
    torch.testing.assert_close(ref["out"], expected["out"], **_tol(dtype))
    torch.testing.assert_close(ref["lse"], expected["lse"], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_sfa_unattended_slots_never_reach_the_output(poison: float, dtype, any_impl: str) -> None:
    """Hot-buffer slots no row attends (slot 0 included) hold NaN / inf: a row whose slots are all ``-1``
    gets out = 0 and lse = -inf, a partially ``-1`` row equals the formula over its attended slots (the
    freshly loaded miss included), for every kernel."""
    c = _copy_sfa_case(3, 4, 16, 8, 8, 4, dtype, block_size=4, blocks_per_row=3)
    c["miss_count"] = _i32([1, 0, 1])
    c["miss_tokens"] = _i32([[5], [-1], [2]])
    c["miss_slots"] = _i32([[6], [-1], [1]])
    c["slots"] = _i32([[-1, 6, -1, 2], [-1, -1, -1, -1], [1, 3, 3, -1]])
    attended = [{6, 2}, set(), {1, 3}]
    for r in range(3):
        for slot in range(8):
            if slot not in attended[r]:
                c["hot_kv_c"][r, slot, slot % 16] = poison
                c["hot_k_pe"][r, slot] = poison
    expected = _clone(c)
    _composed(expected)  # copy_rows, then the op over clean hot buffers below
    got = _clone(c)
    _impl(any_impl, COPY_SFA)(**got)
    for name in ("hot_kv_c", "hot_k_pe"):  # the missed rows landed, the poison stayed where it was
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, equal_nan=True)
    assert bool((got["out"][1] == 0).all()) and bool((got["lse"][1] == -math.inf).all())
    assert bool(torch.isfinite(got["out"]).all())
    rows, cap = 3, 8
    flat = torch.where(
        got["slots"] >= 0, got["slots"] + torch.arange(rows, dtype=torch.int32)[:, None] * cap, -1
    )
    d_out, d_lse = dense_mla_attention(
        c["q_nope"], c["q_pe"], got["hot_kv_c"].reshape(rows * cap, -1), got["hot_k_pe"].reshape(rows * cap, -1),
        flat, c["scale"],
    )  # fmt: skip
    torch.testing.assert_close(got["out"], d_out, **_tol(dtype))
    torch.testing.assert_close(got["lse"], d_lse, atol=1e-4, rtol=1e-5)


def test_copy_sfa_production_shape_bf16(op_impl) -> None:
    skip_unless_kernel(op_impl, COPY_SFA)
    _skip_interpreted_at_scale(op_impl)
    c = _copy_sfa_case(
        2, 16, 512, 64, 4096, 2048, torch.bfloat16, block_size=128, blocks_per_row=64, miss_frac=0.1
    )
    expected = _clone(c)
    _composed(expected)
    call_op(op_impl, COPY_SFA, **c)
    _assert_copy_sfa_matches(c, expected, op_impl, torch.bfloat16)


def test_copy_sfa_ignores_entries_past_miss_count_and_strided_outputs(op_impl) -> None:
    skip_unless_kernel(op_impl, COPY_SFA)
    c = _copy_sfa_case(3, 4, 32, 8, 16, 12, torch.float32)
    c["miss_tokens"][:, -1] = 10**6  # past every count: never read
    c["miss_count"].clamp_(max=c["miss_tokens"].shape[1] - 1)
    expected = _clone(c)
    _composed(expected)
    got = _clone(c)
    big = torch.zeros(3, 4, 64)
    got["out"] = big[:, :, ::2]  # non-contiguous output
    call_op(op_impl, COPY_SFA, **got)
    _assert_copy_sfa_matches(got, expected, op_impl, torch.float32)


def test_copy_sfa_hot_buffers_with_strided_rows(any_impl: str) -> None:
    """Hot buffers whose rows are not contiguous (e.g. a transposed allocation) are updated in place."""
    fn = _impl(any_impl, COPY_SFA)
    c = _copy_sfa_case(2, 4, 16, 8, 12, 8, torch.bfloat16)
    expected = _clone(c)
    _composed(expected)
    got = _clone(c)
    for name_, t in (("hot_kv_c", c["hot_kv_c"]), ("hot_k_pe", c["hot_k_pe"])):
        strided = torch.empty(t.shape[0], t.shape[2], t.shape[1], dtype=t.dtype).transpose(1, 2)
        strided.copy_(t)
        assert strided.stride(-1) != 1
        got[name_] = strided
    fn(*got.values())
    for name_ in ("hot_kv_c", "hot_k_pe"):
        assert torch.equal(got[name_], expected[name_]), name_
    torch.testing.assert_close(got["out"], expected["out"], **_tol(torch.bfloat16))
    torch.testing.assert_close(got["lse"], expected["lse"], atol=1e-4, rtol=1e-5)


def test_copy_sfa_output_sharing_memory_with_queries(any_impl: str) -> None:
    """``out`` may be the query buffer itself (written in place): queries are read as before the call."""
    fn = _impl(any_impl, COPY_SFA)
    c = _copy_sfa_case(3, 4, 32, 8, 16, 12, torch.float32)
    expected = _clone(c)
    fn(*expected.values())
    got = _clone(c)
    got["out"] = got["q_nope"]  # same tensor as input and output
    fn(*got.values())
    assert torch.equal(got["q_nope"], expected["out"])
    assert torch.equal(got["lse"], expected["lse"])


def test_copy_sfa_host_pool_may_live_on_another_device() -> None:
    """The host pool (and the index tensors) may sit on another device than the hot buffers: checked on
    meta hot buffers / queries with a CPU pool (the accelerator case: pinned host pool, device hot buffers)."""
    c = _copy_sfa_case(2, 4, 16, 8, 8, 4, torch.float32)
    on_meta = {"q_nope", "q_pe", "hot_kv_c", "hot_k_pe", "slots", "out", "lse"}
    meta = {k: v.to("meta") if k in on_meta else v for k, v in c.items()}
    torch.ops.kvoffload.scatter_copy_sparse_mla_attention(*meta.values())  # structure accepted
    meta["host_k_pe"] = meta["host_k_pe"].to("meta")
    with pytest.raises(ValueError, match="'host_k_pe' must be on cpu \\(as 'host_kv_c'\\)"):
        torch.ops.kvoffload.scatter_copy_sparse_mla_attention(*meta.values())
    meta["host_k_pe"] = c["host_k_pe"]
    meta["out"] = c["out"]
    with pytest.raises(ValueError, match="'out' must be on meta"):
        torch.ops.kvoffload.scatter_copy_sparse_mla_attention(*meta.values())


# ------------------------------------------------------------------------------------ opcheck / compile


def _opcheck_cases():
    for dtype in DTYPES:
        yield (
            torch.ops.kvoffload.sparse_mla_attention.default,
            (*_sparse_case(3, 4, 32, 8, 20, 6, dtype), 0.1),
        )
        c = _copy_sfa_case(2, 4, 32, 8, 16, 8, dtype)
        yield torch.ops.kvoffload.scatter_copy_sparse_mla_attention.default, tuple(c.values())


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: str(c[0]))
def test_opcheck(case) -> None:
    op, args = case
    torch.library.opcheck(op, args)


def test_compile_fullgraph() -> None:
    def step(c: dict) -> tuple[torch.Tensor, ...]:
        scatter_copy_sparse_mla_attention(**c)
        # reads the hot rows the first op wrote; returns the mutated out / lse too (no arithmetic here: a
        # pointwise kernel would make inductor compile C++, which this check of the ops does not need)
        out2, lse2 = sparse_mla_attention(
            c["q_nope"], c["q_pe"], c["hot_kv_c"][0], c["hot_k_pe"][0], c["slots"], c["scale"]
        )
        return c["out"], c["lse"], out2, lse2

    c = _copy_sfa_case(2, 4, 32, 8, 16, 8, torch.float32)
    c["slots"][:, 0] = 0  # every row attends something
    eager = _clone(c)
    expected = step(eager)
    compiled = _clone(c)
    got = torch.compile(step, fullgraph=True, backend="inductor")(compiled)
    torch.testing.assert_close(got, expected)
    for name in ("hot_kv_c", "hot_k_pe", "out", "lse"):
        assert torch.equal(compiled[name], eager[name]), name


# --------------------------------------------------------------------------------------------- errors


def _sparse_error_cases():
    q_nope, q_pe, kv_c, k_pe, idx = _sparse_case(2, 4, 16, 8, 10, 5, torch.float32)
    oob = idx.clone()
    oob[1, 2] = 10
    neg = idx.clone()
    neg[0, 4] = -2
    base = (q_nope, q_pe, kv_c, k_pe, idx, 0.1)

    def w(i, v):
        a = list(base)
        a[i] = v
        return tuple(a)

    return [
        (w(4, oob), IndexError, "'indices' entry \\[1, 2\\] is 10, expected -1 or a value in \\[0, 10\\)"),
        (w(4, neg), IndexError, "'indices' entry \\[0, 4\\] is -2"),
        (w(4, idx.long()), TypeError, "'indices' must have dtype torch.int32"),
        (w(4, idx[:1]), ValueError, "'indices' must have 2 rows"),
        (w(0, q_nope.double()), TypeError, "'q_nope' must have dtype"),
        (w(1, q_pe.bfloat16()), TypeError, "'q_nope' and 'q_pe' must have the same dtype"),
        (w(1, q_pe[:, :2]), ValueError, "'q_pe' must have shape"),
        (w(2, kv_c[:, :8]), ValueError, "'kv_c' must have last dim 16"),
        (w(3, k_pe[:5]), ValueError, "'kv_c' and 'k_pe' must have the same leading shape"),
        (w(2, kv_c.bfloat16()), TypeError, "'q_nope' and 'kv_c' must have the same dtype"),
        (w(3, k_pe[None]), ValueError, "'k_pe' must have exactly 2 dimensions"),
    ]


@pytest.mark.parametrize("case", _sparse_error_cases(), ids=lambda c: c[2][:40])
def test_sparse_bad_input_raises(case, any_impl: str) -> None:
    args, exc, fragment = case
    fn = _impl(any_impl, SPARSE)
    with pytest.raises(exc, match=f"kvoffload::sparse_mla_attention: .*{fragment}"):
        fn(*args)


def _copy_error_cases():
    c = _copy_sfa_case(3, 4, 16, 8, 12, 6, torch.float32, block_size=4, blocks_per_row=3, miss_frac=0.5)
    c["miss_count"] = _i32([2, 1, 0])
    c["miss_tokens"][:, :2] = _i32([[0, 11], [5, -1], [-1, -1]])
    c["miss_slots"][:, :2] = _i32([[3, 4], [0, -1], [-1, -1]])
    nb = c["host_kv_c"].shape[0]

    def w(**changes):
        d = _clone(c)
        for k, v in changes.items():
            if callable(v):
                v(d)
            else:
                d[k] = v
        return d

    def setitem(name, index, value):
        def f(d):
            d[name][index] = value

        return f

    return [
        (w(a=setitem("miss_tokens", (0, 1), 12)), IndexError, "'miss_tokens' entry \\[0, 1\\] is 12"),
        (w(a=setitem("miss_tokens", (1, 0), -1)), IndexError, "'miss_tokens' entry \\[1, 0\\] is -1"),
        (
            w(a=setitem("block_table", (0, 2), nb)),
            IndexError,
            "'block_table' entry \\[0, 2\\] \\(block of miss",
        ),
        (w(a=setitem("miss_slots", (0, 1), 12)), IndexError, "'miss_slots' entry \\[0, 1\\] is 12"),
        (
            w(a=setitem("miss_slots", (0, 1), 3)),
            ValueError,
            "'miss_slots' row 0 holds destination 3 more than once",
        ),
        (w(a=setitem("miss_count", 2, 4)), ValueError, "'miss_count' entry 2 is 4"),
        (w(a=setitem("miss_count", 2, -1)), ValueError, "'miss_count' entry 2 is -1"),
        (w(a=setitem("slots", (2, 0), 12)), IndexError, "'slots' entry \\[2, 0\\] is 12"),
        (w(a=setitem("slots", (1, 1), -3)), IndexError, "'slots' entry \\[1, 1\\] is -3"),
        (w(slots=c["slots"].long()), TypeError, "'slots' must have dtype torch.int32"),
        (
            w(miss_slots=c["miss_slots"][:, :1]),
            ValueError,
            "'miss_slots' must have the shape of 'miss_tokens'",
        ),
        (w(block_table=c["block_table"][:2]), ValueError, "'block_table' must have 3 rows"),
        (w(hot_kv_c=c["hot_kv_c"][:2]), ValueError, "'hot_kv_c' and 'hot_k_pe' must have the same leading"),
        (w(hot_kv_c=c["hot_kv_c"].bfloat16()), TypeError, "'q_nope' and 'hot_kv_c' must have the same dtype"),
        (w(host_k_pe=c["host_k_pe"][..., :3]), ValueError, "'host_k_pe' must have last dim 8"),
        (w(out=c["out"].bfloat16()), TypeError, "'q_nope' and 'out' must have the same dtype"),
        (w(out=c["out"][:, :2]), ValueError, "'out' must have shape"),
        (w(lse=c["lse"].double()), TypeError, "'lse' must have dtype torch.float32"),
        (w(lse=c["lse"][:2]), ValueError, "'lse' must have shape"),
    ]


@pytest.mark.parametrize("case", _copy_error_cases(), ids=lambda c: c[2][:40])
def test_copy_sfa_bad_input_raises_and_leaves_state_untouched(case, any_impl: str) -> None:
    c, exc, fragment = case
    before = _clone(c)
    name = COPY_SFA
    fn = _impl(any_impl, name)
    with pytest.raises(exc, match=f"kvoffload::{name}: .*{fragment}"):
        fn(*c.values())
    for k in ("hot_kv_c", "hot_k_pe", "out", "lse"):
        assert torch.equal(c[k], before[k]), f"{k} modified by a rejected call"


@requires_cpp
def test_cpp_kernels_registered() -> None:
    from torch_kvoffload.ops import has_kernel

    for name in ("sparse_mla_attention", "scatter_copy_sparse_mla_attention"):
        assert has_kernel(name, "CPU") and has_kernel(name, "Meta")


# ------------------------------------------------------------------------------------------ on CUDA

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_production_shape_matches_dense_reference(dtype) -> None:
    """The registered CUDA kernel at the DeepSeek shape (2 tokens: the selected rows are split over
    programs and merged) against the dense reference on CPU."""
    args = _sparse_case(2, 16, 512, 64, 4096, 2048, dtype, pad=0.05, dup=False)
    scale = 576**-0.5
    out, lse = sparse_mla_attention(*(a.cuda() for a in args), scale)
    ref_out, ref_lse = dense_mla_attention(*args, scale)
    torch.testing.assert_close(out.cpu(), ref_out, **_tol(dtype))
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-4, rtol=1e-5)


@requires_cuda
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned-pool", "pageable-pool"])
def test_cuda_copy_sfa_reads_the_host_pool_in_place(pinned: bool) -> None:
    """Host pool on the CPU (pinned: read by the kernel in place; pageable: moved by copy_rows), every
    other tensor on the device: the hot buffers get exactly the missed rows, the attention matches."""
    c = _copy_sfa_case(
        2, 16, 512, 64, 4096, 2048, torch.bfloat16, block_size=128, blocks_per_row=64, miss_frac=0.1
    )
    expected = _clone(c)
    _composed(expected)
    host = {"host_kv_c", "host_k_pe"}
    got = {
        k: (v.pin_memory() if pinned else v.clone())
        if k in host
        else v.cuda()
        if isinstance(v, torch.Tensor)
        else v
        for k, v in c.items()
    }
    scatter_copy_sparse_mla_attention(**got)
    for name in ("hot_kv_c", "hot_k_pe"):
        assert torch.equal(got[name].cpu(), expected[name]), name
    torch.testing.assert_close(got["out"].cpu(), expected["out"], **_tol(torch.bfloat16))
    torch.testing.assert_close(got["lse"].cpu(), expected["lse"], atol=1e-4, rtol=1e-5)
