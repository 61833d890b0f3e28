"""A custom 4-D ``attention_mask`` on an offloaded model: the unmodified model's attention under it.

transformers takes a 4-D ``attention_mask [B, 1, S, past + S]`` as given (its mask functions return it
unchanged) and adds it to the attention scores, and for a DSA model to the indexer's scores before the
top-k: a tree of draft tokens sharing a prefix, several sequences packed in a row with their own masks,
an additive bias. The library's attention derives what a query sees from the 2-D padding mask, so such a
forward runs with the mask turned into a bias over each request's positions
(:func:`custom_mask_bias`, set on the KV core for that forward: :func:`attention_bias`), which the core's
attention and indexer add as the unmodified model does (:func:`~torch_kvoffload.core.attention.biased_attention`).

Rules of the mask (``ValueError`` naming the row, query and column otherwise, before anything runs):

* ``bool`` (``True``: attend) or floating (additive; ``finfo(dtype).min`` or ``-inf``: masked), shape
  ``[B, 1, S, past + S]``;
* every new position is a real token (the forward has no 2-D padding mask);
* a column of an earlier padding position of the sequence (which the library keeps no KV for) is masked
  for every query;
* a query masked everywhere gets what transformers' attention gives it (zeros under ``-inf`` / ``False``,
  the average over every column under the dtype's minimum): refused where that average would include the
  sequence's padding, whose KV is not kept, and for ``-inf`` in a floating mask of a DSA model (whose
  attention then depends on top-k's order of tied scores).

The forward's KV is not what its tokens alone would give, so its requests are not keyed by content (as
for inputs_embeds): the layerwise store never hands their blocks to another prompt, and a sequence that
started from plain input_ids cannot continue with a custom mask under layerwise offload.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CUSTOM_MASK", "attention_bias", "custom_mask_bias", "is_custom_mask"]

#: How the library names such a forward (the sequence's unkeyed reason).
CUSTOM_MASK = "a custom 4-D attention_mask"


def is_custom_mask(mask: Any) -> bool:
    """Whether ``mask`` is a 4-D tensor (transformers then uses it as given)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4


def custom_mask_bias(where: str, mask: torch.Tensor, real: torch.Tensor, *, indexer: bool) -> torch.Tensor:
    """The additive fp32 bias ``[B, S, L]`` of a custom ``mask [B, 1, S, past + S]`` over each row's
    positions that hold KV (``real bool [B, past + S]``: the sequence's earlier real positions, then the
    ``S`` new ones), ``L`` the most any row holds, ``−inf`` past a row's own; ``indexer``: the model has a
    DSA indexer. See the module docstring for the rules (``ValueError`` naming ``where``)."""
    B, T = real.shape
    if mask.dim() != 4 or mask.shape[0] != B or mask.shape[1] != 1 or mask.shape[3] != T:
        raise ValueError(
            f"{where}: a 4-D attention_mask must be [batch, 1, new, past + new] = [{B}, 1, new, {T}], got "
            f"{list(mask.shape)}"
        )
    S = mask.shape[2]
    if mask.dtype == torch.bool:
        add = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, -math.inf)
        masked = ~mask[:, 0]
    elif mask.dtype.is_floating_point:
        if bool(torch.isnan(mask).any()):
            raise ValueError(f"{where}: the 4-D attention_mask holds NaN")
        add = mask.float()
        masked = mask[:, 0] <= torch.finfo(mask.dtype).min / 2  # -inf too
    else:
        raise ValueError(
            f"{where}: a 4-D attention_mask must be bool or floating (additive), got {mask.dtype}"
        )
    real = real.to(device=mask.device, dtype=torch.bool)
    kept = real[:, -S:] if S else real[:, :0]
    if not bool(kept.all()):
        raise ValueError(f"{where}: with a 4-D attention_mask every new position must be a real token")
    _check_blind_queries(where, mask, masked, real, indexer)
    seen_pad = ~masked & ~real[:, None, :]
    if bool(seen_pad.any()):
        b, s, c = (int(x) for x in seen_pad.nonzero()[0])
        raise ValueError(
            f"{where}: the 4-D attention_mask lets query {s} of row {b} attend to column {c}, a padding position "
            "of the sequence (the library keeps no KV for padding); mask it for every query"
        )
    lengths = real.sum(dim=1).tolist()
    width = max(lengths, default=0)
    bias = torch.full((B, S, width), -math.inf, dtype=torch.float32, device=mask.device)
    for b, n in enumerate(lengths):
        bias[b, :, :n] = add[b, 0][:, real[b]]
    return bias


def _check_blind_queries(
    where: str, mask: torch.Tensor, masked: torch.Tensor, real: torch.Tensor, indexer: bool
) -> None:
    """A query the mask hides from every column gets what transformers' attention gives it: zeros when
    every column is ``-inf`` / ``False`` (SDPA's fully masked row), the average over every column when
    they hold the dtype's minimum (a softmax over equal scores). ``ValueError`` for a mix of the two, for
    the average where the sequence has padding columns (their KV is not kept), and for ``-inf`` in a
    floating mask of a DSA model (its attention then averages over the columns its indexer did not
    select, among equal scores: what top-k's order of ties leaves)."""
    blind = masked.all(dim=-1)  # [B, S]
    if not bool(blind.any()):
        return
    neg_inf = ~mask[:, 0] if mask.dtype == torch.bool else torch.isneginf(mask[:, 0])
    dead = neg_inf.all(dim=-1)
    mixed = blind & ~dead & neg_inf.any(dim=-1)
    if bool(mixed.any()):
        b, s = (int(x) for x in mixed.nonzero()[0])
        raise ValueError(
            f"{where}: the 4-D attention_mask hides every column from query {s} of row {b}, some with -inf and "
            "some with the dtype's minimum; hide them all one way"
        )
    if indexer and mask.dtype != torch.bool and bool((blind & dead).any()):
        b, s = (int(x) for x in (blind & dead).nonzero()[0])
        raise ValueError(
            f"{where}: the 4-D attention_mask hides every column from query {s} of row {b} with -inf: the "
            "unmodified DSA attention then averages over the columns its indexer did not select among equal "
            "scores, which depends on top-k's order of ties; hide them with the dtype's minimum or False"
        )
    average = blind & ~dead & ~real.all(dim=1)[:, None]
    if bool(average.any()):
        b, s = (int(x) for x in average.nonzero()[0])
        raise ValueError(
            f"{where}: the 4-D attention_mask hides every column from query {s} of row {b} with the dtype's "
            "minimum: the unmodified model then averages over every column, the sequence's padding included, "
            "whose KV the library does not keep (-inf or False there gives zeros)"
        )


@contextlib.contextmanager
def attention_bias(core: Any, bias: torch.Tensor | None) -> Iterator[None]:
    """``core.attention_bias`` set to ``bias`` (``None``: causal) for the forward begun inside (see
    :attr:`~torch_kvoffload.core.kv.KVCore.attention_bias`)."""
    core.attention_bias = bias
    try:
        yield
    finally:
        core.attention_bias = None
