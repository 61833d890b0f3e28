"""Triton kernels of the FP8 lightning-indexer ops: ``hadamard_quant_fp8`` and ``fp8_lightning_indexer``
(formulas in :mod:`torch_kvoffload.ops.fp8_indexer`).

* ``hadamard_quant_fp8``: one program per row. The fast Walsh–Hadamard butterflies of
  ``hadamard_quant_int8``'s kernel (``indexer._fwht``: the reference's additions in its order, so the
  same fp32 values), the normalisation, then each 128-wide group quantised by the FP8 row kernels' helper
  (``fp8._quantize_tiles``: the power-of-two scale from the exponent bits, ``e4m3fn`` round to nearest
  even by integer bit manipulation). The bytes equal the reference's under the interpreter and on any
  device. The one exception is a NaN in the rotated row (a NaN input, or an infinity minus an infinity):
  its code is a NaN code (``0x7F``) whose sign bit is the device's NaN's (x86 CPUs and the interpreter
  propagate the operand's NaN and make a negative default NaN; CUDA makes a positive canonical NaN).
  Its group's scale is 1 everywhere, as the reference's.
* ``fp8_lightning_indexer`` scores: grid ``(T, key tiles)`` as the indexer family's scores kernel. A
  program gathers ``BLOCK_S`` keys of its query's request through the block table. For each 128-wide
  group it decodes the ``e4m3fn`` codes of the keys and of the query's heads from their bytes (integer bit
  manipulation, exact) and takes their dot products with ``tl.dot`` as bf16 (every ``e4m3fn`` value is a
  bf16 value, and a product of two is exact in fp32) with fp32 accumulation; then it multiplies by the
  query's and the key's scales (assembled from their four bytes, little-endian; powers of two, so exact)
  and adds up the groups, then ``relu`` (NaN kept, as torch's) and the head weights, ``−inf`` past the
  query's visible length. Only the rounding of the fp32 sums differs from the reference (the order of a
  dot product's additions, and of the sum over heads, which the compiler may fuse into FMAs). Under the
  interpreter, whose bf16 ``tl.dot`` is wrong, the same values go through an fp32 IEEE ``tl.dot``.
* Top-k: the indexer family's kernel (``indexer._launch_topk``) on the scores, which are buffered for at
  most ``indexer.SCORE_BUFFER`` floats at a time (chunks of query tokens), as the other top-k ops do.

No part of a row needs to be aligned: codes are single bytes and scales are assembled byte by byte, so
any row stride and offset works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_kvoffload.ops.fp8 import TILE, index_row_bytes
from torch_kvoffload.ops.fp8_indexer import (
    index_head_dim_of,
    validate_fp8_lightning_indexer,
    validate_hadamard_quant_fp8,
)
from torch_kvoffload.ops.indexer import hadamard_norm
from torch_kvoffload.ops.triton import device_guard, interpreting, require_launchable
from torch_kvoffload.ops.triton import indexer as _indexer
from torch_kvoffload.ops.triton.fp8 import (
    _KIND,
    F32,
    _check_byte_order,
    _fp8_to_f32,
    _quantize_tiles,
    _sign_bit,
    _to_f32,
)
from torch_kvoffload.ops.triton.indexer import _fwht, _launch_topk, _requests

__all__ = [
    "KERNELS",
    "fp8_indexer_scores",
    "launch_hadamard_quant_fp8",
    "triton_fp8_lightning_indexer",
    "triton_hadamard_quant_fp8",
]

#: Keys per scoring program.
BLOCK_S = 64
#: Head-dim chunk per ``tl.dot`` step (a group's 128 values in four steps: no register spills at 64 heads).
BLOCK_D = 32
#: ``tl.dot`` needs every tile dim to be at least this (the heads are padded up to it).
MIN_DOT = 16
#: Head blocks from this size up run on 8 warps (4 below).
WIDE_HEADS = 64


# ---------------------------------------------------------------------------------------- kernels


@triton.jit
def _hadamard_fp8_kernel(
    x_ptr, out_ptr, x_st, out_st, norm, X_KIND: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    # bf16 → fp32 from the bits (the interpreter's conversion gets subnormals wrong)
    y = _fwht(_to_f32(tl.load(x_ptr + r * x_st + d), X_KIND), D, LOG_D) * norm
    groups = tl.reshape(y, (D // 128, 128))  # order-preserving: group g is y[128 g : 128 g + 128]
    code, scale_bits = _quantize_tiles(groups, _sign_bit(groups, F32), True)
    row = out_ptr + r * out_st
    tl.store(row + tl.reshape(d, (D // 128, 128)), code.to(tl.uint8))
    # the scales after the codes, each as its four bytes, least significant first
    g = tl.arange(0, D // 128)
    byte = tl.arange(0, 4)
    bits = (scale_bits[:, None] >> (8 * byte[None, :]).to(tl.uint32)) & 0xFF
    tl.store(row + D + 4 * g[:, None] + byte[None, :], bits.to(tl.uint8))


@triton.jit
def _load_f32(ptrs, stride, mask):
    """fp32 values from their four bytes at ``ptrs``, ``ptrs + stride``, ... (little-endian); 0 where
    ``mask`` is off."""
    bits = tl.load(ptrs, mask=mask, other=0).to(tl.uint32)
    bits |= tl.load(ptrs + stride, mask=mask, other=0).to(tl.uint32) << 8
    bits |= tl.load(ptrs + 2 * stride, mask=mask, other=0).to(tl.uint32) << 16
    bits |= tl.load(ptrs + 3 * stride, mask=mask, other=0).to(tl.uint32) << 24
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_scores_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    table_ptr,
    req_ptr,
    vis_ptr,
    out_ptr,
    H,
    width,
    block_size,
    q_st,
    q_sh,
    q_sr,
    w_st,
    w_sh,
    k_sb,
    k_ss,
    k_sr,
    tb_sb,
    tb_sj,
    out_st,
    G: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    b = tl.load(req_ptr + t)
    vis = tl.load(vis_ptr + t)
    valid = s < vis
    blk = tl.load(table_ptr + b * tb_sb + (s // block_size) * tb_sj, mask=valid, other=0).to(tl.int64)
    key = k_ptr + blk * k_sb + (s % block_size) * k_ss  # [BLOCK_S] row starts
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    hm = h < H
    query = q_ptr + t * q_st + h * q_sh  # [BLOCK_H] row starts
    j = tl.arange(0, BLOCK_D).to(tl.int64)
    for g in tl.static_range(G):
        dots = tl.zeros((BLOCK_S, BLOCK_H), tl.float32)
        for d0 in range(0, 128, BLOCK_D):
            col = g * 128 + d0 + j
            kc = tl.load(key[:, None] + col[None, :] * k_sr, mask=valid[:, None], other=0).to(tl.uint32)
            qc = tl.load(query[None, :] + col[:, None] * q_sr, mask=hm[None, :], other=0).to(tl.uint32)
            kf = _fp8_to_f32(kc)  # [BLOCK_S, BLOCK_D]
            qf = _fp8_to_f32(qc)  # [BLOCK_D, BLOCK_H]
            if DOT_F32:
                dots = tl.dot(kf, qf, dots, input_precision="ieee")
            else:  # exact conversions; fp32 accumulation
                dots = tl.dot(kf.to(tl.bfloat16), qf.to(tl.bfloat16), dots)
        scale_col = G * 128 + 4 * g
        qs = _load_f32(query + scale_col * q_sr, q_sr, hm)
        ks = _load_f32(key + scale_col * k_sr, k_sr, valid)
        part = dots * qs[None, :] * ks[:, None]
        if g == 0:
            logits = part
        else:
            logits += part
    w = tl.load(w_ptr + t * w_st + h * w_sh, mask=hm, other=0.0).to(tl.float32)
    relu = tl.maximum(logits, 0.0, propagate_nan=tl.PropagateNan.ALL)
    score = tl.sum(w[None, :] * relu, axis=1)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + t * out_st + s, score, mask=s < width)


# ---------------------------------------------------------------------------------------- launchers


def launch_hadamard_quant_fp8(x: torch.Tensor, out: torch.Tensor, norm: float) -> None:
    """``hadamard_quant_fp8`` of ``x [..., D]`` (validated) into ``out uint8 [..., D + 4 D / 128]``
    (contiguous). ``norm`` is :func:`torch_kvoffload.ops.indexer.hadamard_norm` of ``D``."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.shape[0] == 0:
        return
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    with device_guard(x.device):
        _hadamard_fp8_kernel[(rows.shape[0],)](
            rows,
            out,
            rows.stride(0),
            out.shape[-1],
            norm,
            X_KIND=_KIND[x.dtype],
            D=dim,
            LOG_D=dim.bit_length() - 1,
        )


