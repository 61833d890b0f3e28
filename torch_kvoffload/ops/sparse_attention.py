"""Sparse MLA attention over selected latent rows, and Copy-SFA (miss-row copy fused with it).

Absorbed MLA (DeepSeek-V3 latent attention) with one shared KV head: for query token ``t`` and head ``h``,
``s_i = scale · (q_nope[t,h] · kv_c[i] + q_pe[t,h] · k_pe[i])`` over the rows ``i`` selected by
``indices[t]`` only (``−1`` entries skipped), ``p = softmax(s)``, ``out[t,h] = Σ_i p_i · kv_c[i]`` (latent
space, ``Dc`` wide) and ``lse[t,h] = log Σ_i exp(s_i)``. Everything accumulates in fp32.

``scatter_copy_sparse_mla_attention`` (Copy-SFA) is the sparse-decode step of one layer: it copies the
rows missed by the residency table from the paged host pool into per-row hot buffers, then attends over
the hot-buffer slots chosen by the residency table.

This module defines the two ops (schema, fake and reference kernel, typed wrapper) and their checks,
which the device kernels run too; the reference kernels' formulas are
:mod:`torch_kvoffload.ops.sparse_attention_reference`.
"""

from __future__ import annotations

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops import sparse_attention_reference as ref
from torch_kvoffload.ops._registry import define_op

