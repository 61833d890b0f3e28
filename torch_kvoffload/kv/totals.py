"""``RuntimeTotals``: a backend's counters over the life of every runtime it built and retired."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch_kvoffload.counters import Counters

__all__ = ["RuntimeTotals"]


class RuntimeTotals:
    """The counters ``names`` of the runtimes a backend retired, plus those of its live one.

    A backend rebuilds its runtime when it is resized; ``retire`` folds the old runtime's counters in
    before closing it, so ``stats`` keeps counting across rebuilds.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self._names = tuple(names)
        self._retired = Counters(self._names)

    def retire(self, runtime: Any) -> None:
        """Fold ``runtime.counters`` into the totals, then close ``runtime``."""
        snap = runtime.counters.snapshot()
        for k in self._names:
            self._retired.add(k, snap.get(k, 0))
        runtime.close()

    def snapshot(self, live: Any | None) -> dict[str, float]:
        """The retired runtimes' totals plus ``live.counters`` (``live`` may be ``None``)."""
        totals = self._retired.snapshot()
        if live is not None:
            snap = live.counters.snapshot()
            totals = {k: totals[k] + snap.get(k, 0) for k in self._names}
        return totals
