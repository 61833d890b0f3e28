"""Triton kernels of ``sparse_mla_attention`` and ``scatter_copy_sparse_mla_attention`` (Copy-SFA).

Attention (``torch_kvoffload.ops.sparse_attention`` for the contract): one program per (query token,
block of heads, split of the selected rows). A program loads its query tile ``[BH, Dc]`` / ``[BH, Dr]``
once, then walks its share of the token's indices ``BN`` rows at a time: gathers the latent and rotary
rows, ``s = scale · (q_nope · c_kvᵀ + q_pe · k_peᵀ)`` with ``tl.dot`` (fp32 accumulation; fp32 inputs use
IEEE products), and folds the tile into an online softmax (running max, sum and output). All heads of a
block share the gathered rows (MLA has one KV head). When the selected rows are split over several
programs (flash-decoding, to fill the device when there are few query tokens), each split writes its
unnormalised partial output and ``(max, sum)`` to an fp32 workspace and a second kernel merges them.
``−1`` indices are skipped; a token without a valid index gets ``out = 0``, ``lse = −inf``.

Copy-SFA first copies the missed rows from the paged host pool into the hot buffers (one program per
block of misses of a row; the host row is found through the block table on the device), then runs the
same attention over ``hot[r, slots[r]]``. On CUDA the host pool is typically pinned CPU memory: the copy
kernel reads it directly through unified virtual addressing (zero-copy, only the missed rows cross the
bus); a pool in pageable memory goes through ``kvoffload::copy_rows`` instead.

Validation runs before any launch with the op's own checks (structure, then the vectorised miss-list and
index checks of ``torch_kvoffload.ops.sparse_attention``), so bad input leaves every tensor untouched.
The ``launch_*`` entry points skip those checks (they read the indices back, a host synchronisation):
they are for a caller that built the indices itself, such as the sparse decode runtime's device step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops import sparse_attention as _sa
from torch_kvoffload.ops.triton import device_guard, interpreting, require_launchable

__all__ = [
    "KERNELS",
    "launch_scatter_copy_sparse_mla_attention",
    "launch_sparse_mla_attention",
    "scatter_copy_sparse_mla_attention",
    "sparse_mla_attention",
]


@triton.jit
def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32; ``UPCAST`` multiplies fp32 copies (for the interpreter, whose
    ``tl.dot`` mishandles bf16 operands; bf16 products are exact in fp32, so the result is the same)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _attend_kernel(
    qn_ptr, qn_st, qn_sh, qn_sd,
    qp_ptr, qp_st, qp_sh, qp_sd,
    kv_ptr, kv_st, kv_sn, kv_sd,
    pe_ptr, pe_st, pe_sn, pe_sd,
    idx_ptr, idx_st, idx_sk,
    out_ptr, out_st, out_sh, out_sd,
    lse_ptr, lse_st, lse_sh,
    part_ptr, ml_ptr,
    H, K, Dc, Dr, rows_per_split, num_splits, scale,
    BH: tl.constexpr, BN: tl.constexpr, BDC: tl.constexpr, BDR: tl.constexpr,
    HAS_PE: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    sp = tl.program_id(2)
    hmask = hs < H
    dc = tl.arange(0, BDC)
    dcmask = dc < Dc
    q = tl.load(
        qn_ptr + t * qn_st + hs[:, None] * qn_sh + dc[None, :] * qn_sd,
        mask=hmask[:, None] & dcmask[None, :],
        other=0.0,
    )
    if HAS_PE:
        dr = tl.arange(0, BDR)
        drmask = dr < Dr
        qp = tl.load(
            qp_ptr + t * qp_st + hs[:, None] * qp_sh + dr[None, :] * qp_sd,
            mask=hmask[:, None] & drmask[None, :],
            other=0.0,
        )
    m = tl.full([BH], float("-inf"), tl.float32)
    den = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BDC], tl.float32)
    k_begin = sp * rows_per_split
    k_end = tl.minimum(K, k_begin + rows_per_split)
    for k0 in range(k_begin, k_end, BN):
        ns = k0 + tl.arange(0, BN)
        ix = tl.load(idx_ptr + t * idx_st + ns * idx_sk, mask=ns < k_end, other=-1).to(tl.int64)
        valid = ix >= 0
        rows = tl.load(
            kv_ptr + t * kv_st + ix[:, None] * kv_sn + dc[None, :] * kv_sd,
            mask=valid[:, None] & dcmask[None, :],
            other=0.0,
        )
        s = _mm(q, tl.trans(rows), PREC, UPCAST)
        if HAS_PE:
            pe = tl.load(
                pe_ptr + t * pe_st + ix[:, None] * pe_sn + dr[None, :] * pe_sd,
                mask=valid[:, None] & drmask[None, :],
                other=0.0,
            )
            s += _mm(qp, tl.trans(pe), PREC, UPCAST)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid row yet: keep zeros, not NaN
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m - base)
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(rows.dtype), rows, PREC, UPCAST)
        m = m_new
    if SPLIT:
        # workspace [T, H, S, Dc] (unnormalised output) and [T, H, S, 2] (max, sum)
        cell = (t * H + hs) * num_splits + sp
        tl.store(part_ptr + cell[:, None] * Dc + dc[None, :], acc, mask=hmask[:, None] & dcmask[None, :])
        tl.store(ml_ptr + cell * 2, m, mask=hmask)
        tl.store(ml_ptr + cell * 2 + 1, den, mask=hmask)
    else:
        some = den > 0  # at least one valid row
        safe = tl.where(some, den, 1.0)
        inv = tl.where(some, 1.0 / safe, 0.0)
        lse = tl.where(some, m + tl.log(safe), float("-inf"))
        o = acc * inv[:, None]
        tl.store(
            out_ptr + t * out_st + hs[:, None] * out_sh + dc[None, :] * out_sd,
            o,
            mask=hmask[:, None] & dcmask[None, :],
        )
        tl.store(lse_ptr + t * lse_st + hs * lse_sh, lse, mask=hmask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, ml_ptr,
    out_ptr, out_st, out_sh, out_sd,
    lse_ptr, lse_st, lse_sh,
    H, Dc, num_splits,
    BH: tl.constexpr, BDC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = hs < H
    dc = tl.arange(0, BDC)
    mask2 = hmask[:, None] & (dc[None, :] < Dc)
    m_all = tl.full([BH], float("-inf"), tl.float32)
    for sp in range(0, num_splits):
        cell = (t * H + hs) * num_splits + sp
        m_all = tl.maximum(m_all, tl.load(ml_ptr + cell * 2, mask=hmask, other=float("-inf")))
    base = tl.where(m_all == float("-inf"), 0.0, m_all)
    den = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BDC], tl.float32)
    for sp in range(0, num_splits):
        cell = (t * H + hs) * num_splits + sp
        w = tl.exp(tl.load(ml_ptr + cell * 2, mask=hmask, other=float("-inf")) - base)
        den += w * tl.load(ml_ptr + cell * 2 + 1, mask=hmask, other=0.0)
        acc += w[:, None] * tl.load(part_ptr + cell[:, None] * Dc + dc[None, :], mask=mask2, other=0.0)
    some = den > 0
    safe = tl.where(some, den, 1.0)
    inv = tl.where(some, 1.0 / safe, 0.0)
    tl.store(
        out_ptr + t * out_st + hs[:, None] * out_sh + dc[None, :] * out_sd, acc * inv[:, None], mask=mask2
    )
    tl.store(
        lse_ptr + t * lse_st + hs * lse_sh, tl.where(some, base + tl.log(safe), float("-inf")), mask=hmask
    )


@triton.jit
def _copy_miss_rows_kernel(
    host_c_ptr, hc_sb, hc_so, hc_sd,
    host_p_ptr, hp_sb, hp_so, hp_sd,
    hot_c_ptr, oc_sr, oc_ss, oc_sd,
    hot_p_ptr, op_sr, op_ss, op_sd,
    table_ptr, table_sr, table_sb,
    mtok_ptr, mtok_sr, mtok_si,
    mslot_ptr, mslot_sr, mslot_si,
    mcount_ptr,
    M, Dc, Dr, block_size,
    BM: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BM + tl.arange(0, BM)
    live = i < tl.minimum(tl.load(mcount_ptr + r), M)
    tok = tl.load(mtok_ptr + r * mtok_sr + i * mtok_si, mask=live, other=0).to(tl.int64)
    slot = tl.load(mslot_ptr + r * mslot_sr + i * mslot_si, mask=live, other=0).to(tl.int64)
    blk = tl.load(table_ptr + r * table_sr + (tok // block_size) * table_sb, mask=live, other=0).to(tl.int64)
    off = tok % block_size
    for d0 in range(0, Dc, BD):
        d = d0 + tl.arange(0, BD)
        mk = live[:, None] & (d[None, :] < Dc)
        v = tl.load(host_c_ptr + blk[:, None] * hc_sb + off[:, None] * hc_so + d[None, :] * hc_sd, mask=mk)
        tl.store(hot_c_ptr + r * oc_sr + slot[:, None] * oc_ss + d[None, :] * oc_sd, v, mask=mk)
    for d0 in range(0, Dr, BD):
        d = d0 + tl.arange(0, BD)
        mk = live[:, None] & (d[None, :] < Dr)
        v = tl.load(host_p_ptr + blk[:, None] * hp_sb + off[:, None] * hp_so + d[None, :] * hp_sd, mask=mk)
        tl.store(hot_p_ptr + r * op_sr + slot[:, None] * op_ss + d[None, :] * op_sd, v, mask=mk)


# ------------------------------------------------------------------------------------------- launchers


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def _num_splits(tokens: int, head_blocks: int, k: int, bn: int, device: torch.device) -> int:
    """Splits of the selected rows per (token, head block): enough programs to fill the device."""
    tiles = triton.cdiv(k, bn)
    if tiles <= 1:
        return 1
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:  # the interpreter (and devices without a known width): a few splits, so the merge runs too
        target = 4 * tokens * head_blocks
    return max(1, min(tiles, triton.cdiv(target, max(tokens * head_blocks, 1))))


class SplitTiling(NamedTuple):
    """How an attention launch splits its work: ``bh`` heads and ``bn`` rows a block, ``head_blocks`` x
    ``splits`` programs a token, ``rows_per_split`` selected rows a split, and the fp32 partial outputs /
    running (max, sum) of the splits (``lse`` itself, untouched, when there is one split)."""

    bh: int
    bn: int
    head_blocks: int
    splits: int
    rows_per_split: int
    part: torch.Tensor
    ml: torch.Tensor


def split_tiling(q_nope: torch.Tensor, K: int, bdc: int, lse: torch.Tensor) -> SplitTiling:
    """The tiling of the sparse attention kernels (floating and FP8 rows) for ``q_nope [T, H, Dc]`` over
    ``K`` selected rows, ``Dc`` padded to ``bdc``."""
    T, H, Dc = q_nope.shape
    bh = min(_pow2(H), 16 if bdc >= 256 else 64)
    bn = 32 if bdc >= 256 else 64
    head_blocks = triton.cdiv(H, bh)
    splits = _num_splits(T, head_blocks, K, bn, q_nope.device)
    rows_per_split = triton.cdiv(triton.cdiv(max(K, 1), splits), bn) * bn
    splits = triton.cdiv(max(K, 1), rows_per_split)
    if splits > 1:
        part = torch.empty((T, H, splits, Dc), dtype=torch.float32, device=q_nope.device)
        ml = torch.empty((T, H, splits, 2), dtype=torch.float32, device=q_nope.device)
    else:
        part = ml = lse  # never touched
    return SplitTiling(bh, bn, head_blocks, splits, rows_per_split, part, ml)


def merge_splits(t: SplitTiling, out: torch.Tensor, lse: torch.Tensor, bdc: int) -> None:
    """Merge the splits' partial outputs into ``out`` / ``lse`` (nothing when there was one split)."""
    if t.splits > 1:
        T, H, Dc = out.shape
        _merge_splits_kernel[(T, t.head_blocks)](
            t.part,
            t.ml,
            out,
            *out.stride(),
            lse,
            *lse.stride(),
            H,
            Dc,
            t.splits,
            BH=t.bh,
            BDC=bdc,
            num_warps=4,
        )


