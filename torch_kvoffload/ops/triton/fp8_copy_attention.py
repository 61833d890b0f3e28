"""Triton kernel of ``kvoffload::fp8_scatter_copy_sparse_mla_attention`` (Copy-SFA over FP8 rows).

Two launches, no read-back: the miss copy of the floating Copy-SFA (``_copy_miss_rows_kernel``: a missed row
is ``W`` bytes here, the rotary part empty) into ``hot_rows``, then the FP8 attention kernel over the hot
buffer viewed as ``[R * C, W]`` rows with row ``r``'s slots offset by ``r * C`` (computed on the device).
A host pool the kernels cannot read in place (pageable memory on CUDA) is copied with the row-copy op
after the miss list was checked, as the floating op does.
"""

from __future__ import annotations

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops.fp8_copy_attention import OP, validate_fp8_copy_sfa
from torch_kvoffload.ops.triton import require_launchable
from torch_kvoffload.ops.triton.fp8 import _check_byte_order
from torch_kvoffload.ops.triton.fp8_attention import launch_fp8_sparse_mla_attention
from torch_kvoffload.ops.triton.sparse_attention import _device_readable, _launch_miss_copy

__all__ = ["KERNELS", "fp8_scatter_copy_sparse_mla_attention", "launch_fp8_scatter_copy_sparse_mla_attention"]


def fp8_scatter_copy_sparse_mla_attention(
    q_nope,
    q_pe,
    host_rows,
    block_table,
    hot_rows,
    miss_tokens,
    miss_slots,
    miss_count,
    slots,
    scale,
    out,
    lse,
) -> None:
    """Triton ``kvoffload::fp8_scatter_copy_sparse_mla_attention`` (same arguments, contract and errors)."""
    src, dst = validate_fp8_copy_sfa(
        q_nope, q_pe, host_rows, block_table, hot_rows, miss_tokens, miss_slots, miss_count, slots, out, lse
    )
    require_launchable(OP, q_nope.device)
    _check_byte_order(OP)
    # the inputs that share memory with a written tensor are read as they were
    host_rows = _checks.unaliased_source(host_rows, hot_rows)
    q_nope = _checks.unaliased_source(_checks.unaliased_source(q_nope, out), lse)
    q_pe = _checks.unaliased_source(_checks.unaliased_source(q_pe, out), lse)
    work = hot_rows if hot_rows.is_contiguous() else hot_rows.contiguous()
    o = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    s = lse if lse.is_contiguous() else torch.empty_like(lse, memory_format=torch.contiguous_format)
    if _device_readable(host_rows, work.device):
        launch_fp8_scatter_copy_sparse_mla_attention(
            q_nope,
            q_pe,
            host_rows,
            block_table,
            work,
            miss_tokens,
            miss_slots,
            miss_count,
            slots,
            scale,
            o,
            s,
        )
    else:  # pageable host memory: the row-copy op moves the missed rows, then the attention
        if src.numel():
            torch.ops.kvoffload.copy_rows(host_rows, work, src, dst)
        _attend(q_nope, q_pe, work, slots, scale, o, s)
    if work is not hot_rows:
        hot_rows.copy_(work)
    if o is not out:
        out.copy_(o)
        lse.copy_(s)


def _attend(q_nope, q_pe, hot_rows, slots, scale, out, lse) -> None:
    """The FP8 attention of row ``t`` over ``hot_rows[t, slots[t]]``, as one ``[N, W]`` tensor of rows with
    absolute indices: the flat buffer itself when ``hot_rows`` expands one over the rows (row stride 0, the
    slots already offset into it), else ``T * C`` rows with row ``t``'s slots offset by ``t * C``."""
    T, C, W = hot_rows.shape
    if hot_rows.stride(0) == 0:
        flat, indices = hot_rows[0], slots
    else:
        flat = hot_rows.reshape(T * C, W)  # a view of a contiguous slice (a copy is only read)
        rows = torch.arange(T, device=slots.device, dtype=torch.int32)[:, None]
        indices = torch.where(slots >= 0, slots + rows * C, -1)
    launch_fp8_sparse_mla_attention(q_nope, q_pe, flat, indices, scale, out, lse)


def launch_fp8_scatter_copy_sparse_mla_attention(
    q_nope,
    q_pe,
    host_rows,
    block_table,
    hot_rows,
    miss_tokens,
    miss_slots,
    miss_count,
    slots,
    scale,
    out,
    lse,
) -> None:
    """Copy-SFA over FP8 rows of validated, unaliased input (the op's contract, none of its checks; nothing
    read back), for a caller whose miss lists come from its own residency kernel. ``host_rows`` must be
    readable in place (pinned memory on CUDA, CPU tensors under the interpreter); ``hot_rows [T, C, W]``
    a slice of rows or one flat buffer expanded over the rows (row stride 0) with ``miss_slots`` and
    ``slots`` already offset into it; ``out`` / ``lse`` contiguous."""
    _launch_miss_copy(
        host_rows,
        host_rows[..., :0],
        block_table,
        hot_rows,
        hot_rows[..., :0],
        miss_tokens,
        miss_slots,
        miss_count,
    )
    _attend(q_nope, q_pe, hot_rows, slots, scale, out, lse)


KERNELS = {OP: fp8_scatter_copy_sparse_mla_attention}
