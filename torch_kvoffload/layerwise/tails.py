"""The device tails of layerwise offload: each request's partial last block, kept between forwards."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LayerTails"]


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