def _attend(q_nope, q_pe, kv, kv_st, pe, pe_st, indices, scale, out, lse) -> None:
    """``out / lse`` of tokens ``[T, H]`` over rows ``kv[t * kv_st + indices[t]]`` (validated indices)."""
    T, H, Dc = q_nope.shape
    Dr = q_pe.shape[2]
    K = indices.shape[1]
    if T == 0 or H == 0:
        return
    bdc, bdr = _pow2(Dc), _pow2(Dr)
    t = split_tiling(q_nope, K, bdc, lse)
    bh, bn, head_blocks, splits, rows_per_split, part, ml = t
    prec = "ieee" if q_nope.dtype == torch.float32 else "tf32"  # bf16 products are exact in either
    with device_guard(q_nope.device):
        _attend_kernel[(T, head_blocks, splits)](
            q_nope, *q_nope.stride(),
            q_pe, *q_pe.stride(),
            kv, kv_st, *kv.stride()[-2:],
            pe, pe_st, *pe.stride()[-2:],
            indices, *indices.stride(),
            out, *out.stride(),
            lse, *lse.stride(),
            part, ml,
            H, K, Dc, Dr, rows_per_split, splits, float(scale),
            BH=bh, BN=bn, BDC=bdc, BDR=bdr, HAS_PE=Dr > 0, SPLIT=splits > 1, PREC=prec,
            UPCAST=interpreting() and q_nope.dtype != torch.float32,
            num_warps=8 if bdc >= 256 else 4,  # Dc 512 tiles: 8 warps keep them in registers (sm_90)
        )  # fmt: skip
        merge_splits(t, out, lse, bdc)


