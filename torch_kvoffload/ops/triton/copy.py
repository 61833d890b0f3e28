"""Triton kernels of ``copy_blocks`` and ``copy_rows``.

Both ops move "units" (a block, or a token row) addressed by an index: unit ``u`` of a tensor
``[num_blocks, block_size, *row]`` starts at ``(u // unit_div) * stride(0) + (u % unit_div) * stride(1)``,
with ``unit_div = 1`` for whole blocks and ``unit_div = block_size`` for rows. The elements inside a unit
are walked through up to four (size, stride) dims, coalesced jointly for source and destination, so
views (bundle components, transposed pools, strided rows) are read and written in place. Elements are
moved as same-width integers, so any dtype copies bit for bit.

Launch grid: ``(units, chunks)``; each program copies ``BLOCK`` elements of one unit per step and strides
over the unit's chunks when it has more than the grid's second axis holds.

Cross-device copies: on CUDA a pinned host tensor is read or written in place by the kernel (the device
addresses pinned memory directly); any other mix of devices (pageable host memory, or Ascend, where
triton-ascend rejects host pointers) goes through the op's reference kernel, a host-side gather and one
transfer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops._registry import reference_kernel
from torch_kvoffload.ops.copy import validate_copy_blocks, validate_copy_rows
from torch_kvoffload.ops.triton import device_guard, require_launchable

__all__ = ["KERNELS", "launch_copy_rows", "triton_copy_blocks", "triton_copy_rows"]

#: Inner (per-unit) dims the kernel walks; layouts that do not coalesce to this many use the reference.
MAX_INNER_DIMS = 4
#: Elements each program moves per step.
MAX_BLOCK = 2048
#: Grid limit of CUDA's second axis.
MAX_GRID_1 = 65535

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_units_kernel(
    src_ptr,
    dst_ptr,
    src_idx_ptr,
    dst_idx_ptr,
    src_idx_stride,
    dst_idx_stride,
    src_div,
    dst_div,
    src_s0,
    src_s1,
    dst_s0,
    dst_s1,
    numel,
    n1,
    n2,
    n3,
    si0,
    si1,
    si2,
    si3,
    di0,
    di1,
    di2,
    di3,
    NDIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    unit = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    s_idx = tl.load(src_idx_ptr + unit.to(tl.int64) * src_idx_stride)
    d_idx = tl.load(dst_idx_ptr + unit.to(tl.int64) * dst_idx_stride)
    src_base = (s_idx // src_div) * src_s0 + (s_idx % src_div) * src_s1
    dst_base = (d_idx // dst_div) * dst_s0 + (d_idx % dst_div) * dst_s1
    lane = tl.arange(0, BLOCK).to(tl.int64)
    for start in range(chunk * BLOCK, numel, num_chunks * BLOCK):
        e = start + lane
        mask = e < numel
        if NDIM == 1:  # one coalesced dim, padded to the innermost slot
            s_off = e * si3
            d_off = e * di3
        else:
            # e = ((i0 * n1 + i1) * n2 + i2) * n3 + i3, innermost dim last
            i3 = e % n3
            r = e // n3
            i2 = r % n2
            r = r // n2
            i1 = r % n1
            i0 = r // n1
            s_off = i0 * si0 + i1 * si1 + i2 * si2 + i3 * si3
            d_off = i0 * di0 + i1 * di1 + i2 * di2 + i3 * di3
        v = tl.load(src_ptr + src_base + s_off, mask=mask)
        tl.store(dst_ptr + dst_base + d_off, v, mask=mask)


def _coalesce(shape: tuple[int, ...], s_strides: tuple[int, ...], d_strides: tuple[int, ...]):
    """Merge adjacent dims that are contiguous relative to each other in both tensors; drop size-1 dims.

    Returns ``(sizes, src_strides, dst_strides)`` outermost first, at least one dim.
    """
    dims = [(n, s, d) for n, s, d in zip(shape, s_strides, d_strides, strict=True) if n != 1]
    merged: list[list[int]] = []
    for n, s, d in dims:
        if merged and merged[-1][1] == s * n and merged[-1][2] == d * n:
            merged[-1] = [merged[-1][0] * n, s, d]
        else:
            merged.append([n, s, d])
    if not merged:
        merged = [[1, 1, 1]]
    sizes, ss, ds = zip(*merged, strict=True)
    return list(sizes), list(ss), list(ds)


def _as_bits(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed as a same-width integer tensor (same strides), or ``None`` for unusual widths."""
    bits = _BITS_DTYPE.get(t.element_size())
    if bits is None:
        return None
    return t if t.dtype == bits else t.view(bits)


