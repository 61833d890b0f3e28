"""The copies behind hybrid sparse attention's spills and promotions: a resident request's rows into the host
pool (:func:`rows_to_host`), an offloaded one's host rows into its device blocks (:class:`PromotionLanding`).

A promotion decided when a forward begins is carried out layer by layer during that forward: layer ``L + 1``'s
rows are copied on the runtime's ``h2d`` transfer stream while layer ``L`` computes, and a layer reads the
promoted requests' blocks only after its own copy landed (:meth:`PromotionLanding.land`). The forward never
waits for the whole promotion before its first layer; a copy that fails fails the forward at the layer
that needs it. Under tensor parallelism the copies run at once, every layer, before the forward
(:meth:`PromotionLanding.run`): the ranks must learn every rank's outcome before any of them computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from torch_kvoffload.sparse.device_blocks import DeviceBlocks
from torch_kvoffload.sparse.runtime import SparseDecodeOffload
from torch_kvoffload.transfer import TransferEvent, record_compute_event

__all__ = ["PromotionLanding", "rows_to_host"]


def rows_to_host(
    rt: SparseDecodeOffload, blocks: DeviceBlocks, request_id: int, start: int, end: int, *, fp8: bool
) -> int:
    """Copy ``request_id``'s rows ``start .. end - 1`` of every layer from its device ``blocks`` to the host pool,
    through the pool's appends (copy-on-write of shared blocks included); returns the bytes moved."""
    if end <= start:
        return 0
    placed = rt.place_rows([request_id] * (end - start), torch.arange(start, end))
    for layer in range(rt.num_layers):
        parts = blocks.read(layer, request_id, start, end)
        kv_c, k_pe = (parts[0], parts[0][:, :0]) if fp8 else parts
        rt.append_validated(layer, placed, kv_c, k_pe)
    rt.sync()
    return (end - start) * rt.pool.row_bytes * rt.num_layers


class PromotionLanding:
    """The copies of promoted requests' host rows into their device blocks, one layer at a time.

    ``rows``: ``(request id, rows)`` pairs; each request already holds blocks for its rows. Only the host
    rows of positions ``0 .. rows - 1`` are read (they do not change while the request is promoted: it
    writes its new rows to its blocks)."""

    def __init__(
        self, rt: SparseDecodeOffload, blocks: DeviceBlocks, rows: Sequence[tuple[int, int]], *, fp8: bool
    ) -> None:
        self.rt, self.blocks, self.fp8 = rt, blocks, fp8
        self.request_ids = [rid for rid, _ in rows]
        device = blocks.device
        # (host pool rows, device block rows) of each request, the same for every layer
        self._at = [
            (rt.pool.slots(rid, torch.arange(n)), blocks.rows(rid, torch.arange(n, device=device)))
            for rid, n in rows
            if n
        ]
        self.bytes = sum(len(src) for src, _ in self._at) * rt.pool.row_bytes * rt.num_layers
        self._events: dict[int, TransferEvent] = {}
        self._landed: set[int] = set()
        #: a copy failed (set by :meth:`land` / :meth:`cancel`, or by the owner of a :meth:`run`)
        self.failed = False

    def copy_layer(self, layer: int) -> None:
        """Copy ``layer``'s rows of every promoted request from the host pool into its blocks."""
        host_c, host_pe = self.rt.pool.rows(layer)
        device = self.blocks.device
        for src, dst in self._at:
            kv_c = host_c[src].to(device)
            self.blocks.write(layer, dst, [kv_c] if self.fp8 else [kv_c, host_pe[src].to(device)])

    def run(self) -> None:
        """Every layer's copy now, on the calling thread."""
        for layer in range(self.rt.num_layers):
            self.rt.wait_rows(layer)
            self.copy_layer(layer)

    def _submit(self, layer: int) -> None:
        if layer < self.rt.num_layers and layer not in self._events:
            self.rt.wait_rows(layer)  # the rows appended in earlier forwards are in the pool
            # after the compute so far: the blocks may have been written or freed by it
            self._events[layer] = self.rt.transfer_streams["h2d"].submit(
                self.copy_layer, layer, after=[record_compute_event()]
            )

    def start(self) -> None:
        """Start the first layer's copy."""
        self._submit(0)

    def land(self, layer: int) -> None:
        """``layer``'s rows are in the blocks for the compute that follows; the next layer's copy is under
        way. Raises when ``layer``'s copy failed."""
        if layer in self._landed:
            return
        self._submit(layer)
        self._submit(layer + 1)
        try:
            self._events[layer].wait_on_compute()
        except Exception:
            self.failed = True
            raise
        self._landed.add(layer)

    def finish(self) -> None:
        """Every layer landed (the layers no compute asked for copied now); raises if a copy failed."""
        for layer in range(self.rt.num_layers):
            self.land(layer)

    def cancel(self) -> None:
        """Wait for the copies under way, whatever their outcome (their blocks are then given up)."""
        for event in self._events.values():
            with contextlib.suppress(Exception):  # reported by the forward that needed the layer
                event.wait()
            self.failed = self.failed or event.error is not None
