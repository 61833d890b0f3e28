"""The device tails of layerwise offload: each request's partial last block, kept between forwards."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LayerTails", "tail_moves"]

Moves = tuple[torch.Tensor, torch.Tensor] | None


def tail_moves(
    slots: Sequence[int],
    cached: Sequence[int],
    old_len: Sequence[int],
    new_len: Sequence[int],
    block_size: int,
    request_rows: int,
    tail_rows: int,
    device: torch.device,
) -> tuple[Moves, Moves]:
    """The row copies of one forward between the tails (flat ``[slots * tail_rows]``) and the layer buffers
    (flat, slot ``s`` at row ``s * request_rows``): ``(restore, keep)``, each ``(source rows, destination
    rows)`` int64 on ``device`` or ``None`` when empty. Restore: the rows of each request's partial block
    that the store does not give (past its ``cached`` tokens), tail to buffer, before the writes; keep: the
    rows of the partial block after the forward (of ``new_len`` tokens), buffer to tail, after them."""
    restore: tuple[list[int], list[int]] = ([], [])
    keep: tuple[list[int], list[int]] = ([], [])
    for slot, c, old, new in zip(slots, cached, old_len, new_len, strict=True):
        full_old, full_new = old // block_size * block_size, new // block_size * block_size
        for p in range(max(c, full_old), old):
            restore[0].append(slot * tail_rows + p - full_old)
            restore[1].append(slot * request_rows + p)
        for p in range(full_new, new):
            keep[0].append(slot * request_rows + p)
            keep[1].append(slot * tail_rows + p - full_new)

    def moves(pair: tuple[list[int], list[int]]) -> Moves:
        return (
            (torch.tensor(pair[0], device=device), torch.tensor(pair[1], device=device)) if pair[0] else None
        )

    return moves(restore), moves(keep)


class LayerTails:
    """Per layer, per component of the layer buffers, ``[slots, rows, D]`` in the component's dtype: the rows
    of each request slot's partial last block (``rows``: a block, never more than a request's tokens).
    Empty until :meth:`build`."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, ...]] = []

    def __bool__(self) -> bool:
        return bool(self.layers)

    def build(self, components: Sequence[torch.Tensor], num_layers: int, slots: int, rows: int) -> None:
        """Tails for ``slots`` slots of ``rows`` rows, one per component like ``components`` (a layer's
        buffers: their width, dtype and device); rows already kept are copied, nothing when the shape holds."""
        if self.layers and self.layers[0][0].shape[:2] == (slots, rows):
            return
        old = self.layers if self.layers and self.layers[0][0].shape[0] == slots else []
        self.layers = [
            tuple(torch.zeros(slots, rows, c.shape[-1], dtype=c.dtype, device=c.device) for c in components)
            for _ in range(num_layers)
        ]
        for new_layer, old_layer in zip(self.layers, old, strict=False):
            for t, o in zip(new_layer, old_layer, strict=True):
                n = min(rows, o.shape[1])
                t[:, :n] = o[:, :n]

    def clear(self) -> None:
        self.layers = []

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot ``dst`` gets slot ``src``'s rows in every layer."""
        for tails in self.layers:
            for t in tails:
                t[dst] = t[src]

    def fill(self, slot: int, n: int, records: Sequence[Sequence[torch.Tensor]]) -> None:
        """Slot ``slot``'s first ``n`` rows from a stored block's ``records`` (per layer, per component,
        ``[block_size, D]``, any device)."""
        for tails, stored in zip(self.layers, records, strict=True):
            for t, b in zip(tails, stored, strict=True):
                t[slot, :n] = b[:n].to(t.device)

    def tensors(self) -> list[torch.Tensor]:
        return [t for tails in self.layers for t in tails]
