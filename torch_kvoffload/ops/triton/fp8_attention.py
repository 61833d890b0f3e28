"""Triton kernel of ``fp8_sparse_mla_attention``: sparse MLA attention over FP8 latent rows (the 656-byte
rows of :mod:`torch_kvoffload.ops.fp8`; contract in :mod:`torch_kvoffload.ops.fp8_attention`).

The kernel is ``sparse_attention._attend_kernel`` (same grid and tiling, online softmax, split rows and
the same merge kernel) with the selected rows read as bytes and decoded where they are read: one program
per (query token, block of heads, split of the selected rows) loads its query tile once, then walks its
share of the token's indices ``BN`` rows at a time. For each tile of rows it gathers

* the ``e4m3fn`` codes ``[BN, Dc]`` (one byte each) and decodes them exactly (``fp8._fp8_to_f32``: integer
  bit manipulation, the same on every device and under the interpreter);
* each row's ``Dc / 128`` fp32 scales from their four bytes (``fp8_indexer._load_f32``, little-endian,
  no alignment needed) and multiplies each tile by its scale (exact: a power of two);
* the bf16 RoPE values from their two bytes.

A dequantized value is exact in bf16 (a code has four significant bits), so every dot takes bf16 operands
with fp32 accumulation (tensor cores). bf16 queries go as they are and the softmax weights are rounded to
bf16, as ``sparse_mla_attention``'s bf16 kernel does. fp32 queries, and then the weights, are split into
three bf16 terms ``hi + mid + lo`` (exact); each term's products with the exact rows are exact, so scores
and outputs keep fp32 precision (only the order of the fp32 additions differs from the reference). (The
fp32 ``sparse_mla_attention`` kernel multiplies with IEEE fp32 FMAs; with the decode added, that spills
registers at ``Dc = 512``, three bf16 MMAs do not.) On CUDA the decoded tiles pass an opaque register move
(``_pin``) so that Triton decodes them once and stages them in shared memory for both dots. Under the
interpreter, whose bf16 ``tl.dot`` is wrong, the same bf16 operands are widened from their bits
(``fp8._to_f32``) and multiplied in fp32: the same exact products. Outputs are rounded to the queries'
dtype to nearest even from the bits (``fp8._store_float``; the merge kernel of split rows converts).

``−1`` indices are skipped (their bytes are never read); a token without a valid index gets ``out = 0``,
``lse = −inf``. Validation (``validate_fp8_sparse_mla_attention``: structure, then the indices' range)
runs before any launch, so bad input raises before the kernel runs. ``launch_fp8_sparse_mla_attention``
skips it (the range check reads the indices back, a host synchronisation), for callers that built the
indices themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_kvoffload.ops.fp8 import TILE
from torch_kvoffload.ops.fp8_attention import validate_fp8_sparse_mla_attention
from torch_kvoffload.ops.triton import device_guard, interpreting, require_launchable
from torch_kvoffload.ops.triton.fp8 import (
    _KIND,
    BF16,
    F32,
    _check_byte_order,
    _fp8_to_f32,
    _store_float,
    _to_f32,
)
from torch_kvoffload.ops.triton.fp8_indexer import _load_f32
from torch_kvoffload.ops.triton.sparse_attention import _pow2, merge_splits, split_tiling

__all__ = ["KERNELS", "fp8_sparse_mla_attention", "launch_fp8_sparse_mla_attention"]

OP = "fp8_sparse_mla_attention"


@triton.jit
def _mm(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` of bf16 operands with fp32 accumulation; ``UPCAST`` (the interpreter, whose bf16
    ``tl.dot`` is wrong) widens them from their bits and multiplies in fp32 (the same exact products)."""
    if UPCAST:
        c = tl.dot(_to_f32(a, BF16), _to_f32(b, BF16), acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc)
    return c