def sparse_mla_attention(q_nope, q_pe, kv_c, k_pe, indices, scale):
    """Triton ``kvoffload::sparse_mla_attention`` (same arguments, results and errors as the op)."""
    op = "sparse_mla_attention"
    _sa._sparse_structure(op, q_nope, q_pe, kv_c, k_pe, indices)
    require_launchable(op, q_nope.device)
    _sa._check_index_range(op, "indices", indices, kv_c.shape[0])
    out = torch.empty_like(q_nope, memory_format=torch.contiguous_format)
    lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
    _attend(q_nope, q_pe, kv_c, 0, k_pe, 0, indices, scale, out, lse)
    return out, lse


def launch_sparse_mla_attention(q_nope, q_pe, kv_c, k_pe, indices, scale, out, lse) -> None:
    """Sparse MLA attention of validated input into ``out [T, H, Dc]`` / ``lse fp32 [T, H]`` (no checks).

    ``indices int32 [T, K]`` must lie in ``[-1, kv_c.shape[0])``; nothing is read back to the host.
    """
    _attend(q_nope, q_pe, kv_c, 0, k_pe, 0, indices, scale, out, lse)


def _launch_miss_copy(
    host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots, miss_count
):
    rows, width = miss_tokens.shape
    if rows == 0 or width == 0:
        return
    device = hot_kv_c.device
    bm = 16
    bd = min(128, _pow2(max(hot_kv_c.shape[2], hot_k_pe.shape[2])))
    idx = [t.to(device) for t in (block_table, miss_tokens, miss_slots, miss_count)]
    table, mtok, mslot, mcount = idx
    mcount = mcount.contiguous()  # read as an [R] array
    with device_guard(hot_kv_c.device):
        _copy_miss_rows_kernel[(rows, triton.cdiv(width, bm))](
            host_kv_c, *host_kv_c.stride(),
            host_k_pe, *host_k_pe.stride(),
            hot_kv_c, *hot_kv_c.stride(),
            hot_k_pe, *hot_k_pe.stride(),
            table, *table.stride(),
            mtok, *mtok.stride(),
            mslot, *mslot.stride(),
            mcount,
            width, hot_kv_c.shape[2], hot_k_pe.shape[2], host_kv_c.shape[1],
            BM=bm, BD=bd, num_warps=4,
        )  # fmt: skip


