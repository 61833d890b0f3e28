"""Slot gates: per physical buffer, which layer holds it and what its next user must wait for.

Reuse invariant: a layer never loads into / writes its physical buffer before the previous user of that
buffer finished computing, its save completed and every registered external consumer (P/D remote read)
reported completion — the slot's ``release`` events. A failed save or load poisons the slot: every
waiter of the slot raises a :class:`~torch_kvoffload.transfer.TransferError` and the slot is not handed
out again until :meth:`SlotGates.reset`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from torch_kvoffload.counters import Counters
from torch_kvoffload.layerwise.errors import PrefixEvictedError, SlotPoisonedError, waiter_error
from torch_kvoffload.transfer import TransferError, TransferEvent, record_compute_event

logger = logging.getLogger(__name__)

__all__ = ["Slot", "SlotGates"]


@dataclass
class Slot:
    occupant: int | None = None  # layer currently owning the buffer
    release: list[TransferEvent] = field(default_factory=list)  # gate for the next user
    compute_done: bool = True
    handed_to: int | None = None  # a later layer whose load into this buffer was issued
    poison: BaseException | None = None
    poison_layer: int | None = None


class SlotGates:
    """The :class:`Slot` of every physical buffer; waits on their gates and poisons them on failure.

    ``counters`` receives ``waits`` / ``wait_seconds`` (blocking waits). ``sync_compute``: compute runs
    on the calling thread (CPU), so it is done whenever the runtime is called and no compute event is
    recorded (``record_compute_event`` would return one that is already complete).
    """

    def __init__(self, num_slots: int, counters: Counters, *, sync_compute: bool) -> None:
        self.slots = [Slot() for _ in range(num_slots)]
        self.counters = counters
        self.sync_compute = sync_compute
        self._lock = threading.Lock()  # poison is set from transfer threads

    def __getitem__(self, slot_id: int) -> Slot:
        return self.slots[slot_id]

    def wait(self, slot_id: int, layer: int, events: list[TransferEvent]) -> None:
        """Order ``layer``'s use of slot ``slot_id`` after ``events``; a failure poisons the slot (not an
        evicted prefix, which leaves nothing half-written) and raises the waiter's error."""
        if all(ev.succeeded() for ev in events):  # the usual case on CPU: nothing to wait for
            return
        pending = [ev for ev in events if not ev.query()]
        start = time.perf_counter()
        try:
            for ev in events:
                ev.wait_on_compute()
        except TransferError as exc:
            if not isinstance(exc.__cause__, PrefixEvictedError):
                self.poison(slot_id, layer, exc)
            raise waiter_error(exc, f"layerwise: layer {layer} cannot use physical buffer {slot_id}") from exc
        finally:
            if pending:
                self.counters.add("waits")
                self.counters.add("wait_seconds", time.perf_counter() - start)

    def poison(self, slot_id: int, layer: int, exc: BaseException) -> None:
        """Mark slot ``slot_id`` unusable after ``layer``'s transfer failed with ``exc`` (first failure kept)."""
        with self._lock:
            slot = self.slots[slot_id]
            if slot.poison is None:
                slot.poison, slot.poison_layer = exc, layer
        logger.error("layerwise: physical buffer %d poisoned by layer %d: %s", slot_id, layer, exc)

    def poison_message(self, slot_id: int, where: str) -> str:
        slot = self.slots[slot_id]
        return (
            f"layerwise {where}: physical buffer {slot_id} is poisoned by a failed transfer of layer "
            f"{slot.poison_layer} ({slot.poison}); call reset() after handling the failure"
        )

    def check_clean(self, where: str) -> None:
        """Raise :class:`SlotPoisonedError` for the first poisoned slot."""
        for s, slot in enumerate(self.slots):
            if slot.poison is not None:
                raise SlotPoisonedError(self.poison_message(s, where))

    def finish_compute_before(self, layer: int) -> None:
        """Layers below ``layer`` finished computing: their buffers' next users may overwrite them once
        the transfers done; on an accelerator that is ordered by a compute event."""
        ev = None
        for slot in self.slots:
            if slot.occupant is not None and slot.occupant < layer and not slot.compute_done:
                if not self.sync_compute:
                    ev = ev or record_compute_event()
                    slot.release.append(ev)
                slot.compute_done = True

    def compute_done(self) -> list[TransferEvent]:
        """Events marking the compute submitted so far; none on CPU, where compute is synchronous."""
        return [] if self.sync_compute else [record_compute_event()]

    def reset(self) -> None:
        """Clear every poison and drop failed release events (the slots' contents are garbage until a
        layer rewrites them)."""
        with self._lock:
            for slot in self.slots:
                slot.poison, slot.poison_layer = None, None
                slot.release = [ev for ev in slot.release if ev.error is None]

    def poisoned(self) -> list[int]:
        with self._lock:
            return [s for s, slot in enumerate(self.slots) if slot.poison is not None]
