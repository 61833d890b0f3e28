"""Store test doubles shared by the layerwise tests, and the arena's invariants."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

from torch_kvoffload.store import LocalKVStore
from torch_kvoffload.store.base import KVStore


class DropsBeforeLoad:
    """Mixin for a LocalKVStore subclass: behaves like a remote pool that cannot pin what the lookup
    found (the base class's non-pinning lease) and loses each key of ``drop`` right before the load that
    reads it."""

    pins_leases = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drop: set[str] = set()

    def lease(self, keys):
        return KVStore.lease(self, keys)

    def batch_get_blocks(self, keys, layout, blocks):
        for key in keys:
            if key in self.drop:
                self.drop.discard(key)
                self.remove(key)
        return super().batch_get_blocks(keys, layout, blocks)


def check_invariants(store: LocalKVStore) -> None:
    """Free list + held bytes partition the arena; nothing overlaps; stored ≤ used ≤ capacity."""
    with store._cond:
        free = store._free
        held = store._held
        for (s0, e0), (s1, _) in itertools.pairwise(free):
            assert s0 < e0 < s1, "free list not sorted / coalesced"
        assert sum(e - s for s, e in free) + held == store.capacity_bytes
        regions = sorted((e.offset, e.offset + e.reserved) for e in store._index.values() if e.reserved)
        for (_, e0), (s1, _) in itertools.pairwise(regions):
            assert e0 <= s1, "live regions overlap"
        for s, e in regions:
            i = next((i for i, (fs, fe) in enumerate(free) if fs < e and s < fe), None)
            assert i is None, "a live region is on the free list"
        assert store._stored == sum(e.nbytes for e in store._index.values())
        assert store._stored <= held <= store.capacity_bytes


def empty_store(store: LocalKVStore) -> None:
    """Every record of ``store`` evicted (as another process's traffic would)."""
    for key in list(store._index):
        store.remove(key)


@contextlib.contextmanager
def store_emptied_after_each_lookup(active: bool = True) -> Iterator[None]:
    """While inside (and ``active``), the store of prefix reuse (a layerwise backend's or a prefix store)
    loses every record right after each prefix lookup (``cached_prefix``): what the lookup found is gone
    when it is read."""
    from torch_kvoffload.layerwise.backend import LayerwiseBackend
    from torch_kvoffload.layerwise.prefix_store import PrefixStore

    reals = {cls: cls.cached_prefix for cls in (LayerwiseBackend, PrefixStore)}

    def losing(real):
        def lookup_then_lose(self, tokens, positions):
            found = real(self, tokens, positions)
            empty_store(self.store)
            return found

        return lookup_then_lose

    if active:
        for cls, real in reals.items():
            cls.cached_prefix = losing(real)
    try:
        yield
    finally:
        for cls, real in reals.items():
            cls.cached_prefix = real
