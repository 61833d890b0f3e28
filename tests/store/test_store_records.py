"""Records between a store and paged block tensors (RecordLayout, batch_get_blocks / batch_put_blocks),
and leases (pinning against eviction) of LocalKVStore."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from support.store_helpers import check_invariants

from torch_kvoffload._utils import round_up
from torch_kvoffload.store import KVStore, LocalKVStore, RecordLayout, StoreClosedError, StoreLease


class DefaultPathStore(LocalKVStore):
    """LocalKVStore whose record methods are the interface's default (staging + batch_get / batch_put),
    the path every remote backend takes."""

    def batch_get_blocks(self, keys, layout, blocks):
        return KVStore.batch_get_blocks(self, keys, layout, blocks)

    def batch_put_blocks(self, keys, layout, blocks):
        KVStore.batch_put_blocks(self, keys, layout, blocks)

    pins_leases = False

    def lease(self, keys):
        return KVStore.lease(self, keys)


STORES = [LocalKVStore, DefaultPathStore]
NB = 10


def _rand(shape, dtype, g) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, dtype=dtype, generator=g)


def _tensors(g, shapes=((4, 12), (4, 3), (4, 5)), dtypes=(torch.float32, torch.bfloat16, torch.int8)):
    return [_rand((NB, *s), d, g) for s, d in zip(shapes, dtypes, strict=True)]


def _layout(tensors, pad=16) -> RecordLayout:
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off = round_up(off + t[0].nbytes, pad)
    return RecordLayout(tensors, offsets, off)


def _record(layout: RecordLayout, block: int) -> torch.Tensor:
    """Reference: the record of ``block`` assembled byte by byte (padding compared as zero-masked)."""
    rec = torch.zeros(layout.record_bytes, dtype=torch.uint8)
    for t, off in zip(layout.tensors, layout.offsets, strict=True):
        b = t[block].contiguous().reshape(-1).view(torch.uint8)
        rec[off : off + b.numel()] = b
    return rec


def _mask(layout: RecordLayout) -> torch.Tensor:
    m = torch.zeros(layout.record_bytes, dtype=torch.bool)
    for v, off in zip(layout.byte_views, layout.offsets, strict=True):
        m[off : off + v.shape[1]] = True
    return m


@pytest.mark.parametrize("cls", STORES)
@pytest.mark.parametrize("alignment", [1, 64])
@pytest.mark.parametrize("blocks", [[3, 0, 7], [9], list(range(NB))])
def test_put_then_get_blocks_round_trip(cls, alignment, blocks) -> None:
    g = torch.Generator().manual_seed(len(blocks) + alignment)
    src = _tensors(g)
    lay = _layout(src)
    store = cls(64 * lay.record_bytes, alignment=alignment)
    keys = [f"k{b}" for b in blocks]
    store.batch_put_blocks(keys, lay, blocks)
    assert store.counters.get("puts") == len(blocks)
    assert store.stored_bytes == len(blocks) * lay.record_bytes
    # the stored value is the record, byte for byte (parts; padding is unspecified)
    m = _mask(lay)
    for key, b in zip(keys, blocks, strict=True):
        out = torch.empty(lay.record_bytes, dtype=torch.uint8)
        assert store.get(key, out)
        assert torch.equal(out[m], _record(lay, b)[m])
    # read back into other blocks of zeroed tensors
    dst = [torch.zeros_like(t) for t in src]
    dlay = _layout(dst)
    targets = [(b + 4) % NB for b in blocks]
    before = store.counters.snapshot()
    hits = store.batch_get_blocks(keys, dlay, torch.tensor(targets))
    assert hits == [True] * len(blocks)
    for s, d in zip(src, dst, strict=True):
        for b, t in zip(blocks, targets, strict=True):
            assert torch.equal(d[t], s[b])
        untouched = sorted(set(range(NB)) - set(targets))
        assert not d[untouched].any()
    after = store.counters.snapshot()
    assert after["hits"] - before["hits"] == len(blocks)
    assert after["bytes_got"] - before["bytes_got"] == len(blocks) * lay.record_bytes
    check_invariants(store)


@pytest.mark.parametrize("cls", STORES)
def test_records_interoperate_with_plain_values(cls) -> None:
    """A record put as a plain value is read into blocks, and one put from blocks is read as a value."""
    g = torch.Generator().manual_seed(5)
    src = _tensors(g)
    lay = _layout(src)
    store = cls(1 << 16)
    store.put("plain", _record(lay, 6))
    dst = [torch.zeros_like(t) for t in src]
    assert store.batch_get_blocks(["plain"], _layout(dst), [2]) == [True]
    assert all(torch.equal(d[2], s[6]) for s, d in zip(src, dst, strict=True))


@pytest.mark.parametrize("cls", STORES)
def test_get_blocks_misses_and_size_mismatch(cls) -> None:
    g = torch.Generator().manual_seed(1)
    src = _tensors(g)
    lay = _layout(src)
    store = cls(1 << 16)
    store.batch_put_blocks(["a", "b"], lay, [1, 2])
    dst = [torch.full_like(t, 7) for t in src]
    dlay = _layout(dst)
    assert store.batch_get_blocks(["a", "zz", "b"], dlay, [5, 6, 8]) == [True, False, True]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[5], s[1]) and torch.equal(d[8], s[2])
        assert (d[6] == 7).all()  # the miss leaves its block untouched
    assert store.counters.get("misses") == 1
    store.put("small", torch.zeros(3))
    dst2 = [torch.full_like(t, 7) for t in src]
    if cls is DefaultPathStore:
        # the interface's default reads through batch_get: a present key of another size raises
        with pytest.raises(ValueError, match="'small' holds 12 bytes"):
            store.batch_get_blocks(["a", "small"], _layout(dst2), [0, 1])
        assert all((d == 7).all() for d in dst2)
        return
    # a present key of another size is no record of this layout: a miss, counted and dropped
    assert store.batch_get_blocks(["a", "small"], _layout(dst2), [0, 1]) == [True, False]
    assert all(torch.equal(d[0], s[1]) and (d[1] == 7).all() for s, d in zip(src, dst2, strict=True))
    assert store.counters.get("corrupt_records") == 1 and "small" not in store


@pytest.mark.parametrize("cls", STORES)
def test_block_argument_errors_leave_state_untouched(cls) -> None:
    src = _tensors(torch.Generator().manual_seed(2))
    lay = _layout(src)
    store = cls(1 << 16)
    store.batch_put_blocks(["a"], lay, [0])
    snap = (store.lru_keys(), store.used_bytes)
    with pytest.raises(IndexError, match=r"'blocks' holds 10, expected a block in \[0, 10\)"):
        store.batch_put_blocks(["b", "c"], lay, [1, NB])
    with pytest.raises(IndexError, match="holds -1"):
        store.batch_get_blocks(["a"], lay, [-1])
    with pytest.raises(ValueError, match="distinct"):
        store.batch_get_blocks(["a", "a"], lay, [1, 1])
    with pytest.raises(ValueError, match="2 keys but 1 blocks"):
        store.batch_put_blocks(["b", "c"], lay, [1])
    with pytest.raises(ValueError, match="int64"):
        store.batch_put_blocks(["b"], lay, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(TypeError, match="blocks\\[0\\] must be an int"):
        store.batch_put_blocks(["b"], lay, [1.0])
    with pytest.raises(TypeError, match="keys must be a sequence"):
        store.batch_put_blocks("b", lay, [1])
    assert (store.lru_keys(), store.used_bytes) == snap
    assert store.batch_get_blocks([], lay, []) == []
    store.batch_put_blocks([], lay, [])
    big = RecordLayout([torch.zeros(2, 1 << 15)], [0], 1 << 17)
    with pytest.raises(ValueError, match="does not fit"):
        store.batch_put_blocks(["x"], big, [0])


def test_record_layout_validation() -> None:
    a, b = torch.zeros(4, 2, 3), torch.zeros(4, 5, dtype=torch.int8)
    lay = RecordLayout([a, b], [0, 32], 40)
    assert lay.num_blocks == 4 and [v.shape for v in lay.byte_views] == [(4, 24), (4, 5)]
    assert lay.byte_views[0].data_ptr() == a.data_ptr()  # views, no copies
    with pytest.raises(ValueError, match="at least one tensor"):
        RecordLayout([], [], 0)
    with pytest.raises(ValueError, match="2 tensors but 1 offsets"):
        RecordLayout([a, b], [0], 40)
    with pytest.raises(ValueError, match="parts 0 and 1 overlap"):
        RecordLayout([a, b], [0, 20], 40)
    with pytest.raises(ValueError, match="ends past record_bytes=36"):
        RecordLayout([a, b], [0, 32], 36)
    with pytest.raises(ValueError, match="tensors\\[1\\] has 3 blocks"):
        RecordLayout([a, b[:3]], [0, 32], 40)
    with pytest.raises(ValueError, match="contiguous"):
        RecordLayout([a.transpose(1, 2)], [0], 24)
    with pytest.raises(ValueError, match="offsets\\[0\\]"):
        RecordLayout([a], [-1], 24)
    with pytest.raises(ValueError, match="leading block dimension"):
        RecordLayout([torch.tensor(1.0)], [0], 4)


@pytest.mark.parametrize("cls", STORES)
def test_put_blocks_evicts_lru_with_exact_accounting(cls) -> None:
    src = _tensors(torch.Generator().manual_seed(3))
    lay = _layout(src)
    store = cls(4 * lay.record_bytes)
    for i in range(3):
        store.batch_put_blocks([f"k{3 * i + j}" for j in range(3)], lay, [0, 1, 2])
    assert store.lru_keys() == ["k5", "k6", "k7", "k8"]  # a later duplicate batch evicted the oldest
    assert store.used_bytes == store.stored_bytes == 4 * lay.record_bytes
    assert store.counters.get("evictions") == 5
    # a later duplicate key wins
    store.batch_put_blocks(["d", "d"], lay, [3, 4])
    dst = [torch.zeros_like(t) for t in src]
    assert store.batch_get_blocks(["d"], _layout(dst), [0]) == [True]
    assert all(torch.equal(d[0], s[4]) for s, d in zip(src, dst, strict=True))
    check_invariants(store)


# --------------------------------------------------------------------------------------------- leases


def _filled(n: int, size: int = 16) -> LocalKVStore:
    store = LocalKVStore(n * size)
    for i in range(n):
        store.put(f"k{i}", torch.full((size // 4,), float(i)))
    return store


def _value(store: LocalKVStore, key: str, size: int = 16) -> float | None:
    out = torch.empty(size // 4)
    return float(out[0]) if store.get(key, out) and bool((out == out[0]).all()) else None


def test_leased_entries_survive_eviction_pressure() -> None:
    store = _filled(8)
    lease = store.lease(["k0", "k1", "k2", "zz"])
    assert isinstance(lease, StoreLease) and lease.pinned and lease.found == [True, True, True, False]
    assert store.leased_keys() == ["k0", "k1", "k2"] and store.leased_bytes == 48
    for i in range(8, 30):  # far more than the capacity: evicts only unleased entries, LRU first
        store.put(f"k{i}", torch.full((4,), float(i)))
        assert store.used_bytes <= store.capacity_bytes
        check_invariants(store)
    assert [_value(store, f"k{i}") for i in range(3)] == [0.0, 1.0, 2.0]
    assert set(store.lru_keys()) == {"k0", "k1", "k2", "k25", "k26", "k27", "k28", "k29"}
    assert store.counters.get("evictions") == 22 and store.counters.get("put_skipped") == 0
    lease.release()
    lease.release()  # idempotent
    assert lease.released and store.leased_bytes == 0 and store.leased_keys() == []
    store.put("new", torch.zeros(4))  # the gets made k0..k2 the most recently used: k25 goes
    assert "new" in store and "k25" not in store and store.used_bytes == 128


def test_put_is_skipped_not_waiting_when_everything_is_leased() -> None:
    store = _filled(4)
    lease = store.lease(store.lru_keys())
    done = threading.Event()
    t = threading.Thread(target=lambda: (store.put("x", torch.full((4,), 9.0)), done.set()))
    t.start()
    assert done.wait(5)  # never waits for a lease
    t.join()
    assert "x" not in store and store.counters.get("put_skipped") == 1
    assert store.counters.get("put_skipped_bytes") == 16
    store.batch_put(["y", "z"], [torch.zeros(4), torch.zeros(4)])
    assert store.counters.get("put_skipped") == 3
    assert [_value(store, f"k{i}") for i in range(4)] == [0.0, 1.0, 2.0, 3.0]  # nothing corrupted
    assert store.used_bytes == store.stored_bytes == 64
    lease.release()
    store.put("x", torch.full((4,), 9.0))
    assert _value(store, "x") == 9.0 and store.used_bytes == 64
    check_invariants(store)


def test_removed_or_replaced_leased_entry_keeps_its_region_until_release() -> None:
    store = _filled(4)
    lease = store.lease(["k0", "k1"])
    assert store.remove("k0")
    assert "k0" not in store and store.used_bytes == 64 and store.stored_bytes == 48
    store.put("k1", torch.full((4,), 11.0))  # replace: the new value needs a fresh region
    assert _value(store, "k1") == 11.0
    # k2 (least recently used, unleased) was evicted to make room; the old k0 / k1 regions stay held
    assert store.lru_keys() == ["k3", "k1"]
    assert store.used_bytes == 64 and store.stored_bytes == 32
    assert store.leased_bytes == 32 and store.leased_keys() == []  # both leased entries are retired
    lease.release()
    assert store.leased_bytes == 0 and store.used_bytes == store.stored_bytes == 32
    check_invariants(store)


def test_lease_and_close() -> None:
    store = _filled(2)
    lease = store.lease(["k0"])
    store.close()
    lease.release()  # no-op after close
    with pytest.raises(StoreClosedError):
        store.lease(["k0"])


def test_default_lease_does_not_pin() -> None:
    store = DefaultPathStore(32)
    store.put("a", torch.zeros(4))
    assert LocalKVStore.pins_leases and not KVStore.pins_leases
    with store.lease(["a", "b"]) as lease:
        assert not lease.pinned and lease.found == [True, False]
        store.put("c", torch.zeros(4))
        store.put("d", torch.zeros(4))  # evicts "a": nothing pins it
        assert "a" not in store
    assert lease.released


def test_concurrent_leases_and_puts_keep_leased_values() -> None:
    """Threads lease random keys and check them while others put under eviction pressure."""
    store = _filled(16)
    errors: list[str] = []
    stop = threading.Event()

    written = [16]

    def leaser(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            top = written[0]
            keys = [f"k{rng.randrange(max(0, top - 24), top)}" for _ in range(3)]
            with store.lease(keys) as lease:
                for k, f in zip(keys, lease.found, strict=True):
                    # keys are never removed or replaced here, so a leased one must stay readable
                    if f and _value(store, k) != float(k[1:]):
                        errors.append(f"leased key {k} unreadable or wrong")

    def putter() -> None:
        for j in range(16, 2000):
            store.put(f"k{j}", torch.full((4,), float(j)))
            written[0] = j + 1

    threads = [threading.Thread(target=leaser, args=(s,)) for s in range(2)]
    for th in threads:
        th.start()
    putter()
    stop.set()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    assert store.leased_bytes == 0
    check_invariants(store)


def test_local_records_on_the_reference_kernel(monkeypatch) -> None:
    """Without the C++ extension copy_blocks runs its pure-PyTorch reference: the overlapping arena
    view must work there too (gather and scatter by byte offset)."""
    import torch_kvoffload.store.local as local_mod
    from torch_kvoffload.ops._registry import reference_kernel

    monkeypatch.setattr(local_mod, "copy_blocks", reference_kernel("copy_blocks"))
    g = torch.Generator().manual_seed(9)
    src = _tensors(g)
    lay = _layout(src, pad=1)
    store = LocalKVStore(5 * lay.record_bytes + 3)  # odd capacity: records at unaligned offsets
    store.put("skew", torch.zeros(3, dtype=torch.uint8))
    store.batch_put_blocks(["a", "b", "c"], lay, [4, 1, 8])
    dst = [torch.zeros_like(t) for t in src]
    assert store.batch_get_blocks(["c", "a", "b"], _layout(dst, pad=1), [0, 2, 5]) == [True] * 3
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[0, 2, 5]], s[[8, 4, 1]])
    check_invariants(store)


def test_same_size_overwrite_reuses_the_region_unless_held() -> None:
    store = LocalKVStore(64)
    store.put("a", torch.full((8,), 1.0))
    offset = store._index["a"].offset
    store.put("a", torch.full((8,), 2.0))  # nobody holds it: written in place
    assert store._index["a"].offset == offset and store.used_bytes == store.stored_bytes == 32
    # a reader in flight keeps the old bytes: the overwrite goes elsewhere
    with store._cond:
        _, pinned = store._pin("get", ["a"], [32], str)
    store.put("a", torch.full((8,), 3.0))
    assert store._index["a"].offset != offset and store.used_bytes == 64 and store.stored_bytes == 32
    assert torch.equal(store._arena[offset : offset + 32].view(torch.float32), torch.full((8,), 2.0))
    store._unpin(pinned)
    assert store.used_bytes == 32 and _value(store, "a", 32) == 3.0
    check_invariants(store)


def _leased_setup(cls, seed=11):
    g = torch.Generator().manual_seed(seed)
    src = _tensors(g)
    lay = _layout(src)
    store = cls(64 * lay.record_bytes)
    store.batch_put_blocks(["a", "b", "c", "d"], lay, [1, 2, 3, 4])
    return src, lay, store


@pytest.mark.parametrize("cls", STORES)
def test_get_leased_blocks_equals_get_blocks(cls) -> None:
    """Reads through leases (LocalKVStore: the pinned entries; a non-pinning lease: by key) give exactly
    what batch_get_blocks of the same keys gives: flags, bytes and counters."""
    src, lay, store = _leased_setup(cls)
    first, second = store.lease(["x", "b", "a"]), store.lease(["zz", "d", "c"])
    segments = [(first, 1, 3), (second, 0, 3)]  # keys b, a, zz, d, c
    keys = ["b", "a", "zz", "d", "c"]
    blocks = [9, 0, 5, 7, 6]
    via_lease = [torch.full_like(t, 3) for t in src]
    by_key = [torch.full_like(t, 3) for t in src]
    c0 = store.counters.snapshot()
    got = store.batch_get_leased_blocks(segments, _layout(via_lease), blocks)
    c1 = store.counters.snapshot()
    want = store.batch_get_blocks(keys, _layout(by_key), blocks)
    c2 = store.counters.snapshot()
    assert got == want == [True, True, False, True, True]
    assert all(torch.equal(x, y) for x, y in zip(via_lease, by_key, strict=True))
    for s, d in zip(src, via_lease, strict=True):  # against the source blocks, and the miss untouched
        for k, b in zip(["b", "a", "d", "c"], [9, 0, 7, 6], strict=True):
            assert torch.equal(d[b], s["abcd".index(k) + 1])
        assert (d[5] == 3).all()
    for name in ("gets", "hits", "misses", "bytes_got"):
        assert c1[name] - c0[name] == c2[name] - c1[name], name
    assert c1["hits"] - c0["hits"] == 4 and c1["bytes_got"] - c0["bytes_got"] == 4 * lay.record_bytes
    first.release()
    second.release()
    check_invariants(store)


def test_get_leased_blocks_reads_pinned_entries_and_refreshes_recency() -> None:
    """A leased entry removed or replaced after the lease is still read (its region is pinned); the live
    entries read become the most recently used."""
    src, lay, store = _leased_setup(LocalKVStore)
    lease = store.lease(["a", "b", "c"])
    assert store.remove("a")
    store.put("b", torch.zeros(lay.record_bytes, dtype=torch.uint8))  # replaced: new value, new region
    dst = [torch.zeros_like(t) for t in src]
    assert store.batch_get_leased_blocks([(lease, 0, 3)], _layout(dst), [5, 6, 7]) == [True] * 3
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[5], s[1]) and torch.equal(d[6], s[2]) and torch.equal(d[7], s[3])
    assert store.lru_keys() == ["d", "b", "c"]  # c refreshed; a and b's old regions are not live
    lease.release()
    assert store.leased_bytes == 0
    check_invariants(store)


def test_get_leased_blocks_errors_leave_state_untouched() -> None:
    src, lay, store = _leased_setup(LocalKVStore)
    store.put("small", torch.zeros(3))
    lease = store.lease(["a", "small", "b"])
    dst = [torch.full_like(t, 7) for t in src]
    dlay = _layout(dst)
    snap = (store.lru_keys(), store.used_bytes, store.counters.snapshot())
    with pytest.raises(IndexError, match="holds 10"):
        store.batch_get_leased_blocks([(lease, 0, 1)], dlay, [NB])
    with pytest.raises(ValueError, match="distinct"):
        store.batch_get_leased_blocks([(lease, 0, 1), (lease, 2, 3)], dlay, [4, 4])
    with pytest.raises(ValueError, match="2 keys but 1 blocks"):
        store.batch_get_leased_blocks([(lease, 1, 3)], dlay, [4])
    with pytest.raises(ValueError, match=r"range \[2, 4\) is not inside its lease of 3 keys"):
        store.batch_get_leased_blocks([(lease, 2, 4)], dlay, [4, 5])
    with pytest.raises(ValueError, match="is not inside"):
        store.batch_get_leased_blocks([(lease, True, 2)], dlay, [4])
    with pytest.raises(TypeError, match=r"segments\[0\] must be a \(StoreLease, start, stop\)"):
        store.batch_get_leased_blocks([("a", 0, 1)], dlay, [4])
    assert all((d == 7).all() for d in dst)
    assert (store.lru_keys(), store.used_bytes, store.counters.snapshot()) == snap
    # a leased key of another size is no record of this layout: a miss, counted and dropped
    assert store.batch_get_leased_blocks([(lease, 0, 2)], dlay, [0, 1]) == [True, False]
    assert all((d[1] == 7).all() for d in dst) and "small" not in store
    assert store.counters.get("corrupt_records") == 1
    dst = [torch.full_like(t, 7) for t in src]
    dlay = _layout(dst)
    lease.release()
    with pytest.raises(ValueError, match="already released"):
        store.batch_get_leased_blocks([(lease, 0, 1)], dlay, [4])
    assert all((d == 7).all() for d in dst)
    assert store.batch_get_leased_blocks([], dlay, []) == []
    # a lease of another store reads by key
    other = LocalKVStore(1 << 16)
    other.batch_put_blocks(["a"], lay, [1])
    foreign = other.lease(["a", "q"])
    assert store.batch_get_leased_blocks([(foreign, 0, 2)], dlay, [8, 9]) == [True, False]
    assert all(torch.equal(d[8], s[1]) for s, d in zip(src, dst, strict=True))
    foreign.release()