def _device_readable(host: torch.Tensor, device: torch.device) -> bool:
    """Whether a kernel on ``device`` can read ``host`` in place (same device, or pinned host memory)."""
    if host.device == device:
        return True
    return host.device.type == "cpu" and device.type == "cuda" and host.is_pinned()


def scatter_copy_sparse_mla_attention(
    q_nope, q_pe, host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots, miss_count,
    slots, scale, out, lse,
) -> None:  # fmt: skip
    """Triton ``kvoffload::scatter_copy_sparse_mla_attention`` (same arguments, contract and errors)."""
    op = "scatter_copy_sparse_mla_attention"
    _sa._copy_sfa_structure(
        op, q_nope, q_pe, host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots,
        miss_count, slots, out, lse,
    )  # fmt: skip
    require_launchable(op, q_nope.device)
    _sa.check_copy_sfa_misses(op, host_kv_c, block_table, hot_kv_c, miss_tokens, miss_slots, miss_count)
    _sa._check_index_range(op, "slots", slots, hot_kv_c.shape[1])
    # Snapshot the inputs that share memory with a written tensor: the op reads them as they were.
    host_kv_c = _checks.unaliased_source(host_kv_c, hot_kv_c)
    host_k_pe = _checks.unaliased_source(host_k_pe, hot_k_pe)
    q_nope = _checks.unaliased_source(_checks.unaliased_source(q_nope, out), lse)
    q_pe = _checks.unaliased_source(_checks.unaliased_source(q_pe, out), lse)
    device = hot_kv_c.device
    if _device_readable(host_kv_c, device) and _device_readable(host_k_pe, device):
        _launch_miss_copy(
            host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots, miss_count
        )
    else:  # pageable host memory: the row-copy op moves the missed rows
        src, dst = _sa.copy_sfa_miss_slots(
            op, host_kv_c, block_table, hot_kv_c, miss_tokens, miss_slots, miss_count
        )
        if src.numel():
            torch.ops.kvoffload.copy_rows(host_kv_c, hot_kv_c, src, dst)
            torch.ops.kvoffload.copy_rows(host_k_pe, hot_k_pe, src, dst)
    _attend(q_nope, q_pe, hot_kv_c, hot_kv_c.stride(0), hot_k_pe, hot_k_pe.stride(0), slots, scale, out, lse)


