"""Triton kernels of the lightning-indexer ops.

* Scores (``lightning_indexer_scores`` and the scoring half of both top-k ops): grid ``(T, key tiles)``;
  a program gathers ``BLOCK_S`` keys of its query's request through the block table, multiplies them
  with the query's ``[H, D]`` tile (``tl.dot``: fp32 in IEEE precision, bf16 with fp32 accumulation,
  int8 with exact int32 accumulation), then applies the scales, ``relu`` and the head weights, and writes
  ``−inf`` past the query's visible length.
* Top-k (``lightning_indexer``, ``quant_lightning_indexer``): one program per query row. Each score is
  packed with its position into one int64 key, ``(order-preserving score bits << 32) | (2³² − 1 − pos)``,
  so every key is distinct and key order is the op's order: higher score first, equal scores by lower
  position. The program keeps the best ``KP`` keys sorted descending and folds in the row tile by tile:
  a tile whose best key beats the list's worst is sorted ascending and taken element-wise ``max`` with
  the list (a bitonic split: the result holds exactly the ``KP`` largest of both), which is then merged
  back into descending order. Positions past the visible length never enter; slots left empty decode to
  ``−1``. The top-k ops score at most ``SCORE_BUFFER`` floats at a time (chunks of query tokens);
  :func:`lightning_indexer_scores_topk` keeps the whole score matrix and returns it with the top-k (one
  scoring pass for callers that need both, such as the residency ``"score"`` policy).
* ``hadamard_quant_int8``: one program per row; the fast Walsh–Hadamard butterflies run in registers in
  the same stage order as the reference (bit-identical fp32), then the row's scale and round-half-to-even
  quantisation.

The ``launch_*`` entry points run the top-k and ``hadamard_quant_int8`` kernels without the checks that
need a host synchronisation, for callers whose input is valid by construction (the sparse decode
runtime's device step, and ``lightning_indexer_manage``'s unchecked launch in ``residency``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_kvoffload.ops.indexer import (
    _visible_lengths,
    hadamard_norm,
    validate_hadamard_quant_int8,
    validate_lightning_indexer,
    validate_lightning_indexer_scores,
    validate_quant_lightning_indexer,
)
from torch_kvoffload.ops.triton import device_guard, interpreting, require_launchable

__all__ = [
    "KERNELS",
    "launch_hadamard_quant_int8",
    "launch_indexer_topk",
    "lightning_indexer_scores_topk",
    "triton_hadamard_quant_int8",
    "triton_lightning_indexer",
    "triton_lightning_indexer_scores",
    "triton_quant_lightning_indexer",
]

#: Keys per scoring program.
BLOCK_S = 64
#: Head-dim chunk per ``tl.dot`` step (the loop covers any ``D``).
MAX_BLOCK_D = 128
#: Keys folded into the running top-k per step (the best list is at least this long).
MIN_TOPK_TILE = 64
#: Top-k key of an empty slot: below every packed (score, position) key; decodes to −1.
EMPTY_KEY = tl.constexpr(-(2**63))
#: Scores (fp32 elements) the top-k ops buffer at a time.
SCORE_BUFFER = 1 << 24
#: ``tl.dot`` needs every tile dim to be at least this ...
MIN_DOT = 16
#: ... and an int8 ``tl.dot`` a reduction dim of at least this.
MIN_DOT_K_INT8 = 32


@triton.jit
def _scores_kernel(
    q_ptr,
    w_ptr,
    qs_ptr,
    k_ptr,
    ks_ptr,
    table_ptr,
    req_ptr,
    vis_ptr,
    out_ptr,
    H,
    D,
    width,
    block_size,
    q_st,
    q_sh,
    q_sd,
    w_st,
    w_sh,
    qs_st,
    qs_sh,
    k_sb,
    k_ss,
    k_sd,
    ks_sb,
    ks_ss,
    tb_sb,
    tb_sj,
    out_st,
    QUANT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
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
    off = s % block_size
    key_base = blk * k_sb + off * k_ss
    h = tl.arange(0, BLOCK_H)
    hm = h < H
    if QUANT:
        acc = tl.zeros((BLOCK_S, BLOCK_H), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_S, BLOCK_H), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        keys = tl.load(
            k_ptr + key_base[:, None] + d[None, :] * k_sd, mask=valid[:, None] & dm[None, :], other=0
        )
        qt = tl.load(
            q_ptr + t * q_st + h[None, :] * q_sh + d[:, None] * q_sd, mask=dm[:, None] & hm[None, :], other=0
        )
        if QUANT:
            acc = tl.dot(keys, qt, acc, out_dtype=tl.int32)
        elif UPCAST:
            acc = tl.dot(keys.to(tl.float32), qt.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(keys, qt, acc, input_precision="ieee")
        else:
            acc = tl.dot(keys, qt, acc)
    if QUANT:
        qs = tl.load(qs_ptr + t * qs_st + h * qs_sh, mask=hm, other=0.0)
        ks = tl.load(ks_ptr + blk * ks_sb + off * ks_ss, mask=valid, other=0.0)
        logits = acc.to(tl.float32) * qs[None, :] * ks[:, None]
    else:
        logits = acc
    w = tl.load(w_ptr + t * w_st + h * w_sh, mask=hm, other=0.0).to(tl.float32)
    score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + t * out_st + s, score, mask=s < width)


@triton.jit
def _compare_swap(x, N: tl.constexpr, J: tl.constexpr, S: tl.constexpr, DESC: tl.constexpr):
    """One bitonic step on ``x [N]``: pairs at distance ``J``; runs of ``S`` elements alternate direction,
    the first one descending when ``DESC`` (``S = N``: one run)."""
    v = tl.permute(tl.reshape(x, (N // (2 * J), 2, J)), (0, 2, 1))
    a, b = tl.split(v)  # [N / 2J, J] each
    run = (tl.arange(0, N // (2 * J)) * (2 * J)) // S
    desc = ((run % 2) == (0 if DESC else 1))[:, None]
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    first = tl.where(desc, hi, lo)
    second = tl.where(desc, lo, hi)
    return tl.reshape(tl.permute(tl.join(first, second), (0, 2, 1)), (N,))


@triton.jit
def _sort(x, N: tl.constexpr, LOG_N: tl.constexpr, DESC: tl.constexpr):
    """Bitonic sort of ``x [N]``, descending when ``DESC`` else ascending."""
    for stage in tl.static_range(1, LOG_N + 1):
        for sub in tl.static_range(stage):
            x = _compare_swap(x, N, 1 << (stage - 1 - sub), 1 << stage, DESC)
    return x


@triton.jit
def _merge_desc(x, N: tl.constexpr, LOG_N: tl.constexpr):
    """Sort a bitonic sequence ``x [N]`` descending (the merge half of a bitonic sort)."""
    for sub in tl.static_range(LOG_N):
        x = _compare_swap(x, N, 1 << (LOG_N - 1 - sub), N, True)
    return x


@triton.jit
def _topk_kernel(scores_ptr, vis_ptr, out_ptr, k, sc_st, out_st, KP: tl.constexpr, LOG_KP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(vis_ptr + t)
    lane = tl.arange(0, KP).to(tl.int64)
    low = tl.full((KP,), 4294967295, tl.int64)  # 2^32 - 1, typed: a bare literal would be uint32
    best = tl.full((KP,), EMPTY_KEY, tl.int64)  # sorted descending
    for start in range(0, n, KP):
        pos = start + lane
        m = pos < n
        sc = tl.load(scores_ptr + t * sc_st + pos, mask=m, other=0.0)
        sc = tl.where(sc == 0.0, 0.0, sc)  # −0 and +0 are equal scores
        sc = tl.where(sc != sc, float("nan"), sc)  # one NaN, above +inf (as a descending sort puts it)
        bits = sc.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order of the floats
        key = (ordered.to(tl.int64) << 32) | (low - pos)
        key = tl.where(m, key, EMPTY_KEY)
        if tl.max(key, axis=0) > tl.min(best, axis=0):
            # best descending, the tile ascending: their element-wise max is the KP largest of both,
            # as a bitonic sequence
            tile = _sort(key, KP, LOG_KP, False)
            best = _merge_desc(tl.maximum(best, tile), KP, LOG_KP)
    pos = low - (best & low)
    res = tl.where(best == EMPTY_KEY, -1, pos).to(tl.int32)
    tl.store(out_ptr + t * out_st + lane, res, mask=lane < k)


@triton.jit
def _fwht(x, D: tl.constexpr, LOG_D: tl.constexpr):
    """The unnormalised fast Walsh–Hadamard transform of fp32 ``x [D]`` (``D = 2^LOG_D``), with the
    reference's additions in its order (``indexer_reference.fwht``)."""
    for i in tl.static_range(LOG_D):
        # stage h = 2^i: each pair (a, b) at distance h becomes (a + b, a − b)
        v = tl.permute(tl.reshape(x, (D // (2 << i), 2, 1 << i)), (0, 2, 1))
        a, b = tl.split(v)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (D,))
    return x


@triton.jit
def _hadamard_kernel(x_ptr, q_ptr, s_ptr, x_st, q_st, norm, D: tl.constexpr, LOG_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    y = _fwht(tl.load(x_ptr + r * x_st + d).to(tl.float32), D, LOG_D) * norm
    amax = tl.max(tl.abs(y), axis=0)
    scale = tl.div_rn(amax + tl.zeros((D,), tl.float32), 127.0)
    safe = tl.where(scale > 0.0, scale, 1.0)
    v = tl.div_rn(y, safe)
    f = tl.floor(v)
    frac = v - f
    odd = f - 2.0 * tl.floor(f * 0.5)  # 1 when f is odd: halves round to the even neighbour
    rounded = tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))
    qv = tl.minimum(tl.maximum(rounded, -127.0), 127.0)
    tl.store(q_ptr + r * q_st + d, qv.to(tl.int8))
    tl.store(s_ptr + r + d, scale, mask=d == 0)


# ---------------------------------------------------------------------------------------- launchers


def _requests(cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, num_tokens: int, device: torch.device):
    """int64 ``[T]`` request of each query token and int64 ``[T]`` keys it sees, on ``device``."""
    cu = cu_seqlens_q.to(device=device, dtype=torch.int64)
    tok = torch.arange(num_tokens, device=device)
    req = torch.searchsorted(cu[1:], tok, right=True)
    visible = _visible_lengths(cu, seq_lens_k.to(device), num_tokens)
    return req.contiguous(), visible.contiguous()


def _launch_scores(q, weights, q_scale, k_cache, k_scale, table, req, visible, out) -> None:
    """Write the scores of the ``out.shape[0]`` query rows of ``q`` (validated input) into ``out``."""
    num_tokens, heads, dim = q.shape
    width = out.shape[1]
    quant = q_scale is not None
    if not quant:
        q_scale, k_scale = weights, k_cache  # unused by the float path; any pointer will do
    block_h = max(MIN_DOT, triton.next_power_of_2(heads))
    block_d = max(MIN_DOT_K_INT8 if quant else MIN_DOT, min(MAX_BLOCK_D, triton.next_power_of_2(dim)))
    grid = (num_tokens, triton.cdiv(width, BLOCK_S))
    with device_guard(q.device):
        _scores_kernel[grid](
            q,
            weights,
            q_scale,
            k_cache,
            k_scale,
            table,
            req,
            visible,
            out,
            heads,
            dim,
            width,
            k_cache.shape[1],
            *q.stride(),
            *weights.stride(),
            q_scale.stride(0),
            q_scale.stride(1),
            *k_cache.stride(),
            k_scale.stride(0),
            k_scale.stride(1),
            *table.stride(),
            out.stride(0),
            QUANT=quant,
            IEEE=q.dtype == torch.float32,
            # the interpreter's bf16 tl.dot is wrong; fp32 of the same values gives the same exact products
            UPCAST=interpreting() and q.dtype == torch.bfloat16,
            BLOCK_S=BLOCK_S,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
        )


def _launch_topk(scores: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, k: int) -> None:
    """Write the best ``k`` (``1 <= k <= width``) positions of each score row into ``out[:, :k]``."""
    width = scores.shape[1]
    # The best-list length: at least k, and at least MIN_TOPK_TILE keys per step unless the rows are short.
    kp = max(triton.next_power_of_2(k), min(MIN_TOPK_TILE, triton.next_power_of_2(width)), 2)
    with device_guard(scores.device):
        _topk_kernel[(scores.shape[0],)](
            scores, visible, out, k, scores.stride(0), out.stride(0), KP=kp, LOG_KP=kp.bit_length() - 1
        )


def _topk(scores: torch.Tensor, visible: torch.Tensor, top_k: int) -> torch.Tensor:
    """int32 ``[T, top_k]`` best positions of fp32 ``scores [T, W]`` rows over their first ``visible[t]``
    entries (descending, ties by lower position), ``−1`` padded."""
    out = torch.full((scores.shape[0], top_k), -1, dtype=torch.int32, device=scores.device)
    k = min(top_k, scores.shape[1])
    if k and scores.shape[0]:
        _launch_topk(scores, visible.to(device=scores.device, dtype=torch.int64), out, k)
    return out


def _scores(op, q, weights, q_scale, k_cache, k_scale, block_table, cu_seqlens_q, seq_lens_k) -> torch.Tensor:
    """fp32 ``[T, max_blocks * block_size]`` scores of validated input."""
    require_launchable(op, q.device)
    num_tokens = q.shape[0]
    out = torch.empty(
        (num_tokens, block_table.shape[1] * k_cache.shape[1]), dtype=torch.float32, device=q.device
    )
    if out.numel():
        req, visible = _requests(cu_seqlens_q, seq_lens_k, num_tokens, q.device)
        table = block_table.to(q.device)
        _launch_scores(q, weights, q_scale, k_cache, k_scale, table, req, visible, out)
    return out


def _indexer(op, q, weights, q_scale, k_cache, k_scale, block_table, cu_seqlens_q, seq_lens_k, top_k):
    """int32 ``[T, top_k]`` top-k positions of validated input; scores are buffered for at most
    ``SCORE_BUFFER`` floats at a time, so prefill-sized calls never hold ``T × width`` scores."""
    require_launchable(op, q.device)
    num_tokens = q.shape[0]
    width = block_table.shape[1] * k_cache.shape[1]
    out = torch.full((num_tokens, top_k), -1, dtype=torch.int32, device=q.device)
    k = min(top_k, width)
    if k == 0 or num_tokens == 0:
        return out
    req, visible = _requests(cu_seqlens_q, seq_lens_k, num_tokens, q.device)
    table = block_table.to(q.device)
    rows = max(1, min(num_tokens, SCORE_BUFFER // width))
    buffer = torch.empty((rows, width), dtype=torch.float32, device=q.device)
    for t0 in range(0, num_tokens, rows):
        t1 = min(num_tokens, t0 + rows)
        scores = buffer[: t1 - t0]
        qs = None if q_scale is None else q_scale[t0:t1]
        _launch_scores(
            q[t0:t1], weights[t0:t1], qs, k_cache, k_scale, table, req[t0:t1], visible[t0:t1], scores
        )
        _launch_topk(scores, visible[t0:t1], out[t0:t1], k)
    return out


# ----------------------------------------------------------------------------------------- wrappers


def triton_lightning_indexer_scores(
    q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k
) -> torch.Tensor:
    """Triton ``lightning_indexer_scores``: fp32 ``[T, max_blocks * block_size]``, ``−inf`` past each
    query's visible keys (contract of the op)."""
    validate_lightning_indexer_scores(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)
    op = "lightning_indexer_scores"
    return _scores(op, q, weights, None, k_cache, None, block_table, cu_seqlens_q, seq_lens_k)


def triton_lightning_indexer(
    q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k: int
) -> torch.Tensor:
    """Triton ``lightning_indexer``: int32 ``[T, top_k]`` key positions, ``−1`` padded (op contract)."""
    validate_lightning_indexer(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k)
    op = "lightning_indexer"
    return _indexer(op, q, weights, None, k_cache, None, block_table, cu_seqlens_q, seq_lens_k, top_k)


def lightning_indexer_scores_topk(
    q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lightning_indexer_scores`` and ``lightning_indexer`` of the same input from one scoring pass.

    Validates once (``lightning_indexer``'s checks and messages), runs the scores kernel into one fp32
    ``[T, max_blocks * block_size]`` buffer and the top-k kernel on that buffer. Returns
    ``(scores fp32 [T, W], topk int32 [T, top_k])``, each equal to what its op returns. Unlike
    ``lightning_indexer`` the scores are held whole (``T × W`` floats), which suits decode-sized ``T``.
    """
    validate_lightning_indexer(q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, top_k)
    require_launchable("lightning_indexer", q.device)
    num_tokens = q.shape[0]
    width = block_table.shape[1] * k_cache.shape[1]
    scores = torch.empty((num_tokens, width), dtype=torch.float32, device=q.device)
    topk = torch.full((num_tokens, top_k), -1, dtype=torch.int32, device=q.device)
    if scores.numel():
        req, visible = _requests(cu_seqlens_q, seq_lens_k, num_tokens, q.device)
        table = block_table.to(q.device)
        _launch_scores(q, weights, None, k_cache, None, table, req, visible, scores)
        k = min(top_k, width)
        if k:
            _launch_topk(scores, visible, topk, k)
    return scores, topk


def triton_quant_lightning_indexer(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k, top_k: int
) -> torch.Tensor:
    """Triton ``quant_lightning_indexer``: int32 ``[T, top_k]`` key positions from int8 queries and keys."""
    validate_quant_lightning_indexer(
        q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k, top_k
    )
    return _indexer(
        "quant_lightning_indexer",
        q_int8,
        weights,
        q_scale,
        k_int8_cache,
        k_scale_cache,
        block_table,
        cu_seqlens_q,
        seq_lens_k,
        top_k,
    )


def triton_hadamard_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``hadamard_quant_int8``: int8 ``[..., D]`` values and fp32 ``[...]`` scales (op contract)."""
    validate_hadamard_quant_int8(x)
    require_launchable("hadamard_quant_int8", x.device)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    launch_hadamard_quant_int8(x, q, scale, hadamard_norm(x.shape[-1]))
    return q, scale


# ------------------------------------------------------------------------------- unchecked launches


def launch_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    topk: torch.Tensor,
    *,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The lightning indexer's top-k of validated input written into ``topk int32 [T, K]`` (unit last stride).

    The floating path (``q [T, H, D]``, ``k_cache [num_blocks, block_size, D]``), or the int8 path with
    ``q_scale fp32 [T, H]`` and ``k_scale fp32 [num_blocks, block_size]`` (``q`` / ``k_cache`` int8).
    Returns the fp32 ``[T, max_blocks * block_size]`` scores the top-k was taken from (held whole: meant
    for decode-sized ``T``). Nothing is read back to the host; the request description must be valid
    (the checked ops verify it with a host synchronisation).
    """
    T, K = topk.shape
    width = block_table.shape[1] * k_cache.shape[1]
    scores = torch.empty((T, width), dtype=torch.float32, device=q.device)
    k = min(K, width)
    if k < K:
        topk[:, k:].fill_(-1)
    if T == 0 or k == 0:
        scores.fill_(float("-inf"))
        return scores
    req, visible = _requests(cu_seqlens_q, seq_lens_k, T, q.device)
    table = block_table.to(q.device)
    _launch_scores(q, weights, q_scale, k_cache, k_scale, table, req, visible, scores)
    _launch_topk(scores, visible, topk, k)
    return scores


def launch_hadamard_quant_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, norm: float) -> None:
    """``hadamard_quant_int8`` of ``x [..., D]`` (``D`` a power of two) into int8 ``q [..., D]`` and fp32
    ``scale [...]`` (contiguous), without the finiteness check (a host synchronisation). ``norm`` is
    :func:`torch_kvoffload.ops.indexer.hadamard_norm` of ``D``, computed once by the caller."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.shape[0] == 0:
        return
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    with device_guard(x.device):
        _hadamard_kernel[(rows.shape[0],)](
            rows, q, scale, rows.stride(0), dim, norm, D=dim, LOG_D=dim.bit_length() - 1
        )


KERNELS = {
    "hadamard_quant_int8": triton_hadamard_quant_int8,
    "lightning_indexer": triton_lightning_indexer,
    "lightning_indexer_scores": triton_lightning_indexer_scores,
    "quant_lightning_indexer": triton_quant_lightning_indexer,
}
