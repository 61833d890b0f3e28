"""Residency management of the per-layer hot buffers of sparse decode offload.

``residency_update`` is the per-layer, per-decode-row bookkeeping of DESIGN §7: given the logical top-k
positions a row attends to this step, it finds the hits in the row's hot buffer, assigns hot-buffer slots
to the misses (evicting where needed), remaps the top-k to physical slots and emits the list of missed
rows to copy host→device. ``lightning_indexer_manage`` fuses the lightning indexer, its top-k and the
residency update into one op (see :func:`lightning_indexer_manage` for what is fused).

State (per layer, mutated in place)
-----------------------------------
``slot_to_token`` ``int32 [R, C]``
    the logical position held by each hot slot, ``-1`` for an empty slot.
``lru_order`` ``int32 [R, C]``
    a permutation of ``0..C-1`` per row: the slots from least to most recently used.
``row_request`` ``int64 [R]``
    the request owning each row, ``-1`` for none.

Semantics of one update, per row ``r`` (both policies)
------------------------------------------------------
1. If ``row_request[r] != request_ids[r]`` the row is reset: every slot empty, order ``0..C-1``, and
   ``row_request[r] = request_ids[r]``.
2. Every slot holding a token ``>= stable_len[r]`` is emptied (speculative positions may have been
   rewritten); it keeps its place in the order.
3. Valid top-k entries are the non-negative ones; negative entries are padding (``slots = -1``, neither
   hit nor miss). A valid entry resident in a slot is a hit and keeps its slot.
4. The misses, in top-k order, take ``n_miss`` of the non-hit slots (empty or not) — the *victims*:

   * ``"lru"``: the ``n_miss`` least recently used non-hit slots;
   * ``"score"``: the ``n_miss`` smallest non-hit slots under the key (empty first; then the resident's
     indexer score ``scores[r, token]`` ascending, where a token ``>= scores.shape[1]`` or a NaN score
     counts as ``-inf``; ties by LRU order).

   The i-th miss (top-k order) takes the i-th victim in LRU order.
5. New order: ``[non-hit slots that were not victims, old order] + [victims, miss order] + [hits, old
   order]``.

``evictions[r]`` counts victims that held a token after steps 1–2 (a slot emptied in step 2 held a
stale token that is dropped, not evicted).

Errors (state and outputs untouched): bad shapes / dtypes / devices, ``K > C``, a valid top-k position
occurring twice in one row, a non-reset row whose ``lru_order`` is not a permutation or whose
``slot_to_token`` holds an entry below ``-1`` or holds a top-k position in two slots, a negative
``stable_len``, ``policy="score"`` without ``scores``, an unknown policy.

This module defines the two ops (schema, fake and reference kernel, typed wrapper) and their checks,
which the device kernels run too; the reference kernels' formula is
:mod:`torch_kvoffload.ops.residency_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops import residency_reference as ref
from torch_kvoffload.ops._registry import define_op

__all__ = [
    "POLICIES",
    "ResidencyOutputs",
    "check_residency_values",
    "lightning_indexer_manage",
    "new_residency_outputs",
    "new_residency_state",
    "residency_update",
]

POLICIES = ("lru", "score")

_I32 = (torch.int32,)
_I64 = (torch.int64,)


@dataclass(frozen=True)
class ResidencyOutputs:
    """Per-step outputs of a residency update (all ``int32``).

    ``slots [R, K]``: physical hot slot of every top-k entry, ``-1`` for padding.
    ``miss_tokens / miss_slots [R, K]``: the first ``miss_count[r]`` entries of row ``r`` list the missed
    logical positions (top-k order) and the slots they were given; the rest are ``-1``.
    ``miss_count [R]``, ``evictions [R]``.
    """

    slots: torch.Tensor
    miss_tokens: torch.Tensor
    miss_slots: torch.Tensor
    miss_count: torch.Tensor
    evictions: torch.Tensor

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return (self.slots, self.miss_tokens, self.miss_slots, self.miss_count, self.evictions)


def new_residency_state(
    num_rows: int, capacity: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh ``(slot_to_token, lru_order, row_request)``: all slots empty, identity order, no request."""
    slot_to_token = torch.full((num_rows, capacity), -1, dtype=torch.int32, device=device)
    lru_order = torch.arange(capacity, dtype=torch.int32, device=device).repeat(num_rows, 1)
    row_request = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    return slot_to_token, lru_order, row_request