def launch_scatter_copy_sparse_mla_attention(
    q_nope, q_pe, host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots, miss_count,
    slots, scale, out, lse,
) -> None:  # fmt: skip
    """Copy-SFA of validated, unaliased input (the op's contract, none of its checks or snapshots).

    For a caller that built the miss lists and slots itself (a residency kernel's outputs): nothing is
    read back to the host when the host pool is readable in place (pinned memory on CUDA, or CPU tensors
    under the interpreter). ``hot_kv_c [T, C, Dc]`` / ``hot_k_pe [T, C, Dr]`` may be any strided view,
    e.g. one flat buffer expanded over the rows (row stride 0) with ``miss_slots`` and ``slots`` already
    offset into it. A pool the kernel cannot read in place (pageable memory) is a ``RuntimeError``.
    """
    device = hot_kv_c.device
    if not (_device_readable(host_kv_c, device) and _device_readable(host_k_pe, device)):
        raise RuntimeError(
            "kvoffload::scatter_copy_sparse_mla_attention (unchecked launch): the host pool must be readable "
            f"in place from {device} (pinned memory on CUDA), got {host_kv_c.device} tensors "
            f"(pinned: {host_kv_c.is_pinned()}); use the op itself for a pageable pool"
        )
    _launch_miss_copy(
        host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots, miss_count
    )
    _attend(q_nope, q_pe, hot_kv_c, hot_kv_c.stride(0), hot_k_pe, hot_k_pe.stride(0), slots, scale, out, lse)


KERNELS = {
    "sparse_mla_attention": sparse_mla_attention,
    "scatter_copy_sparse_mla_attention": scatter_copy_sparse_mla_attention,
}
