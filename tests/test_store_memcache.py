"""MemcacheKVStore against a recording fake of the memcache_hybrid 1.3.0 Python API.

The fake mirrors the calls the adapter uses (see torch_kvoffload/store/memcache.py and docs/store.md
for the source of each): ``DistributedObjectStore.init(device_id, init_bm)``, ``put_from`` /
``batch_put_from`` (a put to an existing key is skipped and still returns 0, as the service does),
``get_into`` / ``batch_get_into``, ``get_key_info(key).size()`` / ``batch_get_key_info``, ``is_exist`` /
``batch_is_exist``, ``remove`` / ``remove_batch`` (refused while a key is leased), ``register_buffer``,
``close``; module constants ``H2G`` / ``G2H``. It moves real bytes through the raw pointers it is given.
"""

from __future__ import annotations

import ctypes
import struct
import sys
import types
import zlib

import pytest
import torch

from torch_kvoffload.store.base import KVStore, StoreClosedError, StoreUnavailableError

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


def _fake_module(init_rc: int = 0) -> types.ModuleType:
    mod = types.ModuleType("memcache_hybrid")
    mod.L2G, mod.G2L, mod.G2H, mod.H2G = 0, 1, 2, 3
    mod.init_rc = init_rc
    mod.instances = []
    mod.DistributedObjectStore = lambda: FakeDistributedObjectStore(mod)
    return mod


@pytest.fixture
def fake(monkeypatch):
    mod = _fake_module()
    monkeypatch.setitem(sys.modules, "memcache_hybrid", mod)
    return mod


def _store(capacity: int = 1 << 16, **kw):
    from torch_kvoffload.store.memcache import MemcacheKVStore

    return MemcacheKVStore(capacity, **kw)


def test_missing_package_names_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "memcache_hybrid", None)  # import raises ImportError
    with pytest.raises(StoreUnavailableError, match="memcache_hybrid"):
        _store()


def test_init_failure_and_config(fake, monkeypatch, tmp_path) -> None:
    fake.init_rc = -1
    with pytest.raises(StoreUnavailableError, match=r"init\(device_id=0\) returned -1"):
        _store()
    fake.init_rc = 0
    with pytest.raises(ValueError, match="is not a file"):
        _store(config_path=str(tmp_path / "nope.conf"))
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("ock.mmc.meta_service_url = tcp://127.0.0.1:5000\n")
    monkeypatch.delenv("MMC_LOCAL_CONFIG_PATH", raising=False)
    store = _store(config_path=str(conf), device_id=3, init_bm=False)
    import os

    assert os.environ["MMC_LOCAL_CONFIG_PATH"] == str(conf)
    assert fake.instances[-1].calls[0] == ("init", 3, False)
    assert isinstance(store, KVStore)


def test_round_trip_through_pointers(fake) -> None:
    store = _store()
    client = fake.instances[-1]
    value = torch.randn(5, 7).to(torch.bfloat16)
    store.put("k", value)
    raw = value.reshape(-1).view(torch.uint8).numpy().tobytes()
    # the value's bytes, then the trailer: magic, length, CRC-32 of the bytes seeded with the key's
    trailer = struct.pack("<4sQI", b"KVc1", 70, zlib.crc32(raw, zlib.crc32(b"k")))
    assert client.data["k"] == raw + trailer
    out = torch.empty(5, 7, dtype=torch.bfloat16)
    assert store.get("k", out) and torch.equal(out, value)
    assert ("put_from", "k", 86) in client.calls and ("get_into", "k", 86) in client.calls
    assert store.exists("k") and not store.exists("x")
    assert store.get("x", out) is False
    store.register(out)
    assert client.calls[-1] == ("register_buffer", out.data_ptr(), 70)
    c = store.counters.snapshot()
    assert (c["puts"], c["hits"], c["misses"], c["bytes_put"], c["bytes_got"]) == (1, 1, 1, 70, 70)


def test_overwrite_removes_old_value_first(fake) -> None:
    store = _store()
    store.put("k", torch.zeros(4))
    store.put("k", torch.ones(6))  # the service alone would keep the zeros
    out = torch.empty(6)
    assert store.get("k", out) and torch.equal(out, torch.ones(6))
    assert store.used_bytes == 24


def test_leased_overwrite(fake) -> None:
    store = _store()
    client = fake.instances[-1]
    store.put("k", torch.zeros(4))
    client.leased.add("k")
    store.put("k", torch.ones(4))  # same size under a content key: the stored value is kept
    # another size cannot replace a leased value: the put is dropped (a cache miss later), never raised
    store.put("k", torch.ones(5))
    assert store.counters.get("put_dropped") == 1 and store.counters.get("store_errors") == 1
    out = torch.empty(4)
    assert store.get("k", out) and torch.equal(out, torch.zeros(4))


