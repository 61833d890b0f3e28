"""Triton kernels of the residency family: ``residency_update`` and ``lightning_indexer_manage``.

GPU formulation of the residency contract (``torch_kvoffload.ops.residency``): one program per decode
row, the whole row held on chip. The row's ``C`` slots and ``K`` top-k entries live in register tiles
(``next_pow2(C)`` / ``next_pow2(K)`` wide, at least 16). The position lookup is a sort of the
residents' ``(token, slot)`` keys in registers followed by a branchless binary search with ``tl.gather``
(``log2 C`` steps); the reverse lookup (is a slot's token in the top-k) sorts the top-k and searches it.
Ranks come from prefix sums (misses in top-k order, non-hit slots in LRU order), the i-th victim meets
the i-th miss through a binary search over those prefix sums, and the new state is written by scatter
stores to distinct addresses (the new order is a permutation): no data-dependent loop, no scratch
memory, no barrier. ``"score"`` adds one sort of ``(empty first, score, LRU position)`` keys to pick the
victims; only the residents' indexer scores are gathered from global memory.

Validation runs before the launch: the structural checks of the op, then
:func:`torch_kvoffload.ops.residency.check_residency_values` (vectorised on the device; one host
synchronisation), so the kernel can assume valid input and bad input leaves every tensor untouched. The ``launch_*``
entry points skip the value checks (no host synchronisation) for callers whose input is valid by
construction, such as the sparse decode runtime's device step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops import residency as _res
from torch_kvoffload.ops.triton import device_guard, require_launchable, triton_kernel
from torch_kvoffload.ops.triton.indexer import (  # the two indexer launchers are also exported here
    launch_hadamard_quant_int8,
    launch_indexer_topk,
    lightning_indexer_scores_topk,
)

__all__ = [
    "KERNELS",
    "MAX_CAPACITY",
    "launch_hadamard_quant_int8",
    "launch_indexer_manage",
    "launch_indexer_topk",
    "launch_residency_rows",
    "lightning_indexer_manage",
    "residency_update",
]

_SLOT_SHIFT = tl.constexpr(4294967296)  # 2**32: (token, slot) keys pack the slot in the low 32 bits
#: Largest capacity ``C``: the score policy's victim keys pack the LRU position in 28 bits.
MAX_CAPACITY = 1 << 28


@triton.jit
def _lower_bound(sorted_vals, target, N: tl.constexpr, LOG_N: tl.constexpr):
    """For each ``target``: the first index of ``sorted_vals [N]`` (ascending) holding a value ``>= target``,
    or ``N - 1`` when there is none; a branchless binary search in registers (``LOG_N`` gathers)."""
    pos = tl.full(target.shape, -1, tl.int32)
    for i in tl.static_range(LOG_N):
        cand = pos + (N >> (i + 1))
        pos = tl.where(tl.gather(sorted_vals, cand, 0) < target, cand, pos)
    return pos + 1


@triton.jit
def _residency_rows_kernel(
    stt_ptr,
    order_ptr,
    row_req_ptr,
    topk_ptr,
    rid_ptr,
    stable_ptr,
    scores_ptr,
    slots_ptr,
    mtok_ptr,
    mslot_ptr,
    mcount_ptr,
    evict_ptr,
    C,
    K,
    L,
    topk_stride,
    scores_stride,
    USE_SCORE: tl.constexpr,
    BC: tl.constexpr,
    LOG_BC: tl.constexpr,
    BK: tl.constexpr,
    LOG_BK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    ps = tl.arange(0, BC)  # slot index, or position in the LRU order
    ks = tl.arange(0, BK)
    cmask = ps < C
    kmask = ks < K

    # ---- state after reset and stable-prefix emptying
    keep = tl.load(row_req_ptr + r) == tl.load(rid_ptr + r)  # False: the row is reset
    stable = tl.load(stable_ptr + r)
    # (a scalar mask is broadcast by hand: the interpreter rejects scalar & block masks)
    live = cmask & ((tl.zeros([BC], tl.int32) + keep.to(tl.int32)) != 0)
    stt = tl.load(stt_ptr + r * C + ps, mask=live, other=-1)
    stt = tl.where(stt.to(tl.int64) >= stable, -1, stt)
    order = tl.load(order_ptr + r * C + ps, mask=live, other=0)
    order = tl.where(live, order, ps)  # reset rows (and padding): identity order
    tk = tl.load(topk_ptr + r * topk_stride + ks, mask=kmask, other=-1)
    valid = tk >= 0

    # ---- hits: top-k entry -> slot, through the residents sorted by (token, slot)
    res_keys = tl.sort(stt.to(tl.int64) * _SLOT_SHIFT + ps)
    at = tl.gather(res_keys, _lower_bound(res_keys, tk.to(tl.int64) * _SLOT_SHIFT, BC, LOG_BC), 0)
    hit_k = valid & ((at >> 32) == tk.to(tl.int64))
    hit_slot_k = (at - (at >> 32) * _SLOT_SHIFT).to(tl.int32)
    # slot -> is its token in the top-k, through the top-k sorted
    big = 1 << 40
    tk_sorted = tl.sort(tl.where(valid, tk.to(tl.int64), big))
    at_s = tl.gather(tk_sorted, _lower_bound(tk_sorted, stt.to(tl.int64), BK, LOG_BK), 0)
    hit_s = (stt >= 0) & (at_s == stt.to(tl.int64))

    # ---- misses in top-k order
    miss_k = valid & (hit_k == 0)
    miss_i = miss_k.to(tl.int32)
    miss_cum = tl.cumsum(miss_i, 0)  # non-decreasing: searched below
    n_miss = tl.sum(miss_i, 0)

    # ---- victims: n_miss non-hit slots, chosen by policy, then taken in LRU order
    hit_p = tl.gather(hit_s.to(tl.int32), order, 0) != 0
    tok_p = tl.gather(stt, order, 0)
    nonhit_p = cmask & (hit_p == 0)
    if USE_SCORE:
        in_range = (tok_p >= 0) & (tok_p.to(tl.int64) < L)
        sc = tl.load(scores_ptr + r * scores_stride + tok_p, mask=nonhit_p & in_range, other=float("-inf"))
        sc = tl.where(sc != sc, float("-inf"), sc)  # NaN counts as -inf
        sc = tl.where(sc == 0.0, 0.0, sc)  # -0.0 ties with +0.0
        bits = sc.to(tl.int32, bitcast=True)
        sortable = tl.where(bits >= 0, bits.to(tl.int64) + 2147483647 + 1, (-1 - bits).to(tl.int64))
        cls = tl.where(nonhit_p, tl.where(tok_p >= 0, 1, 0), 3).to(tl.int64)
        sortable = tl.where(tok_p >= 0, sortable, 0)
        key = cls * (1 << 60) + sortable * (1 << 28) + ps
        thr = tl.max(tl.where(ps == n_miss - 1, tl.sort(key), -1), 0)  # n_miss-th smallest key, or -1
        chosen_p = nonhit_p & (key <= thr)
    else:
        nonhit_i = nonhit_p.to(tl.int32)
        nrank_p = tl.cumsum(nonhit_i, 0) - nonhit_i
        chosen_p = nonhit_p & (nrank_p < n_miss)
    evictions = tl.sum((chosen_p & (tok_p >= 0)).to(tl.int32), 0)

    # the i-th victim (LRU order) takes the i-th miss (top-k order): the miss of rank i is the first
    # top-k entry whose inclusive miss count exceeds i
    chosen_i = chosen_p.to(tl.int32)
    crank_p = tl.cumsum(chosen_i, 0) - chosen_i
    k_p = tl.minimum(_lower_bound(miss_cum, crank_p + 1, BK, LOG_BK), BK - 1)
    new_tok_p = tl.where(chosen_p, tl.gather(tk, k_p, 0), tok_p)

    # ---- outputs (every store below writes distinct addresses)
    tl.store(slots_ptr + r * K + ks, tl.where(hit_k, hit_slot_k, -1), mask=kmask & (miss_k == 0))
    tl.store(slots_ptr + r * K + k_p, order, mask=chosen_p)
    tl.store(mtok_ptr + r * K + crank_p, new_tok_p, mask=chosen_p)
    tl.store(mslot_ptr + r * K + crank_p, order, mask=chosen_p)
    tail = kmask & (ks >= n_miss)
    tl.store(mtok_ptr + r * K + ks, tl.full([BK], -1, tl.int32), mask=tail)
    tl.store(mslot_ptr + r * K + ks, tl.full([BK], -1, tl.int32), mask=tail)
    tl.store(mcount_ptr + r, n_miss)
    tl.store(evict_ptr + r, evictions)

    # ---- new state: slot order[p] takes its miss token when chosen; the new order is [non-hit, not
    # chosen] + [chosen = victims in miss order] + [hits], each part in the old order (a permutation
    # written by scatter)
    tl.store(stt_ptr + r * C + order, new_tok_p, mask=cmask)
    keep_p = nonhit_p & (chosen_p == 0)
    keep_i = keep_p.to(tl.int32)
    hit_i = (cmask & hit_p).to(tl.int32)
    n_keep = tl.sum(keep_i, 0)
    dest = tl.where(
        keep_p,
        tl.cumsum(keep_i, 0) - keep_i,
        tl.where(chosen_p, n_keep + crank_p, n_keep + n_miss + tl.cumsum(hit_i, 0) - hit_i),
    )
    tl.store(order_ptr + r * C + dest, order, mask=cmask)
    tl.store(row_req_ptr + r, tl.load(rid_ptr + r))


def _check_capacity(op: str, slot_to_token: torch.Tensor) -> None:
    C = slot_to_token.shape[1]
    if C > MAX_CAPACITY:
        _checks.fail(
            op, f"argument 'slot_to_token' has capacity C = {C}; the Triton kernel takes at most 2^28 slots"
        )


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(max(n, 1)))


def launch_residency_rows(
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
) -> None:
    """Launch the residency kernel on arguments that passed every check (structure and values)."""
    R, C = slot_to_token.shape
    K = topk.shape[1]
    if R == 0:
        return
    topk = topk if topk.stride(1) == 1 or K <= 1 else topk.contiguous()
    request_ids, stable_len = request_ids.contiguous(), stable_len.contiguous()  # read as [R] arrays
    use_score = policy == "score"
    if use_score:
        assert scores is not None
        scores = scores if scores.stride(1) == 1 or scores.shape[1] <= 1 else scores.contiguous()
        L, scores_stride = scores.shape[1], scores.stride(0)
    else:
        scores, L, scores_stride = slot_to_token, 0, 0  # never read
    bc, bk = _pow2(C), _pow2(K)
    with device_guard(slot_to_token.device):
        _residency_rows_kernel[(R,)](
            slot_to_token, lru_order, row_request, topk, request_ids, stable_len, scores,
            slots, miss_tokens, miss_slots, miss_count, evictions,
            C, K, L, topk.stride(0), scores_stride,
            USE_SCORE=use_score, BC=bc, LOG_BC=bc.bit_length() - 1, BK=bk, LOG_BK=bk.bit_length() - 1,
            num_warps=4 if bc <= 1024 else 8,
        )  # fmt: skip


def launch_indexer_manage(
    q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k,
    slot_to_token, lru_order, row_request, request_ids, stable_len, policy,
    topk, slots, miss_tokens, miss_slots, miss_count, evictions,
    *, q_scale=None, k_scale=None,
) -> None:  # fmt: skip
    """``lightning_indexer_manage`` of validated input without its checks: the indexer's top-k written
    into ``topk``, then the residency kernel over it (``policy="score"`` reads the same scores). With
    ``q_scale`` / ``k_scale`` the int8 indexer (``quant_lightning_indexer``) selects instead."""
    scores = launch_indexer_topk(
        q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, topk, q_scale=q_scale, k_scale=k_scale
    )
    launch_residency_rows(
        slot_to_token, lru_order, row_request, topk, request_ids, stable_len,
        scores if policy == "score" else None, policy, slots, miss_tokens, miss_slots, miss_count, evictions,
    )  # fmt: skip


def residency_update(
    slot_to_token, lru_order, row_request, topk, request_ids, stable_len, scores, policy,
    slots, miss_tokens, miss_slots, miss_count, evictions,
) -> None:  # fmt: skip
    """Triton ``kvoffload::residency_update`` (same arguments and contract as the op)."""
    op = "residency_update"
    _res._residency_structure(
        op, slot_to_token, lru_order, row_request, topk, request_ids, stable_len, scores, policy,
        slots, miss_tokens, miss_slots, miss_count, evictions,
    )  # fmt: skip
    _check_capacity(op, slot_to_token)
    require_launchable(op, slot_to_token.device)
    _res.check_residency_values(op, slot_to_token, lru_order, row_request, topk, request_ids, stable_len)
    launch_residency_rows(
        slot_to_token, lru_order, row_request, topk, request_ids, stable_len, scores, policy,
        slots, miss_tokens, miss_slots, miss_count, evictions,
    )  # fmt: skip


def lightning_indexer_manage(
    q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k,
    slot_to_token, lru_order, row_request, request_ids, stable_len, policy,
    topk, slots, miss_tokens, miss_slots, miss_count, evictions,
) -> None:  # fmt: skip
    """Triton ``kvoffload::lightning_indexer_manage``: the Triton lightning indexer's top-k (with
    ``policy="score"`` its scores too, from the same scoring pass), then the residency kernel on that
    top-k; Triton end to end, validated before the first write like the op."""
    op = "lightning_indexer_manage"
    _res._lim_structure(
        q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k, slot_to_token, lru_order,
        row_request, request_ids, stable_len, policy, topk, slots, miss_tokens, miss_slots, miss_count,
        evictions,
    )  # fmt: skip
    _check_capacity(op, slot_to_token)
    require_launchable(op, slot_to_token.device)
    K = topk.shape[1]
    idx = (q, weights, k_cache, block_table, cu_seqlens_q, seq_lens_k)
    scores = None
    if policy == "score":  # one indexer pass: the top-k is taken from the scores the policy reads
        scores, new_topk = lightning_indexer_scores_topk(*idx, K)
    else:
        new_topk = triton_kernel("lightning_indexer")(*idx, K)
    _res.check_residency_values(op, slot_to_token, lru_order, row_request, new_topk, request_ids, stable_len)
    launch_residency_rows(
        slot_to_token, lru_order, row_request, new_topk, request_ids, stable_len, scores, policy,
        slots, miss_tokens, miss_slots, miss_count, evictions,
    )  # fmt: skip
    topk.copy_(new_topk)


KERNELS = {"residency_update": residency_update, "lightning_indexer_manage": lightning_indexer_manage}
