"""LocalKVStore: round trips, LRU order, exact capacity accounting, overwrite, errors, concurrency."""

from __future__ import annotations

import random
import threading
from collections import OrderedDict

import pytest
import torch
from support.store_helpers import check_invariants

from torch_kvoffload.device import pin_memory_enabled
from torch_kvoffload.store import KVStore, LocalKVStore, StoreClosedError

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float16, torch.int64]


def _rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


def test_is_a_kvstore_and_counters() -> None:
    store = LocalKVStore(1024)
    assert isinstance(store, KVStore)
    snap = store.counters.snapshot()
    for name in ("puts", "gets", "hits", "misses", "evictions", "bytes_put", "bytes_got"):
        assert snap[name] == 0
    assert store.used_bytes == 0
    assert store.pinned is pin_memory_enabled()  # the arena is pinned exactly when an accelerator exists


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (4, 3, 5), (2, 128, 576), (0,)])
def test_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    value = _rand(shape, dtype)
    store = LocalKVStore(max(1, value.nbytes * 2))
    store.put("k", value)
    value_copy = value.clone()
    value.zero_() if value.numel() else None  # the store holds a copy, not a reference
    out = torch.empty_like(value)
    assert store.get("k", out)
    assert torch.equal(out, value_copy)
    assert store.used_bytes == value.nbytes
    # the bytes can be read back through another dtype / shape of the same size
    if value.numel():
        raw = torch.empty(value.nbytes, dtype=torch.uint8)
        assert store.get("k", raw)
        assert torch.equal(raw, value_copy.reshape(-1).view(torch.uint8))
    c = store.counters.snapshot()
    assert c["puts"] == 1 and c["bytes_put"] == value.nbytes
    assert c["hits"] == c["gets"] == (2 if value.numel() else 1)


def test_miss_leaves_out_untouched() -> None:
    store = LocalKVStore(100)
    out = torch.full((4,), 3.0)
    assert store.get("absent", out) is False
    assert torch.equal(out, torch.full((4,), 3.0))
    assert store.counters.get("misses") == 1 and store.counters.get("hits") == 0
    assert not store.exists("absent")
    assert store.remove("absent") is False


def test_size_mismatch_raises_and_leaves_state_untouched() -> None:
    store = LocalKVStore(48)
    for k in "abc":
        store.put(k, torch.full((4,), float(ord(k))))
    before = (store.lru_keys(), store.used_bytes, store.counters.snapshot())
    out = torch.full((5,), -1.0)
    with pytest.raises(ValueError, match=r"LocalKVStore.get: key 'a' holds 16 bytes but out has 20 bytes"):
        store.get("a", out)
    assert torch.equal(out, torch.full((5,), -1.0))
    assert (
        store.lru_keys(),
        store.used_bytes,
        store.counters.snapshot(),
    ) == before  # LRU order unchanged too
    # batch: one mismatch means nothing is copied and nothing is refreshed
    outs = [torch.full((4,), -1.0), torch.full((3,), -1.0)]
    with pytest.raises(ValueError, match="key 'c' holds 16 bytes"):
        store.batch_get(["b", "c"], outs)
    assert torch.equal(outs[0], torch.full((4,), -1.0))
    assert (store.lru_keys(), store.used_bytes, store.counters.snapshot()) == before


def test_lru_order_get_and_put_refresh_exists_does_not() -> None:
    v = torch.zeros(4)  # 16 bytes; capacity holds exactly 3
    store = LocalKVStore(48)
    for k in "abc":
        store.put(k, v)
    assert store.get("a", torch.empty(4))  # order: b c a
    assert store.exists("b")  # no refresh
    store.put("d", v)  # evicts b
    assert store.lru_keys() == ["c", "a", "d"]
    store.put("c", torch.ones(4))  # overwrite refreshes: a d c
    store.put("e", v)  # evicts a
    assert store.lru_keys() == ["d", "c", "e"]
    assert store.batch_exists(["a", "b", "c", "d", "e"]) == [False, False, True, True, True]
    assert store.counters.get("evictions") == 2
    assert store.used_bytes == 48


