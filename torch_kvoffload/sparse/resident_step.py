"""The decode step of requests whose latent KV is resident in a device block pool (hybrid sparse attention):
after the lightning indexer's top-k over the device indexer cache (``IndexerView.select``), sparse MLA
attention over the selected rows in place. The same ops, and so the same arithmetic per query, as
resident sparse attention.

Shapes: ``R`` decode rows (one query each), ``K`` top-k, ``H`` heads, ``Dc`` / ``Dr`` latent / rotary
widths; flat block rows index the pool's ``[num_blocks * block_size, ·]`` tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torch_kvoffload.kv.backend import IndexerView, Queries, SelectedRows
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.ops.fp8_attention import dequantize_rows, fp8_sparse_mla_attention
from torch_kvoffload.ops.sparse_attention import sparse_mla_attention
from torch_kvoffload.sparse.device_blocks import DeviceBlocks

__all__ = [
    "ResidentInputs", "block_rows", "merge_selected", "resident_attention", "resident_decode",
    "resident_selected", "split_new_rows",
]  # fmt: skip


@dataclass(frozen=True)
class ResidentInputs:
    """A decode forward's inputs of its resident rows, the same for every layer: ``pick`` / ``host_pick``
    (int64: the batch rows of resident / offloaded requests), ``index_table`` (their indexer-cache blocks),
    ``cu`` (int32 ``[R + 1]``: one query each), ``lens`` (their rows), ``table`` (int64 ``[R, M]``: their
    latent blocks)."""

    pick: torch.Tensor
    host_pick: torch.Tensor
    index_table: torch.Tensor
    cu: torch.Tensor
    lens: torch.Tensor
    table: torch.Tensor

    @classmethod
    def of(
        cls, fwd: ForwardPlan, blocks: DeviceBlocks, index_table: torch.Tensor, resident: Sequence[int],
        offloaded: Sequence[int],
    ) -> ResidentInputs:  # fmt: skip
        """Of the batch rows ``resident`` of ``fwd`` (``index_table``: every row's indexer blocks)."""
        device = fwd.cu_seqlens_q.device
        pick = torch.tensor(resident, dtype=torch.int64, device=device)
        return cls(
            pick,
            torch.tensor(offloaded, dtype=torch.int64, device=device),
            index_table[pick],
            torch.arange(len(resident) + 1, dtype=torch.int32, device=device),
            fwd.seq_lens_k[pick],
            blocks.table([fwd.request_ids[i] for i in resident], blocks.device),
        )


def resident_decode(
    view: IndexerView, layer_rows: Sequence[torch.Tensor], q: Queries, at: ResidentInputs, block_size: int,
    *, every: bool, fp8: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(output [R, H, Dc], top-k positions [R, K], their pool rows int32 [R, K])`` of the resident rows
    ``at`` of the decode queries ``q`` (``every``: they are all of ``q``'s rows, taken as they are)."""
    index_q, weights, q_nope, q_pe = q.index_q, q.index_weights, q.q_nope, q.q_pe
    assert index_q is not None and weights is not None
    if not every:
        index_q, weights, q_nope, q_pe = (t[at.pick] for t in (index_q, weights, q_nope, q_pe))
    topk = view.select(index_q, weights, at.cu, at.lens)
    rows_at = block_rows(topk, at.table, block_size)
    return resident_attention(layer_rows, q_nope, q_pe, rows_at, q.scale, fp8=fp8), topk, rows_at


def block_rows(topk: torch.Tensor, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """``int32 [R, K]``: the flat pool rows of positions ``topk [R, K]`` through each row's blocks ``table
    int64 [R, M]`` (−1 where the position is −1)."""
    pos = topk.long().clamp(min=0)
    flat = torch.gather(table, 1, pos // block_size) * block_size + pos % block_size
    return torch.where(topk >= 0, flat, -1).to(torch.int32)


def resident_attention(
    layer_rows: Sequence[torch.Tensor], q_nope: torch.Tensor, q_pe: torch.Tensor, rows_at: torch.Tensor,
    scale: float, *, fp8: bool,
) -> torch.Tensor:  # fmt: skip
    """``[R, H, Dc]``: sparse MLA attention of ``q_nope [R, H, Dc]`` / ``q_pe [R, H, Dr]`` over the pool rows
    ``rows_at int32 [R, K]`` of ``layer_rows`` (``(kv_c, k_pe)``, or ``(FP8 rows,)`` when ``fp8``)."""
    if fp8:
        return fp8_sparse_mla_attention(q_nope, q_pe, layer_rows[0], rows_at, scale)[0]
    return sparse_mla_attention(q_nope, q_pe, layer_rows[0], layer_rows[1], rows_at, scale)[0]


def resident_selected(
    layer_rows: Sequence[torch.Tensor], topk: torch.Tensor, rows_at: torch.Tensor, *, fp8: bool, dc: int
) -> SelectedRows:
    """The rows :func:`resident_attention` read: positions ``int64 [R, K]`` and their latent / rotary rows
    (FP8 rows dequantized)."""
    at = rows_at.long().clamp(min=0)
    if fp8:
        kv_c, k_pe = dequantize_rows(layer_rows[0][at], dc)
    else:
        kv_c, k_pe = layer_rows[0][at], layer_rows[1][at]
    return SelectedRows(torch.where(topk >= 0, topk.long(), -1), kv_c, k_pe)


def merge_selected(n: int, parts: Sequence[tuple[torch.Tensor, SelectedRows]]) -> SelectedRows:
    """One :class:`SelectedRows` of ``n`` queries from ``(query indices int64 [r], their rows)`` parts of
    equal ``K``; latent / rotary rows in the first part's dtype."""
    first = parts[0][1]
    k = first.positions.shape[1]
    pos = first.positions.new_full((n, k), -1)
    kv_c = first.kv_c.new_zeros((n, k, first.kv_c.shape[-1]))
    k_pe = first.k_pe.new_zeros((n, k, first.k_pe.shape[-1]))
    for at, rows in parts:
        pos[at], kv_c[at], k_pe[at] = rows.positions, rows.kv_c.to(kv_c.dtype), rows.k_pe.to(k_pe.dtype)
    return SelectedRows(pos, kv_c, k_pe)


def split_new_rows(
    fwd: ForwardPlan, blocks: DeviceBlocks, resident: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices of fwd's new rows whose requests are resident, their flat rows in ``blocks``, indices of
    the others)``, int64 on ``device``; ``resident``: the batch rows of resident requests."""
    keep = set(resident)
    row, pos, ids = fwd.row.tolist(), fwd.pos.tolist(), fwd.request_ids
    dev_at = [i for i, r in enumerate(row) if r in keep]
    host_at = [i for i, r in enumerate(row) if r not in keep]
    dev_rows = blocks.flat_rows([ids[row[i]] for i in dev_at], [pos[i] for i in dev_at], device)
    return (torch.tensor(dev_at, dtype=torch.int64, device=device), dev_rows,
            torch.tensor(host_at, dtype=torch.int64, device=device))  # fmt: skip
