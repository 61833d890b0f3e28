"""Store I/O of the layerwise runtime: a layer's blocks between the store and its buffer, on transfer streams.

The value of a store record is the block's bundle — every cache component of the layer (main, then
indexer) for that block, each at a 16-byte aligned offset inside one ``uint8`` record. With host (CPU)
buffers a layer's blocks move between the store and the buffers in one store call per layer
(:meth:`KVStore.batch_get_leased_blocks` through the lookup's pinning leases, else ``batch_get_blocks``;
``batch_put_blocks``); the embedded store does that with one ``copy_blocks`` kernel per component, no
staging copy. With device buffers the records go through pinned host staging tensors, each reused only
after the device copy that last used it completed (an event), and a host read of a device-to-host copy
waits for that copy's event first.

Every transfer is submitted to a :class:`~torch_kvoffload.transfer.TransferStream` (or cut in parts by
:func:`~torch_kvoffload.transfer.submit_split`); the work here runs on the stream's thread, or in part on
the thread that waits for it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torch_kvoffload._utils import round_up
from torch_kvoffload.counters import Counters
from torch_kvoffload.device import empty_host
from torch_kvoffload.layerwise.allocation import LayerBuffers
from torch_kvoffload.layerwise.batch import Transfers
from torch_kvoffload.layerwise.errors import PrefixEvictedError, SlotPoisonedError
from torch_kvoffload.layerwise.lookup import PrefixLookup
from torch_kvoffload.layerwise.slots import SlotGates
from torch_kvoffload.ops.copy import copy_blocks
from torch_kvoffload.store.base import KVStore, RecordLayout, StoreLease, leased_keys
from torch_kvoffload.transfer import TransferEvent, TransferStream, submit_split

logger = logging.getLogger(__name__)

__all__ = ["LayerStoreIO", "Layout", "Staging", "layer_layout"]

_ALIGN = 16
# pinned staging tensors per direction with device buffers: the host fills one while the device copies
# from another
_STAGING_RING = 2


@dataclass
class Layout:
    """One layer's store record: its cache ``components``, each at ``offsets[i]`` in ``record_bytes``."""

    components: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    record_bytes: int
    records: RecordLayout | None  # the components as store records; None for device buffers


def layer_layout(buffers: LayerBuffers, layer: int) -> Layout:
    """The record layout of ``layer``'s caches in ``buffers`` (direct store records when every component
    is a contiguous host tensor)."""
    comps = buffers.layer_caches(layer)
    offsets, off = [], 0
    for c in comps:
        offsets.append(off)
        off = round_up(off + c[0].nbytes, _ALIGN)
    direct = all(c.device.type == "cpu" and c.is_contiguous() for c in comps)
    return Layout(comps, tuple(offsets), off, RecordLayout(comps, offsets, off) if direct else None)


@dataclass
class Staging:
    """A reusable pinned host staging buffer; ``event`` marks the device copy that last used it."""

    buffer: torch.Tensor | None = None
    event: torch.Event | None = None


