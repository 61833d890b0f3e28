"""kvoffload::copy_blocks and kvoffload::copy_rows: reference equality, opcheck, compile, errors."""

from __future__ import annotations

import pytest
import torch
from support.op_impls import call_op, requires_cpp, skip_unless_kernel

from torch_kvoffload import ops
from torch_kvoffload.ops import copy_blocks, copy_rows, reference_kernel

DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def _rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=dtype)
    return torch.randn(shape).to(dtype)


def _mapping(n: int, num_src: int, num_dst: int) -> torch.Tensor:
    return torch.stack([torch.randint(0, num_src, (n,)), torch.randperm(num_dst)[:n]], dim=1)


def _slots(n: int, src_rows: int, dst_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, src_rows, (n,)), torch.randperm(dst_rows)[:n]


# Shapes: (src_blocks, dst_blocks, block_size, row_shape)
BLOCK_SHAPES = [(16, 8, 4, (3,)), (64, 32, 16, (576,)), (5, 5, 1, (2, 7)), (9, 3, 128, ())]


# ------------------------------------------------------------------------------------ reference match


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BLOCK_SHAPES)
def test_copy_blocks_matches_reference(op_impl: str, dtype: torch.dtype, shape, streaming: bool) -> None:
    skip_unless_kernel(op_impl, "copy_blocks")
    ns, nd, bs, row = shape
    src = _rand((ns, bs, *row), dtype)
    dst = _rand((nd, bs, *row), dtype)
    mapping = _mapping(min(ns, nd), ns, nd)
    expected = dst.clone()
    reference_kernel("copy_blocks")(src, expected, mapping, streaming=streaming)
    call_op(op_impl, "copy_blocks", src, dst, mapping, streaming=streaming)
    assert torch.equal(dst, expected)
    # independent check of the reference itself
    for s, d in mapping.tolist():
        assert torch.equal(dst[d], src[s])


@pytest.mark.parametrize("shift", [0, 4, 16])
@pytest.mark.parametrize("block_bytes", [17, 48, 64, 4128])
def test_copy_blocks_streaming_any_alignment(op_impl: str, shift: int, block_bytes: int) -> None:
    """Streamed blocks at 32-byte, 16-byte and unaligned addresses, sizes that are and are not multiples
    of the store width: every block lands whole, nothing outside the destination blocks is written."""
    skip_unless_kernel(op_impl, "copy_blocks")
    ns, nd = 9, 7
    raw = torch.zeros(shift + nd * block_bytes + 64, dtype=torch.uint8)
    dst = raw[shift : shift + nd * block_bytes].view(nd, block_bytes)
    src = torch.randint(0, 256, (ns, block_bytes), dtype=torch.uint8)
    mapping = _mapping(5, ns, nd)
    expected = dst.clone()
    reference_kernel("copy_blocks")(src, expected, mapping)
    call_op(op_impl, "copy_blocks", src, dst, mapping, streaming=True)
    assert torch.equal(dst, expected)
    assert not raw[:shift].any() and not raw[shift + nd * block_bytes :].any()
    # overlapping byte rows, as the host pool views its arena: rows start at every byte
    rows = raw.as_strided((raw.numel() - block_bytes + 1, block_bytes), (1, 1))
    offsets = torch.tensor([[0, 16], [1, 21 + block_bytes], [2, 64 + 2 * block_bytes]])  # disjoint
    call_op(op_impl, "copy_blocks", src, rows, offsets, streaming=True)
    for s, o in offsets.tolist():
        assert torch.equal(raw[o : o + block_bytes], src[s])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BLOCK_SHAPES)
