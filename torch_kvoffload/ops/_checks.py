"""Argument checks shared by the Python kernels (fake and reference) of every op.

Messages follow one pattern — ``kvoffload::<op>: argument '<name>' <expected>, got <actual>`` — and the
exception types follow the C++ kernels: ``ValueError`` for shapes, devices and duplicated destinations,
``TypeError`` for dtypes, ``IndexError`` for out-of-range indices. Structural checks only read shapes and
dtypes, so fake kernels call them too; value checks read the data and run in real kernels only.
"""

from __future__ import annotations

import torch


def fail(op: str, message: str, exc: type[Exception] = ValueError) -> None:
    raise exc(f"kvoffload::{op}: {message}")


def check_dtype(op: str, arg: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        fail(op, f"argument '{arg}' must have dtype {expected}, got {t.dtype}", TypeError)


def check_dim(op: str, arg: str, t: torch.Tensor, dim: int, *, at_least: bool = False) -> None:
    if (t.dim() < dim) if at_least else (t.dim() != dim):
        expected = f"at least {dim}" if at_least else f"exactly {dim}"
        fail(op, f"argument '{arg}' must have {expected} dimensions, got shape {list(t.shape)}")


def check_same_dtype(op: str, a: str, ta: torch.Tensor, b: str, tb: torch.Tensor) -> None:
    if ta.dtype != tb.dtype:
        fail(op, f"'{a}' and '{b}' must have the same dtype, got {ta.dtype} and {tb.dtype}", TypeError)


def check_range(op: str, arg: str, idx: torch.Tensor, limit: int) -> None:
    """Every entry of ``idx`` lies in ``[0, limit)``."""
    if idx.numel() == 0:
        return
    bad = ((idx < 0) | (idx >= limit)).nonzero()
    if bad.numel():
        i = int(bad[0, 0]) if bad.dim() > 1 else int(bad[0])
        fail(
            op,
            f"argument '{arg}' entry {i} is {int(idx.flatten()[i])}, expected a value in [0, {limit})",
            IndexError,
        )


def check_unique(op: str, arg: str, idx: torch.Tensor) -> None:
    """No value occurs twice in ``idx`` (destinations of one call must be distinct)."""
    if idx.numel() < 2:
        return
    values, counts = torch.unique(idx, return_counts=True)
    dup = values[counts > 1]
    if dup.numel():
        fail(
            op,
            f"argument '{arg}' holds destination {int(dup[0])} more than once; destinations must be distinct",
        )


def _symbolic(t: torch.Tensor) -> bool:
    return any(isinstance(x, torch.SymInt) for x in (*t.shape, *t.stride()))


def units_self_overlap(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether two elements of a ``(sizes, strides)`` layout may share memory.

    Sorted by stride, each dim must step past everything the smaller dims reach; every slice and
    permutation of a dense tensor passes, so only ``as_strided`` views over too little memory fail.
    """
    if 0 in sizes:
        return False
    reach = 0
    for stride, size in sorted((abs(st), n) for n, st in zip(sizes, strides, strict=True) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def check_destination(op: str, arg: str, t: torch.Tensor, lead_dims: int) -> None:
    """``t`` can be written in place by an op that addresses its units (blocks, rows) by the first
    ``lead_dims`` dims.

    Refused, as PyTorch's in-place ops refuse them: a dim of stride 0 (an expanded tensor: several
    elements on one memory location, ``at::has_internal_overlap``), and a tensor that requires grad while
    grad mode is on (the ops have no derivative: autograd would silently ignore the write). Also refused:
    units whose own elements overlap. Distinct units may overlap each other (a byte arena viewed with a row
    starting at every byte): the caller keeps the units it writes apart.
    """
    if not _symbolic(t) and (
        torch._debug_has_internal_overlap(t) == 1
        or units_self_overlap(tuple(t.shape[lead_dims:]), t.stride()[lead_dims:])
    ):
        fail(
            op,
            f"argument '{arg}' has internal overlap: more than one of its elements refers to the same memory "
            f"location (shape {list(t.shape)}, strides {list(t.stride())}), so writes into it would "
            "overwrite each other; clone() it first",
        )
    if t.requires_grad and torch.is_grad_enabled():
        what = "is a leaf tensor that requires grad" if t.is_leaf else "requires grad"
        fail(
            op,
            f"argument '{arg}' {what}; the op writes it in place and has no derivative: write under "
            "torch.no_grad() or into a tensor that does not require grad",
        )


def check_index_device(op: str, arg: str, idx: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """An index tensor lives on the CPU or on the device of ``src`` or ``dst`` (a kernel reads it there)."""
    if idx.device not in (torch.device("cpu"), src.device, dst.device):
        fail(
            op,
            f"argument '{arg}' must be on the cpu or on the device of 'src' ({src.device}) or 'dst' "
            f"({dst.device}), got {idx.device}",
        )


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def may_overlap(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``src`` and ``dst`` may share bytes (same storage, intersecting byte ranges)."""
    if src.device != dst.device or src.numel() == 0 or dst.numel() == 0:
        return False
    if src.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr():
        return False
    s0, s1 = _byte_span(src)
    d0, d1 = _byte_span(dst)
    return s0 < d1 and d0 < s1


def unaliased_source(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``src``, or a snapshot of it when it shares memory with ``dst``: an op never reads what it writes.

    The result is as if ``src`` had been cloned before the call — the program a compiler meant when it
    dropped such a clone (pytorch#198031).
    """
    return src.clone() if may_overlap(src, dst) else src