def _widen(src: torch.Tensor, dst: torch.Tensor, lead: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors viewed with the widest integer element (up to 8 bytes) their layouts allow.

    Only the last dim changes size, so it must be a per-unit dim (beyond the ``lead`` addressing dims);
    :meth:`torch.Tensor.view` checks the rest (unit last stride, divisible sizes, strides and offsets).
    Wider elements mean fewer, wider memory accesses for the same bytes.
    """
    if src.dim() <= lead or src.stride(-1) != 1 or dst.stride(-1) != 1:
        return src, dst
    for width in (8, 4, 2):
        if width <= src.element_size():
            break
        try:
            return src.view(_BITS_DTYPE[width]), dst.view(_BITS_DTYPE[width])
        except RuntimeError:
            continue
    return src, dst


def _kernel_device(src: torch.Tensor, dst: torch.Tensor) -> torch.device | None:
    """Where the kernel runs, or ``None`` when the copy must take the staged (reference) path."""
    if src.device == dst.device:
        return dst.device
    host, dev = (src, dst) if src.device.type == "cpu" else (dst, src)
    if host.device.type == "cpu" and dev.device.type == "cuda" and host.is_pinned():
        return dev.device
    return None


def _launch(
    op: str,
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    src_div: int,
    dst_div: int,
    lead: int,
) -> bool:
    """Launch the unit copy; return ``False`` (nothing written) when the layout needs the reference path.

    ``lead`` is 1 for blocks, 2 for rows: the dims that address a unit.
    """
    device = _kernel_device(src, dst)
    if device is None:
        return False
    require_launchable(op, device)
    s_bits, d_bits = _as_bits(src), _as_bits(dst)
    if s_bits is None or d_bits is None:
        return False
    src, dst = _widen(s_bits, d_bits, lead)
    sizes, ss, ds = _coalesce(tuple(src.shape[lead:]), src.stride()[lead:], dst.stride()[lead:])
    if len(sizes) > MAX_INNER_DIMS:
        return False
    ndim = len(sizes)
    pad = MAX_INNER_DIMS - ndim
    sizes, ss, ds = [1] * pad + sizes, [0] * pad + ss, [0] * pad + ds
    numel = 1
    for n in sizes:
        numel *= n
    n_units = src_idx.shape[0]
    block = min(MAX_BLOCK, triton.next_power_of_2(max(numel, 16)))
    grid = (n_units, min(triton.cdiv(numel, block), MAX_GRID_1))
    src_idx = src_idx.to(device)
    dst_idx = dst_idx.to(device)
    s1 = src.stride(1) if lead == 2 else 0
    d1 = dst.stride(1) if lead == 2 else 0
    with device_guard(device):
        _copy_units_kernel[grid](
            src,
            dst,
            src_idx,
            dst_idx,
            src_idx.stride(0),
            dst_idx.stride(0),
            src_div,
            dst_div,
            src.stride(0),
            s1,
            dst.stride(0),
            d1,
            numel,
            sizes[1],
            sizes[2],
            sizes[3],
            *ss,
            *ds,
            NDIM=1 if ndim == 1 else MAX_INNER_DIMS,
            BLOCK=block,
        )
    return True


def triton_copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor, *, streaming: bool = False
) -> None:
    """Triton ``copy_blocks``: ``dst[mapping[i, 1]] = src[mapping[i, 0]]`` (contract of the op).

    ``src [num_src_blocks, *block_shape]``, ``dst [num_dst_blocks, *block_shape]`` (same dtype, mutated),
    ``mapping int64 [n, 2]``. ``streaming`` is accepted for the op's signature; on a device it is a plain
    copy (the result is the same either way).
    """
    validate_copy_blocks(src, dst, mapping)
    if mapping.shape[0] == 0 or src[0].numel() == 0:
        return
    src = _checks.unaliased_source(src, dst)
    if not _launch("copy_blocks", src, dst, mapping[:, 0], mapping[:, 1], 1, 1, lead=1):
        reference_kernel("copy_blocks")(src, dst, mapping, streaming=streaming)


def triton_copy_rows(
    src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Triton ``copy_rows``: ``dst.row(dst_slots[i]) = src.row(src_slots[i])`` (contract of the op).

    ``src [num_src_blocks, src_block_size, *row]``, ``dst [num_dst_blocks, dst_block_size, *row]`` (same
    dtype, mutated), ``src_slots`` / ``dst_slots`` ``int64 [n]`` with ``slot = block * block_size + offset``.
    """
    validate_copy_rows(src, dst, src_slots, dst_slots)
    if src_slots.shape[0] == 0 or src[0, 0].numel() == 0:
        return
    src = _checks.unaliased_source(src, dst)
    if not _launch("copy_rows", src, dst, src_slots, dst_slots, src.shape[1], dst.shape[1], lead=2):
        reference_kernel("copy_rows")(src, dst, src_slots, dst_slots)


def launch_copy_rows(
    src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """``copy_rows`` without the value checks, for callers that built valid slots themselves.

    Same contract as :func:`triton_copy_rows`, but the slots are not read back (no host
    synchronisation): ``src_slots`` / ``dst_slots`` must be in range, distinct in ``dst`` and on the kernel's
    device, and ``src`` must not overlap ``dst``. Layouts the kernel does not walk go through the op's
    reference kernel (which synchronises).
    """
    if src_slots.shape[0] == 0 or src[0, 0].numel() == 0:
        return
    if not _launch("copy_rows", src, dst, src_slots, dst_slots, src.shape[1], dst.shape[1], lead=2):
        reference_kernel("copy_rows")(src, dst, src_slots, dst_slots)


KERNELS = {"copy_blocks": triton_copy_blocks, "copy_rows": triton_copy_rows}