class LayerStoreIO:
    """Moves layers' blocks between ``store`` and their buffers on one or two transfer streams.

    Parameters
    ----------
    store : the host KV pool.
    layouts : per layer, its record :class:`Layout`.
    lookup : the store keys and the forward's leases.
    gates : the slot gates (a failed transfer poisons its slot; a poisoned slot is never loaded into).
    counters : receives the load / save counters (bytes, blocks, batches, seconds, failures, evictions).
    transfer_streams : 2 = loads and saves on separate streams; 1 = one stream in submission order.
    host_buffers : the buffers are host memory: one staging tensor per direction, no events.
    """

    def __init__(
        self,
        store: KVStore,
        layouts: Sequence[Layout],
        lookup: PrefixLookup,
        gates: SlotGates,
        counters: Counters,
        *,
        transfer_streams: int,
        host_buffers: bool,
    ) -> None:
        self.store = store
        self.layouts = layouts
        self.lookup = lookup
        self.gates = gates
        self.counters = counters
        self.block_size = lookup.block_size
        self.load_stream = TransferStream("layerwise-load" if transfer_streams == 2 else "layerwise")
        self.save_stream = TransferStream("layerwise-save") if transfer_streams == 2 else self.load_stream
        # host buffers: the staging path (non-contiguous host buffers) reuses one staging tensor per
        # direction with no events; device buffers: a ring of pinned tensors gated by copy events
        ring = 1 if host_buffers else _STAGING_RING
        self.staging_ring: dict[str, list[Staging]] = {
            k: [Staging() for _ in range(ring)] for k in ("load", "save")
        }
        self.staging_next = {"load": 0, "save": 0}

    def close(self) -> None:
        """Finish queued transfers and stop the streams' threads."""
        self.load_stream.close()
        if self.save_stream is not self.load_stream:
            self.save_stream.close()

    def splits(self, layer: int, parts: int) -> bool:
        """Whether a transfer of ``layer`` asked to run in ``parts`` is cut: host buffers only (the
        staging path reuses one staging tensor per direction)."""
        return parts > 1 and self.layouts[layer].records is not None

    # ------------------------------------------------------------------------------ submission
    def submit_load(
        self,
        layer: int,
        slot_id: int,
        plan: Transfers,
        *,
        after: list[TransferEvent],
        parts: int,
        wake_delay: float,
    ) -> TransferEvent:
        """Load ``layer``'s prefix blocks of ``plan`` into its buffer (slot ``slot_id``) after ``after``:
        cut in ``parts`` run also by the waiting thread (:meth:`splits`), else one job started
        ``wake_delay`` seconds after it wakes an idle stream thread."""
        if self.splits(layer, parts):
            return submit_split(
                [self.load_stream],
                len(plan.load_hashes),
                functools.partial(self._load_part, layer, slot_id, plan),
                after=after,
                done=functools.partial(self._load_done, layer, slot_id, plan),
                parts=parts,
            )
        return self.load_stream.submit(
            self._do_load, layer, slot_id, plan, after=after, wake_delay=wake_delay
        )

    def submit_save(
        self,
        layer: int,
        slot_id: int,
        plan: Transfers,
        *,
        after: list[TransferEvent],
        parts: int,
        wake_delay: float,
    ) -> TransferEvent:
        """Store ``layer``'s newly computed blocks of ``plan`` after ``after`` (as :meth:`submit_load`)."""
        args = (layer, plan.save_hashes, plan.save_blocks)
        if self.splits(layer, parts):
            n = len(plan.save_hashes)
            return submit_split(
                [self.save_stream],
                n,
                functools.partial(self._save_part, *args),
                after=after,
                done=functools.partial(self._save_done, layer, slot_id, n),
                parts=parts,
            )
        # keys are made on the transfer thread: per-layer Python stays off the compute thread
        return self.save_stream.submit(self._do_save, slot_id, *args, after=after, wake_delay=wake_delay)

    def read_block(self, block_hash: str) -> list[list[torch.Tensor]] | None:
        """Every layer's stored record of the block ``block_hash``, read on the calling thread (between
        forwards): per layer, per component, a host ``[block_size, *row]`` tensor in the component's
        dtype; ``None`` when a layer's record is missing (evicted)."""
        keys = [self.lookup.layer_keys([block_hash], layer)[0] for layer in range(len(self.layouts))]
        records = [torch.empty(1, lay.record_bytes, dtype=torch.uint8) for lay in self.layouts]
        if False in self.store.batch_get(keys, [r[0] for r in records]):
            return None
        return [[v[0] for v in self.staging_views(layer, r)] for layer, r in enumerate(records)]

    def write_block(self, block_hash: str, rows: Sequence[Sequence[torch.Tensor]]) -> None:
        """Store ``rows`` (per layer, per component, a host ``[block_size, *row]`` tensor in the component's
        dtype) as every layer's record of the block ``block_hash``, on the calling thread (between forwards;
        what :meth:`read_block` reads back)."""
        keys = [self.lookup.layer_keys([block_hash], layer)[0] for layer in range(len(self.layouts))]
        records = []
        for layer, comps in enumerate(rows):
            record = torch.zeros(1, self.layouts[layer].record_bytes, dtype=torch.uint8)
            for view, src in zip(self.staging_views(layer, record), comps, strict=True):
                view[0].copy_(src)
            records.append(record[0])
        self.store.batch_put(keys, records)
        self.counters.add("blocks_saved", len(keys))
        self.counters.add("bytes_saved", sum(r.numel() for r in records))

    # ---------------------------------------------------------------------- transfer-thread work
    def staging(self, kind: str, n: int, record_bytes: int) -> tuple[Staging, torch.Tensor]:
        """The next staging buffer of direction ``kind`` and a ``uint8 [n, record_bytes]`` view of it.

        Each direction runs on one transfer thread, one transfer at a time, and reuses its buffers: a
        fresh multi-MiB (pinned) allocation per layer would page-fault or register memory every time.
        With host buffers there is one per direction (copies are synchronous; the store keeps copies of
        what it is given). With device buffers a ring of pinned buffers: one is reused only after the
        device copy that last used it completed (its event; a host wait on this transfer thread).
        """
        ring = self.staging_ring[kind]
        entry = ring[self.staging_next[kind]]
        self.staging_next[kind] = (self.staging_next[kind] + 1) % len(ring)
        if entry.event is not None:
            entry.event.synchronize()
            entry.event = None
        need = n * record_bytes
        if entry.buffer is None or entry.buffer.numel() < need:
            entry.buffer = empty_host((need,), torch.uint8)
        return entry, entry.buffer[:need].view(n, record_bytes)

    def copies_issued(self, entry: Staging, device: torch.device) -> None:
        """Mark the copies this thread just issued to or from ``entry`` (device buffers: an event on the
        current stream — the transfer stream on the transfer thread; host buffers: done already)."""
        if device.type != "cpu":
            event = torch.Event(device)
            event.record(torch.accelerator.current_stream(device))
            entry.event = event

    def staging_views(self, layer: int, staging: torch.Tensor) -> list[torch.Tensor]:
        """Per component of ``layer``, its ``[n, *block shape]`` view of the ``uint8 [n, record_bytes]``
        records in ``staging``."""
        lay = self.layouts[layer]
        n = staging.shape[0]
        views = []
        for comp, off in zip(lay.components, lay.offsets, strict=True):
            nb = comp[0].nbytes
            views.append(staging[:, off : off + nb].view(comp.dtype).view(n, *comp.shape[1:]))
        return views

    def _evicted(self, layer: int, plan: Transfers, found: list[bool]) -> PrefixEvictedError:
        """The error of a load that found its blocks (the load list of ``layer``) partly missing."""
        found_of = dict(zip(plan.load_blocks, found, strict=True))
        usable = []
        for q in plan.requests:
            n = q.num_cached_blocks
            # a block not in the load list is computed in this forward by the request that writes it
            missing = next((j for j in range(n) if not found_of.get(q.block_ids[j], True)), n)
            usable.append(missing * self.block_size)
        missing = found.count(False)
        return PrefixEvictedError(
            f"layerwise: {missing} of {len(found)} cached blocks of layer {layer} could not be loaded from the "
            f"store (evicted after the lookup, failed their checksum, or the store failed: see the store's "
            f"counters and the log); usable cached tokens per request: {usable}",
            layer=layer,
            usable_tokens=usable,
            missing_blocks=missing,
        )

    @staticmethod
    def _lease_segments(
        plan: Transfers, layer: int, begin: int, end: int
    ) -> list[tuple[StoreLease, int, int]]:
        """The lease ranges holding entries ``[begin, end)`` of ``layer``'s load list: each request's
        lease holds its leased prefix of every layer, layer-major (``plan.load_runs``)."""
        segments: list[tuple[StoreLease, int, int]] = []
        for start, r, first, length in plan.load_runs:
            lo, hi = max(begin, start), min(end, start + length)
            if lo < hi:
                q = plan.requests[r]
                k = layer * q.leased_blocks + first - start
                segments.append((q.lease, k + lo, k + hi))  # type: ignore[arg-type]
        return segments

    def _do_load(self, layer: int, slot_id: int, plan: Transfers) -> None:
        """Load all of ``layer``'s prefix blocks on this thread."""
        n = len(plan.load_hashes)
        try:
            result = self._load_part(layer, slot_id, plan, 0, n)
        except BaseException as exc:
            self._load_done(layer, slot_id, plan, [], exc)
            raise  # not reached: _load_done raises
        self._load_done(layer, slot_id, plan, [result], None)

    def _load_part(
        self, layer: int, slot_id: int, plan: Transfers, begin: int, end: int
    ) -> tuple[list[bool], float]:
        """Copy entries ``[begin, end)`` of ``layer``'s load list into its buffer; return which were
        found and the seconds it took. Misses are reported by :meth:`_load_done`."""
        start = time.perf_counter()
        lay = self.layouts[layer]
        if self.gates[slot_id].poison is not None:
            raise SlotPoisonedError(self.gates.poison_message(slot_id, f"load of layer {layer}"))
        part_blocks = plan.load_blocks[begin:end]
        if plan.via_leases:
            segments = self._lease_segments(plan, layer, begin, end)
            if lay.records is not None:
                # host buffers: the store writes the records straight into the layer's blocks
                found = self.store.batch_get_leased_blocks(segments, lay.records, part_blocks)
                return found, time.perf_counter() - start
            keys = leased_keys("LayerwiseOffloadRuntime load", segments)
        else:
            keys = self.lookup.layer_keys(plan.load_hashes[begin:end], layer)
            if lay.records is not None:
                found = self.store.batch_get_blocks(keys, lay.records, part_blocks)
                return found, time.perf_counter() - start
        n = end - begin
        entry, staging = self.staging("load", n, lay.record_bytes)
        found = self.store.batch_get(keys, list(staging.unbind(0)))
        if False not in found:
            mapping = torch.stack([torch.arange(n), torch.tensor(part_blocks, dtype=torch.int64)], dim=1)
            for comp, view in zip(lay.components, self.staging_views(layer, staging), strict=True):
                copy_blocks(view, comp, mapping)
            self.copies_issued(entry, lay.components[0].device)
        return found, time.perf_counter() - start

    def _load_done(
        self,
        layer: int,
        slot_id: int,
        plan: Transfers,
        results: list[tuple[list[bool], float]],
        error: BaseException | None,
    ) -> None:
        """Account for ``layer``'s whole load (its parts' ``results``); raise its failure: ``error``, or
        :class:`PrefixEvictedError` if blocks were missing."""
        if error is None:
            found = [hit for part, _ in results for hit in part]
            if False in found:
                error = self._evicted(layer, plan, found)
        if error is not None:
            self.counters.add("load_failures")
            if isinstance(error, PrefixEvictedError):
                # the layer's waiter raises; the buffer holds nothing anyone will read, so no poison
                self.counters.add("prefix_evictions")
                logger.info("%s", error)
            else:
                self.gates.poison(slot_id, layer, error)
            raise error
        n = len(plan.load_hashes)
        self.counters.add("load_seconds", sum(seconds for _, seconds in results))
        self.counters.add("loads")
        self.counters.add("blocks_loaded", n)
        self.counters.add("bytes_loaded", n * self.layouts[layer].record_bytes)

    def _do_save(self, slot_id: int, layer: int, hashes: list[str], blocks: list[int]) -> None:
        """Save all of ``layer``'s new blocks on this thread."""
        n = len(hashes)
        try:
            seconds = self._save_part(layer, hashes, blocks, 0, n)
        except BaseException as exc:
            self._save_done(layer, slot_id, n, [], exc)
            raise  # not reached: _save_done raises
        self._save_done(layer, slot_id, n, [seconds], None)

    def _save_part(self, layer: int, hashes: list[str], blocks: list[int], begin: int, end: int) -> float:
        """Store entries ``[begin, end)`` of the save list from ``layer``'s buffer; return the seconds."""
        start = time.perf_counter()
        lay = self.layouts[layer]
        keys = self.lookup.layer_keys(hashes[begin:end], layer)
        if lay.records is not None:
            self.store.batch_put_blocks(keys, lay.records, blocks[begin:end])
        else:
            n = end - begin
            entry, staging = self.staging("save", n, lay.record_bytes)
            mapping = torch.stack(
                [torch.tensor(blocks[begin:end], dtype=torch.int64), torch.arange(n)], dim=1
            )
            for comp, view in zip(lay.components, self.staging_views(layer, staging), strict=True):
                copy_blocks(comp, view, mapping)
            self.copies_issued(entry, lay.components[0].device)
            if entry.event is not None:
                # the store reads the staging bytes on this host thread: the copies must have landed
                entry.event.synchronize()
                entry.event = None
            self.store.batch_put(keys, list(staging.unbind(0)))
        return time.perf_counter() - start

    def _save_done(
        self, layer: int, slot_id: int, n: int, results: list[float], error: BaseException | None
    ) -> None:
        """Account for ``layer``'s whole save (its parts' seconds); raise ``error`` (poisoning the slot)."""
        if error is not None:
            self.counters.add("save_failures")
            self.gates.poison(slot_id, layer, error)
            raise error
        self.counters.add("save_seconds", sum(results))
        self.counters.add("saves")
        self.counters.add("blocks_saved", n)
        self.counters.add("bytes_saved", n * self.layouts[layer].record_bytes)