def test_size_mismatch_copies_nothing(fake) -> None:
    store = _store()
    store.batch_put(["a", "b"], [torch.zeros(4), torch.zeros(3)])
    outs = [torch.full((4,), 7.0), torch.full((4,), 7.0)]
    with pytest.raises(ValueError, match="key 'b' holds 12 bytes but out has 16 bytes"):
        store.batch_get(["a", "b"], outs)
    assert all(torch.equal(o, torch.full((4,), 7.0)) for o in outs)
    assert store.counters.get("gets") == 0


def test_batches_use_batch_calls(fake) -> None:
    store = _store()
    client = fake.instances[-1]
    vals = [torch.randn(8) for _ in range(3)]
    store.batch_put(["a", "b", "c"], vals)
    outs = [torch.empty(8) for _ in range(4)]
    assert store.batch_get(["a", "b", "c", "d"], outs) == [True, True, True, False]
    assert all(torch.equal(o, v) for o, v in zip(outs, vals, strict=False))
    names = [c[0] for c in client.calls]
    assert "batch_put_from" in names and "batch_get_key_info" in names and "batch_get_into" in names
    assert ("batch_get_into", ("a", "b", "c")) in client.calls  # absent keys are not requested
    assert store.batch_exists(["a", "d"]) == [True, False]


def test_client_quota_lru_and_leases(fake) -> None:
    store = _store(capacity=48)  # three 16-byte values
    client = fake.instances[-1]
    for k in "abc":
        store.put(k, torch.zeros(4))
    store.get("a", torch.empty(4))  # LRU order: b c a
    store.put("d", torch.zeros(4))
    assert sorted(client.data) == ["a", "c", "d"] and store.counters.get("evictions") == 1
    client.leased.add("c")  # the next victim is being read elsewhere: skip to the one after
    store.put("e", torch.zeros(4))
    assert sorted(client.data) == ["c", "d", "e"]
    client.leased.update({"d", "e"})
    store.put("f", torch.zeros(4))  # nothing can be freed: the put is dropped, the bound holds
    assert "f" not in client.data and store.counters.get("put_dropped") == 1
    assert store.used_bytes == 48
    with pytest.raises(ValueError, match="does not fit"):
        store.put("g", torch.zeros(13))


def test_server_eviction_is_noticed(fake) -> None:
    store = _store()
    client = fake.instances[-1]
    store.put("a", torch.zeros(4))
    del client.data["a"]  # the pool evicted it
    assert store.get("a", torch.empty(4)) is False
    assert store.used_bytes == 0 and store.counters.get("server_evictions") == 1


def test_remove_and_close(fake) -> None:
    store = _store()
    client = fake.instances[-1]
    store.put("a", torch.zeros(4))
    client.leased.add("a")
    assert store.remove("a") is False
    client.leased.clear()
    assert store.remove("a") is True and store.used_bytes == 0
    assert store.remove("a") is False
    store.close()
    store.close()
    assert client.calls.count(("close",)) == 1
    with pytest.raises(StoreClosedError):
        store.put("a", torch.zeros(1))
    with pytest.raises(StoreClosedError):
        store.get("a", torch.zeros(1))
    with pytest.raises(ValueError, match="empty values"):
        _store().put("z", torch.empty(0))


def test_factory_builds_memcache(fake, tmp_path) -> None:
    from torch_kvoffload.store import MemcacheKVStore, create_store

    store = create_store("memcache", capacity_bytes="1KiB", device_id=2)
    assert isinstance(store, MemcacheKVStore) and store.capacity_bytes == 1024
    assert fake.instances[-1].calls[0] == ("init", 2, True)


def test_records_and_leases_through_the_default_path(fake) -> None:
    """batch_put_blocks / batch_get_blocks go through staging and the pool's batch calls; lease does
    not pin (the pool evicts on its own)."""
    from torch_kvoffload.store.base import RecordLayout

    store = _store()
    client = fake.instances[-1]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 4, 8, generator=g), torch.randint(-9, 9, (6, 4, 3), dtype=torch.int8, generator=g)
    lay = RecordLayout([a, b], [0, 128], 144)
    store.batch_put_blocks(["r0", "r1"], lay, [5, 2])
    assert client.data["r0"][:128] == a[5].reshape(-1).view(torch.uint8).numpy().tobytes()
    assert client.data["r1"][128:140] == b[2].reshape(-1).view(torch.uint8).numpy().tobytes()
    da, db = torch.zeros_like(a), torch.zeros_like(b)
    assert store.batch_get_blocks(["r1", "rx", "r0"], RecordLayout([da, db], [0, 128], 144), [0, 1, 3]) == [
        True,
        False,
        True,
    ]
    for src, dst in ((a, da), (b, db)):
        assert torch.equal(dst[[0, 3]], src[[2, 5]]) and not dst[[1, 2, 4, 5]].any()
    lease = store.lease(["r0", "rx"])
    assert not lease.pinned and lease.found == [True, False]