def _launch_scores(q_rows, weights, k_rows, table, req, visible, out) -> None:
    """Write the scores of the ``out.shape[0]`` query rows of ``q_rows`` (validated input) into ``out``."""
    num_tokens, heads, row_bytes = q_rows.shape
    groups = index_head_dim_of("fp8_lightning_indexer", "q_rows", row_bytes) // TILE
    width = out.shape[1]
    block_h = max(MIN_DOT, triton.next_power_of_2(heads))
    grid = (num_tokens, triton.cdiv(width, BLOCK_S))
    with device_guard(q_rows.device):
        _fp8_scores_kernel[grid](
            q_rows,
            weights,
            k_rows,
            table,
            req,
            visible,
            out,
            heads,
            width,
            k_rows.shape[1],
            *q_rows.stride(),
            *weights.stride(),
            *k_rows.stride(),
            *table.stride(),
            out.stride(0),
            G=groups,
            DOT_F32=interpreting(),
            BLOCK_S=BLOCK_S,
            BLOCK_H=block_h,
            BLOCK_D=BLOCK_D,
            num_warps=8 if block_h >= WIDE_HEADS else 4,
        )


def launch_fp8_indexer_topk(q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k, topk) -> None:
    """``fp8_lightning_indexer``'s top-k of validated input written into ``topk int32 [T, K]`` (unit last
    stride), ``−1`` padded; the scores are held whole (``[T, max_blocks * block_size]`` fp32: meant for
    decode-sized ``T``). Nothing is read back to the host: the request description must be valid (the
    checked op verifies it with a host synchronisation)."""
    num_tokens, K = topk.shape
    width = block_table.shape[1] * k_rows.shape[1]
    k = min(K, width)
    if k < K:
        topk[:, k:].fill_(-1)
    if num_tokens == 0 or k == 0:
        return
    req, visible = _requests(cu_seqlens_q, seq_lens_k, num_tokens, q_rows.device)
    scores = torch.empty((num_tokens, width), dtype=torch.float32, device=q_rows.device)
    _launch_scores(q_rows, weights, k_rows, block_table.to(q_rows.device), req, visible, scores)
    _launch_topk(scores, visible, topk, k)


