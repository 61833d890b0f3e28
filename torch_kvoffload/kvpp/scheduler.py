"""One-layer-ahead broadcast prefetch of KVPP bundles.

Per forward (the engine calls these on every rank of the group, with the same arguments):

* :meth:`KVPPScheduler.schedule_forward` — with history, start the first target layer's broadcast at
  once; without history (first prefill, dummy / profiling runs) nothing is broadcast in this forward.
* :meth:`KVPPScheduler.wait_for_layer` — after the layer's projections and before its first KV read or
  write: wait for the layer's broadcast, then start the next target layer's. The next layer's destination
  is the other scratch buffer (index among target layers % 2), last read by the layer before this one,
  whose compute is done; the broadcast is still ordered after a compute event.
* :meth:`KVPPScheduler.complete_forward` — finish a pending broadcast (a forward may end early) and reset.

The owner of a layer also waits for its broadcast: the owner's persistent buffer is the source, and
attention must not write the layer's new rows into it while peers are still reading it. Draft / MTP
layers are local: waiting on them is a no-op.

A failed broadcast raises :class:`~torch_kvoffload.device.TransferError` from ``wait_for_layer`` (or
``complete_forward``); the scheduler is then failed — nothing further is submitted and every later call
raises. Before the first forward, the ranks exchange their plans (``all_gather_object``) and refuse to run
when layouts, owners or block counts differ.

Counters: ``broadcasts`` issued, ``bytes_broadcast``, ``waits``, ``wait_seconds``, ``forwards``,
``forwards_with_history``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.device import TransferError, TransferEvent, record_compute_event
from torch_kvoffload.kvpp.allocation import KVPPAllocation
from torch_kvoffload.kvpp.transport import BroadcastTransport
from torch_kvoffload.ops.kvpp import register_scheduler, unregister_scheduler

logger = logging.getLogger(__name__)

__all__ = ["KVPPScheduler"]


class KVPPScheduler:
    """Drives the bundle broadcasts of one rank.

    Parameters
    ----------
    allocation : the rank's buffers (its ``plan`` gives owners and target order).
    transport : broadcasts over the group (:class:`BroadcastTransport` or anything with its interface).
    name : if given, register under this name for ``torch.ops.kvoffload.kvpp_*``; unregistered by
        :meth:`close`.
    wait_timeout : seconds ``wait_for_layer`` waits before raising ``TimeoutError`` (``None``: forever).
    """

    def __init__(
        self,
        allocation: KVPPAllocation,
        transport: BroadcastTransport,
        *,
        name: str | None = None,
        wait_timeout: float | None = None,
    ) -> None:
        self.allocation = allocation
        self.plan = allocation.plan
        self.transport = transport
        self.name = name
        self.wait_timeout = wait_timeout
        self.counters = Counters(
            ["broadcasts", "bytes_broadcast", "waits", "wait_seconds", "forwards", "forwards_with_history"]
        )
        self._targets = self.plan.target_layers
        self._verified = False
        self._in_forward = False
        self._has_history = False
        self._next = 0  # index in target layers of the next broadcast to start
        self._pending: tuple[int, TransferEvent] | None = None
        self._failed: BaseException | None = None
        self._closed = False
        if name is not None:
            register_scheduler(name, self)

    # --------------------------------------------------------------------------------------- agreement

    def _description(self) -> dict[str, Any]:
        alloc = self.allocation
        return {
            "owners": sorted(self.plan.owners.items()),
            "layouts": sorted((layer, spec.describe()) for layer, spec in alloc.bundles.items()),
            "draft_layouts": sorted((layer, spec.describe()) for layer, spec in alloc.draft_bundles.items()),
            "num_blocks": alloc.num_blocks,
            "group_ranks": list(self.transport.group.ranks),
        }

    def verify_agreement(self) -> None:
        """Check that every rank of the group has the same owners, layouts and block count (collective)."""
        mine = self._description()
        everyone = self.transport.all_gather_object(mine)
        ranks = self.transport.group.ranks
        for key in mine:
            values = [d[key] for d in everyone]
            if any(v != values[0] for v in values[1:]):
                per_rank = "; ".join(f"rank {r}: {v}" for r, v in zip(ranks, values, strict=True))
                raise RuntimeError(f"KVPP ranks disagree on {key}: {per_rank}")
        self._verified = True

    # ----------------------------------------------------------------------------------------- forward

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"KVPPScheduler.{what}: the scheduler is closed")
        if self._failed is not None:
            raise TransferError(
                f"KVPPScheduler.{what}: an earlier broadcast failed: {self._failed}"
            ) from self._failed

    def schedule_forward(self, has_history: bool) -> None:
        """Begin a forward; with history, start the first target layer's broadcast now."""
        self._check_usable("schedule_forward")
        if self._pending is not None:
            raise RuntimeError(
                f"KVPPScheduler.schedule_forward: the prefetch of layer {self._pending[0]} is still pending; "
                "call complete_forward() first"
            )
        if self._in_forward:
            raise RuntimeError("KVPPScheduler.schedule_forward: a forward is already scheduled")
        if not self._verified:
            self.verify_agreement()
        self._in_forward = True
        self._has_history = bool(has_history)
        self._next = 0
        self.counters.add("forwards")
        if self._has_history:
            self.counters.add("forwards_with_history")
            if self._targets:
                self._start(self._targets[0])

    def _start(self, layer: int) -> None:
        index = self.plan.target_index(layer)
        assert index == self._next and self._pending is None
        span = self.allocation.bundle_span(layer)
        event = self.transport.broadcast(layer, span, self.plan.owners[layer], after=[record_compute_event()])
        self._pending = (layer, event)
        self._next = index + 1
        logger.debug(
            "KVPP broadcast of layer %d (%d bytes) from owner %d",
            layer,
            span.numel(),
            self.plan.owners[layer],
        )
        self.counters.add("broadcasts")
        self.counters.add("bytes_broadcast", span.numel())

    def _check_bundle(self, layer: int, bundle: list[torch.Tensor] | None) -> None:
        if bundle is None:
            return
        views = list(self.allocation.views(layer).values())
        span = self.allocation.bundle_span(layer)
        expected = [(tuple(v.shape), v.dtype) for v in views]
        got = [(tuple(t.shape), t.dtype) for t in bundle]
        if got != expected and got != [(tuple(span.shape), span.dtype)]:
            raise ValueError(
                f"KVPPScheduler: bundle of layer {layer} must be its component tensors {expected} "
                f"(or its byte span), got {got}"
            )

    def _wait_pending(self, what: str) -> None:
        assert self._pending is not None
        layer, event = self._pending
        start = time.perf_counter()
        try:
            event.wait(self.wait_timeout)
        except TransferError as exc:
            self._failed = exc.__cause__ or exc
            self._pending = None
            raise TransferError(
                f"KVPPScheduler.{what}: broadcast of layer {layer} failed: {self._failed}"
            ) from exc
        finally:
            self.counters.add("waits")
            self.counters.add("wait_seconds", time.perf_counter() - start)
        self._pending = None

    def wait_for_layer(self, layer: int, bundle: list[torch.Tensor] | None = None) -> None:
        """Wait for ``layer``'s broadcast (owners wait for their send), then start the next layer's."""
        self._check_usable("wait_for_layer")
        if not self._in_forward:
            raise RuntimeError(
                "KVPPScheduler.wait_for_layer: no forward scheduled (call schedule_forward first)"
            )
        if not self.plan.is_target(layer):
            if layer not in self.allocation.draft_bundles:
                raise KeyError(f"KVPPScheduler.wait_for_layer: layer {layer} has no KV cache on this rank")
            return
        self._check_bundle(layer, bundle)
        if not self._has_history:
            return
        index = self.plan.target_index(layer)
        if self._pending is None or self._pending[0] != layer:
            expected = self._pending[0] if self._pending is not None else None
            raise RuntimeError(
                f"KVPPScheduler.wait_for_layer: layer {layer} (target #{index}) waited out of order; "
                f"the pending broadcast is for layer {expected}"
            )
        self._wait_pending("wait_for_layer")
        nxt = self.plan.next_target(layer)
        if nxt is not None:
            self._start(nxt)

    def prefetch_layer(self, layer: int, bundle: list[torch.Tensor] | None = None) -> None:
        """Start ``layer``'s broadcast if it is the next one and not started yet; otherwise a no-op.

        ``wait_for_layer`` already starts the next layer, so this only matters for graphs that place the
        prefetch explicitly. Asking for a layer beyond the next one is an error (only one is in flight).
        """
        self._check_usable("prefetch_layer")
        if not self._in_forward:
            raise RuntimeError(
                "KVPPScheduler.prefetch_layer: no forward scheduled (call schedule_forward first)"
            )
        if not self.plan.is_target(layer):
            return
        self._check_bundle(layer, bundle)
        if not self._has_history:
            return
        index = self.plan.target_index(layer)
        if index < self._next:
            return  # started already (pending or finished)
        if index > self._next or self._pending is not None:
            raise RuntimeError(
                f"KVPPScheduler.prefetch_layer: layer {layer} is not the next layer to prefetch "
                f"(next: {self._targets[self._next] if self._next < len(self._targets) else None})"
            )
        self._start(layer)

    def complete_forward(self) -> None:
        """End the forward: finish any broadcast still in flight, then reset the layer cursor."""
        if self._closed:
            raise RuntimeError("KVPPScheduler.complete_forward: the scheduler is closed")
        try:
            if self._pending is not None:
                self._wait_pending("complete_forward")
        finally:
            self._in_forward = False
            self._has_history = False
            self._next = 0

    @property
    def pending_layer(self) -> int | None:
        return None if self._pending is None else self._pending[0]

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def close(self) -> None:
        """Finish in-flight work, stop the transfer thread and unregister; idempotent."""
        if self._closed:
            return
        if self._pending is not None:
            try:
                self._pending[1].wait(self.wait_timeout)
            except (TransferError, TimeoutError) as exc:
                logger.warning("KVPP broadcast of layer %s failed during close: %s", self._pending[0], exc)
            self._pending = None
        self._closed = True
        self.transport.close()
        if self.name is not None:
            unregister_scheduler(self.name)

    def __enter__(self) -> KVPPScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
