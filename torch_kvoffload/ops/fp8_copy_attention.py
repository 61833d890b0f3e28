"""Copy-SFA over FP8 latent rows: load the missed rows' bytes host→hot buffer, then sparse MLA attention over
the hot buffer's rows dequantized.

``fp8_scatter_copy_sparse_mla_attention`` is
:func:`~torch_kvoffload.ops.sparse_attention.scatter_copy_sparse_mla_attention` for a host pool and hot
buffers of FP8 rows (``uint8 [.., Dc + 4 * Dc / 128 + 2 * Dr]``, the format of :mod:`torch_kvoffload.ops.fp8`):
each missed row moves as its bytes (one copy, no separate RoPE part), then each decode row attends over
``hot_rows[r, slots[r]]`` as :func:`~torch_kvoffload.ops.fp8_attention.fp8_sparse_mla_attention` does. The
miss list is checked exactly as Copy-SFA checks it (:func:`~torch_kvoffload.ops.sparse_attention.
check_copy_sfa_misses`), every check before the first write.

Op (a fake kernel, the reference below, a C++ CPU kernel and a Triton kernel):
``fp8_scatter_copy_sparse_mla_attention(q_nope [R, H, Dc], q_pe [R, H, Dr], host_rows uint8 [num_blocks,
block_size, W], block_table int32 [R, max_blocks], hot_rows uint8 [R, C, W] (written), miss_tokens int32 [R,
M], miss_slots int32 [R, M], miss_count int32 [R], slots int32 [R, K], scale, out [R, H, Dc] (written), lse
fp32 [R, H] (written)) -> ()``.
"""

from __future__ import annotations

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops import sparse_attention_reference as ref
from torch_kvoffload.ops._registry import define_op
from torch_kvoffload.ops.fp8_attention import _reference as fp8_attention_reference
from torch_kvoffload.ops.fp8_attention import check_fp8_queries, check_fp8_rows
from torch_kvoffload.ops.sparse_attention import (
    _check_devices,
    _check_index_range,
    check_copy_sfa_lists,
    copy_sfa_miss_slots,
)

__all__ = [
    "fp8_scatter_copy_sparse_mla_attention",
    "validate_fp8_copy_sfa",
    "validate_fp8_copy_sfa_structure",
]

OP = "fp8_scatter_copy_sparse_mla_attention"


def _structure(
    q_nope, q_pe, host_rows, block_table, hot_rows, miss_tokens, miss_slots, miss_count, slots, out, lse
) -> None:
    check_fp8_queries(OP, q_nope, q_pe)
    for arg, t in (("host_rows", host_rows), ("hot_rows", hot_rows)):
        check_fp8_rows(OP, arg, t, 3, q_nope, q_pe)
    check_copy_sfa_lists(
        OP, q_nope, "hot_rows", hot_rows, block_table, miss_tokens, miss_slots, miss_count, slots, out, lse
    )
    # the host pool is read where it lives (pinned CPU memory while the hot buffers sit on the accelerator)
    _check_devices(OP, q_nope, {"q_pe": q_pe, "hot_rows": hot_rows, "slots": slots, "out": out, "lse": lse})


def validate_fp8_copy_sfa_structure(
    q_nope, q_pe, host_rows, block_table, hot_rows, miss_tokens, miss_slots, miss_count, slots, out, lse
) -> None:
    """The op's structural checks (shapes, dtypes, devices; no values): for callers whose miss lists come
    from their own residency kernel (the device step's unchecked launches)."""
    _structure(
        q_nope, q_pe, host_rows, block_table, hot_rows, miss_tokens, miss_slots, miss_count, slots, out, lse
    )


def validate_fp8_copy_sfa(
    q_nope, q_pe, host_rows, block_table, hot_rows, miss_tokens, miss_slots, miss_count, slots, out, lse
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every check of the op (structure, the miss list, the slots' range); returns the flat ``int64`` host
    and hot slots of the valid misses (:func:`~torch_kvoffload.ops.sparse_attention.copy_sfa_miss_slots`)."""
    _structure(
        q_nope, q_pe, host_rows, block_table, hot_rows, miss_tokens, miss_slots, miss_count, slots, out, lse
    )
    src, dst = copy_sfa_miss_slots(OP, host_rows, block_table, hot_rows, miss_tokens, miss_slots, miss_count)
    _check_index_range(OP, "slots", slots, hot_rows.shape[1])
    return src, dst


def _fake(
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
    _structure(
        q_nope, q_pe, host_rows, block_table, hot_rows, miss_tokens, miss_slots, miss_count, slots, out, lse
    )


def _reference(
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
    src, dst = validate_fp8_copy_sfa(
        q_nope, q_pe, host_rows, block_table, hot_rows, miss_tokens, miss_slots, miss_count, slots, out, lse
    )
    # the inputs that share memory with a written tensor are read as they were
    host_rows = _checks.unaliased_source(host_rows, hot_rows)
    q_nope = _checks.unaliased_source(_checks.unaliased_source(q_nope, out), lse)
    q_pe = _checks.unaliased_source(_checks.unaliased_source(q_pe, out), lse)
    ref.copy_miss_rows(host_rows, host_rows[..., :0], hot_rows, hot_rows[..., :0], src, dst)  # no RoPE part
    capacity = hot_rows.shape[1]
    rows = torch.arange(slots.shape[0], device=slots.device, dtype=torch.int32)[:, None]
    indices = torch.where(slots >= 0, slots + rows * capacity, -1)
    o, s = fp8_attention_reference(q_nope, q_pe, hot_rows.reshape(-1, hot_rows.shape[-1]), indices, scale)
    out.copy_(o)
    lse.copy_(s)


_op = define_op(
    OP,
    "(Tensor q_nope, Tensor q_pe, Tensor host_rows, Tensor block_table, Tensor(a!) hot_rows, Tensor miss_tokens, "
    "Tensor miss_slots, Tensor miss_count, Tensor slots, float scale, Tensor(b!) out, Tensor(c!) lse) -> ()",
    fake=_fake,
    reference=_reference,
)


def fp8_scatter_copy_sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    host_rows: torch.Tensor,
    block_table: torch.Tensor,
    hot_rows: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Copy-SFA over FP8 rows (see the module docstring): the first ``miss_count[r]`` misses of row ``r``
    (logical token ``miss_tokens[r, i]`` of the row's ``block_table``) are copied to ``hot_rows[r,
    miss_slots[r, i]]``, then ``out[r]`` / ``lse[r]`` are the attention of ``q_nope[r]`` / ``q_pe[r]`` over
    ``hot_rows[r, slots[r]]`` dequantized (``−1`` slots skipped).

    ``q_nope [R, H, Dc]`` / ``q_pe [R, H, Dr]`` fp32 or bf16 (``Dc`` a multiple of 128); ``host_rows uint8
    [num_blocks, block_size, W]`` on any device; ``hot_rows uint8 [R, C, W]``, ``W = Dc + 4 * Dc / 128 + 2 *
    Dr``. ``ValueError`` / ``TypeError`` / ``IndexError`` naming the argument before anything is written.
    """
    _op(
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
    )
