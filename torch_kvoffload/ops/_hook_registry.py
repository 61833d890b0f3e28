"""Name → runtime registries for the hook ops.

Hook ops (``layer_wait``, ``kvpp_wait_layer``, ...) take a runtime's *name* — a string survives graph
capture where a Python object would not — and look the runtime up here. The registries live in ``ops`` so
that ``ops`` never imports the runtime packages; runtimes register themselves.

A hook op's tensor arguments are the runtime's own cache tensors in eager code, or copies of them made by
a functionalizing backend; :func:`sync_copies` keeps such copies and the runtime's tensors in step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


def sync_copies(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every ``dst[i]`` that is not ``src[i]``'s own memory (the same data
    pointer and strides); equal lengths. Copying from a runtime's tensors into a hook op's arguments gives
    a graph what the runtime holds; the other way, the runtime what the graph wrote."""
    for d, s in zip(dst, src, strict=True):
        if d.data_ptr() == s.data_ptr() and d.stride() == s.stride():
            continue
        d.copy_(s)


class HookRegistry(Generic[T]):
    """A thread-safe map from names to runtime objects of one kind.

    ``what`` names the kind in errors; ``methods`` are the hook methods the ops call (by the rule
    "runtime method = op name without its family prefix"): an object lacking one is refused at
    ``register`` rather than failing inside a graph.
    """

    def __init__(self, what: str, *, methods: tuple[str, ...] = ()) -> None:
        self._what = what
        self._methods = tuple(methods)
        self._lock = threading.Lock()
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T, *, replace: bool = False) -> None:
        """Register ``obj`` as ``name``; an existing name is an error unless ``replace``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"register {self._what}: 'name' must be a non-empty str, got {name!r}")
        missing = [m for m in self._methods if not callable(getattr(obj, m, None))]
        if missing:
            raise TypeError(
                f"register {self._what}: {type(obj).__name__} has no hook method(s) {missing}; a "
                f"{self._what} needs {list(self._methods)}"
            )
        with self._lock:
            if name in self._items and not replace:
                raise ValueError(
                    f"register {self._what}: a {self._what} named {name!r} is already registered"
                )
            self._items[name] = obj

    def unregister(self, name: str) -> None:
        """Forget ``name``; unknown names are ignored."""
        with self._lock:
            self._items.pop(name, None)

    def get(self, name: str) -> T:
        """The object registered as ``name``; ``KeyError`` naming the registered ones otherwise."""
        with self._lock:
            obj = self._items.get(name)
            known = sorted(self._items)
        if obj is None:
            raise KeyError(f"no {self._what} named {name!r}; registered: {known or 'none'}")
        return obj

    def names(self) -> list[str]:
        """The registered names, sorted."""
        with self._lock:
            return sorted(self._items)
