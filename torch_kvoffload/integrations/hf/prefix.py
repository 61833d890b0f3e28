"""A Hugging Face forward that starts a sequence skips the prompt columns whose KV the store holds.

:func:`skip_cached_prefix` runs before a fresh forward (``past == 0``) of an offloaded model: it looks up
each row's real tokens (:class:`~torch_kvoffload.core.prefix.PrefixReuse`), finds the widest leading
column span ``[0, P)`` that every row has cached (each row's cached real tokens in it; a row's span may
end inside a block), starts the session's sequence with those tokens adopted from the store, and returns
the call's keyword arguments cut to the columns ``[P, S)``: ``input_ids`` and ``position_ids`` sliced, the
2-D ``attention_mask`` kept whole (its first ``P`` columns are the sequence's past). The model then runs
only those columns, at the positions it would have computed them at (the cache reports ``P`` tokens).

Only where the call's outputs do not depend on the skipped columns: ``logits_to_keep`` a positive int the
uncached columns cover (``generate`` passes 1), no hidden states, attentions or labels asked for, token
ids given, a 2-D mask or none, every row with a real token. Otherwise (and with reuse off) the forward
computes every column, as before.

Under tensor parallelism every rank skips the same columns: each row's least cached length over the group,
and the ranks take the prefix over together or none does (a block one rank's store lost makes every rank
compute every column).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_kvoffload.integrations.hf.inputs import model_positions
from torch_kvoffload.layerwise.errors import PrefixEvictedError, StoreMissError

__all__ = ["skip_cached_prefix"]

#: the adoption errors after which the forward computes every column (a block lost from the store)
_MISSES = frozenset(c.__name__ for c in (StoreMissError, PrefixEvictedError))


def _reusable_call(model: torch.nn.Module, kwargs: dict[str, Any], width: int) -> int:
    """The columns at the end of a ``width``-column call whose outputs the call returns (0: the call's
    outputs cover every column, or depend on them: no reuse)."""
    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, bool) or not isinstance(keep, int) or not 0 < keep < width:
        return 0
    hidden = kwargs.get("output_hidden_states")
    if hidden is None:
        hidden = getattr(model.config, "output_hidden_states", False)
    if hidden or any(kwargs.get(k) is not None for k in ("labels", "inputs_embeds", "cache_position")):
        return 0
    pos = kwargs.get("position_ids")
    if pos is not None and not (isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[-1] == width):
        return 0
    return keep


def skip_cached_prefix(
    model: torch.nn.Module, session: Any, cache: Any, kwargs: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """``(P, kwargs)`` for a fresh forward of ``cache`` (see the module docstring): ``P`` columns adopted from
    the store and the call's keyword arguments cut to the rest, or ``(0, kwargs)`` unchanged. A prefix the
    store no longer gives when it is read (evicted, damaged) is counted (``prefix_fallbacks``) and the
    forward computes every column."""
    reuse = session.core.prefix
    ids = kwargs.get("input_ids")
    if (
        not reuse.enabled
        or not isinstance(ids, torch.Tensor)
        or ids.dim() != 2
        or ids.dtype.is_floating_point
    ):
        return 0, kwargs
    B, S = ids.shape
    keep = _reusable_call(model, kwargs, S)
    mask = kwargs.get("attention_mask")
    if keep == 0 or (mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != (B, S))):
        return 0, kwargs
    real = torch.ones(B, S, dtype=torch.bool) if mask is None else mask.to("cpu") != 0
    counts = real.sum(dim=1).tolist()
    if min(counts) == 0:
        return 0, kwargs
    ids_cpu = ids.to("cpu")
    prompts = [ids_cpu[b][real[b]].tolist() for b in range(B)]
    pos_ids = kwargs.get("position_ids")
    model_pos = model_positions(pos_ids, B, S, 0, real)
    positions = [None if p == list(range(len(p))) else p for p in model_pos]
    session._seq.size_fresh(B, max(counts))  # the store keys name the caches' layout: sized first
    columns = S - keep  # at most every column but the ones whose outputs the call returns
    founds = reuse.agree([reuse.lookup(prompts[b], positions[b]) for b in range(B)])
    for b, found in enumerate(founds):
        cols = real[b].nonzero().flatten()
        columns = min(columns, int(cols[found]) if found < len(cols) else S)
    if columns <= 0:
        return 0, kwargs
    head = real[:, :columns]
    lengths = head.sum(dim=1).tolist()
    if not any(lengths):
        return 0, kwargs
    error = reuse.together(
        lambda: session._seq.start_with_prefix(cache, head, prompts, positions, lengths),
        lambda: session._seq.end(persist=False),
        _MISSES,
    )
    if error is not None:
        reuse.fell_back("prefix reuse", error)
        return 0, kwargs
    cut = dict(kwargs)
    cut["input_ids"] = ids[:, columns:]
    if pos_ids is not None:
        cut["position_ids"] = pos_ids[:, columns:]
    return columns, cut
