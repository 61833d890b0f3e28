"""Packed (padding-free) rows: several sequences in one row, each an independent segment.

transformers treats a row as packed when a forward gets ``position_ids`` but no ``attention_mask`` and no
cache (``use_cache`` off): a new segment starts wherever the position does not follow the previous one
(``position_ids[t] - position_ids[t-1] != 1``), and each segment attends only to itself. The flash-attention
style keywords ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (cumulative segment lengths ``int [n + 1]`` over the
flattened ``[1, T]`` row) say the same explicitly.

The library's attention follows requests, not masks, so :func:`packed_forward` runs a packed forward as a
batch of its segments (left-padded to the longest, each with its own positions: one request each) and packs
the per-token outputs back into the caller's layout: ``logits`` and ``hidden_states``; a ``loss`` is
computed from the packed logits and ``labels`` with the model's own loss function.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["packed_forward", "packed_segments"]

_CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _lengths_from_cu(name: str, cu: Any, tokens: int) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point():
        raise ValueError(f"{name}: cu_seq_lens_q must be an integer tensor [segments + 1], got {cu!r:.80}")
    cu = cu.tolist()
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    if cu[0] != 0 or cu[-1] != tokens or any(n <= 0 for n in lengths):
        raise ValueError(
            f"{name}: cu_seq_lens_q must rise from 0 to the row's {tokens} tokens in positive steps, got {cu}"
        )
    return lengths


def packed_segments(
    name: str, model: torch.nn.Module, kwargs: dict[str, Any], rows: int, width: int
) -> list[list[int]] | None:
    """Per row of the ``[rows, width]`` input, the lengths of its segments when ``kwargs`` describe a packed
    forward (see the module docstring), else ``None``. ``position_ids [1, width]`` serve every row, as in
    transformers. ``ValueError`` for ``cu_seq_lens_q`` that do not describe one ``[1, width]`` row, or that
    contradict ``cu_seq_lens_k``."""
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", True)
    cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if use_cache or cached:
            raise ValueError(
                f"{name}: packed rows (cu_seq_lens_q) are served without a cache: pass use_cache=False and no cache"
            )
        if rows != 1:
            raise ValueError(f"{name}: cu_seq_lens_q describe one flattened [1, tokens] row, got {rows} rows")
        lengths = _lengths_from_cu(name, cu, width)
        other = kwargs.get("cu_seq_lens_k")
        if other is not None and not torch.equal(torch.as_tensor(other).cpu(), cu.cpu()):
            raise ValueError(
                f"{name}: cu_seq_lens_k differs from cu_seq_lens_q (a self-attention forward has one)"
            )
        return [lengths]
    pos = kwargs.get("position_ids")
    if not isinstance(pos, torch.Tensor) or kwargs.get("attention_mask") is not None or use_cache or cached:
        return None
    if pos.dim() != 2 or pos.shape[0] not in (1, rows):
        return None
    pos = pos.expand(rows, -1)
    step = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    starts = step != 1
    if not bool(starts[:, 1:].any()):
        return None
    out = []
    for row in starts.cpu().tolist():
        cut = [t for t, s in enumerate(row) if s or t == 0] + [len(row)]
        out.append([b - a for a, b in itertools.pairwise(cut)])
    return out


def packed_forward(
    name: str,
    model: torch.nn.Module,
    forward: Callable[..., Any],
    segments: list[list[int]],
    args: tuple,
    kwargs: dict[str, Any],
) -> Any:
    """Run the packed forward of ``kwargs`` (``input_ids int64 [B, T]`` or ``inputs_embeds [B, T, h]``,
    ``position_ids [B, T]``; ``segments[b]``: row ``b``'s segment lengths) through ``forward`` (the offloaded
    model's) as one left-padded batch of its segments, and pack ``logits [B, T', V]`` and ``hidden_states``
    back. ``ValueError`` naming what cannot be packed back (``output_attentions``, a cache)."""
    kwargs = dict(kwargs)
    if args:
        kwargs.setdefault("input_ids", args[0])
    for key in _CU_KEYS:
        kwargs.pop(key, None)
    ids, embeds = kwargs.pop("input_ids", None), kwargs.pop("inputs_embeds", None)
    source = ids if ids is not None else embeds
    B, T = int(source.shape[0]), int(source.shape[1])
    pos = kwargs.pop("position_ids", None)
    if pos is None:  # cu_seq_lens alone: every segment's positions start at 0
        pos = torch.cat([torch.arange(n) for n in segments[0]])
    pos = pos.view(-1, T).expand(B, T).to(device=source.device, dtype=torch.long)
    for key in ("use_cache", "attention_mask", "cache", "past_key_values"):
        kwargs.pop(key, None)  # packed: no mask and no cache; the batch of segments gets its own mask
    labels = kwargs.pop("labels", None)
    keep = kwargs.pop("logits_to_keep", 0)
    return_dict = kwargs.pop("return_dict", None)
    spans = [(b, start, n) for b, lengths in enumerate(segments) for start, n in zip(
        [sum(lengths[:i]) for i in range(len(lengths))], lengths, strict=True)]  # fmt: skip
    width = max(n for _, _, n in spans)
    rows = len(spans)
    batch = torch.zeros(rows, width, *source.shape[2:], dtype=source.dtype, device=source.device)
    mask = torch.zeros(rows, width, dtype=torch.long, device=source.device)
    positions = torch.zeros(rows, width, dtype=torch.long, device=source.device)
    for r, (b, start, n) in enumerate(spans):
        batch[r, width - n :] = source[b, start : start + n]
        mask[r, width - n :] = 1
        positions[r, width - n :] = pos[b, start : start + n]
    inputs = {"input_ids": batch} if ids is not None else {"inputs_embeds": batch}
    out = forward(
        **inputs, attention_mask=mask, position_ids=positions, use_cache=False, return_dict=True, **kwargs
    )

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed = t.new_empty(B, T, *t.shape[2:])
        for r, (b, start, n) in enumerate(spans):
            packed[b, start : start + n] = t[r, width - n :]
        return packed

    logits = pack(out.logits)
    fields = dict(out.items())
    fields["logits"] = logits
    if out.hidden_states is not None:
        fields["hidden_states"] = tuple(pack(h) for h in out.hidden_states)
    if labels is not None:
        fields["loss"] = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)
    if isinstance(keep, int) and keep > 0:
        fields["logits"] = logits[:, -keep:]
    elif isinstance(keep, torch.Tensor):
        fields["logits"] = logits[:, keep]
    result = type(out)(**fields)
    if return_dict is False or (return_dict is None and not getattr(model.config, "use_return_dict", True)):
        return result.to_tuple()
    return result
