"""Block and row copies between paged caches: the transfer primitives of every offload path.

``copy_blocks`` moves whole blocks (layer save / load between a device buffer and the host pool);
``copy_rows`` moves single token rows (new-token device→host appends, missed-row host→device loads).
Source and destination may live on different devices; on CPU a C++ kernel parallelises over rows and
releases the GIL so copies submitted to a transfer stream overlap Python-side compute.
"""

from __future__ import annotations

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops._registry import define_op

__all__ = ["copy_blocks", "copy_rows", "validate_copy_blocks", "validate_copy_rows"]


def _check_pair(op: str, lead_dims: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    _checks.check_dim(op, "src", src, lead_dims, at_least=True)
    _checks.check_dim(op, "dst", dst, lead_dims, at_least=True)
    if src.shape[lead_dims:] != dst.shape[lead_dims:]:
        _checks.fail(
            op,
            f"'src' and 'dst' must have equal trailing shapes after dim {lead_dims - 1}, "
            f"got {list(src.shape)} and {list(dst.shape)}",
        )
    _checks.check_same_dtype(op, "src", src, "dst", dst)
    _checks.check_destination(op, "dst", dst, lead_dims)


# ----------------------------------------------------------------------------------------- copy_blocks


def _copy_blocks_structure(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
    op = "copy_blocks"
    _check_pair(op, 1, src, dst)
    _checks.check_dtype(op, "mapping", mapping, (torch.int64,))
    _checks.check_dim(op, "mapping", mapping, 2)
    if mapping.shape[1] != 2:
        _checks.fail(
            op,
            f"argument 'mapping' must have shape [n, 2] of (src_block, dst_block), got {list(mapping.shape)}",
        )
    _checks.check_index_device(op, "mapping", mapping, src, dst)


def validate_copy_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor) -> None:
    """Every check of ``copy_blocks`` (structure, then index values); run by each kernel before writing."""
    op = "copy_blocks"
    _copy_blocks_structure(src, dst, mapping)
    _checks.check_range(op, "mapping[:, 0]", mapping[:, 0], src.shape[0])
    _checks.check_range(op, "mapping[:, 1]", mapping[:, 1], dst.shape[0])
    _checks.check_unique(op, "mapping[:, 1]", mapping[:, 1])


def _copy_blocks_fake(
    src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor, *, streaming: bool = False
) -> None:
    _copy_blocks_structure(src, dst, mapping)


def _copy_blocks_reference(
    src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor, *, streaming: bool = False
) -> None:
    # ``streaming`` only changes how a kernel writes (cache-bypassing stores), never what it writes
    validate_copy_blocks(src, dst, mapping)
    if mapping.shape[0] == 0:
        return
    src = _checks.unaliased_source(src, dst)
    blocks = src[mapping[:, 0].to(src.device)]
    dst[mapping[:, 1].to(dst.device)] = blocks.to(dst.device)


_copy_blocks_op = define_op(
    "copy_blocks",
    "(Tensor src, Tensor(a!) dst, Tensor mapping, *, bool streaming=False) -> ()",
    fake=_copy_blocks_fake,
    reference=_copy_blocks_reference,
)


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor, *, streaming: bool = False
) -> None:
    """Copy whole blocks ``dst[mapping[i, 1]] = src[mapping[i, 0]]``.

    Parameters
    ----------
    src : Tensor
        ``[num_src_blocks, *block_shape]``, any dtype, any device.
    dst : Tensor
        ``[num_dst_blocks, *block_shape]``, same dtype as ``src``; mutated in place.
    mapping : Tensor
        ``int64 [n, 2]`` of ``(src_block, dst_block)`` pairs; destination blocks must be distinct.
    streaming : bool
        A hint for destinations that will not be read soon (e.g. writes into a host pool): the CPU
        kernel writes contiguous blocks whose address is 16- or 32-byte aligned with streaming
        (non-temporal) stores, which bypass the caches, so the copy neither reads the destination
        lines first nor evicts what other threads keep in the cache. The result is the same.

    Raises ``ValueError`` / ``TypeError`` / ``IndexError`` naming the argument when shapes, dtypes or
    indices are wrong, when ``dst`` has internal overlap (a stride-0 / expanded dim, or a unit whose own
    elements share memory) or requires grad while grad mode is on (the op has no derivative), or when an
    index tensor is on another device than the CPU, ``src``'s or ``dst``'s; ``dst`` is then left untouched. A ``src`` that shares memory with ``dst`` is read
    as it was before the call (the kernel snapshots it), never while being written.

    Example
    -------
    >>> host = torch.randn(16, 128, 576)
    >>> dev = torch.empty(4, 128, 576)
    >>> copy_blocks(host, dev, torch.tensor([[3, 0], [7, 1]]))
    """
    _copy_blocks_op(src, dst, mapping, streaming=streaming)


