"""Client-side accounting for remote stores: which keys this client wrote, their sizes, LRU order.

A remote pool (Mooncake, Memcache) enforces its own global capacity; :class:`ClientLedger` bounds this
client's share to ``capacity_bytes`` by choosing victims (least recently put or got by this client)
before a put, so ``used_bytes`` — the bytes this client wrote and has not seen disappear — never exceeds
the capacity. Entries evicted by the server are dropped when a ``get`` or ``exists`` finds them gone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class ClientLedger:
    """Thread-safe ``key -> nbytes`` map in least-recently-used order with a byte bound."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._used = 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def victims_for(
        self, items: list[tuple[str, int]], exclude: frozenset[str] = frozenset()
    ) -> list[str] | None:
        """Keys to drop (oldest first) so that every ``(key, nbytes)`` of ``items`` fits at once.

        Keys of ``items`` and of ``exclude`` are never victims. Returns ``None`` if even dropping every
        candidate would not make room. Does not change state: the caller removes the victims from the
        backend, then calls :meth:`forget` / :meth:`record`.
        """
        batch = {k for k, _ in items}
        with self._lock:
            used = self._used - sum(self._sizes.get(k, 0) for k in batch) + sum(n for _, n in items)
            victims = []
            for k, n in self._sizes.items():
                if used <= self.capacity_bytes:
                    break
                if k not in batch and k not in exclude:
                    victims.append(k)
                    used -= n
            return victims if used <= self.capacity_bytes else None

    def record(self, key: str, nbytes: int) -> None:
        with self._lock:
            self._used += nbytes - self._sizes.pop(key, 0)
            self._sizes[key] = nbytes

    def touch(self, key: str) -> None:
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)

    def forget(self, key: str) -> bool:
        with self._lock:
            n = self._sizes.pop(key, None)
            if n is None:
                return False
            self._used -= n
            return True

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._sizes)
