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
from torch_kvoffload.ops._registry import define_op
from torch_kvoffload.ops.fp8 import TILE, kv_row_bytes
from torch_kvoffload.ops.fp8_attention import _reference as fp8_attention_reference
from torch_kvoffload.ops.sparse_attention import (
    _check_devices,
    _check_index_range,
    _check_queries,
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
    _check_queries(OP, q_nope, q_pe)
    dc, dr = q_nope.shape[-1], q_pe.shape[-1]
    if dc % TILE or dc == 0:
        _checks.fail(
            OP,
            f"argument 'q_nope' must have a latent width (Dc) that is a positive multiple of {TILE} (one fp32 "
            f"scale per {TILE} values of an FP8 row), got shape {list(q_nope.shape)}",
        )
    want = kv_row_bytes(dc, dr)
    for arg, t in (("host_rows", host_rows), ("hot_rows", hot_rows)):
        _checks.check_dtype(OP, arg, t, (torch.uint8,))
        _checks.check_dim(OP, arg, t, 3)
        if t.shape[-1] != want:
            _checks.fail(
                OP,
                f"argument '{arg}' must have {want} bytes per row (Dc {dc} fp8 values, {dc // TILE} fp32 "
                f"scales, Dr {dr} bf16 RoPE values), got shape {list(t.shape)}",
            )
    rows = q_nope.shape[0]
    for arg, t, dim in (
        ("block_table", block_table, 2),
        ("miss_tokens", miss_tokens, 2),
        ("miss_slots", miss_slots, 2),
        ("miss_count", miss_count, 1),
        ("slots", slots, 2),
    ):
        _checks.check_dtype(OP, arg, t, (torch.int32,))
        _checks.check_dim(OP, arg, t, dim)
        if t.shape[0] != rows:
            _checks.fail(
                OP, f"argument '{arg}' must have {rows} rows (R of 'q_nope'), got shape {list(t.shape)}"
            )
    if hot_rows.shape[0] != rows:
        _checks.fail(
            OP, f"argument 'hot_rows' must have {rows} rows (R of 'q_nope'), got shape {list(hot_rows.shape)}"
        )
    if miss_slots.shape != miss_tokens.shape:
        _checks.fail(
            OP,
            f"argument 'miss_slots' must have the shape of 'miss_tokens' {list(miss_tokens.shape)}, "
            f"got {list(miss_slots.shape)}",
        )
    _checks.check_same_dtype(OP, "q_nope", q_nope, "out", out)
    if out.shape != q_nope.shape:
        _checks.fail(
            OP, f"argument 'out' must have shape {list(q_nope.shape)} (as 'q_nope'), got {list(out.shape)}"
        )
    _checks.check_dtype(OP, "lse", lse, (torch.float32,))
    if lse.shape != q_nope.shape[:2]:
        _checks.fail(
            OP, f"argument 'lse' must have shape {list(q_nope.shape[:2])} ([R, H]), got {list(lse.shape)}"
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
    width = hot_rows.shape[-1]
    if src.numel():
        flat = hot_rows.view(-1, width) if hot_rows.is_contiguous() else hot_rows.reshape(-1, width)
        flat[dst.to(hot_rows.device)] = host_rows.reshape(-1, width)[src.to(host_rows.device)].to(
            hot_rows.device
        )
        if not hot_rows.is_contiguous():
            hot_rows.copy_(flat.view(hot_rows.shape))
    capacity = hot_rows.shape[1]
    rows = torch.arange(slots.shape[0], device=slots.device, dtype=torch.int32)[:, None]
    indices = torch.where(slots >= 0, slots + rows * capacity, -1)
    o, s = fp8_attention_reference(q_nope, q_pe, hot_rows.reshape(-1, width), indices, scale)
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
