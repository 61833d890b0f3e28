"""Packed (padding-free) rows: several sequences in one row, each an independent segment.

transformers treats a row as packed when a forward gets ``position_ids`` but no ``attention_mask`` and no
cache (``use_cache`` off): a new segment starts wherever the position does not follow the previous one
(``position_ids[t] - position_ids[t-1] != 1``), and each segment attends only to itself. The flash-attention
style keywords ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (cumulative segment lengths ``int [n + 1]`` over the
flattened ``[1, T]`` row) say the same explicitly; transformers' continuous batching feeds every step that
way (decode tokens of some requests and prompt chunks of others in one row).

The library's attention follows requests, not masks: each segment is one request. :class:`PackedRows` is the
layout, built once for every caller. The continuous-batching step
(:meth:`~torch_kvoffload.integrations.hf.serving.ServingRequests.run_step`, each segment continuing its
request) and a packed forward of an offloaded model (:func:`packed_core_forward`, no cache, each segment a
new request) run their segments as one packed forward of the KV core (:meth:`PackedRows.take`: the
segments' tokens one after the other, no padding computed; :meth:`PackedRows.unpack` /
:meth:`PackedRows.scatter_last`: the outputs back). Where the model's forward is a graph compiled for
batches, or the attention probabilities are asked for (``output_attentions``, in the batched model's
layout), :func:`packed_forward` runs the segments as the right-padded batch ``[segments, longest]``
(:meth:`PackedRows.gather`, :meth:`PackedRows.scatter`). Both return ``logits`` and ``hidden_states``
packed, and a ``loss`` computed from the packed logits and ``labels`` with the model's own loss function.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PackedRows", "packed_core_forward", "packed_forward", "packed_segments"]

_CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class PackedRows:
    """The segments of a packed input ``[rows, width]``: ``spans[i] = (row, start, length)``, segment ``i``
    holding tokens ``start .. start + length - 1`` of ``row``, in packed (row-major) order. As a batch,
    segment ``i`` is row ``i`` of ``[len(spans), longest]``, its tokens at columns ``0 .. length - 1``
    (right-padded)."""

    rows: int
    width: int
    spans: tuple[tuple[int, int, int], ...]

    @classmethod
    def from_lengths(cls, lengths: Sequence[Sequence[int]], width: int) -> PackedRows:
        """``lengths[b]``: row ``b``'s segment lengths, positive, summing to at most ``width``."""
        spans = []
        for b, row in enumerate(lengths):
            starts = itertools.accumulate(row, initial=0)
            spans.extend((b, start, int(n)) for start, n in zip(starts, row, strict=False))
            if any(n <= 0 for n in row) or sum(row) > width:
                raise ValueError(
                    f"PackedRows: row {b}'s segment lengths {list(row)} do not fit {width} tokens"
                )
        return cls(len(lengths), width, tuple(spans))

    @classmethod
    def from_cu(cls, name: str, cu: Any, width: int) -> PackedRows:
        """One row of ``width`` tokens cut at the cumulative lengths ``cu int [segments + 1]`` (``0`` first,
        ``width`` last, rising); ``ValueError`` naming ``name`` otherwise."""
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point():
            raise ValueError(
                f"{name}: cu_seq_lens_q must be an integer tensor [segments + 1], got {cu!r:.80}"
            )
        bounds = cu.tolist()
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        if bounds[0] != 0 or bounds[-1] != width or any(n <= 0 for n in lengths):
            raise ValueError(
                f"{name}: cu_seq_lens_q must rise from 0 to the row's {width} tokens in positive steps, got {bounds}"
            )
        return cls.from_lengths([lengths], width)

    def select(self, indices: Sequence[int]) -> PackedRows:
        """The layout of segments ``indices`` only (same packed input)."""
        return PackedRows(self.rows, self.width, tuple(self.spans[i] for i in indices))

    @property
    def lengths(self) -> list[int]:
        return [n for _, _, n in self.spans]

    @property
    def longest(self) -> int:
        return max(self.lengths)

    @functools.cached_property
    def _host_index(self) -> tuple[torch.Tensor, ...]:
        seg, col, row, tok = [], [], [], []
        for i, (b, start, n) in enumerate(self.spans):
            seg += [i] * n
            col += range(n)
            row += [b] * n
            tok += range(start, start + n)
        return tuple(torch.tensor(x, dtype=torch.int64) for x in (seg, col, row, tok))

    def _index(self, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """``(segment, column, row, token)`` ``int64 [N]`` over the ``N`` real tokens of the segments (built
        once per layout, on the host)."""
        return tuple(t.to(device) for t in self._host_index)

    def take(self, packed: torch.Tensor) -> torch.Tensor:
        """The segments' tokens of ``packed [rows, width, ...]`` one after the other, in segment order:
        ``[1, n, ...]`` (``n = sum(lengths)``), the layout of a packed forward of these segments."""
        _, _, row, tok = self._index(packed.device)
        return packed[row, tok][None]

    def mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``bool [segments, longest]``: which batch positions hold a real token."""
        return (
            torch.arange(self.longest, device=device)[None, :]
            < torch.tensor(self.lengths, device=device)[:, None]
        )

    def gather(self, packed: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """``packed [rows, width, ...]`` (a ``[1, width]`` tensor serves every row) as the batch
        ``[segments, longest, ...]``, padding set to ``fill``."""
        packed = packed.expand(self.rows, *packed.shape[1:]) if packed.shape[0] == 1 else packed
        seg, col, row, tok = self._index(packed.device)
        out = packed.new_full((len(self.spans), self.longest, *packed.shape[2:]), fill)
        out[seg, col] = packed[row, tok]
        return out

    def scatter(self, batch: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The batch ``[segments, >= longest, ...]`` back in the packed layout: into ``out [rows, width,
        ...]`` (zeros when ``None``, positions of no segment stay as they are), which is returned."""
        if out is None:
            out = batch.new_zeros(self.rows, self.width, *batch.shape[2:])
        seg, col, row, tok = self._index(batch.device)
        out[row, tok] = batch[seg, col]
        return out

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`take`: ``flat [1, n, ...]`` (the segments' tokens one after the other) in the
        packed layout ``[rows, width, ...]`` (zeros at positions of no segment)."""
        out = flat.new_zeros(self.rows, self.width, *flat.shape[2:])
        _, _, row, tok = self._index(flat.device)
        out[row, tok] = flat[0]
        return out

    def scatter_last(self, last: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Each segment's last-token output ``last [segments, ...]`` into its packed position of ``out [rows,
        width, ...]``, which is returned."""
        row = torch.tensor([b for b, _, _ in self.spans], dtype=torch.int64, device=out.device)
        tok = torch.tensor([s + n - 1 for _, s, n in self.spans], dtype=torch.int64, device=out.device)
        out[row, tok] = last.to(out.device)
        return out


def packed_segments(
    name: str, model: torch.nn.Module, kwargs: dict[str, Any], rows: int, width: int
) -> PackedRows | None:
    """The segments of the ``[rows, width]`` input when ``kwargs`` describe a packed forward (see the module
    docstring), else ``None``. ``position_ids [1, width]`` serve every row, as in transformers.
    ``ValueError`` for ``cu_seq_lens_q`` that do not describe one ``[1, width]`` row, or that contradict
    ``cu_seq_lens_k``."""
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
        layout = PackedRows.from_cu(name, cu, width)
        other = kwargs.get("cu_seq_lens_k")
        if other is not None and not torch.equal(torch.as_tensor(other).cpu(), cu.cpu()):
            raise ValueError(
                f"{name}: cu_seq_lens_k differs from cu_seq_lens_q (a self-attention forward has one)"
            )
        return layout
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
    lengths = []
    for row in starts.cpu().tolist():
        cut = [t for t, s in enumerate(row) if s or t == 0] + [len(row)]
        lengths.append([b - a for a, b in itertools.pairwise(cut)])
    return PackedRows.from_lengths(lengths, width)


def _packed_inputs(layout: PackedRows, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The packed forward's inputs from the caller's ``args`` / ``kwargs``: ``ids`` or ``embeds`` (one of
    them ``None``), ``pos int64 [rows | 1, width]``, the ``labels`` / ``keep`` / ``return_dict`` the outputs
    are finished with, and the ``rest`` of the keywords for the model (no mask, no cache)."""
    kwargs = dict(kwargs)
    if args:
        kwargs.setdefault("input_ids", args[0])
    for key in _CU_KEYS:
        kwargs.pop(key, None)
    ids, embeds = kwargs.pop("input_ids", None), kwargs.pop("inputs_embeds", None)
    source = ids if ids is not None else embeds
    pos = kwargs.pop("position_ids", None)
    if pos is None:  # cu_seq_lens alone: every segment's positions start at 0
        pos = torch.cat([torch.arange(n) for n in layout.lengths])[None, :]
    pos = pos.to(device=source.device, dtype=torch.long)
    for key in ("use_cache", "attention_mask", "cache", "past_key_values"):
        kwargs.pop(key, None)  # packed: no mask and no cache
    return dict(
        ids=ids, embeds=embeds, source=source, pos=pos, labels=kwargs.pop("labels", None),
        keep=kwargs.pop("logits_to_keep", 0), return_dict=kwargs.pop("return_dict", None), rest=kwargs,
    )  # fmt: skip


def _finish(model: torch.nn.Module, out: Any, fields: dict[str, Any], inputs: dict[str, Any]) -> Any:
    """``out``'s type with ``fields`` (``logits [rows, width, V]`` packed), the loss from the packed logits
    and ``labels`` (the model's own loss function), ``logits_to_keep`` and ``return_dict`` applied."""
    logits = fields["logits"]
    if inputs["labels"] is not None:
        fields["loss"] = model.loss_function(
            logits=logits, labels=inputs["labels"], vocab_size=model.config.vocab_size
        )
    keep = inputs["keep"]
    if isinstance(keep, int) and keep > 0:
        fields["logits"] = logits[:, -keep:]
    elif isinstance(keep, torch.Tensor):
        fields["logits"] = logits[:, keep]
    result = type(out)(**fields)
    return_dict = inputs["return_dict"]
    if return_dict is False or (return_dict is None and not getattr(model.config, "use_return_dict", True)):
        return result.to_tuple()
    return result


def packed_core_forward(
    model: torch.nn.Module,
    forward: Callable[..., Any],
    layout: PackedRows,
    args: tuple,
    kwargs: dict[str, Any],
    run_packed: Callable[..., Any],
) -> Any:
    """Run the packed forward of ``kwargs`` (``input_ids int64 [B, T]`` or ``inputs_embeds [B, T, h]``,
    ``position_ids [B, T]`` or ``[1, T]``, cut into ``layout``'s segments) as one packed forward of the KV
    core: ``forward`` (the model's own, with the library's attention) over the segments' tokens one after
    the other ``[1, n]``, each segment a request of its own (``run_packed``:
    :meth:`~torch_kvoffload.integrations.hf.session.OffloadSession.run_packed`); ``logits`` and
    ``hidden_states`` come back in the input's ``[B, T, ...]`` layout."""
    inputs = _packed_inputs(layout, args, kwargs)
    ids, pos = inputs["ids"], inputs["pos"]
    flat_pos = layout.take(pos.expand(layout.rows, -1))  # [1, n]
    if ids is not None:
        flat_ids = layout.take(ids)
        tokens = [t.tolist() for t in flat_ids[0].cpu().split(layout.lengths)]
        model_in = {"input_ids": flat_ids}
    else:
        tokens = [[-1] * n for n in layout.lengths]
        model_in = {"inputs_embeds": layout.take(inputs["embeds"])}

    def body() -> Any:
        return forward(**model_in, position_ids=flat_pos, use_cache=False, return_dict=True, **inputs["rest"])

    out = run_packed(body, tokens, flat_pos[0], unkeyed=ids is None)
    fields = dict(out.items())
    fields["logits"] = layout.unpack(out.logits)
    if out.hidden_states is not None:
        fields["hidden_states"] = tuple(layout.unpack(h) for h in out.hidden_states)
    return _finish(model, out, fields, inputs)


def packed_forward(
    name: str,
    model: torch.nn.Module,
    forward: Callable[..., Any],
    layout: PackedRows,
    args: tuple,
    kwargs: dict[str, Any],
) -> Any:
    """Run the packed forward of ``kwargs`` (as :func:`packed_core_forward`) through ``forward`` as one
    right-padded batch of its segments ``[segments, longest]``, and pack ``logits [B, T', V]`` and
    ``hidden_states`` back: the path of graphs compiled for batches, and of ``output_attentions`` (the
    probabilities in the batched model's layout)."""
    inputs = _packed_inputs(layout, args, kwargs)
    source = inputs["source"]
    batch = layout.gather(source)
    model_in = {"input_ids": batch} if inputs["ids"] is not None else {"inputs_embeds": batch}
    out = forward(
        **model_in,
        attention_mask=layout.mask(source.device).long(),
        position_ids=layout.gather(inputs["pos"].view(-1, layout.width)),
        use_cache=False,
        return_dict=True,
        **inputs["rest"],
    )
    fields = dict(out.items())
    fields["logits"] = layout.scatter(out.logits)
    if out.hidden_states is not None:
        fields["hidden_states"] = tuple(layout.scatter(h) for h in out.hidden_states)
    return _finish(model, out, fields, inputs)
