"""MemcacheKVStore against the recording fake of the memcache_hybrid 1.3.0 Python API
(``support/memcache_fake.py``, installed by the ``fake`` fixture)."""

from __future__ import annotations

import struct
import sys
import zlib

import pytest
import torch
from support.memcache_fake import memcache_store

from torch_kvoffload.store.base import KVStore, StoreClosedError, StoreUnavailableError


def test_missing_package_names_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "memcache_hybrid", None)  # import raises ImportError
    with pytest.raises(StoreUnavailableError, match="memcache_hybrid"):
        memcache_store()


def test_init_failure_and_config(fake, monkeypatch, tmp_path) -> None:
    fake.init_rc = -1
    with pytest.raises(StoreUnavailableError, match=r"init\(device_id=0\) returned -1"):
        memcache_store()
    fake.init_rc = 0
    with pytest.raises(ValueError, match="is not a file"):
        memcache_store(config_path=str(tmp_path / "nope.conf"))
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("ock.mmc.meta_service_url = tcp://127.0.0.1:5000\n")
    monkeypatch.delenv("MMC_LOCAL_CONFIG_PATH", raising=False)
    store = memcache_store(config_path=str(conf), device_id=3, init_bm=False)
    import os

    assert os.environ["MMC_LOCAL_CONFIG_PATH"] == str(conf)
    assert fake.instances[-1].calls[0] == ("init", 3, False)
    assert isinstance(store, KVStore)


def test_round_trip_through_pointers(fake) -> None:
    store = memcache_store()
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
    store = memcache_store()
    store.put("k", torch.zeros(4))
    store.put("k", torch.ones(6))  # the service alone would keep the zeros
    out = torch.empty(6)
    assert store.get("k", out) and torch.equal(out, torch.ones(6))
    assert store.used_bytes == 24


def test_leased_overwrite(fake) -> None:
    store = memcache_store()
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
    store = memcache_store()
    store.batch_put(["a", "b"], [torch.zeros(4), torch.zeros(3)])
    outs = [torch.full((4,), 7.0), torch.full((4,), 7.0)]
    with pytest.raises(ValueError, match="key 'b' holds 12 bytes but out has 16 bytes"):
        store.batch_get(["a", "b"], outs)
    assert all(torch.equal(o, torch.full((4,), 7.0)) for o in outs)
    assert store.counters.get("gets") == 0


def test_batches_use_batch_calls(fake) -> None:
    store = memcache_store()
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
    store = memcache_store(capacity=48)  # three 16-byte values
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
    store = memcache_store()
    client = fake.instances[-1]
    store.put("a", torch.zeros(4))
    del client.data["a"]  # the pool evicted it
    assert store.get("a", torch.empty(4)) is False
    assert store.used_bytes == 0 and store.counters.get("server_evictions") == 1


def test_remove_and_close(fake) -> None:
    store = memcache_store()
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
        memcache_store().put("z", torch.empty(0))


def test_factory_builds_memcache(fake, tmp_path) -> None:
    from torch_kvoffload.store import MemcacheKVStore, create_store

    store = create_store("memcache", capacity_bytes="1KiB", device_id=2)
    assert isinstance(store, MemcacheKVStore) and store.capacity_bytes == 1024
    assert fake.instances[-1].calls[0] == ("init", 2, True)


def test_records_and_leases_through_the_default_path(fake) -> None:
    """batch_put_blocks / batch_get_blocks go through staging and the pool's batch calls; lease does
    not pin (the pool evicts on its own)."""
    from torch_kvoffload.store.base import RecordLayout

    store = memcache_store()
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
