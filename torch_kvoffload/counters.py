"""Thread-safe named counters (bytes moved, hits, misses, waits, seconds waited) that runtimes expose."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import torch

__all__ = ["Counters"]


class Counters:
    """A fixed set of named numeric counters, safe to bump from transfer threads.

    The names are given at construction; :meth:`add` / :meth:`get` of any other name raise ``KeyError``
    listing the known ones (a misspelled name is a bug, not a new counter).

    ``add`` takes a number or a one-element tensor. A tensor on an accelerator is accumulated there (no
    host synchronisation while a decode step runs) and read back only when :meth:`get` /
    :meth:`snapshot` ask for the value; a CPU tensor is read at once.

    >>> c = Counters(["bytes_h2d", "hits"])
    >>> c.add("hits", 3)
    >>> c.snapshot()["hits"]
    3
    """

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(names, 0)
        self._device: dict[str, torch.Tensor] = {}  # name -> pending on-device sum

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._values)

    def _check(self, name: str) -> None:
        if name not in self._values:
            raise KeyError(f"Counters: unknown counter {name!r}; known counters: {sorted(self._values)}")

    def add(self, name: str, amount: float | torch.Tensor = 1) -> None:
        self._check(name)
        if isinstance(amount, torch.Tensor):
            if amount.numel() != 1:
                raise ValueError(
                    f"Counters.add: amount of {name!r} must be a number or a one-element tensor, "
                    f"got shape {list(amount.shape)}"
                )
            if amount.device.type == "cpu":
                amount = amount.item()
            else:
                acc = amount.reshape(()).to(torch.float64 if amount.is_floating_point() else torch.int64)
                with self._lock:
                    prev = self._device.get(name)
                    self._device[name] = acc if prev is None else prev + acc
                return
        with self._lock:
            self._values[name] = self._values[name] + amount

    def add_many(self, amounts: Mapping[str, float]) -> None:
        """:meth:`add` of several numbers (not tensors) under one lock; nothing is added if a name is
        unknown."""
        for name in amounts:
            self._check(name)
        with self._lock:
            values = self._values
            for name, amount in amounts.items():
                values[name] = values[name] + amount

    def _fold(self) -> None:
        """Move the pending device sums into the host values (a device sync; call with the lock)."""
        for name, acc in self._device.items():
            v = acc.item()
            self._values[name] = self._values[name] + v
        self._device.clear()

    def get(self, name: str) -> float:
        self._check(name)
        with self._lock:
            self._fold()
            return self._values[name]

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            self._fold()
            return dict(self._values)

    def reset(self) -> None:
        with self._lock:
            self._device.clear()
            for name in self._values:
                self._values[name] = 0

    def __repr__(self) -> str:
        return f"Counters({self.snapshot()})"
