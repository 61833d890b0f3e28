"""``SlotPages``: per-layer device caches with one set of pages per request slot.

The device indexer cache (sparse offload and resident sparse) and the resident main KV are laid out alike:
per layer, one tensor per component, ``[slots * pages, page, width]`` (``width`` ``None``: ``[slots *
pages, page]``, a per-row scalar such as an int8 scale), where slot ``s`` owns pages ``s * pages ..
s * pages + pages - 1`` (``KVLayout.page``). Growing the layout copies every live request's rows into the
new pages; the old tensors are then dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.kv.requests import Request

__all__ = ["SlotPages"]


class SlotPages:
    """Per-layer paged tensors (see the module docstring).

    Parameters
    ----------
    num_layers : int
    components : sequence of ``(width or None, dtype)``
        One tensor per component and layer.
    device : torch.device
    """

    def __init__(
        self,
        num_layers: int,
        components: Sequence[tuple[int | None, torch.dtype]],
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.components = tuple(components)
        self.device = device
        self.layers: list[tuple[torch.Tensor, ...]] = []
        self._layout: KVLayout | None = None

    def _new(self, layout: KVLayout) -> list[tuple[torch.Tensor, ...]]:
        page, pages = layout.page
        n = layout.slots * pages
        return [
            tuple(
                torch.zeros((n, page) if w is None else (n, page, w), dtype=dt, device=self.device)
                for w, dt in self.components
            )
            for _ in range(self.num_layers)
        ]

    def allocate(self, layout: KVLayout, live: Sequence[Request] = ()) -> None:
        """Tensors for ``layout``; the rows of ``live`` requests (their ``length`` rows from position 0)
        are copied from the current tensors."""
        old, old_layout = self.layers, self._layout
        self.layers = []  # the old tensors are dropped as soon as the copy is done
        new = self._new(layout)
        if live and old_layout is not None:
            o_page, o_pages = old_layout.page
            page, pages = layout.page
            for old_layer, new_layer in zip(old, new, strict=True):
                for src, dst in zip(old_layer, new_layer, strict=True):
                    s = src.view(-1, *src.shape[2:])
                    d = dst.view(-1, *dst.shape[2:])
                    for r in live:
                        n, a, b = r.length, r.slot * o_pages * o_page, r.slot * pages * page
                        d[b : b + n] = s[a : a + n]
        self.layers, self._layout = new, layout

    def free(self) -> None:
        self.layers, self._layout = [], None

    def slot_pages(self, slot: int) -> list[int]:
        """The pages of request slot ``slot``."""
        assert self._layout is not None, "SlotPages.slot_pages before allocate()"
        pages = self._layout.page[1]
        return list(range(slot * pages, slot * pages + pages))

    @property
    def built(self) -> bool:
        return bool(self.layers)

    def write(self, layer: int, rows_at: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """Write ``values[c]`` (``[N, width]`` or ``[N]``) at flat rows ``rows_at int64 [N]`` of component
        ``c`` of ``layer``."""
        for t, v in zip(self.layers[layer], values, strict=True):
            t.view(-1, *t.shape[2:]).index_copy_(0, rows_at, v.to(t.dtype))

    def copy_rows(self, src_slot: int, dst_slot: int, n: int, layers: Sequence[int] | None = None) -> None:
        """Copy the first ``n`` rows (logical positions ``0..n-1``) of slot ``src_slot`` to slot
        ``dst_slot`` in every component of ``layers`` (default: every layer)."""
        assert self._layout is not None, "SlotPages.copy_rows before allocate()"
        page, pages = self._layout.page
        per_slot = page * pages
        if not 0 <= n <= per_slot or src_slot == dst_slot:
            raise ValueError(
                f"SlotPages.copy_rows: n must be in [0, {per_slot}] and the slots must differ, got n={n}, "
                f"slots {src_slot} -> {dst_slot}"
            )
        a, b = src_slot * per_slot, dst_slot * per_slot
        for layer in range(self.num_layers) if layers is None else layers:
            for t in self.flat(layer):
                t[b : b + n] = t[a : a + n]

    def read(self, layer: int, requests: Sequence[Request]) -> list[list[torch.Tensor]]:
        """Per request, per component, a copy of its rows ``0 .. length - 1`` of ``layer``."""
        assert self._layout is not None, "SlotPages.read before allocate()"
        page, pages = self._layout.page
        per_slot = page * pages
        flat = self.flat(layer)
        return [[t[r.slot * per_slot : r.slot * per_slot + r.length].clone() for t in flat] for r in requests]

    def flat(self, layer: int) -> list[torch.Tensor]:
        """``layer``'s components as ``[slots * pages * page, width]`` views."""
        return [t.view(-1, *t.shape[2:]) for t in self.layers[layer]]

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer]