def new_residency_outputs(num_rows: int, top_k: int, device: torch.device | str = "cpu") -> ResidencyOutputs:
    """Uninitialised output buffers for :func:`residency_update`."""

    def mk(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.int32, device=device)

    return ResidencyOutputs(
        mk(num_rows, top_k), mk(num_rows, top_k), mk(num_rows, top_k), mk(num_rows), mk(num_rows)
    )


# ----------------------------------------------------------------------------------- residency_update


def _check_contiguous(op: str, arg: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        _checks.fail(
            op, f"argument '{arg}' must be contiguous (it is written in place), got strides {t.stride()}"
        )


def _check_shape(op: str, arg: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        _checks.fail(op, f"argument '{arg}' must have shape {what} = {list(shape)}, got {list(t.shape)}")


def _residency_structure(
    op: str,
    slot_to_token: torch.Tensor,
    lru_order: torch.Tensor,
    row_request: torch.Tensor,
    topk: torch.Tensor,
    request_ids: torch.Tensor,
    stable_len: torch.Tensor,
    scores: torch.Tensor | None,
    policy: str,
    slots: torch.Tensor,
    miss_tokens: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    evictions: torch.Tensor,
    *,
    topk_is_output: bool = False,
) -> None:
    if policy not in POLICIES:
        _checks.fail(op, f"argument 'policy' must be one of {list(POLICIES)}, got {policy!r}")
    _checks.check_dtype(op, "slot_to_token", slot_to_token, _I32)
    _checks.check_dim(op, "slot_to_token", slot_to_token, 2)
    R, C = slot_to_token.shape
    _checks.check_dtype(op, "lru_order", lru_order, _I32)
    _check_shape(op, "lru_order", lru_order, (R, C), "[R, C]")
    _checks.check_dtype(op, "row_request", row_request, _I64)
    _check_shape(op, "row_request", row_request, (R,), "[R]")
    _checks.check_dtype(op, "topk", topk, _I32)
    _checks.check_dim(op, "topk", topk, 2)
    if topk.shape[0] != R:
        _checks.fail(op, f"argument 'topk' must have R = {R} rows, got shape {list(topk.shape)}")
    K = topk.shape[1]
    if K > C:
        _checks.fail(op, f"argument 'topk' has K = {K} entries per row, more than the capacity C = {C}")
    _checks.check_dtype(op, "request_ids", request_ids, _I64)
    _check_shape(op, "request_ids", request_ids, (R,), "[R]")
    _checks.check_dtype(op, "stable_len", stable_len, _I64)
    _check_shape(op, "stable_len", stable_len, (R,), "[R]")
    if scores is not None:
        _checks.check_dtype(op, "scores", scores, (torch.float32,))
        _checks.check_dim(op, "scores", scores, 2)
        if scores.shape[0] != R:
            _checks.fail(op, f"argument 'scores' must have R = {R} rows, got shape {list(scores.shape)}")
    elif policy == "score":
        _checks.fail(op, "argument 'scores' is required with policy 'score', got None")
    outs = [
        ("slots", slots, (R, K)),
        ("miss_tokens", miss_tokens, (R, K)),
        ("miss_slots", miss_slots, (R, K)),
    ]
    outs += [("miss_count", miss_count, (R,)), ("evictions", evictions, (R,))]
    if topk_is_output:
        outs.insert(0, ("topk", topk, (R, K)))
    for arg, t, shape in outs:
        _checks.check_dtype(op, arg, t, _I32)
        _check_shape(op, arg, t, shape, "[R, K]" if len(shape) == 2 else "[R]")
    device = slot_to_token.device
    named = [("lru_order", lru_order), ("row_request", row_request), ("topk", topk)]
    named += [("request_ids", request_ids), ("stable_len", stable_len)]
    named += [(a, t) for a, t, _ in outs]
    if scores is not None:
        named.append(("scores", scores))
    for arg, t in named:
        if t.device != device:
            _checks.fail(op, f"argument '{arg}' must be on {device} like 'slot_to_token', got {t.device}")
    for arg, t in [("slot_to_token", slot_to_token), ("lru_order", lru_order), ("row_request", row_request)]:
        _check_contiguous(op, arg, t)
    for arg, t, _ in outs:
        _check_contiguous(op, arg, t)


def _residency_update_fake(
    slot_to_token, lru_order, row_request, topk, request_ids, stable_len, scores, policy,
    slots, miss_tokens, miss_slots, miss_count, evictions,
) -> None:  # fmt: skip
    _residency_structure(
        "residency_update", slot_to_token, lru_order, row_request, topk, request_ids, stable_len,
        scores, policy, slots, miss_tokens, miss_slots, miss_count, evictions,
    )  # fmt: skip


def _first_duplicate(values: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``values [R, N]`` (entries where ``keep``): whether a value occurs twice, and the smallest
    such value."""
    big = torch.iinfo(torch.int64).max
    v = torch.sort(torch.where(keep, values.long(), big), dim=1).values
    dup = (v[:, 1:] == v[:, :-1]) & (v[:, 1:] != big)
    has = dup.any(dim=1)
    if v.shape[1] < 2:
        return has, v.new_full((v.shape[0],), big)
    return has, torch.where(dup, v[:, 1:], big).min(dim=1).values


def check_residency_values(
    op: str,
    slot_to_token: torch.Tensor,
    lru_order: torch.Tensor,
    row_request: torch.Tensor,
    topk: torch.Tensor,
    request_ids: torch.Tensor,
    stable_len: torch.Tensor,
) -> None:
    """Value checks of a residency update (every kernel runs them before writing anything).

    Shapes and dtypes must already have passed :func:`_residency_structure`. Raises ``ValueError`` for a
    negative ``stable_len`` (any row) first, then for the first bad row, checks in this order: for a row
    that is not reset, an ``lru_order`` that is not a permutation or a ``slot_to_token`` entry below
    ``-1``; a valid top-k position listed twice; a top-k position resident in two slots (after
    stable-prefix emptying).
    Vectorised over rows on the tensors' device: one host synchronisation when the input is valid.
    """
    R, C = slot_to_token.shape
    if R == 0:
        return
    device = slot_to_token.device
    neg_stable = stable_len < 0
    keep = row_request == request_ids  # rows that are not reset keep (and must have) a valid state
    iota = torch.arange(C, dtype=lru_order.dtype, device=device)
    if C:
        perm_bad = keep & (torch.sort(lru_order, dim=1).values != iota).any(dim=1)
    else:
        perm_bad = torch.zeros(R, dtype=torch.bool, device=device)
    low = slot_to_token < -1
    low_bad = keep & low.any(dim=1)
    valid = topk >= 0
    topk_dup, topk_dup_value = _first_duplicate(topk, valid)
    stt = torch.where(keep[:, None], slot_to_token, -1)
    stt = torch.where(stt.long() >= stable_len[:, None], -1, stt)
    if topk.shape[1]:
        big = torch.iinfo(torch.int64).max
        sorted_topk = torch.sort(torch.where(valid, topk.long(), big), dim=1).values.contiguous()
        pos = torch.searchsorted(sorted_topk, stt.long().contiguous()).clamp(max=topk.shape[1] - 1)
        hit = (stt >= 0) & (torch.gather(sorted_topk, 1, pos) == stt.long())
    else:
        hit = torch.zeros_like(stt, dtype=torch.bool)
    hit_dup, hit_dup_value = _first_duplicate(stt, hit)
    row_bad = perm_bad | low_bad | topk_dup | hit_dup
    if not bool(neg_stable.any() | row_bad.any()):
        return
    if bool(neg_stable.any()):
        r = int(neg_stable.nonzero()[0, 0])
        _checks.fail(op, f"argument 'stable_len' entry {r} is {int(stable_len[r])}, expected a value >= 0")
    r = int(row_bad.nonzero()[0, 0])
    if bool(perm_bad[r]):
        _checks.fail(op, f"argument 'lru_order' row {r} is not a permutation of 0..{C - 1}")
    if bool(low_bad[r]):
        s = int(low[r].nonzero()[0, 0])
        _checks.fail(
            op, f"argument 'slot_to_token' row {r} slot {s} holds {int(slot_to_token[r, s])}, expected >= -1"
        )
    if bool(topk_dup[r]):
        _checks.fail(op, f"argument 'topk' row {r} holds position {int(topk_dup_value[r])} more than once")
    _checks.fail(
        op, f"argument 'slot_to_token' row {r} holds top-k position {int(hit_dup_value[r])} in two slots"
    )


def _residency_update_reference(
    slot_to_token, lru_order, row_request, topk, request_ids, stable_len, scores, policy,
    slots, miss_tokens, miss_slots, miss_count, evictions,
) -> None:  # fmt: skip
    op = "residency_update"
    _residency_structure(
        op, slot_to_token, lru_order, row_request, topk, request_ids, stable_len,
        scores, policy, slots, miss_tokens, miss_slots, miss_count, evictions,
    )  # fmt: skip
    check_residency_values(op, slot_to_token, lru_order, row_request, topk, request_ids, stable_len)
    plans = ref.plan_rows(
        slot_to_token, lru_order, row_request, topk, request_ids, stable_len, scores, policy
    )
    ref.commit(plans, slot_to_token, lru_order, row_request, request_ids, slots, miss_tokens, miss_slots,
               miss_count, evictions)  # fmt: skip


_residency_update_op = define_op(
    "residency_update",
    "(Tensor(a!) slot_to_token, Tensor(b!) lru_order, Tensor(c!) row_request, Tensor topk, "
    "Tensor request_ids, Tensor stable_len, Tensor? scores, str policy, Tensor(d!) slots, "
    "Tensor(e!) miss_tokens, Tensor(f!) miss_slots, Tensor(g!) miss_count, Tensor(h!) evictions) -> ()",
    fake=_residency_update_fake,
    reference=_residency_update_reference,
)


def residency_update(
    slot_to_token: torch.Tensor,
    lru_order: torch.Tensor,
    row_request: torch.Tensor,
    topk: torch.Tensor,
    request_ids: torch.Tensor,
    stable_len: torch.Tensor,
    scores: torch.Tensor | None,
    policy: str,
    out: ResidencyOutputs,
) -> ResidencyOutputs:
    """Update one layer's residency state for this step's top-k; fill ``out`` and return it.

    Parameters
    ----------
    slot_to_token, lru_order : Tensor
        ``int32 [R, C]`` state, mutated in place (see the module docstring).
    row_request : Tensor
        ``int64 [R]`` state, mutated in place (set to ``request_ids``).
    topk : Tensor
        ``int32 [R, K]`` logical positions, ``K <= C``; negative entries are padding.
    request_ids, stable_len : Tensor
        ``int64 [R]``: the request of each row this step, and the length of its stable prefix (resident
        tokens at or beyond it are dropped).
    scores : Tensor or None
        ``float32 [R, L]`` indexer score of every logical position (required with ``policy="score"``,
        ignored with ``"lru"``).
    policy : str
        ``"lru"`` or ``"score"``.
    out : ResidencyOutputs
        ``int32`` buffers from :func:`new_residency_outputs`; mutated in place.

    Raises ``ValueError`` / ``TypeError`` naming the argument on bad input, leaving every tensor untouched.

    Example
    -------
    >>> stt, lru, req = new_residency_state(2, 8)
    >>> out = new_residency_outputs(2, 4)
    >>> topk = torch.tensor([[0, 5, 9, -1], [3, 1, 2, 7]], dtype=torch.int32)
    >>> ids = torch.tensor([10, 11]); stable = torch.tensor([10, 8])
    >>> residency_update(stt, lru, req, topk, ids, stable, None, "lru", out).miss_count.tolist()
    [3, 4]
    """
    _residency_update_op(
        slot_to_token, lru_order, row_request, topk, request_ids, stable_len, scores, policy, *out.as_tuple()
    )
    return out


# --------------------------------------------------------------------------- lightning_indexer_manage
# Defined in this module too: it shares the residency contract; its indexer part is the
# ``kvoffload::lightning_indexer`` / ``lightning_indexer_scores`` ops (called through the dispatcher).


def _lim_structure(
    q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k,
    slot_to_token, lru_order, row_request, request_ids, stable_len, policy,
    topk, slots, miss_tokens, miss_slots, miss_count, evictions,
) -> None:  # fmt: skip
    op = "lightning_indexer_manage"
    _residency_structure(
        op, slot_to_token, lru_order, row_request, topk, request_ids, stable_len, None,
        "lru" if policy == "score" else policy, slots, miss_tokens, miss_slots, miss_count, evictions,
        topk_is_output=True,
    )  # fmt: skip
    _checks.check_dim(op, "q", q, 3)
    if q.shape[0] != slot_to_token.shape[0]:
        _checks.fail(
            op,
            f"argument 'slot_to_token' must have one row per query token (T = {q.shape[0]}), "
            f"got shape {list(slot_to_token.shape)}",
        )


def _lim_fake(
    q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k,
    slot_to_token, lru_order, row_request, request_ids, stable_len, policy,
    topk, slots, miss_tokens, miss_slots, miss_count, evictions,
) -> None:  # fmt: skip
    _lim_structure(
        q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, slot_to_token, lru_order,
        row_request, request_ids, stable_len, policy, topk, slots, miss_tokens, miss_slots, miss_count,
        evictions,
    )  # fmt: skip


def _lim_reference(
    q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k,
    slot_to_token, lru_order, row_request, request_ids, stable_len, policy,
    topk, slots, miss_tokens, miss_slots, miss_count, evictions,
) -> None:  # fmt: skip
    op = "lightning_indexer_manage"
    _lim_structure(
        q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, slot_to_token, lru_order,
        row_request, request_ids, stable_len, policy, topk, slots, miss_tokens, miss_slots, miss_count,
        evictions,
    )  # fmt: skip
    K = topk.shape[1]
    new_topk = torch.ops.kvoffload.lightning_indexer(
        q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, K
    )
    scores = None
    if policy == "score":
        scores = torch.ops.kvoffload.lightning_indexer_scores(
            q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k
        )
    check_residency_values(op, slot_to_token, lru_order, row_request, new_topk, request_ids, stable_len)
    plans = ref.plan_rows(
        slot_to_token, lru_order, row_request, new_topk, request_ids, stable_len, scores, policy
    )
    topk.copy_(new_topk)
    ref.commit(plans, slot_to_token, lru_order, row_request, request_ids, slots, miss_tokens, miss_slots,
               miss_count, evictions)  # fmt: skip


_lim_op = define_op(
    "lightning_indexer_manage",
    "(Tensor q, Tensor weights, Tensor k_cache, Tensor block_table, Tensor cu_seqlens_q, "
    "Tensor seq_lens_k, Tensor(a!) slot_to_token, Tensor(b!) lru_order, Tensor(c!) row_request, "
    "Tensor request_ids, Tensor stable_len, str policy, Tensor(d!) topk, Tensor(e!) slots, "
    "Tensor(f!) miss_tokens, Tensor(g!) miss_slots, Tensor(h!) miss_count, Tensor(i!) evictions) -> ()",
    fake=_lim_fake,
    reference=_lim_reference,
)


def lightning_indexer_manage(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    slot_to_token: torch.Tensor,
    lru_order: torch.Tensor,
    row_request: torch.Tensor,
    request_ids: torch.Tensor,
    stable_len: torch.Tensor,
    policy: str,
    topk: torch.Tensor,
    out: ResidencyOutputs,
) -> ResidencyOutputs:
    """Lightning indexer + top-k + residency update in one op (fused manage, "LIM").

    Equivalent to ``topk[:] = lightning_indexer(q, weights, k_cache, block_table, cu_seqlens_q,
    seq_lens_k, K)`` followed by :func:`residency_update` on that top-k (with ``policy="score"`` the
    scores are the indexer's own ``lightning_indexer_scores``). One residency row per query token:
    ``R = T``.

    Parameters
    ----------
    q : Tensor
        ``[T, H, D]`` indexer queries (fp32 / bf16), ``weights [T, H]``, ``k_cache [num_blocks,
        block_size, D]``, ``block_table int32 [B, max_blocks]``, ``cu_seqlens_q int32 [B + 1]``,
        ``seq_lens_k int32 [B]`` — as for ``lightning_indexer``.
    slot_to_token, lru_order, row_request, request_ids, stable_len, policy
        as for :func:`residency_update`, with ``R = T``.
    topk : Tensor
        ``int32 [T, K]`` output: the selected logical positions (mutated).
    out : ResidencyOutputs
        residency outputs (mutated).

    What is fused (C++ CPU kernel): with ``"lru"`` it calls ``kvoffload::lightning_indexer`` through the
    dispatcher and runs the residency routine directly on its output; with ``"score"`` it calls
    ``kvoffload::lightning_indexer_scores`` once, selects the top-k from those scores itself (same order as
    the indexer: score descending, ties by lower position, invisible positions ``-1``) and evicts by the
    same scores — one indexer pass instead of two, no intermediate op dispatch. Every argument is
    validated before anything is written; on error the state and outputs are untouched.
    """
    _lim_op(
        q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, slot_to_token, lru_order, row_request,
        request_ids, stable_len, policy, topk, *out.as_tuple(),
    )  # fmt: skip
    return out
