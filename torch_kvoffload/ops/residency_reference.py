"""Pure-PyTorch formula of the residency update on validated inputs: the golden model that the
reference kernels of :mod:`torch_kvoffload.ops.residency` run (after their checks) and the C++ / Triton
kernels are tested against. The semantics are in :mod:`torch_kvoffload.ops.residency`.
"""

from __future__ import annotations

import torch

__all__ = ["RowPlan", "commit", "plan_rows"]

#: One row's planned ``(slot_to_token, lru_order, slots, miss_tokens, miss_slots, miss_count, evictions)``.
RowPlan = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]


def plan_rows(
    slot_to_token: torch.Tensor,
    lru_order: torch.Tensor,
    row_request: torch.Tensor,
    topk: torch.Tensor,
    request_ids: torch.Tensor,
    stable_len: torch.Tensor,
    scores: torch.Tensor | None,
    policy: str,
) -> list[RowPlan]:
    """Every row's new state and outputs of validated inputs, without writing anything.

    Per row ``r``: ``(slot_to_token [C], lru_order [C], slots [K], miss_tokens [K], miss_slots [K],
    miss_count, evictions)`` as :func:`commit` writes them (the semantics are
    :mod:`torch_kvoffload.ops.residency`'s).
    """
    R, C = slot_to_token.shape
    K = topk.shape[1]
    device = slot_to_token.device
    iota = torch.arange(C, dtype=torch.int32, device=device)
    plans = []
    for r in range(R):
        reset = int(row_request[r]) != int(request_ids[r])
        if reset:
            stt = torch.full((C,), -1, dtype=torch.int32, device=device)
            order = iota.clone()
        else:
            stt = slot_to_token[r].clone()
            order = lru_order[r]
        row_topk = topk[r]
        valid = row_topk >= 0
        tokens = row_topk[valid]
        stt[stt.long() >= int(stable_len[r])] = -1
        # token -> slot lookup for the top-k entries among residents
        resident = stt >= 0
        hit_mask_slot = resident & torch.isin(stt, tokens)
        hit_tokens = stt[hit_mask_slot]
        hit_slot_ids = hit_mask_slot.nonzero().flatten().to(torch.int32)
        slots_row = torch.full((K,), -1, dtype=torch.int32, device=device)
        if hit_tokens.numel():
            sorted_tok, perm = torch.sort(hit_tokens)
            pos = torch.searchsorted(sorted_tok, row_topk.clamp(min=0))
            pos = pos.clamp(max=sorted_tok.numel() - 1)
            is_hit = valid & (sorted_tok[pos] == row_topk)
            slots_row = torch.where(is_hit, hit_slot_ids[perm[pos]], slots_row)
        else:
            is_hit = torch.zeros(K, dtype=torch.bool, device=device)
        miss_k = (valid & ~is_hit).nonzero().flatten()
        n_miss = miss_k.numel()
        hit_in_order = hit_mask_slot[order.long()]
        nonhit_order = order[~hit_in_order]
        if policy == "lru" or n_miss == 0:
            victims = nonhit_order[:n_miss]
            chosen = torch.zeros(nonhit_order.numel(), dtype=torch.bool, device=device)
            chosen[:n_miss] = True
        else:
            assert scores is not None
            cand_tok = stt[nonhit_order.long()].long()
            L = scores.shape[1]
            sc = torch.full(cand_tok.shape, float("-inf"), dtype=torch.float32, device=device)
            in_range = (cand_tok >= 0) & (cand_tok < L)
            sc[in_range] = scores[r, cand_tok[in_range]].float()
            sc = torch.nan_to_num(sc, nan=float("-inf"))
            empty = cand_tok < 0
            # lexicographic (resident?, score, lru rank): stable sorts from the last key to the first
            rank = torch.arange(cand_tok.numel(), device=device)
            idx = rank[torch.sort(sc, stable=True).indices]
            idx = idx[torch.sort((~empty).to(torch.int8)[idx], stable=True).indices]
            chosen = torch.zeros(cand_tok.numel(), dtype=torch.bool, device=device)
            chosen[idx[:n_miss]] = True
            victims = nonhit_order[chosen]
        miss_tokens_row = torch.full((K,), -1, dtype=torch.int32, device=device)
        miss_slots_row = torch.full((K,), -1, dtype=torch.int32, device=device)
        evictions = int((stt[victims.long()] >= 0).sum()) if n_miss else 0
        if n_miss:
            miss_tokens_row[:n_miss] = row_topk[miss_k]
            miss_slots_row[:n_miss] = victims
            slots_row[miss_k] = victims
            stt[victims.long()] = row_topk[miss_k]
        new_order = torch.cat([nonhit_order[~chosen], victims, order[hit_in_order]])
        plans.append((stt, new_order, slots_row, miss_tokens_row, miss_slots_row, n_miss, evictions))
    return plans


def commit(plans, slot_to_token, lru_order, row_request, request_ids, slots, miss_tokens, miss_slots,
           miss_count, evictions) -> None:  # fmt: skip
    """Write the rows of :func:`plan_rows` into the state and outputs (``row_request`` set to
    ``request_ids`` when there is any row)."""
    for r, (stt, order, slots_row, mt, ms, n_miss, ev) in enumerate(plans):
        slot_to_token[r] = stt
        lru_order[r] = order
        slots[r] = slots_row
        miss_tokens[r] = mt
        miss_slots[r] = ms
        miss_count[r] = n_miss
        evictions[r] = ev
    if plans:
        row_request.copy_(request_ids)