def test_random_workload_matches_lru_model() -> None:
    """Uniform sizes: the store must behave exactly like an ideal LRU cache of capacity // size entries."""
    rng = random.Random(1)
    size, slots = 24, 7
    store = LocalKVStore(size * slots)
    model: OrderedDict[str, torch.Tensor] = OrderedDict()
    evictions = 0
    for step in range(1500):
        key = f"k{rng.randrange(15)}"
        op = rng.random()
        if op < 0.45:
            value = torch.randint(0, 255, (size,), dtype=torch.uint8)
            store.put(key, value)
            model.pop(key, None)
            if len(model) == slots:
                model.popitem(last=False)
                evictions += 1
            model[key] = value
        elif op < 0.9:
            out = torch.empty(size // 4, dtype=torch.int32)
            hit = store.get(key, out)
            assert hit == (key in model), step
            if hit:
                model.move_to_end(key)
                assert torch.equal(out.view(torch.uint8), model[key])
        else:
            assert store.remove(key) == (model.pop(key, None) is not None)
        assert store.lru_keys() == list(model)
        assert store.used_bytes == size * len(model)
    check_invariants(store)
    assert store.counters.get("evictions") == evictions


def test_variable_sizes_exact_capacity_and_contents() -> None:
    rng = random.Random(2)
    capacity = 1000
    store = LocalKVStore(capacity)
    latest: dict[str, torch.Tensor] = {}
    for _ in range(2000):
        key = f"k{rng.randrange(40)}"
        if rng.random() < 0.6:
            value = torch.randint(0, 255, (rng.randrange(0, 300),), dtype=torch.uint8)
            store.put(key, value)
            latest[key] = value
            assert store.exists(key)  # a put always lands, evicting as needed
        else:
            exp = latest.get(key)
            out = torch.empty(exp.numel() if exp is not None else 1, dtype=torch.uint8)
            if store.get(key, out):
                assert torch.equal(out, exp)
        assert store.used_bytes <= capacity
        check_invariants(store)
    # everything still present holds its latest value
    for key in store.lru_keys():
        out = torch.empty_like(latest[key])
        assert store.get(key, out) and torch.equal(out, latest[key])


def test_overwrite_full_store_evicts_nothing_and_resizes() -> None:
    store = LocalKVStore(64)
    for k in "abcd":
        store.put(k, torch.full((4,), 1.0))
    store.put("b", torch.full((4,), 2.0))
    assert store.counters.get("evictions") == 0
    assert sorted(store.lru_keys()) == list("abcd")
    out = torch.empty(4)
    assert store.get("b", out) and torch.equal(out, torch.full((4,), 2.0))
    # a bigger value under the same key needs room: the LRU entry goes
    store.put("b", torch.full((6,), 3.0))
    assert store.lru_keys() == ["c", "d", "b"]  # "a" (LRU) went; b's old 16 bytes merged with a's hole
    assert store.used_bytes <= 64
    check_invariants(store)
    big = torch.empty(6)
    assert store.get("b", big) and torch.equal(big, torch.full((6,), 3.0))
    with pytest.raises(ValueError, match="holds 24 bytes"):
        store.get("b", torch.empty(4))


def test_value_larger_than_capacity() -> None:
    store = LocalKVStore(64)
    store.put("a", torch.zeros(16))  # exactly the capacity: fine
    with pytest.raises(ValueError, match="65 bytes does not fit in a store of 64 bytes"):
        store.put("b", torch.zeros(65, dtype=torch.uint8))
    assert store.lru_keys() == ["a"] and store.used_bytes == 64


def test_argument_errors() -> None:
    store = LocalKVStore(64)
    with pytest.raises(TypeError, match="key must be a str"):
        store.put(3, torch.zeros(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        store.put("", torch.zeros(1))
    with pytest.raises(ValueError, match="value must be contiguous"):
        store.put("a", torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        store.put("a", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out must be contiguous"):
        store.get("a", torch.zeros(4, 4)[:, 1])
    with pytest.raises(ValueError, match="got 2 keys but 1 values"):
        store.batch_put(["a", "b"], [torch.zeros(1)])
    with pytest.raises(ValueError, match=r"values\[1\] must be contiguous"):
        store.batch_put(["a", "b"], [torch.zeros(1), torch.zeros(3, 3).t()])
    assert len(store) == 0  # batch validation happens before any put
    with pytest.raises(TypeError, match="single str"):
        store.batch_exists("ab")  # type: ignore[arg-type]
    for bad in (0, -5):
        with pytest.raises(ValueError, match="capacity_bytes must be >= 1"):
            LocalKVStore(bad)
    with pytest.raises(ValueError, match="power of two"):
        LocalKVStore(64, alignment=3)


def test_batch_ops() -> None:
    store = LocalKVStore(10_000)
    keys = [f"k{i}" for i in range(10)]
    values = [_rand((i + 1, 3), torch.float32) for i in range(10)]
    store.batch_put(keys, values)
    outs = [torch.empty_like(v) for v in values]
    hits = store.batch_get([*keys, "missing"], [*outs, torch.empty(1)])
    assert hits == [True] * 10 + [False]
    assert all(torch.equal(o, v) for o, v in zip(outs, values, strict=True))
    assert store.batch_exists(["k0", "nope"]) == [True, False]
    assert store.counters.get("bytes_got") == sum(v.nbytes for v in values)
    # duplicate keys in a batch: the later value wins
    store.batch_put(["d", "d"], [torch.zeros(2), torch.ones(2)])
    out = torch.empty(2)
    assert store.get("d", out) and torch.equal(out, torch.ones(2))


def test_batch_put_larger_than_capacity_matches_sequential_puts() -> None:
    vals = [torch.full((4,), float(i)) for i in range(10)]
    keys = [f"k{i}" for i in range(10)]
    batched, sequential = LocalKVStore(64), LocalKVStore(64)
    batched.put("old", torch.zeros(4))
    sequential.put("old", torch.zeros(4))
    batched.batch_put(keys, vals)
    for k, v in zip(keys, vals, strict=True):
        sequential.put(k, v)
    assert batched.lru_keys() == sequential.lru_keys() == keys[-4:]
    assert batched.counters.snapshot() == sequential.counters.snapshot()
    for k, v in zip(keys[-4:], vals[-4:], strict=True):
        out = torch.empty(4)
        assert batched.get(k, out) and torch.equal(out, v)
    check_invariants(batched)


def test_alignment_pads_and_counts_against_capacity() -> None:
    store = LocalKVStore(200, alignment=64)
    store.put("a", torch.zeros(10, dtype=torch.uint8))
    store.put("b", torch.zeros(70, dtype=torch.uint8))
    assert store.used_bytes == 64 + 128
    assert store.stored_bytes == 80
    offsets = sorted(e.offset for e in store._index.values())
    assert offsets == [0, 64]
    store.put("c", torch.zeros(8, dtype=torch.uint8))  # fits in the 8-byte tail (clipped at the end)
    assert store.used_bytes == 200 and store.counters.get("evictions") == 0
    store.put("d", torch.zeros(9, dtype=torch.uint8))  # needs room: evicts "a"
    assert store.lru_keys() == ["b", "c", "d"]
    check_invariants(store)
    store.put("e", torch.zeros(200, dtype=torch.uint8))  # the whole arena
    assert store.lru_keys() == ["e"]
    check_invariants(store)


def test_fragmentation_evicts_until_contiguous_room() -> None:
    store = LocalKVStore(100)
    for i in range(10):
        store.put(f"k{i}", torch.full((10,), i, dtype=torch.uint8))
    for i in (1, 3, 5, 7):
        store.remove(f"k{i}")  # 40 bytes free but in 10-byte holes
    store.put("big", torch.zeros(30, dtype=torch.uint8))
    check_invariants(store)
    assert store.exists("big") and store.used_bytes <= 100
    # eviction went in LRU order (k0 first) until 30 contiguous bytes were free
    assert not store.exists("k0") and store.exists("k9")
    for key in store.lru_keys():
        if key != "big":
            out = torch.empty(10, dtype=torch.uint8)
            assert store.get(key, out) and torch.equal(
                out, torch.full((10,), int(key[1:]), dtype=torch.uint8)
            )


def test_close() -> None:
    store = LocalKVStore(64)
    store.put("a", torch.zeros(1))
    store.close()
    store.close()  # idempotent
    for call in (
        lambda: store.put("a", torch.zeros(1)),
        lambda: store.get("a", torch.zeros(1)),
        lambda: store.exists("a"),
        lambda: store.remove("a"),
        lambda: store.batch_exists(["a"]),
    ):
        with pytest.raises(StoreClosedError, match="closed"):
            call()
    with LocalKVStore(8) as s2:
        s2.put("x", torch.zeros(2))
    with pytest.raises(StoreClosedError):
        s2.exists("x")


def test_put_waits_for_reader_then_evicts() -> None:
    """A region pinned by a reader is neither evicted nor reused; the put proceeds once it is released."""
    store = LocalKVStore(32)
    store.put("a", torch.full((8,), 7.0))  # fills the store
    out = torch.empty(8)
    with store._cond:
        _, pinned = store._pin("get", ["a"], [out.nbytes], str)
    done = threading.Event()
    t = threading.Thread(target=lambda: (store.put("b", torch.full((8,), 9.0)), done.set()))
    t.start()
    assert not done.wait(0.2)  # cannot evict "a" while it is read
    assert store.exists("a")
    store._unpin(pinned)
    assert done.wait(5)
    t.join()
    assert store.lru_keys() == ["b"] and store.counters.get("put_waits") == 1
    got = torch.empty(8)
    assert store.get("b", got) and torch.equal(got, torch.full((8,), 9.0))


def test_remove_while_reading_defers_free() -> None:
    store = LocalKVStore(32)
    store.put("a", torch.full((8,), 7.0))
    with store._cond:
        _, pinned = store._pin("get", ["a"], [32], str)
    assert store.remove("a")
    assert not store.exists("a") and store.used_bytes == 32  # still held by the reader
    store._unpin(pinned)
    assert store.used_bytes == 0
    check_invariants(store)


def test_concurrent_put_get_no_torn_reads() -> None:
    """Several threads put and get overlapping keys under heavy eviction; every hit is an intact value."""
    n_elems, slots = 4096, 6
    store = LocalKVStore(n_elems * 4 * slots)
    errors: list[str] = []
    n_threads, iters = 6, 300

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        out = torch.empty(n_elems, dtype=torch.int32)
        for _ in range(iters):
            key = f"k{rng.randrange(12)}"
            op = rng.random()
            if op < 0.35:
                # every value is one constant derived from (key, writer): a torn read mixes constants
                tag = int(key[1:]) * 1000 + tid
                store.put(key, torch.full((n_elems,), tag, dtype=torch.int32))
            elif op < 0.5:
                key2 = f"k{rng.randrange(12)}"
                store.batch_put(
                    [key, key2],
                    [torch.full((n_elems,), int(k[1:]) * 1000 + tid, dtype=torch.int32) for k in (key, key2)],
                )
            elif store.get(key, out):
                first = int(out[0])
                if not bool((out == first).all()) or first // 1000 != int(key[1:]):
                    errors.append(f"torn or foreign value under {key}: {out.unique()[:4].tolist()}")
            if store.used_bytes > store.capacity_bytes:
                errors.append("capacity exceeded")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:3]
    check_invariants(store)
    c = store.counters.snapshot()
    assert c["hits"] + c["misses"] == c["gets"]
    assert c["evictions"] > 0 and c["hits"] > 0
    assert len(store) <= slots
    assert all(e.readers == 0 for e in store._index.values())  # every pin was released


# ---------------------------------------------------------------------------------------- factory


def test_create_store_local_and_config_errors() -> None:
    from torch_kvoffload.store import StoreConfig, create_store, parse_bytes

    store = create_store("local", capacity_bytes="1MiB", alignment=64)
    assert isinstance(store, LocalKVStore) and store.capacity_bytes == 1 << 20 and store.alignment == 64
    assert create_store().capacity_bytes == 1 << 30  # default kind and capacity
    cfg = StoreConfig.from_json('{"kind": "local", "capacity_bytes": "2GB"}')
    assert cfg.capacity_bytes == 2 * 10**9
    assert [parse_bytes("x", v) for v in (5, "5", "1k", "1KB", "1.5KiB", "2g")] == [
        5,
        5,
        1024,
        1000,
        1536,
        2 << 30,
    ]
    bad = [
        {"kind": "redis"},
        {"kind": "local", "master_server_addr": "127.0.0.1:1"},  # an option of another kind
        {"kind": "local", "device_id": 1},
        {"kind": "mooncake", "capacity_bytes": 10},  # no master / metadata address
        {"kind": "memcache", "protocol": "tcp"},
        {"capacity_bytes": 0},
        {"capacity_bytes": "12 parsecs"},
        {"capacity_bytes": "0.5B"},
        {"alignment": 3},
        {"unknown_option": 1},
    ]
    for options in bad:
        with pytest.raises(ValueError):
            StoreConfig(**options)
