"""Requests: admitted, extended and finished with independent lifetimes.

A :class:`Request` is one sequence of tokens whose KV a model keeps: an id (unique for the table's life,
never reused: host pools and stores key their blocks by it), the device *slot* it holds and the token ids
seen so far. The slot is the request's place in every device cache the KV core pages: slot ``s`` owns
blocks ``s * M .. s * M + M - 1`` of a cache of ``M`` blocks per request (row ``s`` of per-request caches).

A :class:`RequestTable` has a fixed number of slots (the requests the device caches are sized for).
:meth:`~RequestTable.admit` gives new requests the lowest free slots, :meth:`~RequestTable.finish` frees one
request's slot while the others continue, and a later admission reuses it. The table does bookkeeping
only: what a slot's caches hold is the backends' business (they are told about admissions and releases by
the KV core).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from torch_kvoffload._utils import check_int

__all__ = ["Request", "RequestTable"]


@dataclass
class Request:
    """One request: ``id``, device ``slot`` and the ``tokens`` (host ints) whose KV is kept, in order.

    ``keyed``: whether ``tokens`` are the token ids the KV was computed from. A request fed embeddings
    (``inputs_embeds``) has placeholders (``-1``) where no id is known; it is not keyed, for its whole
    life: a store that keys KV by content neither looks up nor shares its blocks.

    ``positions``: the model (rotary) position each token's KV was computed at, one per token, or ``None``
    while every token sat at its logical position (token ``t`` at ``t``: what ``generate`` feeds). The
    rotary part of the KV depends on it, so a store that keys KV by content keys it by these positions
    too (:meth:`add_positions`).
    """

    id: int
    slot: int
    tokens: list[int] = field(default_factory=list)
    keyed: bool = True
    positions: list[int] | None = None

    @property
    def length(self) -> int:
        """Tokens seen so far (the next token's logical position)."""
        return len(self.tokens)

    def add_positions(self, start: int, positions: Sequence[int] | None) -> None:
        """Record the positions of tokens ``start .. start + len(positions) - 1`` (``None``: at their
        logical positions). ``positions`` stays ``None`` while every token is at its logical position."""
        if positions is None:
            if self.positions is not None:
                self.positions[start:] = range(start, self.length)
            return
        n = len(positions)
        if self.positions is None and list(positions) == list(range(start, start + n)):
            return
        if self.positions is None:
            self.positions = list(range(start))
        self.positions[start:] = [int(p) for p in positions]

    def truncate_positions(self, length: int) -> None:
        """Keep the positions of the first ``length`` tokens."""
        if self.positions is not None:
            del self.positions[length:]


class RequestTable:
    """The live requests of a model and the device slots they hold (see the module docstring).

    Parameters
    ----------
    slots : int
        Device slots (≥ 0); :meth:`resize` changes it.
    """

    def __init__(self, slots: int = 0) -> None:
        self._slots = check_int("RequestTable", "slots", slots, minimum=0)
        self._live: dict[int, Request] = {}  # admission order
        self._ids = itertools.count()

    @property
    def slots(self) -> int:
        """Device slots of the table."""
        return self._slots

    def resize(self, slots: int) -> None:
        """Set the number of slots; ``ValueError`` if a live request holds a slot ``>= slots``."""
        slots = check_int("RequestTable.resize", "slots", slots, minimum=0)
        held = [r.slot for r in self._live.values() if r.slot >= slots]
        if held:
            raise ValueError(f"RequestTable.resize: live requests hold slots {held}, got slots={slots}")
        self._slots = slots

    def free_slots(self) -> list[int]:
        """Slots no live request holds, ascending."""
        used = {r.slot for r in self._live.values()}
        return [s for s in range(self._slots) if s not in used]

    def admit(self, count: int = 1) -> list[Request]:
        """``count`` new requests (no tokens yet) in the lowest free slots, in slot order.

        ``ValueError`` (nothing admitted) when fewer than ``count`` slots are free.
        """
        count = check_int("RequestTable.admit", "count", count, minimum=1)
        free = self.free_slots()
        if len(free) < count:
            raise ValueError(
                f"RequestTable.admit: {count} requests need free slots, {len(free)} of {self._slots} are free"
            )
        out = [Request(next(self._ids), slot) for slot in free[:count]]
        for r in out:
            self._live[r.id] = r
        return out

    def get(self, request_id: int) -> Request:
        """The live request ``request_id``; ``KeyError`` naming it if it is not live."""
        try:
            return self._live[request_id]
        except KeyError:
            raise KeyError(f"RequestTable: request {request_id} is not live") from None

    def extend(self, request_id: int, tokens: Iterable[int]) -> Request:
        """Append ``tokens`` to request ``request_id``; return it."""
        r = self.get(request_id)
        r.tokens.extend(int(t) for t in tokens)
        return r

    def finish(self, request_id: int) -> Request:
        """End request ``request_id``: its slot is free for the next admission; return it."""
        r = self.get(request_id)
        del self._live[request_id]
        return r

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._live.values()))

    def __len__(self) -> int:
        return len(self._live)

    @property
    def ids(self) -> list[int]:
        """Ids of the live requests, in admission order."""
        return list(self._live)
