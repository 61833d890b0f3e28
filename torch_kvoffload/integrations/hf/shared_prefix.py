"""Rows of one ``generate()`` batch that start with the same prompt prefix compute it once.

Before a batch's first forward, the prefixes of whole blocks that several of its prompts start with and the
store does not hold (:meth:`~torch_kvoffload.core.prefix.PrefixReuse.shared_unstored`) are each run through
the model once, alone (a forward of its own, its logits for the last token only), and stored; the batch's
rows then take them over as they take any stored prefix, and compute only what follows. A padded batch
skips only the columns every row has cached, so this runs only when the columns it lets the batch skip
(times its rows) outnumber the prefixes' tokens. The stats count
those tokens as ``shared_prefix_tokens`` (computed) besides the rows' ``prefix_store_tokens`` (taken over).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_kvoffload.integrations.hf.session import OffloadSession

__all__ = ["compute_shared_prefixes"]


def compute_shared_prefixes(
    model: torch.nn.Module,
    session: OffloadSession,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    pad_token_id: Any,
) -> None:
    """Run each shared, unstored prefix of the rows of ``input_ids [B, S]`` (left padded as
    ``attention_mask`` says; without a mask every token is a prompt token unless one is ``pad_token_id``)
    through ``model`` once, between sequences (each forward is a sequence of its own). Nothing for a batch
    the rows of which are not left-padded prompts, or when prefix reuse is off."""
    prompts = _row_prompts(input_ids, attention_mask, pad_token_id)
    if prompts is None:
        return
    prefix_reuse = session.core.prefix
    prefixes = prefix_reuse.shared_unstored(prompts)
    # a padded batch skips only the columns every row has cached (its padding, then its prefix): run the
    # prefixes when that saves more tokens than they cost
    width = input_ids.shape[1]
    skip = min(
        width - len(p) + max((len(k) for k in prefixes if p[: len(k)] == k), default=0) for p in prompts
    )
    if skip * len(prompts) <= sum(len(k) for k in prefixes):
        return
    for prefix in prefixes:
        ids = torch.tensor([prefix], dtype=input_ids.dtype, device=input_ids.device)
        try:
            with torch.no_grad():
                model(
                    input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, cache=session.new_cache(),
                    logits_to_keep=1,
                )  # fmt: skip
        finally:
            session.end_sequence()  # its full blocks are stored; the batch's sequence starts anew
        prefix_reuse.counters.add("shared_prefix_tokens", len(prefix))


def _row_prompts(ids: torch.Tensor, mask: torch.Tensor | None, pad_token_id: Any) -> list[list[int]] | None:
    """Each row's prompt tokens: the tokens after its left padding; ``None`` when a row is not a left-padded
    prompt (a mask of another shape, right padding or holes, an empty row)."""
    if ids.dim() != 2 or ids.shape[0] < 2:
        return None
    if mask is None:
        if pad_token_id is not None and bool((ids == pad_token_id).any()):
            return None  # generate infers a mask from the padding: its positions are not known here
        return [row.tolist() for row in ids]
    if mask.shape != ids.shape:
        return None
    out = []
    width = ids.shape[1]
    for row, m in zip(ids, mask, strict=True):
        n = int(m.sum())
        if n == 0 or not bool(m[width - n :].bool().all()):
            return None
        out.append(row[width - n :].tolist())
    return out