# ------------------------------------------------------------------------------------------- copy_rows


def _copy_rows_structure(
    src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    op = "copy_rows"
    _check_pair(op, 2, src, dst)
    for arg, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        _checks.check_dtype(op, arg, t, (torch.int64,))
        _checks.check_dim(op, arg, t, 1)
        _checks.check_index_device(op, arg, t, src, dst)
    if src_slots.shape[0] != dst_slots.shape[0]:
        _checks.fail(
            op,
            f"'src_slots' and 'dst_slots' must have the same length, got {src_slots.shape[0]} and {dst_slots.shape[0]}",
        )


def validate_copy_rows(
    src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Every check of ``copy_rows`` (structure, then slot values); run by each kernel before writing."""
    op = "copy_rows"
    _copy_rows_structure(src, dst, src_slots, dst_slots)
    _checks.check_range(op, "src_slots", src_slots, src.shape[0] * src.shape[1])
    _checks.check_range(op, "dst_slots", dst_slots, dst.shape[0] * dst.shape[1])
    _checks.check_unique(op, "dst_slots", dst_slots)


def _copy_rows_fake(
    src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    _copy_rows_structure(src, dst, src_slots, dst_slots)


def _copy_rows_reference(
    src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    validate_copy_rows(src, dst, src_slots, dst_slots)
    src_bs, dst_bs = src.shape[1], dst.shape[1]
    if src_slots.shape[0] == 0:
        return
    src = _checks.unaliased_source(src, dst)
    s = src_slots.to(src.device)
    d = dst_slots.to(dst.device)
    rows = src[s // src_bs, s % src_bs]
    dst[d // dst_bs, d % dst_bs] = rows.to(dst.device)


_copy_rows_op = define_op(
    "copy_rows",
    "(Tensor src, Tensor(a!) dst, Tensor src_slots, Tensor dst_slots) -> ()",
    fake=_copy_rows_fake,
    reference=_copy_rows_reference,
)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy token rows between paged caches: ``dst.row(dst_slots[i]) = src.row(src_slots[i])``.

    A slot addresses one token row: ``slot = block * block_size + offset``, where ``block_size`` is dim 1
    of each tensor (the two block sizes may differ, e.g. a host pool of 128-token blocks and a hot buffer
    ``[rows, capacity, D]``).

    Parameters
    ----------
    src : Tensor
        ``[num_src_blocks, src_block_size, *row_shape]``, any dtype, any device.
    dst : Tensor
        ``[num_dst_blocks, dst_block_size, *row_shape]``, same dtype; mutated in place.
    src_slots, dst_slots : Tensor
        ``int64 [n]``; destination slots must be distinct.

    Raises ``ValueError`` / ``TypeError`` / ``IndexError`` naming the argument when shapes, dtypes or
    indices are wrong, when ``dst`` has internal overlap (a stride-0 / expanded dim, or a unit whose own
    elements share memory) or requires grad while grad mode is on (the op has no derivative), or when an
    index tensor is on another device than the CPU, ``src``'s or ``dst``'s; ``dst`` is then left untouched. A ``src`` that shares memory with ``dst`` is read
    as it was before the call (the kernel snapshots it), never while being written.

    Example
    -------
    >>> pool = torch.randn(64, 128, 576, dtype=torch.bfloat16)   # host pool, 128-token blocks
    >>> hot = torch.zeros(2, 4096, 576, dtype=torch.bfloat16)    # per-row hot buffer
    >>> copy_rows(pool, hot, torch.tensor([5, 900]), torch.tensor([0, 4097]))
    """
    _copy_rows_op(src, dst, src_slots, dst_slots)