@triton.jit
def _bf16_terms(x):
    """fp32 ``x`` as ``hi + mid + lo``, three bf16 values (exact: 3 x 8 significant bits), so that its
    products with exact bf16 values run on bf16 tensor cores at fp32 precision."""
    hi = x.to(tl.bfloat16)
    r = x - _to_f32(hi, BF16)
    mid = r.to(tl.bfloat16)
    lo = (r - _to_f32(mid, BF16)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _pin(x, PIN: tl.constexpr):
    """bf16 ``x``; with ``PIN`` (CUDA) through an opaque register move that the compiler keeps in place.

    Without it Triton recomputes a tile decoded from bytes in each dot's operand layout, whose tiles are
    replicated across warps (the decode runs several times over, in hundreds of registers); after the
    move the tile is decoded once, stored to shared memory and read by both dots, as loaded rows are.
    """
    if PIN:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], tl.bfloat16, False, 2)
    return x


@triton.jit
def _fp8_attend_kernel(
    qn_ptr, qn_st, qn_sh, qn_sd,
    qp_ptr, qp_st, qp_sh, qp_sd,
    kv_ptr, kv_sn, kv_sb,
    idx_ptr, idx_st, idx_sk,
    out_ptr, out_st, out_sh, out_sd,
    lse_ptr, lse_st, lse_sh,
    part_ptr, ml_ptr,
    H, K, Dc, Dr, rows_per_split, num_splits, scale,
    BH: tl.constexpr, BN: tl.constexpr, BDC: tl.constexpr, BDR: tl.constexpr,
    HAS_PE: tl.constexpr, SPLIT: tl.constexpr, Q_KIND: tl.constexpr, UPCAST: tl.constexpr,
    PIN: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    sp = tl.program_id(2)
    hmask = hs < H
    dc = tl.arange(0, BDC)
    dcmask = dc < Dc
    tiles = tl.arange(0, BDC // 128)
    scale_col = Dc  # first scale byte of a row
    pe_col = Dc + 4 * (Dc // 128)  # first RoPE byte of a row
    q = tl.load(
        qn_ptr + t * qn_st + hs[:, None] * qn_sh + dc[None, :] * qn_sd,
        mask=hmask[:, None] & dcmask[None, :],
        other=0.0,
    )
    if Q_KIND == F32:
        q1, q2, q3 = _bf16_terms(q)
    else:
        q1 = q
    if HAS_PE:
        dr = tl.arange(0, BDR)
        drmask = dr < Dr
        qp = tl.load(
            qp_ptr + t * qp_st + hs[:, None] * qp_sh + dr[None, :] * qp_sd,
            mask=hmask[:, None] & drmask[None, :],
            other=0.0,
        )
        if Q_KIND == F32:
            qp1, qp2, qp3 = _bf16_terms(qp)
        else:
            qp1 = qp
    m = tl.full([BH], float("-inf"), tl.float32)
    den = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BDC], tl.float32)
    k_begin = sp * rows_per_split
    k_end = tl.minimum(K, k_begin + rows_per_split)
    for k0 in range(k_begin, k_end, BN):
        ns = k0 + tl.arange(0, BN)
        ix = tl.load(idx_ptr + t * idx_st + ns * idx_sk, mask=ns < k_end, other=-1).to(tl.int64)
        valid = ix >= 0
        row = kv_ptr + ix * kv_sn  # [BN] row starts (never read where not valid)
        codes = tl.load(
            row[:, None] + dc[None, :] * kv_sb, mask=valid[:, None] & dcmask[None, :], other=0
        ).to(tl.uint32)
        sc = _load_f32(  # [BN, tiles]
            row[:, None] + (scale_col + 4 * tiles)[None, :] * kv_sb,
            kv_sb,
            valid[:, None] & (tiles * 128 < Dc)[None, :],
        )
        # each tile times its scale (exact: a power of two), then bf16 (exact: 4 significant bits)
        rows = tl.reshape(_fp8_to_f32(codes), (BN, BDC // 128, 128)) * sc[:, :, None]
        rows = _pin(tl.reshape(rows, (BN, BDC)).to(tl.bfloat16), PIN)  # 0 where masked
        rows_t = tl.trans(rows)
        s = _mm(q1, rows_t, tl.zeros([BH, BN], tl.float32), UPCAST)
        if Q_KIND == F32:
            s = _mm(q3, rows_t, _mm(q2, rows_t, s, UPCAST), UPCAST)
        if HAS_PE:
            pmask = valid[:, None] & drmask[None, :]
            pe_at = row[:, None] + (pe_col + 2 * dr)[None, :] * kv_sb
            lo = tl.load(pe_at, mask=pmask, other=0).to(tl.uint16)
            hi = tl.load(pe_at + kv_sb, mask=pmask, other=0).to(tl.uint16)
            pe_t = tl.trans(_pin((lo | (hi << 8)).to(tl.bfloat16, bitcast=True), PIN))
            s = _mm(qp1, pe_t, s, UPCAST)
            if Q_KIND == F32:
                s = _mm(qp3, pe_t, _mm(qp2, pe_t, s, UPCAST), UPCAST)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid row yet: keep zeros, not NaN
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m - base)
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if Q_KIND == F32:  # the weights at fp32 precision too
            p1, p2, p3 = _bf16_terms(p)
            acc = _mm(p3, rows, _mm(p2, rows, _mm(p1, rows, acc, UPCAST), UPCAST), UPCAST)
        else:
            acc = _mm(p.to(tl.bfloat16), rows, acc, UPCAST)
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
        _store_float(
            out_ptr + t * out_st + hs[:, None] * out_sh + dc[None, :] * out_sd,
            acc * inv[:, None],
            hmask[:, None] & dcmask[None, :],
            Q_KIND,
        )
        tl.store(lse_ptr + t * lse_st + hs * lse_sh, lse, mask=hmask)


# ------------------------------------------------------------------------------------------- launchers


def _pin_operands(device: torch.device) -> bool:
    """Whether the kernel pins its decoded tiles (``_pin``: PTX, so NVIDIA CUDA only)."""
    return device.type == "cuda" and torch.version.hip is None and not interpreting()


def launch_fp8_sparse_mla_attention(q_nope, q_pe, kv_rows, indices, scale, out, lse) -> None:
    """FP8 sparse MLA attention of validated input into ``out [T, H, Dc]`` / ``lse fp32 [T, H]`` (no
    checks). ``indices int32 [T, K]`` must lie in ``[-1, kv_rows.shape[0])``; nothing is read back."""
    T, H, Dc = q_nope.shape
    Dr = q_pe.shape[2]
    K = indices.shape[1]
    if T == 0 or H == 0:
        return
    bdc, bdr = _pow2(Dc, TILE), _pow2(Dr)
    t = split_tiling(q_nope, K, bdc, lse)  # sparse_attention's tiling
    bh, bn, head_blocks, splits, rows_per_split, part, ml = t
    with device_guard(q_nope.device):
        _fp8_attend_kernel[(T, head_blocks, splits)](
            q_nope, *q_nope.stride(),
            q_pe, *q_pe.stride(),
            kv_rows, *kv_rows.stride(),
            indices, *indices.stride(),
            out, *out.stride(),
            lse, *lse.stride(),
            part, ml,
            H, K, Dc, Dr, rows_per_split, splits, float(scale),
            BH=bh, BN=bn, BDC=bdc, BDR=bdr, HAS_PE=Dr > 0, SPLIT=splits > 1, Q_KIND=_KIND[q_nope.dtype],
            UPCAST=interpreting(), PIN=_pin_operands(q_nope.device),
            num_warps=8 if bdc >= 256 else 4,  # Dc 512 tiles: 8 warps keep them in registers (sm_90)
        )  # fmt: skip
        merge_splits(t, out, lse, bdc)


def fp8_sparse_mla_attention(q_nope, q_pe, kv_rows, indices, scale):
    """Triton ``kvoffload::fp8_sparse_mla_attention`` (same arguments, results and errors as the op)."""
    validate_fp8_sparse_mla_attention(q_nope, q_pe, kv_rows, indices)
    require_launchable(OP, q_nope.device)
    _check_byte_order(OP)
    out = torch.empty_like(q_nope, memory_format=torch.contiguous_format)
    lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
    launch_fp8_sparse_mla_attention(q_nope, q_pe, kv_rows, indices, scale, out, lse)
    return out, lse


KERNELS = {OP: fp8_sparse_mla_attention}