def test_copy_rows_matches_reference(op_impl: str, dtype: torch.dtype, shape) -> None:
    skip_unless_kernel(op_impl, "copy_rows")
    ns, nd, bs, row = shape
    src = _rand((ns, bs, *row), dtype)
    dst_bs = max(1, bs // 2)
    dst = _rand((nd * 2, dst_bs, *row), dtype)
    n = min(ns * bs, nd * 2 * dst_bs)
    if op_impl == "triton":
        n = min(n, 48)  # one program per row in the interpreter
    s, d = _slots(n, ns * bs, nd * 2 * dst_bs)
    expected = dst.clone()
    reference_kernel("copy_rows")(src, expected, s, d)
    call_op(op_impl, "copy_rows", src, dst, s, d)
    assert torch.equal(dst, expected)
    for a, b in zip(s.tolist(), d.tolist(), strict=True):
        assert torch.equal(dst[b // dst_bs, b % dst_bs], src[a // bs, a % bs])


def test_copy_rows_strided_views(op_impl: str) -> None:
    """Non-contiguous block / row layouts (views into a bundle, transposed pools) are copied correctly."""
    skip_unless_kernel(op_impl, "copy_rows")
    bundle = torch.randn(2, 10, 8, 6)  # [component, blocks, block_size, D]
    src = bundle[1]  # contiguous view with an offset
    base = torch.zeros(8, 10, 6)
    dst = base.transpose(0, 1)  # [10, 8, 6] with non-contiguous block dims
    s, d = _slots(40, 80, 80)
    expected = dst.clone()
    reference_kernel("copy_rows")(src, expected, s, d)
    call_op(op_impl, "copy_rows", src, dst, s, d)
    assert torch.equal(dst, expected)
    rows_not_contig = torch.randn(10, 8, 6, 2)[..., 0]  # trailing dim strided: slow path
    dst2 = torch.zeros(10, 8, 6)
    expected2 = dst2.clone()
    reference_kernel("copy_rows")(rows_not_contig, expected2, s, d)
    call_op(op_impl, "copy_rows", rows_not_contig, dst2, s, d)
    assert torch.equal(dst2, expected2)


def test_copy_blocks_strided_blocks(op_impl: str) -> None:
    skip_unless_kernel(op_impl, "copy_blocks")
    src = torch.randn(6, 4, 3, 2)[:, :, :, 0]  # blocks not contiguous
    dst = torch.zeros(6, 4, 3)
    mapping = _mapping(6, 6, 6)
    expected = dst.clone()
    reference_kernel("copy_blocks")(src, expected, mapping)
    call_op(op_impl, "copy_blocks", src, dst, mapping)
    assert torch.equal(dst, expected)
    # Destination blocks whose dims do not merge (a permuted pool) and a 5-d block shape.
    src = torch.randn(5, 2, 3, 4, 5)
    base = torch.zeros(5, 5, 4, 3, 2)
    dst = base.permute(0, 4, 3, 2, 1)  # [5, 2, 3, 4, 5], every inner dim strided differently
    mapping = _mapping(4, 5, 5)
    expected = dst.clone()
    reference_kernel("copy_blocks")(src, expected, mapping)
    call_op(op_impl, "copy_blocks", src, dst, mapping)
    assert torch.equal(dst, expected)


def test_empty_calls_are_noops(op_impl: str) -> None:
    src, dst = torch.randn(4, 4, 8), torch.randn(4, 4, 8)
    before = dst.clone()
    call_op(op_impl, "copy_blocks", src, dst, torch.empty(0, 2, dtype=torch.int64))
    empty = torch.empty(0, dtype=torch.int64)
    call_op(op_impl, "copy_rows", src, dst, empty, empty)
    # zero-sized rows: valid slots, nothing to move
    call_op(op_impl, "copy_rows", src[..., :0], dst[..., :0], torch.tensor([1]), torch.tensor([2]))
    assert torch.equal(dst, before)


def test_cross_device_meta_fake_shapes() -> None:
    """The fake kernels accept meta tensors and run the structural checks."""
    src = torch.empty(4, 8, 16, device="meta")
    dst = torch.empty(2, 8, 16, device="meta")
    copy_blocks(src, dst, torch.zeros(1, 2, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match=r"copy_blocks.*trailing shapes"):
        copy_blocks(
            src, torch.empty(2, 8, 15, device="meta"), torch.zeros(1, 2, dtype=torch.int64, device="meta")
        )


# -------------------------------------------------------------------------------------------- opcheck


def _opcheck_cases():
    src = torch.randn(8, 4, 6)
    yield torch.ops.kvoffload.copy_blocks.default, (src, torch.zeros(5, 4, 6), _mapping(5, 8, 5))
    yield (
        torch.ops.kvoffload.copy_blocks.default,
        (src.bfloat16(), torch.zeros(3, 4, 6).bfloat16(), _mapping(0, 8, 3)),
    )
    s, d = _slots(12, 32, 20)
    yield torch.ops.kvoffload.copy_rows.default, (src, torch.zeros(4, 5, 6), s, d)
    s, d = _slots(3, 32, 3)
    yield (
        torch.ops.kvoffload.copy_rows.default,
        (src.to(torch.int8), torch.zeros(1, 3, 6, dtype=torch.int8), s, d),
    )


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: str(c[0]))
def test_opcheck(case) -> None:
    op, args = case
    torch.library.opcheck(op, args)


def test_opcheck_copy_blocks_streaming() -> None:
    src = torch.randn(8, 4, 8)
    op = torch.ops.kvoffload.copy_blocks.default
    torch.library.opcheck(op, (src, torch.zeros(5, 4, 8), _mapping(5, 8, 5)), {"streaming": True})


# -------------------------------------------------------------------------------------------- compile


def test_compile_fullgraph() -> None:
    def step(
        pool: torch.Tensor, hot: torch.Tensor, blocks: torch.Tensor, mapping, s, d
    ) -> tuple[torch.Tensor, ...]:
        copy_blocks(pool, blocks, mapping)
        copy_rows(pool, hot, s, d)
        return hot, blocks

    pool = torch.randn(16, 4, 8)
    mapping = _mapping(3, 16, 3)
    s, d = _slots(10, 64, 12)
    eager_hot, eager_blocks = torch.zeros(3, 4, 8), torch.zeros(3, 4, 8)
    compiled_hot, compiled_blocks = eager_hot.clone(), eager_blocks.clone()
    expected = step(pool, eager_hot, eager_blocks, mapping, s, d)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    got = compiled(pool, compiled_hot, compiled_blocks, mapping, s, d)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert torch.equal(compiled_hot, eager_hot)
    assert torch.equal(compiled_blocks, eager_blocks)


def test_compile_never_runs_on_aliased_clone() -> None:
    """Regression (pytorch#198031): a clone of the destination used as the source must stay a copy.

    torch 2.13's inductor drops the clone and calls the op with the same tensor twice; the kernels then
    snapshot the source, so the result still equals eager. Without that, rotating the blocks in place
    would smear block 0 over all of them.
    """

    def shift(x: torch.Tensor, mapping: torch.Tensor, s, d) -> torch.Tensor:
        src = x.clone()
        copy_blocks(src, x, mapping)
        src2 = x.clone()
        copy_rows(src2, x, s, d)
        return x

    x = torch.randn(6, 4, 5)
    mapping = torch.tensor([[i, (i + 1) % 6] for i in range(6)])  # rotate all blocks: aliasing shows
    s = torch.arange(24)
    d = (s + 5) % 24
    expected = shift(x.clone(), mapping, s, d)
    for backend in ("eager", "aot_eager", "inductor"):
        got = torch.compile(shift, fullgraph=True, backend=backend)(x.clone(), mapping, s, d)
        assert torch.equal(got, expected), backend


def test_aliased_source_is_read_before_the_write(any_impl: str) -> None:
    """A source sharing memory with the destination behaves as a clone taken before the call."""
    x = torch.randn(6, 4, 5)
    rotate = torch.tensor([[i, (i + 1) % 6] for i in range(6)])
    expected = x.clone()
    for i in range(6):  # independent: block i lands in block i + 1
        expected[(i + 1) % 6] = x[i]
    call_op(any_impl, "copy_blocks", x, x, rotate)
    assert torch.equal(x, expected)
    y = torch.randn(6, 4, 5)
    s, d = torch.arange(16), torch.arange(16) + 3  # overlapping views: rows shift by 3 inside y
    expected = y.clone()
    flat_expected, flat_y = expected.view(24, 5), y.view(24, 5)
    flat_expected[4 + 3 : 4 + 19] = flat_y[:16].clone()  # y[1:] starts 4 rows in
    call_op(any_impl, "copy_rows", y[:4], y[1:], s, d)
    assert torch.equal(y, expected)


# --------------------------------------------------------------------------------------------- errors

ERROR_CASES = [
    # (op, build args from (src, dst), exception, message fragment)
    (
        "copy_blocks",
        lambda s, d: (s, d, torch.tensor([[0, 0], [1, 0]])),
        ValueError,
        "'mapping\\[:, 1\\]' holds destination 0",
    ),
    (
        "copy_blocks",
        lambda s, d: (s, d, torch.tensor([[-1, 0]])),
        IndexError,
        "'mapping\\[:, 0\\]' entry 0 is -1",
    ),
    (
        "copy_blocks",
        lambda s, d: (s, d, torch.tensor([[0, 4]])),
        IndexError,
        "'mapping\\[:, 1\\]' entry 0 is 4",
    ),
    (
        "copy_blocks",
        lambda s, d: (s, d, torch.tensor([[0, 1]], dtype=torch.int32)),
        TypeError,
        "'mapping' must have dtype torch.int64",
    ),
    (
        "copy_blocks",
        lambda s, d: (s, d, torch.tensor([0, 1])),
        ValueError,
        "'mapping' must have exactly 2 dimensions",
    ),
    (
        "copy_blocks",
        lambda s, d: (s, d, torch.tensor([[0, 1, 2]])),
        ValueError,
        "'mapping' must have shape \\[n, 2\\]",
    ),
    (
        "copy_blocks",
        lambda s, d: (s, d[..., :3], torch.tensor([[0, 1]])),
        ValueError,
        "equal trailing shapes",
    ),
    ("copy_blocks", lambda s, d: (s, d.double(), torch.tensor([[0, 1]])), TypeError, "same dtype"),
    (
        "copy_rows",
        lambda s, d: (s, d, torch.tensor([0, 1]), torch.tensor([3, 3])),
        ValueError,
        "'dst_slots' holds destination 3",
    ),
    (
        "copy_rows",
        lambda s, d: (s, d, torch.tensor([0, -1]), torch.tensor([3, 4])),
        IndexError,
        "'src_slots' entry 1 is -1",
    ),
    (
        "copy_rows",
        lambda s, d: (s, d, torch.tensor([0]), torch.tensor([16])),
        IndexError,
        "'dst_slots' entry 0 is 16",
    ),
    ("copy_rows", lambda s, d: (s, d, torch.tensor([0]), torch.tensor([1, 2])), ValueError, "same length"),
    (
        "copy_rows",
        lambda s, d: (s, d, torch.tensor([[0]]), torch.tensor([[1]])),
        ValueError,
        "'src_slots' must have exactly 1",
    ),
    (
        "copy_rows",
        lambda s, d: (s, d, torch.tensor([0.0]), torch.tensor([1])),
        TypeError,
        "'src_slots' must have dtype",
    ),
    (
        "copy_rows",
        lambda s, d: (s[0, 0], d, torch.tensor([0]), torch.tensor([1])),
        ValueError,
        "'src' must have at least 2",
    ),
    (
        "copy_rows",
        lambda s, d: (s, d[:, :, :2], torch.tensor([0]), torch.tensor([1])),
        ValueError,
        "equal trailing shapes",
    ),
    ("copy_rows", lambda s, d: (s.half(), d, torch.tensor([0]), torch.tensor([1])), TypeError, "same dtype"),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda c: f"{c[0]}-{c[3][:30]}")
def test_bad_input_raises_and_leaves_dst_untouched(case, any_impl: str) -> None:
    name, build, exc, fragment = case
    src = torch.randn(8, 4, 5)
    dst = torch.randn(4, 4, 5)
    args = build(src, dst)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(exc, match=f"kvoffload::{name}: .*{fragment}"):
        call_op(any_impl, name, *args)
    assert torch.equal(args[1], before[1]), "destination modified by a rejected call"
    assert torch.equal(dst, before[1] if args[1] is dst else dst)


# -------------------------------------------------------------------------------------------- registry


@requires_cpp
def test_registry_lists_cpp_and_reference_kernels() -> None:
    infos = {info.name: info for info in ops.registered_ops()}
    for name in ("copy_blocks", "copy_rows"):
        assert {"CPU", "Meta", "CompositeExplicitAutograd"} <= set(infos[name].kernels)
        assert infos[name].schema.startswith("(Tensor src, Tensor(a!) dst")
    assert "kvoffload::copy_rows" in ops.format_registered_ops()


@pytest.mark.parametrize("offset_elems", [0, 4, 1], ids=["aligned32", "aligned16", "unaligned"])
def test_large_copy_rows_streaming_paths(offset_elems: int) -> None:
    """Copies over 8 MiB use streaming stores when destination rows are 32- or 16-byte aligned."""
    src = torch.randn(256, 128, 64)  # 8 MiB of fp32 rows of 256 bytes
    n = src.shape[0] * src.shape[1]
    flat = torch.zeros(n * 64 + offset_elems)
    dst = flat[offset_elems:].view(256, 128, 64)
    s = torch.randperm(n)
    d = torch.randperm(n)
    copy_rows(src, dst, s, d)
    assert torch.equal(dst.view(n, 64)[d], src.view(n, 64)[s])
    assert not flat[:offset_elems].any()


# ------------------------------------------------------------------------ destinations and index devices


def _copy_args(name: str, src: torch.Tensor, dst: torch.Tensor):
    if name == "copy_blocks":
        return (src, dst, torch.tensor([[0, 1], [2, 3]]))
    return (src, dst, torch.tensor([0, 5, 9]), torch.tensor([1, 6, 14]))


@pytest.mark.parametrize("name", ["copy_blocks", "copy_rows"])
@pytest.mark.parametrize(
    "case",
    [
        ("expanded", lambda: torch.randn(1, 4, 5).expand(4, 4, 5), "internal overlap"),
        ("stride0-block-dim", lambda: torch.randn(20).as_strided((4, 4, 5), (0, 5, 1)), "internal overlap"),
        ("stride0-row-dim", lambda: torch.randn(20).as_strided((4, 4, 5), (5, 0, 1)), "internal overlap"),
        # a row's elements overlap each other (as_strided over too little memory): a copy would smear
        (
            "overlapping-elements",
            lambda: torch.randn(96).as_strided((4, 4, 2, 3), (24, 6, 2, 1)),
            "internal overlap",
        ),
        (
            "leaf-requires-grad",
            lambda: torch.zeros(4, 4, 5, requires_grad=True),
            "is a leaf tensor that requires grad",
        ),
        ("requires-grad", lambda: torch.zeros(4, 4, 5, requires_grad=True) * 2, "requires grad"),
    ],
    ids=lambda c: c[0],
)
def test_bad_destination_raises_and_is_untouched(name: str, case, any_impl: str) -> None:
    """Destinations an in-place op cannot write correctly: several elements on one memory location
    (expanded / stride-0 / overlapping ``as_strided`` views) or a tensor autograd tracks (the op has no
    derivative). Every kernel refuses them before writing, naming the op and the argument."""
    _, make, fragment = case
    dst = make()
    src = torch.randn(8, *dst.shape[1:])
    args = _copy_args(name, src, dst)
    before = dst.detach().clone()
    with pytest.raises(ValueError, match=f"kvoffload::{name}: argument 'dst' .*{fragment}"):
        call_op(any_impl, name, *args)
    assert torch.equal(dst.detach(), before), "destination modified by a rejected call"
    # then a good call: the same copy into a plain tensor (or, for autograd, into the same one under no_grad)
    target = dst if dst.requires_grad else torch.zeros(dst.shape)
    with torch.no_grad():
        call_op(any_impl, name, *_copy_args(name, src, target))
    if name == "copy_blocks":
        assert torch.equal(target[1].detach(), src[0]) and torch.equal(target[3].detach(), src[2])
    else:
        assert torch.equal(target[0, 1].detach(), src[0, 0]) and torch.equal(target[3, 2].detach(), src[2, 1])


def test_overlapping_units_named_by_distinct_indices_are_accepted(any_impl: str) -> None:
    """An expanded (stride-0) view of a byte arena is refused; units that overlap each other (the arena
    viewed with a row starting at every byte) are a valid destination: only the elements inside one unit
    must be distinct, and the caller keeps the units it writes apart."""
    raw = torch.zeros(64, dtype=torch.uint8)
    src = torch.randint(1, 256, (3, 8), dtype=torch.uint8)
    with pytest.raises(ValueError, match="copy_blocks: argument 'dst' has internal overlap"):
        call_op(any_impl, "copy_blocks", src, raw[:8].expand(57, 8), torch.tensor([[0, 0]]))  # stride 0
    assert not raw.any()
    rows = raw.as_strided((57, 8), (1, 1))
    call_op(any_impl, "copy_blocks", src, rows, torch.tensor([[0, 0], [1, 8], [2, 40]]))
    assert torch.equal(raw[:16], torch.cat([src[0], src[1]])) and torch.equal(raw[40:48], src[2])


@pytest.mark.parametrize(
    ("name", "pos", "arg"),
    [("copy_blocks", 2, "mapping"), ("copy_rows", 2, "src_slots"), ("copy_rows", 3, "dst_slots")],
)
def test_index_tensor_on_another_device_raises(name: str, pos: int, arg: str, any_impl: str) -> None:
    """An index tensor on a device that is neither 'src''s, 'dst''s nor the CPU ('meta' here: with CPU
    data the dispatcher would otherwise pick the meta kernel and copy nothing) is refused by name."""
    src, dst = torch.randn(8, 4, 5), torch.randn(4, 4, 5)
    args = list(_copy_args(name, src, dst))
    args[pos] = args[pos].to("meta")
    before = dst.clone()
    with pytest.raises(
        ValueError, match=f"kvoffload::{name}: argument '{arg}' must be on the cpu .*got meta"
    ):
        call_op(any_impl, name, *args)
    assert torch.equal(dst, before)
    call_op(any_impl, name, *_copy_args(name, src, dst))  # the same call with CPU indices works
    assert not torch.equal(dst, before)
