"""A recording fake of the memcache_hybrid 1.3.0 Python API.

It mirrors the calls the adapter uses (see torch_kvoffload/store/memcache.py and docs/store.md for the
source of each): ``DistributedObjectStore.init(device_id, init_bm)``, ``put_from`` / ``batch_put_from``
(a put to an existing key is skipped and still returns 0, as the service does), ``get_into`` /
``batch_get_into``, ``get_key_info(key).size()`` / ``batch_get_key_info``, ``is_exist`` /
``batch_is_exist``, ``remove`` / ``remove_batch`` (refused while a key is leased), ``register_buffer``,
``close``; module constants ``H2G`` / ``G2H``. It moves real bytes through the raw pointers it is given.
The ``fake`` fixture of ``tests/store/conftest.py`` installs it as ``memcache_hybrid``.
"""

from __future__ import annotations

import ctypes
import types

NOT_FOUND = -3000  # any non-zero code: the adapter only tests for 0


class _KeyInfo:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class FakeDistributedObjectStore:
    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.data: dict[str, bytes] = {}
        self.leased: set[str] = set()
        self.calls: list[tuple] = []
        self.closed = False
        module.instances.append(self)

    def init(self, device_id: int, init_bm: bool = True) -> int:
        self.calls.append(("init", device_id, init_bm))
        return self.module.init_rc

    def _put(self, key: str, ptr: int, size: int, direct: int) -> int:
        assert direct == self.module.H2G
        if key in self.data:
            return 0  # the service skips a put to an existing key
        self.data[key] = ctypes.string_at(ptr, size)
        return 0

    def _get(self, key: str, ptr: int, size: int, direct: int) -> int:
        assert direct == self.module.G2H
        value = self.data.get(key)
        if value is None or len(value) != size:
            return NOT_FOUND
        ctypes.memmove(ptr, value, size)
        return 0

    def put_from(self, key, buffer_ptr, size, direct=3):
        self.calls.append(("put_from", key, size))
        return self._put(key, buffer_ptr, size, direct)

    def batch_put_from(self, keys, buffer_ptrs, sizes, direct=3):
        self.calls.append(("batch_put_from", tuple(keys)))
        return [self._put(k, p, n, direct) for k, p, n in zip(keys, buffer_ptrs, sizes, strict=True)]

    def get_into(self, key, buffer_ptr, size, direct=2):
        self.calls.append(("get_into", key, size))
        return self._get(key, buffer_ptr, size, direct)

    def batch_get_into(self, keys, buffer_ptrs, sizes, direct=2):
        self.calls.append(("batch_get_into", tuple(keys)))
        return [self._get(k, p, n, direct) for k, p, n in zip(keys, buffer_ptrs, sizes, strict=True)]

    def get_key_info(self, key):
        self.calls.append(("get_key_info", key))
        return _KeyInfo(len(self.data.get(key, b"")))

    def batch_get_key_info(self, keys):
        self.calls.append(("batch_get_key_info", tuple(keys)))
        return [_KeyInfo(len(self.data.get(k, b""))) for k in keys]

    def is_exist(self, key):
        return 1 if key in self.data else 0

    def batch_is_exist(self, keys):
        return [self.is_exist(k) for k in keys]

    def remove(self, key):
        self.calls.append(("remove", key))
        if key in self.leased or key not in self.data:
            return NOT_FOUND
        del self.data[key]
        return 0

    def remove_batch(self, keys):
        return [self.remove(k) for k in keys]

    def register_buffer(self, buffer_ptr, size):
        self.calls.append(("register_buffer", buffer_ptr, size))
        return 0

    def close(self):
        self.calls.append(("close",))
        self.closed = True
        return 0


def fake_module(init_rc: int = 0) -> types.ModuleType:
    mod = types.ModuleType("memcache_hybrid")
    mod.L2G, mod.G2L, mod.G2H, mod.H2G = 0, 1, 2, 3
    mod.init_rc = init_rc
    mod.instances = []
    mod.DistributedObjectStore = lambda: FakeDistributedObjectStore(mod)
    return mod


def memcache_store(capacity: int = 1 << 16, **kw):
    """A :class:`MemcacheKVStore` of ``capacity`` bytes (over whatever ``memcache_hybrid`` imports)."""
    from torch_kvoffload.store.memcache import MemcacheKVStore

    return MemcacheKVStore(capacity, **kw)
