"""``RowMap``: which residency row (hot buffer) each decode row of a step uses.

Residency rows belong to requests, not to batch positions: decode row ``t`` of a step is identified by
``(request id, ordinal)``, its ordinal being the number of earlier rows of the same request in that
step (0 for a plain decode token; 0, 1, ... for the query tokens of a speculative step). A key gets a row
the first time it is seen (the lowest free row) and keeps it until its request is released, so reordering
or compacting the batch keeps every hot row where it is.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

__all__ = ["RowMap", "RowPlan"]


@dataclass(frozen=True)
class RowPlan:
    """The rows of one step (``rows[t]`` for decode row ``t``) and the keys it would newly assign."""

    rows: list[int]
    new: dict[tuple[int, int], int] = field(default_factory=dict)

    def contiguous(self) -> bool:
        """Whether the rows are ``a, a + 1, ..., a + T - 1`` (a slice of the hot buffers)."""
        return bool(self.rows) and self.rows == list(range(self.rows[0], self.rows[0] + len(self.rows)))


class RowMap:
    """Assignment of ``(request id, ordinal)`` keys to rows ``0..max_rows-1``.

    :meth:`plan` computes a step's rows without changing anything; :meth:`commit` records the new keys
    once the step succeeded; :meth:`release` frees a request's rows.
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._rows: dict[int, list[int]] = {}  # request id -> its rows, by ordinal
        self._free: list[int] = list(range(max_rows))  # a heap: the lowest free row first
        # the last plan that assigned nothing, and its request ids: every later layer of a forward steps the
        # same rows, until a commit or a release changes the map
        self._last: tuple[list[int], RowPlan] | None = None

    @property
    def alive(self) -> int:
        """Rows held by requests now."""
        return self.max_rows - len(self._free)

    def rows_of(self, request_id: int) -> list[int]:
        """The rows ``request_id`` holds, by ordinal."""
        return list(self._rows.get(request_id, ()))

    def plan(self, where: str, request_ids: list[int]) -> RowPlan:
        """The rows of a step whose decode rows belong to ``request_ids`` (any order).

        Raises ``ValueError`` naming ``where`` when more rows would be alive than ``max_rows``.
        """
        last = self._last
        if last is not None and last[0] == request_ids:
            return last[1]
        ordinal: dict[int, int] = {}
        keys = []
        for rid in request_ids:
            k = ordinal.get(rid, 0)
            ordinal[rid] = k + 1
            keys.append((rid, k))
        fresh = [(rid, k) for rid, k in keys if k >= len(self._rows.get(rid, ()))]
        if len(fresh) > len(self._free):
            raise ValueError(
                f"{where}: the step needs {len(fresh)} new residency rows but only {len(self._free)} of "
                f"max_rows={self.max_rows} are free ({self.alive} held by {len(self._rows)} "
                "requests); release finished requests or raise max_rows"
            )
        new = dict(zip(fresh, heapq.nsmallest(len(fresh), self._free), strict=True))
        rows = [new[rid, k] if (rid, k) in new else self._rows[rid][k] for rid, k in keys]
        plan = RowPlan(rows, new)
        if not new:
            self._last = (list(request_ids), plan)
        return plan

    def commit(self, plan: RowPlan) -> None:
        """Record the keys ``plan`` assigned (after the step succeeded)."""
        if not plan.new:
            return
        self._last = None
        taken = set(plan.new.values())
        self._free = [r for r in self._free if r not in taken]
        heapq.heapify(self._free)
        for (rid, k), row in sorted(plan.new.items()):
            held = self._rows.setdefault(rid, [])
            assert len(held) == k, "ordinals are assigned in order"
            held.append(row)

    def release(self, request_id: int) -> list[int]:
        """Free every row of ``request_id``; return them (empty for an unknown request)."""
        self._last = None
        rows = self._rows.pop(request_id, [])
        for row in rows:
            heapq.heappush(self._free, row)
        return rows
