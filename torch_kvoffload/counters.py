"""Thread-safe named counters (bytes moved, hits, misses, waits, seconds waited) that runtimes expose."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class Counters:
    """A set of named numeric counters, safe to bump from transfer threads.

    >>> c = Counters(["bytes_h2d", "hits"])
    >>> c.add("hits", 3)
    >>> c.snapshot()["hits"]
    3
    """

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(names, 0)

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def get(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def reset(self) -> None:
        with self._lock:
            for name in self._values:
                self._values[name] = 0

    def __repr__(self) -> str:
        return f"Counters({self.snapshot()})"
