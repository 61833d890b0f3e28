"""Pure-PyTorch formulas of the sparse MLA attention ops on validated inputs: the golden model that the
reference kernels of :mod:`torch_kvoffload.ops.sparse_attention` run (after their checks) and the C++ /
Triton kernels are tested against. The semantics are in :mod:`torch_kvoffload.ops.sparse_attention`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attend", "attend_hot_slots", "attend_rows", "copy_miss_rows"]


def attend(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    rows_c: torch.Tensor,
    rows_pe: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of ``[T, H, *]`` queries over gathered rows ``[T, K, *]`` where ``valid [T, K]``.

    Rows where ``valid`` is false (``−1`` entries, gathered from a placeholder row) are replaced by zeros
    before use, so NaN / inf in rows no query selected never reach a product: ``0 · NaN`` is NaN.
    """
    skip = ~valid[..., None]
    rows_c, rows_pe = rows_c.masked_fill(skip, 0), rows_pe.masked_fill(skip, 0)
    s = torch.einsum("thd,tkd->thk", q_nope.float(), rows_c.float())
    s = s + torch.einsum("thd,tkd->thk", q_pe.float(), rows_pe.float())
    s = (s * scale).masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else s.new_full(s.shape[:-1], -math.inf)
    # Rows without a valid index: lse = −inf, p = 0 (not NaN), out = 0.
    finite = torch.isfinite(lse)
    p = torch.where(
        valid[:, None, :] & finite[..., None], torch.exp(s - torch.where(finite, lse, 0)[..., None]), 0
    )
    out = torch.einsum("thk,tkd->thd", p, rows_c.float())
    return out.to(q_nope.dtype), lse


def attend_rows(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` of ``[T, H, *]`` queries over the rows of ``kv_c [N, Dc]`` / ``k_pe [N, Dr]``
    selected by ``indices int32 [T, K]`` (``−1``: skipped)."""
    idx = indices.to(torch.int64)
    valid = idx >= 0
    safe = idx.clamp(min=0)
    if kv_c.shape[0] == 0:  # nothing to gather from: every index is −1
        rows_c = kv_c.new_zeros((*idx.shape, kv_c.shape[1]))
        rows_pe = k_pe.new_zeros((*idx.shape, k_pe.shape[1]))
    else:
        rows_c, rows_pe = kv_c[safe], k_pe[safe]
    return attend(q_nope, q_pe, rows_c, rows_pe, valid, scale)


def copy_miss_rows(
    host_kv_c: torch.Tensor,
    host_k_pe: torch.Tensor,
    hot_kv_c: torch.Tensor,
    hot_k_pe: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Copy host pool rows ``src`` (flat ``int64`` slots of ``[num_blocks * block_size]``) into hot-buffer
    slots ``dst`` (flat slots of ``[R * C]``), for the latent and the rope rows."""
    if src.numel():
        bs, capacity = host_kv_c.shape[1], hot_kv_c.shape[1]
        s, d = src.to(host_kv_c.device), dst.to(hot_kv_c.device)
        hot_kv_c[d // capacity, d % capacity] = host_kv_c[s // bs, s % bs].to(hot_kv_c.device)
        hot_k_pe[d // capacity, d % capacity] = host_k_pe[s // bs, s % bs].to(hot_k_pe.device)


def attend_hot_slots(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    hot_kv_c: torch.Tensor,
    hot_k_pe: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` of row ``r``'s queries over its hot-buffer slots ``slots[r]`` (``int32 [R, K]``,
    ``−1``: skipped) of ``hot_kv_c [R, C, Dc]`` / ``hot_k_pe [R, C, Dr]``."""
    capacity = hot_kv_c.shape[1]
    idx = slots.to(torch.int64)
    valid = idx >= 0
    safe = idx.clamp(min=0)
    r = torch.arange(q_nope.shape[0], device=idx.device)[:, None]
    if capacity == 0:
        rows_c = hot_kv_c.new_zeros((*idx.shape, hot_kv_c.shape[2]))
        rows_pe = hot_k_pe.new_zeros((*idx.shape, hot_k_pe.shape[2]))
    else:
        rows_c, rows_pe = hot_kv_c[r, safe], hot_k_pe[r, safe]
    return attend(q_nope, q_pe, rows_c, rows_pe, valid, scale)
