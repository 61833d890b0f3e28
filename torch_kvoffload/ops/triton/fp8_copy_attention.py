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

__all__ = ["KERNELS", "fp8_scatter_copy_sparse_mla_attention"]


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
    if _device_readable(host_rows, work.device):
        _launch_miss_copy(
            host_rows,
            host_rows[..., :0],
            block_table,
            work,
            work[..., :0],
            miss_tokens,
            miss_slots,
            miss_count,
        )
    elif src.numel():  # pageable host memory: the row-copy op moves the missed rows
        torch.ops.kvoffload.copy_rows(host_rows, work, src, dst)
    R, C, W = work.shape
    rows = torch.arange(R, device=slots.device, dtype=torch.int32)[:, None]
    indices = torch.where(slots >= 0, slots + rows * C, -1)
    o = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    s = lse if lse.is_contiguous() else torch.empty_like(lse, memory_format=torch.contiguous_format)
    launch_fp8_sparse_mla_attention(q_nope, q_pe, work.view(R * C, W), indices, scale, o, s)
    if work is not hot_rows:
        hot_rows.copy_(work)
    if o is not out:
        out.copy_(o)
        lse.copy_(s)


KERNELS = {OP: fp8_scatter_copy_sparse_mla_attention}