# ----------------------------------------------------------------------------------------- wrappers


def triton_hadamard_quant_fp8(x: torch.Tensor) -> torch.Tensor:
    """Triton ``hadamard_quant_fp8``: indexer rows ``uint8 [..., D + 4 D / 128]`` (op contract)."""
    validate_hadamard_quant_fp8(x)
    op = "hadamard_quant_fp8"
    require_launchable(op, x.device)
    _check_byte_order(op)
    dim = x.shape[-1]
    out = torch.empty((*x.shape[:-1], index_row_bytes(dim)), dtype=torch.uint8, device=x.device)
    launch_hadamard_quant_fp8(x, out, hadamard_norm(dim))
    return out


def fp8_indexer_scores(q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k) -> torch.Tensor:
    """fp32 scores ``[T, max_blocks * block_size]`` of ``fp8_lightning_indexer``'s formula (``−inf`` past
    each query's visible keys), from the scores kernel: what the top-k is taken from. Validated as the
    op (``top_k = 0``)."""
    validate_fp8_lightning_indexer(q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k, 0)
    op = "fp8_lightning_indexer"
    require_launchable(op, q_rows.device)
    _check_byte_order(op)
    num_tokens = q_rows.shape[0]
    width = block_table.shape[1] * k_rows.shape[1]
    out = torch.empty((num_tokens, width), dtype=torch.float32, device=q_rows.device)
    if out.numel():
        req, visible = _requests(cu_seqlens_q, seq_lens_k, num_tokens, q_rows.device)
        table = block_table.to(q_rows.device)
        _launch_scores(q_rows, weights, k_rows, table, req, visible, out)
    return out


def triton_fp8_lightning_indexer(
    q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k, top_k: int
) -> torch.Tensor:
    """Triton ``fp8_lightning_indexer``: int32 ``[T, top_k]`` key positions, ``−1`` padded (op contract).

    Scores are buffered for at most ``indexer.SCORE_BUFFER`` floats at a time, so prefill-sized calls
    never hold ``T × width`` scores."""
    validate_fp8_lightning_indexer(q_rows, weights, k_rows, block_table, cu_seqlens_q, seq_lens_k, top_k)
    op = "fp8_lightning_indexer"
    require_launchable(op, q_rows.device)
    _check_byte_order(op)
    device = q_rows.device
    num_tokens = q_rows.shape[0]
    width = block_table.shape[1] * k_rows.shape[1]
    out = torch.full((num_tokens, top_k), -1, dtype=torch.int32, device=device)
    k = min(top_k, width)
    if k == 0 or num_tokens == 0:
        return out
    req, visible = _requests(cu_seqlens_q, seq_lens_k, num_tokens, device)
    table = block_table.to(device)
    rows = max(1, min(num_tokens, _indexer.SCORE_BUFFER // width))
    buffer = torch.empty((rows, width), dtype=torch.float32, device=device)
    for t0 in range(0, num_tokens, rows):
        t1 = min(num_tokens, t0 + rows)
        scores = buffer[: t1 - t0]
        _launch_scores(q_rows[t0:t1], weights[t0:t1], k_rows, table, req[t0:t1], visible[t0:t1], scores)
        _launch_topk(scores, visible[t0:t1], out[t0:t1], k)
    return out


KERNELS = {
    "fp8_lightning_indexer": triton_fp8_lightning_indexer,
    "hadamard_quant_fp8": triton_hadamard_quant_fp8,
}