__all__ = [
    "check_copy_sfa_lists",
    "check_copy_sfa_misses",
    "copy_sfa_miss_slots",
    "scatter_copy_sparse_mla_attention",
    "sparse_mla_attention",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def _check_queries(op: str, q_nope: torch.Tensor, q_pe: torch.Tensor) -> None:
    _checks.check_dtype(op, "q_nope", q_nope, FLOAT_DTYPES)
    _checks.check_dim(op, "q_nope", q_nope, 3)
    _checks.check_dim(op, "q_pe", q_pe, 3)
    _checks.check_same_dtype(op, "q_nope", q_nope, "q_pe", q_pe)
    if q_pe.shape[:2] != q_nope.shape[:2]:
        _checks.fail(
            op,
            f"argument 'q_pe' must have shape [{q_nope.shape[0]}, {q_nope.shape[1]}, Dr] ([T, H] of 'q_nope'), "
            f"got {list(q_pe.shape)}",
        )


def _check_rows(
    op: str, q_nope, q_pe, kv_name: str, kv: torch.Tensor, pe_name: str, pe: torch.Tensor, dims: int
):
    """Latent / rope row tensors with ``dims`` leading dims whose last dim matches the queries."""
    _checks.check_dim(op, kv_name, kv, dims + 1)
    _checks.check_dim(op, pe_name, pe, dims + 1)
    _checks.check_same_dtype(op, "q_nope", q_nope, kv_name, kv)
    _checks.check_same_dtype(op, "q_nope", q_nope, pe_name, pe)
    if kv.shape[-1] != q_nope.shape[-1]:
        _checks.fail(
            op,
            f"argument '{kv_name}' must have last dim {q_nope.shape[-1]} (Dc of 'q_nope'), got shape {list(kv.shape)}",
        )
    if pe.shape[-1] != q_pe.shape[-1]:
        _checks.fail(
            op,
            f"argument '{pe_name}' must have last dim {q_pe.shape[-1]} (Dr of 'q_pe'), got shape {list(pe.shape)}",
        )
    if pe.shape[:-1] != kv.shape[:-1]:
        _checks.fail(
            op,
            f"'{kv_name}' and '{pe_name}' must have the same leading shape, got {list(kv.shape)} and {list(pe.shape)}",
        )


def _check_devices(op: str, q_nope: torch.Tensor, named: dict[str, torch.Tensor]) -> None:
    for arg, t in named.items():
        if t.device != q_nope.device:
            _checks.fail(op, f"argument '{arg}' must be on {q_nope.device} (as 'q_nope'), got {t.device}")


def _check_index_range(op: str, arg: str, idx: torch.Tensor, limit: int) -> None:
    """Entries of ``idx`` are ``−1`` (skip) or in ``[0, limit)``."""
    if idx.numel() == 0:
        return
    flat = idx.flatten()
    bad = ((flat < -1) | (flat >= limit)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        pos = [int(v) for v in torch.unravel_index(torch.tensor(i), tuple(idx.shape))]
        fail_at = ", ".join(str(p) for p in pos)
        _checks.fail(
            op,
            f"argument '{arg}' entry [{fail_at}] is {int(flat[i])}, expected -1 or a value in [0, {limit})",
            IndexError,
        )


# ----------------------------------------------------------------------------------- sparse_mla_attention


def _sparse_structure(op: str, q_nope, q_pe, kv_c, k_pe, indices) -> None:
    _check_queries(op, q_nope, q_pe)
    _check_rows(op, q_nope, q_pe, "kv_c", kv_c, "k_pe", k_pe, 1)
    _checks.check_dtype(op, "indices", indices, (torch.int32,))
    _checks.check_dim(op, "indices", indices, 2)
    if indices.shape[0] != q_nope.shape[0]:
        _checks.fail(
            op,
            f"argument 'indices' must have {q_nope.shape[0]} rows (T of 'q_nope'), got shape {list(indices.shape)}",
        )
    _check_devices(op, q_nope, {"q_pe": q_pe, "kv_c": kv_c, "k_pe": k_pe, "indices": indices})


def _sparse_fake(q_nope, q_pe, kv_c, k_pe, indices, scale):
    _sparse_structure("sparse_mla_attention", q_nope, q_pe, kv_c, k_pe, indices)
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty(q_nope.shape[:2], dtype=torch.float32)


def _sparse_reference(q_nope, q_pe, kv_c, k_pe, indices, scale):
    op = "sparse_mla_attention"
    _sparse_structure(op, q_nope, q_pe, kv_c, k_pe, indices)
    _check_index_range(op, "indices", indices, kv_c.shape[0])
    return ref.attend_rows(q_nope, q_pe, kv_c, k_pe, indices, scale)


_sparse_op = define_op(
    "sparse_mla_attention",
    "(Tensor q_nope, Tensor q_pe, Tensor kv_c, Tensor k_pe, Tensor indices, float scale) -> (Tensor, Tensor)",
    fake=_sparse_fake,
    reference=_sparse_reference,
)


def sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention over the latent rows selected by ``indices``.

    Parameters
    ----------
    q_nope : Tensor
        ``[T, H, Dc]`` fp32 or bf16 (queries absorbed into the latent space).
    q_pe : Tensor
        ``[T, H, Dr]``, dtype of ``q_nope``: rotary part of the queries.
    kv_c : Tensor
        ``[N, Dc]``, dtype of ``q_nope``: latent rows (``c_kv``).
    k_pe : Tensor
        ``[N, Dr]``, dtype of ``q_nope``: rotary key rows.
    indices : Tensor
        ``int32 [T, K]``: rows attended by token ``t``; ``−1`` entries are skipped; a row listed twice is
        attended twice (as a dense gather would).
    scale : float
        Softmax scale.

    Returns
    -------
    (Tensor, Tensor)
        ``out [T, H, Dc]`` in ``q_nope``'s dtype and ``lse fp32 [T, H]`` (natural log). A token with no valid
        index gets ``out = 0`` and ``lse = −inf``.

    Raises ``IndexError`` for an index ``>= N`` or ``< −1``; ``ValueError`` / ``TypeError`` for bad shapes
    or dtypes.

    Example
    -------
    >>> q_nope, q_pe = torch.randn(2, 16, 512), torch.randn(2, 16, 64)
    >>> kv_c, k_pe = torch.randn(100, 512), torch.randn(100, 64)
    >>> idx = torch.tensor([[3, 7, -1], [0, 99, 5]], dtype=torch.int32)
    >>> out, lse = sparse_mla_attention(q_nope, q_pe, kv_c, k_pe, idx, 576 ** -0.5)
    """
    return _sparse_op(q_nope, q_pe, kv_c, k_pe, indices, scale)


# ------------------------------------------------------------------------ scatter_copy_sparse_mla_attention


def _copy_sfa_structure(
    op, q_nope, q_pe, host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots,
    miss_count, slots, out, lse,
) -> None:  # fmt: skip
    _check_queries(op, q_nope, q_pe)
    _check_rows(op, q_nope, q_pe, "host_kv_c", host_kv_c, "host_k_pe", host_k_pe, 2)
    _check_rows(op, q_nope, q_pe, "hot_kv_c", hot_kv_c, "hot_k_pe", hot_k_pe, 2)
    check_copy_sfa_lists(op, q_nope, "hot_kv_c", hot_kv_c, block_table, miss_tokens, miss_slots, miss_count,
                         slots, out, lse)  # fmt: skip
    # The host pool is read where it lives (e.g. pinned CPU memory while the hot buffers sit on the
    # accelerator); the small index tensors may be on either side.
    _check_devices(
        op,
        q_nope,
        {"q_pe": q_pe, "hot_kv_c": hot_kv_c, "hot_k_pe": hot_k_pe, "slots": slots, "out": out, "lse": lse},
    )
    if host_k_pe.device != host_kv_c.device:
        _checks.fail(
            op, f"argument 'host_k_pe' must be on {host_kv_c.device} (as 'host_kv_c'), got {host_k_pe.device}"
        )


def check_copy_sfa_lists(
    op, q_nope, hot_name, hot, block_table, miss_tokens, miss_slots, miss_count, slots, out, lse
) -> None:
    """The structure of a Copy-SFA op's index tensors (``int32``, ``R`` rows), of its hot buffer's rows
    (``hot_name``) and of ``out`` / ``lse``: the checks the floating and the FP8 Copy-SFA share."""
    rows = q_nope.shape[0]
    for arg, t, dim in (
        ("block_table", block_table, 2),
        ("miss_tokens", miss_tokens, 2),
        ("miss_slots", miss_slots, 2),
        ("miss_count", miss_count, 1),
        ("slots", slots, 2),
    ):
        _checks.check_dtype(op, arg, t, (torch.int32,))
        _checks.check_dim(op, arg, t, dim)
        if t.shape[0] != rows:
            _checks.fail(
                op, f"argument '{arg}' must have {rows} rows (R of 'q_nope'), got shape {list(t.shape)}"
            )
    if hot.shape[0] != rows:
        _checks.fail(
            op, f"argument '{hot_name}' must have {rows} rows (R of 'q_nope'), got shape {list(hot.shape)}"
        )
    if miss_slots.shape != miss_tokens.shape:
        _checks.fail(
            op,
            f"argument 'miss_slots' must have the shape of 'miss_tokens' {list(miss_tokens.shape)}, "
            f"got {list(miss_slots.shape)}",
        )
    _checks.check_same_dtype(op, "q_nope", q_nope, "out", out)
    if out.shape != q_nope.shape:
        _checks.fail(
            op, f"argument 'out' must have shape {list(q_nope.shape)} (as 'q_nope'), got {list(out.shape)}"
        )
    _checks.check_dtype(op, "lse", lse, (torch.float32,))
    if lse.shape != q_nope.shape[:2]:
        _checks.fail(
            op, f"argument 'lse' must have shape {list(q_nope.shape[:2])} ([R, H]), got {list(lse.shape)}"
        )


def _first_repeat(values: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``[R, M]`` mask: live entries whose value occurs at an earlier live entry of the same row."""
    big = torch.iinfo(torch.int64).max
    keyed = torch.where(live, values, big)
    order = torch.sort(keyed, dim=1, stable=True).indices
    v = torch.gather(keyed, 1, order)
    again = torch.zeros_like(live)
    again[:, 1:] = (v[:, 1:] == v[:, :-1]) & (v[:, 1:] != big)
    return torch.zeros_like(live).scatter_(1, order, again)


def check_copy_sfa_misses(
    op: str,
    host_kv_c: torch.Tensor,
    block_table: torch.Tensor,
    hot_kv_c: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
) -> None:
    """Value checks of a Copy-SFA miss list (every kernel runs them before writing anything).

    Raises for the first bad row, in row order: a ``miss_count`` outside ``[0, M]``; then, for its used
    entries in order, a miss token outside the row's ``max_blocks x block_size`` positions
    (``IndexError``), a block-table entry outside the pool (``IndexError``), a slot outside ``[0, C)``
    (``IndexError``), a slot already used by an earlier miss of the row (``ValueError``). Vectorised on the
    index tensors (moved to ``miss_count``'s device); one host synchronisation when the list is valid.
    """
    rows = miss_count.shape[0]
    if rows == 0:
        return
    num_blocks, block_size = host_kv_c.shape[0], host_kv_c.shape[1]
    capacity = hot_kv_c.shape[1]
    max_blocks = block_table.shape[1]
    width = miss_tokens.shape[1]
    positions = max_blocks * block_size
    device = miss_count.device
    count = miss_count.long()
    tok = miss_tokens.to(device).long()
    slot = miss_slots.to(device).long()
    table = block_table.to(device)
    count_bad = (count < 0) | (count > width)
    live = torch.arange(width, device=device)[None, :] < count.clamp(0, width)[:, None]
    tok_bad = live & ((tok < 0) | (tok >= positions))
    if positions:
        blk_col = tok.clamp(0, positions - 1) // block_size
        blk = torch.gather(table.long(), 1, blk_col)
    else:
        blk_col = blk = torch.zeros_like(tok)
    blk_bad = live & ~tok_bad & ((blk < 0) | (blk >= num_blocks))
    slot_bad = live & ~tok_bad & ~blk_bad & ((slot < 0) | (slot >= capacity))
    entry_bad = tok_bad | blk_bad | slot_bad | _first_repeat(slot, live)
    row_bad = count_bad | entry_bad.any(dim=1)
    if not bool(row_bad.any()):
        return
    r = int(row_bad.nonzero()[0, 0])
    if bool(count_bad[r]):
        _checks.fail(
            op, f"argument 'miss_count' entry {r} is {int(count[r])}, expected a value in [0, {width}]"
        )
    i = int(entry_bad[r].nonzero()[0, 0])
    t, sl = int(tok[r, i]), int(slot[r, i])
    if bool(tok_bad[r, i]):
        _checks.fail(
            op,
            f"argument 'miss_tokens' entry [{r}, {i}] is {t}, expected a value in "
            f"[0, {positions}) (max_blocks x block_size)",
            IndexError,
        )
    if bool(blk_bad[r, i]):
        _checks.fail(
            op,
            f"argument 'block_table' entry [{r}, {int(blk_col[r, i])}] (block of miss token {t}) is "
            f"{int(blk[r, i])}, expected a value in [0, {num_blocks})",
            IndexError,
        )
    if bool(slot_bad[r, i]):
        _checks.fail(
            op,
            f"argument 'miss_slots' entry [{r}, {i}] is {sl}, expected a value in [0, {capacity})",
            IndexError,
        )
    _checks.fail(
        op,
        f"argument 'miss_slots' row {r} holds destination {sl} more than once; destinations must be distinct",
    )


def copy_sfa_miss_slots(
    op: str,
    host_kv_c: torch.Tensor,
    block_table: torch.Tensor,
    hot_kv_c: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the miss list; return the flat ``int64`` host slots and hot slots of every valid miss.

    Host slot = ``block_table[r, tok // block_size] * block_size + tok % block_size`` (a row of the pool viewed
    ``[num_blocks * block_size, ...]``); hot slot = ``r * C + miss_slots[r, i]``. These are exactly the
    ``src_slots`` / ``dst_slots`` of :func:`torch_kvoffload.ops.copy_rows` from the host pool into the hot
    buffer, in row-major miss order, on ``miss_count``'s device.
    """
    check_copy_sfa_misses(op, host_kv_c, block_table, hot_kv_c, miss_tokens, miss_slots, miss_count)
    device = miss_count.device
    block_size, capacity = host_kv_c.shape[1], hot_kv_c.shape[1]
    width = miss_tokens.shape[1]
    live = torch.arange(width, device=device)[None, :] < miss_count.long()[:, None]
    r, i = live.nonzero(as_tuple=True)
    tok = miss_tokens.to(device).long()[r, i]
    blk = block_table.to(device).long()[r, tok // block_size]
    return blk * block_size + tok % block_size, r * capacity + miss_slots.to(device).long()[r, i]


def _copy_sfa_fake(
    q_nope, q_pe, host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots, miss_count,
    slots, scale, out, lse,
) -> None:  # fmt: skip
    _copy_sfa_structure(
        "scatter_copy_sparse_mla_attention", q_nope, q_pe, host_kv_c, host_k_pe, block_table, hot_kv_c,
        hot_k_pe, miss_tokens, miss_slots, miss_count, slots, out, lse,
    )  # fmt: skip


def _copy_sfa_reference(
    q_nope, q_pe, host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots, miss_count,
    slots, scale, out, lse,
) -> None:  # fmt: skip
    op = "scatter_copy_sparse_mla_attention"
    _copy_sfa_structure(
        op, q_nope, q_pe, host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots,
        miss_count, slots, out, lse,
    )  # fmt: skip
    src, dst = copy_sfa_miss_slots(op, host_kv_c, block_table, hot_kv_c, miss_tokens, miss_slots, miss_count)
    _check_index_range(op, "slots", slots, hot_kv_c.shape[1])
    # Snapshot the inputs that share memory with a written tensor: the op reads them as they were.
    host_kv_c = _checks.unaliased_source(host_kv_c, hot_kv_c)
    host_k_pe = _checks.unaliased_source(host_k_pe, hot_k_pe)
    q_nope = _checks.unaliased_source(_checks.unaliased_source(q_nope, out), lse)
    q_pe = _checks.unaliased_source(_checks.unaliased_source(q_pe, out), lse)
    ref.copy_miss_rows(host_kv_c, host_k_pe, hot_kv_c, hot_k_pe, src, dst)
    o, lse_ = ref.attend_hot_slots(q_nope, q_pe, hot_kv_c, hot_k_pe, slots, scale)
    out.copy_(o)
    lse.copy_(lse_)


_copy_sfa_op = define_op(
    "scatter_copy_sparse_mla_attention",
    "(Tensor q_nope, Tensor q_pe, Tensor host_kv_c, Tensor host_k_pe, Tensor block_table, Tensor(a!) hot_kv_c, "
    "Tensor(b!) hot_k_pe, Tensor miss_tokens, Tensor miss_slots, Tensor miss_count, Tensor slots, float scale, "
    "Tensor(c!) out, Tensor(d!) lse) -> ()",
    fake=_copy_sfa_fake,
    reference=_copy_sfa_reference,
)


def scatter_copy_sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    host_kv_c: torch.Tensor,
    host_k_pe: torch.Tensor,
    block_table: torch.Tensor,
    hot_kv_c: torch.Tensor,
    hot_k_pe: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Copy-SFA: load the missed rows host→hot buffer, then sparse MLA attention over hot-buffer slots.

    One decode row per query (``R`` rows). Equivalent to :func:`torch_kvoffload.ops.copy_rows` of the missed
    rows (for ``kv_c`` and ``k_pe``) followed by :func:`sparse_mla_attention` over ``hot[r, slots[r]]``; the
    host pool is read in place, never moved wholesale.

    Parameters
    ----------
    q_nope, q_pe : Tensor
        ``[R, H, Dc]`` / ``[R, H, Dr]``, fp32 or bf16.
    host_kv_c, host_k_pe : Tensor
        ``[num_blocks, block_size, Dc]`` / ``[num_blocks, block_size, Dr]``: the layer's paged host pool, on
        any device (read in place; typically pinned CPU memory while everything else is on the accelerator).
    block_table : Tensor
        ``int32 [R, max_blocks]``: row ``r``'s logical block → physical host block.
    hot_kv_c, hot_k_pe : Tensor
        ``[R, C, Dc]`` / ``[R, C, Dr]``: per-row hot buffers; **mutated** (missed rows written).
    miss_tokens : Tensor
        ``int32 [R, M]``: logical token positions to load; the first ``miss_count[r]`` entries of row ``r``
        are used, the rest are ignored (conventionally ``−1``).
    miss_slots : Tensor
        ``int32 [R, M]``: hot-buffer slot in ``[0, C)`` for each miss; distinct within a row.
    miss_count : Tensor
        ``int32 [R]``, each in ``[0, M]``.
    slots : Tensor
        ``int32 [R, K]``: hot-buffer slots to attend (``−1`` skipped, duplicates attended twice).
    scale : float
        Softmax scale.
    out : Tensor
        ``[R, H, Dc]`` in the query dtype; **written** with the attention output.
    lse : Tensor
        ``fp32 [R, H]``; **written** with the log-sum-exp (``−inf`` for a row without valid slot).

    Everything is validated before anything is written: a miss token outside the row's blocks, a block-table
    entry out of range, a slot outside ``[0, C)`` or a duplicated destination slot raises (``IndexError`` /
    ``ValueError`` naming the argument) and leaves the hot buffers, ``out`` and ``lse`` untouched.

    Example
    -------
    >>> R, H, Dc, Dr, C = 2, 16, 512, 64, 8
    >>> pool_c, pool_pe = torch.randn(10, 4, Dc), torch.randn(10, 4, Dr)
    >>> hot_c, hot_pe = torch.zeros(R, C, Dc), torch.zeros(R, C, Dr)
    >>> i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    >>> out, lse = torch.empty(R, H, Dc), torch.empty(R, H)
    >>> scatter_copy_sparse_mla_attention(
    ...     torch.randn(R, H, Dc), torch.randn(R, H, Dr), pool_c, pool_pe, i32([[0, 1], [5, 6]]), hot_c, hot_pe,
    ...     i32([[6, -1], [0, 7]]), i32([[3, -1], [0, 1]]), i32([1, 2]), i32([[3, -1], [0, 1]]), 576 ** -0.5,
    ...     out, lse)
    """
    _copy_sfa_op(
        q_nope, q_pe, host_kv_c, host_k_pe, block_table, hot_kv_c, hot_k_pe, miss_tokens, miss_slots,
        miss_count, slots, scale, out, lse,
    )  # fmt: skip
