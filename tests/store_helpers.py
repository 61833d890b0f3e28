"""Store test doubles shared by the layerwise tests."""

from __future__ import annotations

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
