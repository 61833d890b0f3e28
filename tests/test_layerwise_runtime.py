"""LayerwiseOffloadRuntime: store round trip, reuse gate, prefetch, failures, registry, hook ops."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from store_helpers import DropsBeforeLoad

from torch_kvoffload.device import TransferError, TransferEvent
from torch_kvoffload.layerwise import (
    LayerCacheSpec,
    LayerwiseOffloadRuntime,
    PrefixEvictedError,
    SlotPoisonedError,
    StoreMissError,
    TensorSpec,
    allocate_layer_buffers,
    get_runtime,
    plan_layer_buffers,
    register_runtime,
    unregister_runtime,
)
from torch_kvoffload.ops import layer_prefetch, layer_save, layer_wait
from torch_kvoffload.store.keys import block_hashes, layer_block_keys, parse_layer_block_key
from torch_kvoffload.store.local import LocalKVStore

NB, BS = 16, 4


def _specs(n: int, indexer_layers=()) -> list[LayerCacheSpec]:
    main = (TensorSpec((NB, BS, 12), torch.float32), TensorSpec((NB, BS, 4), torch.bfloat16))
    idx = (TensorSpec((NB, BS, 6), torch.int8), TensorSpec((NB, BS, 1), torch.float32))
    return [LayerCacheSpec(main, idx if i in indexer_layers else None) for i in range(n)]


class LoggingStore(LocalKVStore):
    """LocalKVStore that logs put/get per layer with times, optionally slow or failing."""

    def __init__(self, *args, put_delay: float = 0.0, fail_put_layers=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.put_delay = put_delay
        self.fail_put_layers = set(fail_put_layers)
        self.log: list[tuple[str, int, float]] = []
        self._log_lock = threading.Lock()

    def _note(self, what: str, layer: int) -> None:
        with self._log_lock:
            self.log.append((what, layer, time.perf_counter()))

    def batch_put_blocks(self, keys, layout, blocks) -> None:
        layer = parse_layer_block_key(keys[0])[1]
        self._note("put_start", layer)
        time.sleep(self.put_delay)
        if layer in self.fail_put_layers:
            self._note("put_failed", layer)
            raise OSError(f"injected put failure for layer {layer}")
        super().batch_put_blocks(keys, layout, blocks)
        self._note("put_end", layer)

    def batch_get_blocks(self, keys, layout, blocks):
        layer = parse_layer_block_key(keys[0])[1]
        self._note("get_start", layer)
        out = super().batch_get_blocks(keys, layout, blocks)
        self._note("get_end", layer)
        return out

    def batch_get_leased_blocks(self, segments, layout, blocks):
        lease, start, _ = segments[0]
        layer = parse_layer_block_key(lease.keys[start])[1]
        self._note("get_start", layer)
        out = super().batch_get_leased_blocks(segments, layout, blocks)
        self._note("get_end", layer)
        return out

    def times(self, what: str) -> dict[int, float]:
        return {layer: t for w, layer, t in self.log if w == what}


def _make(
    n=6,
    b=2,
    indexer_layers=(1, 3, 5),
    depth=2,
    store=None,
    independent=(0,),
    streams=None,
    model_id="test",
    critical=None,
):
    plan = plan_layer_buffers(_specs(n, indexer_layers), b, independent)
    bufs = allocate_layer_buffers(plan, "cpu")
    store = store if store is not None else LoggingStore(1 << 22)
    rt = LayerwiseOffloadRuntime(
        plan,
        bufs,
        store,
        prefetch_depth=depth,
        model_id=model_id,
        transfer_streams=streams,
        critical_parts=critical,
    )
    return rt, store


def _fill(t: torch.Tensor, blocks: list[int]) -> None:
    for b in blocks:
        if t.dtype.is_floating_point:
            t[b] = torch.randn(t.shape[1:]).to(t.dtype)
        else:
            t[b] = torch.randint(-100, 100, t.shape[1:], dtype=t.dtype)


def _forward(rt, tokens, tables, *, write=True, on_layer=None, on_enter=None):
    """Run one forward: each layer 'computes' by filling its non-cached blocks with random data."""
    cached = rt.begin_forward(tokens, tables)
    snapshots = {}
    try:
        for layer in range(rt.plan.num_layers):
            if on_enter is not None:
                on_enter(layer)
            rt.before_attention(layer)
            if on_layer is not None:
                on_layer(layer)
            for toks, table, c in zip(tokens, tables, cached, strict=True):
                new = table[c // BS : -(-len(toks) // BS)]
                if write:
                    for t in rt.layer_caches(layer):
                        _fill(t, new)
            used = sorted(
                b for toks, table in zip(tokens, tables, strict=True) for b in table[: -(-len(toks) // BS)]
            )
            snapshots[layer] = [t[used].clone() for t in rt.layer_caches(layer)]
            rt.after_cache_write(layer)
    finally:
        rt.end_forward()
    return cached, snapshots


def test_roundtrip_prefix_is_loaded_for_every_layer() -> None:
    rt, _store = _make()
    try:
        toks = [list(range(100, 118))]  # 18 tokens: 4 full blocks + 2
        cached, first = _forward(rt, toks, [[3, 5, 7, 9, 11]])
        assert cached == [0]
        snap = rt.counters.snapshot()
        assert snap["saves"] == 6 and snap["blocks_saved"] == 6 * 4 and snap["loads"] == 0
        assert snap["store_misses"] == 4
        # same prefix, other blocks and one extra block: 4 full blocks are cached
        toks2 = [[*toks[0][:16], 7, 7, 7, 7, 7]]
        assert rt.lookup(toks2[0]) == 16
        seen = {}

        def check(layer):
            # right after before_attention: the prefix blocks hold exactly what forward 1 computed
            seen[layer] = [t[[0, 2, 4, 6]].clone() for t in rt.layer_caches(layer)]

        cached, _ = _forward(rt, toks2, [[0, 2, 4, 6, 8, 10]], on_layer=check)
        assert cached == [16]
        used1 = [3, 5, 7, 9, 11]
        for layer in range(6):
            for got, ref in zip(seen[layer], first[layer], strict=True):
                expect = ref[[used1.index(b) for b in (3, 5, 7, 9)]]
                assert torch.equal(got, expect), layer
        snap = rt.counters.snapshot()
        assert snap["loads"] == 6 and snap["blocks_loaded"] == 24 and snap["store_hits"] == 4
        rec = sum(rt.record_bytes(i) for i in range(6))
        assert snap["bytes_loaded"] == 4 * rec
        # layer with an indexer records more bytes than one without (16-byte aligned components)
        assert rt.record_bytes(1) == 192 + 32 + 32 + 16 and rt.record_bytes(2) == 192 + 32
    finally:
        rt.close()


class CountingStore(LoggingStore):
    """Counts the load calls by path: through the lookup leases, or by key."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.by_key = self.via_leases = 0

    def batch_get_blocks(self, keys, layout, blocks):
        self.by_key += 1
        return super().batch_get_blocks(keys, layout, blocks)

    def batch_get_leased_blocks(self, segments, layout, blocks):
        self.via_leases += 1
        return super().batch_get_leased_blocks(segments, layout, blocks)


@pytest.mark.parametrize(("fixed", "critical"), [(False, 2), (True, 2), (False, 1)])
def test_loads_read_through_the_lookup_leases(fixed: bool, critical: int) -> None:
    """With a pinning store the loads read the entries the lookup leased (no second lookup by key); the
    data, the counters and the leases are those of the keyed path. Layer 0's load (waited for at once)
    is cut into ``critical`` parts: the second half starts inside request 0's prefix."""
    store = CountingStore(1 << 22)
    rt, _ = _make(n=4, b=2, indexer_layers=(1,), store=store, model_id="m/1", critical=critical)
    try:
        toks = _two_requests()
        _, first = _forward(rt, toks, [[0, 1, 2, 3], [4, 5, 6]])
        rt.counters.reset()
        cached = rt.begin_forward(toks, [[7, 8, 9, 10], [11, 12, 13]], [12, 8] if fixed else None)
        assert cached == [12, 8]
        for layer in range(4):
            rt.before_attention(layer)
            for got, ref in zip(rt.layer_caches(layer), first[layer], strict=True):
                # forward 1 used blocks [0..3] and [4..6]; its sorted snapshot holds them in that order
                assert torch.equal(got[[7, 8, 9, 11, 12]], ref[[0, 1, 2, 4, 5]]), layer
            rt.after_cache_write(layer)
        rt.end_forward()
        assert (store.via_leases, store.by_key) == (4 + critical - 1, 0)
        snap = rt.counters.snapshot()
        assert snap["loads"] == 4 and snap["blocks_loaded"] == 4 * 5
        assert snap["bytes_loaded"] == 5 * sum(rt.record_bytes(layer) for layer in range(4))
        assert store.leased_bytes == 0
        h = block_hashes(toks[0], BS)
        assert rt._layer_keys(h, 3) == layer_block_keys(h, 3, model_id="m/1")
    finally:
        rt.close()


def test_fully_cached_prompt_still_computes_a_token() -> None:
    rt, _ = _make(n=3, b=1, indexer_layers=())
    try:
        toks = [list(range(16))]
        _forward(rt, toks, [[0, 1, 2, 3]])
        assert rt.lookup(toks[0]) == 12  # not 16: the last block is recomputed
        cached, _ = _forward(rt, toks, [[4, 5, 6, 7]])
        assert cached == [12]
    finally:
        rt.close()


def test_partial_layer_presence_limits_the_prefix() -> None:
    rt, store = _make(n=4, b=1, indexer_layers=())
    try:
        toks = list(range(40, 61))
        _forward(rt, [toks], [[0, 1, 2, 3, 4, 5]])
        h = block_hashes(toks, BS)
        store.remove(layer_block_keys(h, 2, model_id="test")[3])  # layer 2, block 3 evicted
        assert rt.lookup(toks) == 12
        assert rt.counters.get("store_hits") == 0
    finally:
        rt.close()


@pytest.mark.parametrize("streams", [1, 2])
def test_reuse_gate_orders_loads_after_previous_users_save(streams: int) -> None:
    store = LoggingStore(1 << 22, put_delay=0.03)
    rt, _ = _make(n=7, b=2, indexer_layers=(), store=store, depth=3, streams=streams)
    assert rt.transfer_streams == streams
    try:
        toks = [list(range(50, 75)), list(range(200, 213))]
        tables = [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
        _forward(rt, toks, tables)
        store.log.clear()
        toks2 = [[*t[:12], 1, 2, 3, 4, 5] for t in toks]
        calls: dict[int, float] = {}
        _forward(
            rt,
            toks2,
            [[11, 12, 13, 14, 15], [0, 1, 2, 3, 4]],
            on_layer=lambda L: calls.setdefault(L, time.perf_counter()),
        )
        put_end, get_start = store.times("put_end"), store.times("get_start")
        assert sorted(get_start) == list(range(7))
        for layer in range(7):
            prev = rt.plan.previous_user[layer]
            if prev is not None:
                assert get_start[layer] >= put_end[prev], (layer, prev)
        assert rt.counters.get("waits") >= 1 and rt.counters.get("wait_seconds") > 0
    finally:
        rt.close()


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetch_runs_ahead_of_compute(depth: int) -> None:
    store = LoggingStore(1 << 22)
    rt, _ = _make(n=7, b=3, indexer_layers=(), store=store, depth=depth)
    try:
        toks = [list(range(50, 75))]
        _forward(rt, toks, [[0, 1, 2, 3, 4, 5, 6]])
        store.log.clear()
        entered: dict[int, float] = {}
        _forward(
            rt,
            [[*toks[0][:20], 9, 9]],
            [[8, 9, 10, 11, 12, 13]],
            on_enter=lambda L: entered.setdefault(L, time.perf_counter()),
            on_layer=lambda L: time.sleep(0.03),  # 'compute'
        )
        get_start = store.times("get_start")
        ahead = [layer for layer in range(1, 7) if get_start[layer] < entered[layer]]
        # with B=3 every layer's buffer is free one layer ahead: its load starts while the layer before computes
        assert ahead == list(range(1, 7))
        assert rt.counters.get("loads") == 7
    finally:
        rt.close()


def test_aborted_forward_does_not_let_a_later_layer_load_early() -> None:
    """After a forward stopped at layer 1, the next forward must not prefetch layer 3 (same buffer,
    previous user 1) before layer 1 of the new forward ran: layer 1 would read layer 3's prefix."""
    rt, _ = _make(n=4, b=2, indexer_layers=(), depth=3)
    try:
        assert rt.plan.slots == [[0], [1, 3], [2]]
        toks = [list(range(300, 313))]
        _, first = _forward(rt, toks, [[0, 1, 2, 3]])
        rt.begin_forward(toks, [[4, 5, 6, 7]])
        rt.before_attention(0)
        rt.after_cache_write(0)
        rt.before_attention(1)
        rt.end_forward()  # aborted after layer 1: buffer 1's occupant is layer 1
        cached = rt.begin_forward(toks, [[8, 9, 10, 11]])
        assert cached == [12]
        rt.before_attention(0)
        rt.after_cache_write(0)
        rt.before_attention(1)
        rt._load_stream.synchronize()  # let any load issued for a later layer land before we look
        got = rt.layer_caches(1)[0][[8, 9, 10]]
        assert torch.equal(got, first[1][0][:3])
        rt.after_cache_write(1)
        for layer in (2, 3):
            rt.before_attention(layer)
            assert torch.equal(rt.layer_caches(layer)[0][[8, 9, 10]], first[layer][0][:3])
            rt.after_cache_write(layer)
        rt.end_forward()
    finally:
        rt.close()


def test_completion_provider_gates_reuse() -> None:
    rt, _store = _make(n=4, b=1, indexer_layers=())
    releases: dict[int, TransferEvent] = {}
    calls = []

    def provider(slot, layer):
        calls.append((slot, layer))
        ev = TransferEvent()
        releases[layer] = ev
        return ev

    rt.register_completion_provider(provider)
    try:
        rt.begin_forward([list(range(9))], [[0, 1, 2]])
        rt.before_attention(0)
        rt.after_cache_write(0)
        rt.before_attention(1)
        rt.after_cache_write(1)
        assert calls == [(0, 0), (1, 1)]
        entered = threading.Event()

        def enter2():
            rt.before_attention(2)  # slot 1 previously used by layer 1: waits for its provider event
            entered.set()

        th = threading.Thread(target=enter2)
        th.start()
        time.sleep(0.1)
        assert not entered.is_set()
        releases[1]._set_done()
        th.join(5)
        assert entered.is_set()
        rt.after_cache_write(2)
        releases[2]._set_error(ConnectionError("remote read failed"))
        with pytest.raises(TransferError, match="remote read failed"):
            rt.before_attention(3)
        assert rt.poisoned_slots() == [1]
        rt.end_forward()
        with pytest.raises(SlotPoisonedError):
            rt.begin_forward([list(range(9))], [[0, 1, 2]])
        rt.reset()
        assert rt.poisoned_slots() == []
    finally:
        for ev in releases.values():
            if not ev.query():
                ev._set_done()
        rt.close()


@pytest.mark.parametrize("streams", [1, 2])
def test_save_failure_poisons_slot_and_next_user_never_loads(streams: int) -> None:
    store = LoggingStore(1 << 22)
    rt, _ = _make(n=6, b=2, indexer_layers=(), store=store, streams=streams)
    try:
        toks = [list(range(30))]
        _forward(rt, toks, [[0, 1, 2, 3, 4, 5, 6, 7]])
        store.fail_put_layers = {2}
        store.log.clear()
        toks2 = [[*toks[0][:20], *range(500, 520)]]
        entered = []
        with pytest.raises(TransferError, match="injected put failure for layer 2"):
            _forward(rt, toks2, [[*list(range(8, 16)), 0, 1]], on_layer=entered.append)
        assert entered == [0, 1, 2, 3]  # layer 4 (next user of layer 2's buffer) never ran
        assert 4 not in store.times("get_start")  # and its load never touched the buffer
        assert rt.poisoned_slots() == [rt.plan.slot_of[2]]
        assert rt.counters.get("save_failures") == 1
        with pytest.raises(SlotPoisonedError):
            rt.begin_forward(toks2, [[*list(range(8, 16)), 0, 1]])
        rt.reset()
        store.fail_put_layers = set()
        _forward(rt, toks2, [[*list(range(8, 16)), 0, 1]])
    finally:
        rt.close()


def test_evicted_block_fails_the_load() -> None:
    store = LoggingStore(1 << 22)
    rt, _ = _make(n=3, b=1, indexer_layers=(), store=store)
    try:
        toks = list(range(13))
        _forward(rt, [toks], [[0, 1, 2, 3]])
        cached = rt.begin_forward([toks], [[4, 5, 6, 7]])
        assert cached == [12]
        rt.end_forward()  # loads issued for layers 0..2 complete; now evict and retry
        store.remove(layer_block_keys(block_hashes(toks, BS), 2, model_id="test")[1])
        rt.begin_forward([toks], [[4, 5, 6, 7]], num_cached_tokens=[12])
        rt.before_attention(0)
        rt.after_cache_write(0)
        rt.before_attention(1)
        rt.after_cache_write(1)
        with pytest.raises(PrefixEvictedError) as info:
            rt.before_attention(2)
        assert isinstance(info.value, StoreMissError)
        assert (info.value.layer, info.value.usable_tokens, info.value.missing_blocks) == (2, [4], 1)
        with pytest.raises(PrefixEvictedError):
            rt.end_forward()
        assert rt.counters.get("load_failures") == 1 and rt.counters.get("prefix_evictions") == 1
        assert rt.poisoned_slots() == []  # nothing half-written is ever read: the runtime stays usable
        assert store.leased_bytes == 0
        cached, _ = _forward(rt, [toks], [[4, 5, 6, 7]])
        assert cached == [4]
    finally:
        rt.close()


class DroppingStore(DropsBeforeLoad, LoggingStore):
    """A LoggingStore that cannot pin what the lookup found and loses ``drop`` keys before their load."""


def _two_requests():
    return [list(range(13)), list(range(100, 109))]  # 3 and 2 full blocks


def test_block_dropped_after_lookup_raises_prefix_evicted_and_runtime_stays_usable() -> None:
    store = DroppingStore(1 << 22)
    rt, _ = _make(n=4, b=2, indexer_layers=(1,), store=store)
    try:
        toks = _two_requests()
        _, first = _forward(rt, toks, [[0, 1, 2, 3], [4, 5, 6]])
        store.drop = {layer_block_keys(block_hashes(toks[0], BS), 2, model_id="test")[1]}
        cached = rt.begin_forward(toks, [[7, 8, 9, 10], [11, 12, 13]])
        assert cached == [12, 8]
        for layer in range(2):
            rt.before_attention(layer)
            rt.after_cache_write(layer)
        with pytest.raises(PrefixEvictedError, match="usable cached tokens per request: \\[4, 8\\]") as info:
            rt.before_attention(2)
        err = info.value
        assert (err.layer, err.usable_tokens, err.missing_blocks) == (2, [4, 8], 1)
        with pytest.raises(PrefixEvictedError) as info2:
            rt.end_forward()
        assert info2.value.usable_tokens == [4, 8]
        assert rt.poisoned_slots() == [] and rt.counters.get("prefix_evictions") == 1
        # the recovery: cap the prefix at what is usable; the model recomputes the rest
        seen = {}

        def check(layer):
            seen[layer] = [t[[7, 11]].clone() for t in rt.layer_caches(layer)]

        cached = rt.begin_forward(toks, [[7, 8, 9, 10], [11, 12, 13]], max_cached_tokens=[4, 4])
        assert cached == [4, 4]
        for layer in range(4):
            rt.before_attention(layer)
            check(layer)
            rt.after_cache_write(layer)
        rt.end_forward()
        for layer in range(4):  # forward 1's blocks 0 (request 0) and 4 (request 1) were loaded
            for got, ref in zip(seen[layer], first[layer], strict=True):
                assert torch.equal(got, ref[[0, 4]]), layer
    finally:
        rt.close()


def test_run_forward_recomputes_instead_of_failing() -> None:
    store = DroppingStore(1 << 22)
    rt, _ = _make(n=4, b=2, indexer_layers=(1,), store=store, depth=1)
    try:
        toks = _two_requests()
        _forward(rt, toks, [[0, 1, 2, 3], [4, 5, 6]])
        keys1 = layer_block_keys(block_hashes(toks[1], BS), 3, model_id="test")
        store.drop = {keys1[0]}
        runs = []

        def body(cached):
            runs.append(list(cached))
            for layer in range(4):
                rt.before_attention(layer)
                rt.after_cache_write(layer)
            return "done"

        assert rt.run_forward(toks, [[7, 8, 9, 10], [11, 12, 13]], body) == "done"
        assert runs == [[12, 8], [12, 0]]
        assert rt.counters.get("forward_retries") == 1 and rt.poisoned_slots() == []
        # an error that is not an eviction closes the forward and propagates
        with pytest.raises(ZeroDivisionError):
            rt.run_forward(toks, [[7, 8, 9, 10], [11, 12, 13]], lambda cached: 1 / 0)
        assert rt.run_forward(toks, [[7, 8, 9, 10], [11, 12, 13]], body) == "done"
    finally:
        rt.close()


def test_lookup_leases_keep_the_prefix_under_eviction_pressure() -> None:
    """The forward's own saves need room; the leased prefix is never what gets evicted."""
    n = 3
    rt, _ = _make(n=n, b=1, indexer_layers=(1,), depth=1, store=LoggingStore(1))
    rt.close()
    rec = [rt.record_bytes(layer) for layer in range(n)]
    store = LoggingStore(3 * sum(rec) + 3 * max(rec))  # the prefix, and new blocks of one layer
    rt, _ = _make(n=n, b=1, indexer_layers=(1,), depth=1, store=store)
    try:
        toks = list(range(13))
        _, first = _forward(rt, [toks], [[0, 1, 2, 3]])
        prefix_keys = [
            k for layer in range(n) for k in layer_block_keys(block_hashes(toks, BS), layer, model_id="test")
        ]
        assert all(store.batch_exists(prefix_keys))
        toks2 = [*toks[:12], *range(50, 63)]  # 3 cached + 3 new full blocks + 1 token
        seen = {}
        cached, _ = _forward(
            rt,
            [toks2],
            [[4, 5, 6, 7, 8, 9, 10]],
            on_layer=lambda layer: seen.setdefault(
                layer, [t[[4, 5, 6]].clone() for t in rt.layer_caches(layer)]
            ),
        )
        assert cached == [12]
        for layer in range(n):
            for got, ref in zip(seen[layer], first[layer], strict=True):
                assert torch.equal(got, ref[:3]), layer
        assert rt.counters.get("leased_blocks") == 3 * n
        assert all(store.batch_exists(prefix_keys))  # never evicted under the forward's saves
        assert store.counters.get("evictions") > 0  # the new blocks evicted each other instead
        assert store.used_bytes <= store.capacity_bytes and store.leased_bytes == 0
        with store._cond:
            assert store._stored == sum(e.nbytes for e in store._index.values()) == store._held
    finally:
        rt.close()


def test_leases_are_released_on_every_path() -> None:
    store = LoggingStore(1 << 22)
    rt, _ = _make(n=3, b=1, indexer_layers=(), store=store)
    try:
        toks = list(range(13))
        _forward(rt, [toks], [[0, 1, 2, 3]])
        # a save fails: end_forward raises, the leases are gone
        store.fail_put_layers = {1}
        with pytest.raises(TransferError):
            _forward(rt, [[*toks[:12], 9, 9, 9, 9, 9]], [[4, 5, 6, 7, 8]])
        assert store.leased_bytes == 0
        rt.reset()
        store.fail_put_layers = set()
        # begin_forward fails validating request 1 after leasing request 0's prefix
        with pytest.raises(IndexError):
            rt.begin_forward([toks, list(range(5))], [[4, 5, 6, 7], [99, 100]])
        assert store.leased_bytes == 0
        # an aborted forward, closed with end_forward
        rt.begin_forward([toks], [[4, 5, 6, 7]])
        assert store.leased_bytes > 0
        rt.before_attention(0)
        rt.end_forward()
        assert store.leased_bytes == 0
        # close() in the middle of a forward
        rt.begin_forward([toks], [[4, 5, 6, 7]])
        assert store.leased_bytes > 0
    finally:
        rt.close()
    assert store.leased_bytes == 0


def test_max_cached_tokens_arguments() -> None:
    rt, _ = _make(n=2, b=1, indexer_layers=())
    try:
        toks = list(range(13))
        _forward(rt, [toks], [[0, 1, 2, 3]])
        assert rt.begin_forward([toks], [[4, 5, 6, 7]], max_cached_tokens=[7]) == [4]  # whole blocks
        rt.end_forward()
        assert rt.begin_forward([toks], [[4, 5, 6, 7]], max_cached_tokens=[100]) == [12]
        rt.end_forward()
        with pytest.raises(ValueError, match="not both"):
            rt.begin_forward([toks], [[4, 5, 6, 7]], [4], max_cached_tokens=[4])
        with pytest.raises(ValueError, match="'max_cached_tokens' has 2 entries"):
            rt.begin_forward([toks], [[4, 5, 6, 7]], max_cached_tokens=[4, 4])
        with pytest.raises(ValueError, match=r"max_cached_tokens\[0\] must be an int >= 0"):
            rt.begin_forward([toks], [[4, 5, 6, 7]], max_cached_tokens=[-4])
    finally:
        rt.close()


def test_call_order_and_argument_errors() -> None:
    rt, _ = _make(n=3, b=1, indexer_layers=())
    try:
        with pytest.raises(RuntimeError, match="no forward is running"):
            rt.before_attention(0)
        with pytest.raises(ValueError, match="block table only 1"):
            rt.begin_forward([list(range(9))], [[0]])
        with pytest.raises(IndexError, match=r"block_tables\[0\]\[1\] is 99"):
            rt.begin_forward([list(range(9))], [[0, 99, 2]])
        with pytest.raises(ValueError, match="used by requests 0 and 1"):
            rt.begin_forward([list(range(4)), list(range(4))], [[0], [0]])
        with pytest.raises(ValueError, match="multiple of 4"):
            rt.begin_forward([list(range(9))], [[0, 1, 2]], num_cached_tokens=[3])
        with pytest.raises(ValueError, match="leaves no token"):
            rt.begin_forward([list(range(8))], [[0, 1]], num_cached_tokens=[8])
        with pytest.raises(ValueError, match="no tokens"):
            rt.begin_forward([[]], [[0]])
        rt.begin_forward([list(range(9))], torch.tensor([[0, 1, 2, -1]]))
        with pytest.raises(RuntimeError, match="forward is running"):
            rt.begin_forward([list(range(9))], [[0, 1, 2]])
        with pytest.raises(RuntimeError, match="call before_attention"):
            rt.after_cache_write(0)
        with pytest.raises(ValueError, match=r"'layer' must be an int in \[0, 3\)"):
            rt.before_attention(3)
        rt.before_attention(1)
        rt.before_attention(1)  # re-entering the running layer is a no-op wait
        with pytest.raises(RuntimeError, match="increasing order"):
            rt.before_attention(0)
        with pytest.raises(ValueError, match="must hold 2 tensors"):
            rt.after_cache_write(1, [rt.layer_caches(1)[0]])
        with pytest.raises(TypeError, match="dtype"):
            rt.after_cache_write(1, [rt.layer_caches(1)[0], rt.layer_caches(1)[0]])
        rt.after_cache_write(1)
        rt.end_forward()
    finally:
        rt.close()
    plan = plan_layer_buffers(_specs(2), 1)
    with pytest.raises(ValueError, match="different plan"):
        LayerwiseOffloadRuntime(
            plan, allocate_layer_buffers(plan_layer_buffers(_specs(2), 1), "cpu"), LocalKVStore(64)
        )
    with pytest.raises(ValueError, match="prefetch_depth"):
        LayerwiseOffloadRuntime(plan, allocate_layer_buffers(plan, "cpu"), LocalKVStore(64), prefetch_depth=0)
    with pytest.raises(ValueError, match="layer count"):
        LayerwiseOffloadRuntime(plan_layer_buffers(2, 1), None, LocalKVStore(64))
    with pytest.raises(ValueError, match="transfer_streams"):
        LayerwiseOffloadRuntime(
            plan, allocate_layer_buffers(plan, "cpu"), LocalKVStore(64), transfer_streams=3
        )
    with pytest.raises(TypeError, match="KVStore"):
        LayerwiseOffloadRuntime(plan, allocate_layer_buffers(plan, "cpu"), {})


def test_registry() -> None:
    rt, _ = _make(n=2, b=1)
    try:
        register_runtime("reg-test", rt)
        assert get_runtime("reg-test") is rt
        with pytest.raises(ValueError, match="already registered"):
            register_runtime("reg-test", rt)
        register_runtime("reg-test", rt, replace=True)
        unregister_runtime("reg-test")
        with pytest.raises(KeyError, match="no layerwise runtime named 'reg-test'"):
            get_runtime("reg-test")
        with pytest.raises(TypeError):
            register_runtime("x", object())
    finally:
        rt.close()


# ---------------------------------------------------------------------------------------- hook ops


@pytest.fixture
def hooked():
    rt, store = _make(n=4, b=1, indexer_layers=(1,))
    register_runtime("hook-test", rt, replace=True)
    yield rt, store
    unregister_runtime("hook-test")
    rt.close()


def test_hook_ops_run_the_runtime(hooked) -> None:
    rt, _store = hooked
    toks = [list(range(10))]
    for rnd in range(2):
        cached = rt.begin_forward(toks, [[rnd * 3, rnd * 3 + 1, rnd * 3 + 2]])
        for layer in range(4):
            caches = list(rt.layer_caches(layer))
            layer_wait("hook-test", layer, caches)
            layer_save("hook-test", layer, caches)
            layer_prefetch("hook-test", layer, caches)
        rt.end_forward()
        assert cached == [8 * rnd]
    assert rt.counters.get("loads") == 4 and rt.counters.get("saves") == 4
    with pytest.raises(KeyError, match="no layerwise runtime"):
        layer_wait("nope", 0, list(rt.layer_caches(0)))


def test_hook_ops_opcheck(hooked) -> None:
    """opcheck: test_schema (declared mutation vs what the kernel does), test_faketensor (fake vs real),
    test_aot_dispatch_dynamic (functionalized tracing gives eager results). test_autograd_registration
    does not apply: cache buffers never require grad and the ops have no autograd formula."""
    rt, _ = hooked
    rt.begin_forward([list(range(10))], [[0, 1, 2]])
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    try:
        for layer in (1,):  # the layer with main + indexer components
            caches = list(rt.layer_caches(layer))
            torch.library.opcheck(
                torch.ops.kvoffload.layer_wait.default, ("hook-test", layer, caches), test_utils=utils
            )
            torch.library.opcheck(
                torch.ops.kvoffload.layer_save.default, ("hook-test", layer, caches), test_utils=utils
            )
            torch.library.opcheck(
                torch.ops.kvoffload.layer_prefetch.default, ("hook-test", layer, caches), test_utils=utils
            )
    finally:
        rt.end_forward()


def test_hook_ops_compile_in_order(hooked) -> None:
    rt, _ = hooked
    graphs = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(c0a, c0b, c1a, c1b, i1a, i1b, x):
        outs = []
        for layer, caches in ((0, [c0a, c0b]), (1, [c1a, c1b, i1a, i1b])):
            layer_wait("hook-test", layer, caches)
            caches[0][0, 0] = x  # the cache write
            layer_save("hook-test", layer, caches)
            layer_prefetch("hook-test", layer + 1, list(rt.layer_caches(layer + 1)))
            outs.append(caches[0].sum())
        return outs[0] + outs[1]

    compiled = torch.compile(step, fullgraph=True, backend=recording_backend)
    args = [*rt.layer_caches(0), *rt.layer_caches(1), torch.ones(12)]
    rt.begin_forward([list(range(10))], [[0, 1, 2]])
    got = compiled(*args)
    rt.end_forward()
    assert torch.equal(got, rt.layer_caches(0)[0].sum() + rt.layer_caches(1)[0].sum())
    nodes = [
        (n.target._name.split("::")[1], n.args[1])
        for n in graphs[0].graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == "kvoffload"
    ]
    assert nodes == [
        ("layer_wait", 0),
        ("layer_save", 0),
        ("layer_prefetch", 1),
        ("layer_wait", 1),
        ("layer_save", 1),
        ("layer_prefetch", 2),
    ]
    assert rt.counters.get("saves") == 2


def test_hook_ops_with_copies_of_the_caches(hooked) -> None:
    """A functionalizing backend may hand the ops clones: wait fills them, save writes them back."""
    rt, _ = hooked
    toks = [list(range(10))]
    _forward(rt, toks, [[0, 1, 2]])
    rt.begin_forward(toks, [[3, 4, 5]])
    try:
        clones = [torch.zeros_like(t) for t in rt.layer_caches(0)]
        layer_wait("hook-test", 0, clones)
        for c, t in zip(clones, rt.layer_caches(0), strict=True):
            assert torch.equal(c, t) and c.data_ptr() != t.data_ptr()
        assert clones[0][[3, 4]].abs().sum() > 0  # the loaded prefix
        clones[0][5] = 7.0  # the "cache write" happened on the copy
        layer_save("hook-test", 0, clones)
        assert torch.equal(rt.layer_caches(0)[0][5], clones[0][5])
        with pytest.raises(ValueError, match="must hold 2 tensors"):
            layer_prefetch("hook-test", 0, clones[:1])
        with pytest.raises(ValueError, match=r"must be \[16, 4, 12\]"):
            layer_wait("hook-test", 0, [torch.zeros(3, 4, 12), clones[1]])
    finally:
        rt.end_forward()


def test_hook_ops_under_a_functionalizing_backend(hooked) -> None:
    """Under aot_eager (AOT autograd, functionalization of the mutating hooks) the graph reads the loaded
    prefix and its cache write reaches the buffer, as in eager execution."""
    rt, _ = hooked
    toks = [list(range(10))]
    _, first = _forward(rt, toks, [[0, 1, 2]])

    def step(c0a, c0b, x):
        layer_wait("hook-test", 0, [c0a, c0b])
        seen = c0a[3:5].sum()  # reads the loaded prefix (blocks 3, 4)
        c0a[5] = x
        layer_save("hook-test", 0, [c0a, c0b])
        return seen

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    rt.begin_forward(toks, [[3, 4, 5]])
    try:
        got = compiled(*rt.layer_caches(0), torch.full((4, 12), 3.0))
    finally:
        rt.end_forward()
    assert torch.equal(got, first[0][0][:2].sum())
    assert torch.equal(rt.layer_caches(0)[0][5], torch.full((4, 12), 3.0))
    # layers 0 and 1 were loaded (layer 2 shares layer 1's buffer and never ran); no new full block
    assert rt.counters.get("loads") == 2 and rt.counters.get("saves") == 4


# ------------------------------------------------------------------------ split critical-path transfers


class PartStore(LocalKVStore):
    """Logs every block call of the runtime: (kind, layer, number of keys), and fails on request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int, int]] = []
        self.fail_keys: set[str] = set()
        self._log_lock = threading.Lock()

    def _note(self, kind: str, keys) -> None:
        with self._log_lock:
            self.calls.append((kind, parse_layer_block_key(keys[0])[1], len(keys)))
        if self.fail_keys.intersection(keys):
            raise OSError(f"injected {kind} failure")

    def batch_put_blocks(self, keys, layout, blocks) -> None:
        self._note("put", keys)
        super().batch_put_blocks(keys, layout, blocks)

    def batch_get_leased_blocks(self, segments, layout, blocks):
        self._note("get", [k for lease, start, stop in segments for k in lease.keys[start:stop]])
        return super().batch_get_leased_blocks(segments, layout, blocks)

    def sizes(self, kind: str, layer: int) -> list[int]:
        return sorted(n for k, L, n in self.calls if k == kind and layer == L)


def _halves(n: int, critical: int) -> list[int]:
    return [n] if critical == 1 or n < 2 else [n // 2, n - n // 2]


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("cached_blocks", [1, 2, 3, 5])
def test_split_critical_transfers_move_the_same_blocks_and_count_them_once(
    b: int, cached_blocks: int
) -> None:
    """With critical_parts=2 the transfers the compute thread waits for at once are cut in two, run by the
    transfer thread and the waiting thread (the first layer's load, the last layer's save; with B=1 also
    the loads of the running layer and the saves its buffer waits for); the data and the counters are
    those of whole transfers."""
    n, new_blocks = 5, 3
    toks = list(range(1000, 1000 + (cached_blocks + new_blocks) * BS + 1))
    table1 = list(range(cached_blocks + 1))
    table2 = list(range(NB - 1, NB - 2 - cached_blocks - new_blocks, -1))  # other blocks, reversed
    # transfers on the critical path: (loads, saves) by layer
    critical_layers = {1: ({0, 2, 3, 4}, {1, 2, 3, 4}), 2: ({0}, {4})}[b]
    for critical in (1, 2):
        store = PartStore(1 << 22)
        rt, _ = _make(n=n, b=b, indexer_layers=(1, 3), store=store, depth=1, critical=critical)
        try:
            _, first = _forward(rt, [toks[: cached_blocks * BS + 1]], [table1])
            store.calls.clear()
            rt.counters.reset()
            seen = {}

            def check(layer, rt=rt, seen=seen):
                seen[layer] = [t[table2[:cached_blocks]].clone() for t in rt.layer_caches(layer)]

            cached, _ = _forward(rt, [toks], [table2], on_layer=check)
            assert cached == [cached_blocks * BS]
            for layer in range(n):  # forward 1 computed blocks 0.. in table order; they were loaded
                for got, ref in zip(seen[layer], first[layer], strict=True):
                    assert torch.equal(got, ref[:cached_blocks]), (critical, layer)
            snap = rt.counters.snapshot()
            rec = sum(rt.record_bytes(layer) for layer in range(n))
            assert snap["loads"] == n and snap["blocks_loaded"] == n * cached_blocks
            assert snap["bytes_loaded"] == cached_blocks * rec
            assert snap["saves"] == n and snap["blocks_saved"] == n * new_blocks
            assert snap["bytes_saved"] == new_blocks * rec
            assert snap["load_failures"] == snap["save_failures"] == 0
            assert snap["load_seconds"] > 0 and snap["save_seconds"] > 0
            loads, saves = critical_layers
            for layer in range(n):
                split_load = critical if layer in loads else 1
                split_save = critical if layer in saves else 1
                assert store.sizes("get", layer) == _halves(cached_blocks, split_load), (critical, layer)
                assert store.sizes("put", layer) == _halves(new_blocks, split_save), (critical, layer)
        finally:
            rt.close()


def test_split_transfers_without_blocks_are_not_issued() -> None:
    """Nothing cached (first forward) and nothing new to save (a fully cached prompt but its last token):
    no split transfer runs, nothing is counted."""
    store = PartStore(1 << 22)
    rt, _ = _make(n=3, b=1, indexer_layers=(), store=store, critical=2)
    try:
        toks = list(range(12))  # 3 full blocks
        cached, _ = _forward(rt, [toks], [[0, 1, 2]])
        assert cached == [0] and store.sizes("get", 0) == []
        store.calls.clear()
        rt.counters.reset()
        cached, _ = _forward(rt, [[*toks, 5]], [[3, 4, 5, 6]])  # 3 cached blocks + 1 token: nothing to save
        assert cached == [12]
        assert all(kind == "get" for kind, _, _ in store.calls)
        snap = rt.counters.snapshot()
        assert snap["saves"] == snap["blocks_saved"] == snap["bytes_saved"] == 0
        assert snap["loads"] == 3 and snap["blocks_loaded"] == 9
    finally:
        rt.close()


@pytest.mark.parametrize("half", [0, 1])
def test_split_save_failure_in_one_half_poisons_and_counts_once(half: int) -> None:
    store = PartStore(1 << 22)
    rt, _ = _make(n=4, b=2, indexer_layers=(), store=store, critical=2)
    try:
        toks = list(range(2000, 2000 + 4 * BS + 1))
        keys = layer_block_keys(block_hashes(toks, BS), 3, model_id="test")  # the last layer's 4 blocks
        store.fail_keys = {keys[2 * half]}  # one block of one half
        with pytest.raises(TransferError, match="injected put failure"):
            _forward(rt, [toks], [[0, 1, 2, 3, 4]])
        assert store.sizes("put", 3) == [2, 2]  # both halves ran
        assert rt.poisoned_slots() == [rt.plan.slot_of[3]]
        snap = rt.counters.snapshot()
        assert snap["save_failures"] == 1 and snap["saves"] == 3 and snap["blocks_saved"] == 3 * 4
        assert store.leased_bytes == 0
        with pytest.raises(SlotPoisonedError):
            rt.begin_forward([toks], [[0, 1, 2, 3, 4]])
        rt.reset()
        store.fail_keys = set()
        _forward(rt, [toks], [[0, 1, 2, 3, 4]])
        assert rt.counters.get("saves") == 3 + 4
    finally:
        rt.close()


@pytest.mark.parametrize("half", [0, 1])
def test_split_load_failure_in_one_half_poisons_the_first_layer(half: int) -> None:
    store = PartStore(1 << 22)
    rt, _ = _make(n=3, b=2, indexer_layers=(), store=store, critical=2)
    try:
        toks = list(range(3000, 3000 + 4 * BS + 1))
        _forward(rt, [toks], [[0, 1, 2, 3, 4]])
        store.fail_keys = {layer_block_keys(block_hashes(toks, BS), 0, model_id="test")[2 * half + 1]}
        rt.counters.reset()
        assert rt.begin_forward([toks], [[5, 6, 7, 8, 9]]) == [16]
        with pytest.raises(SlotPoisonedError, match="injected get failure"):
            rt.before_attention(0)
        with pytest.raises(TransferError):
            rt.end_forward()
        assert store.sizes("get", 0) == [2, 2]
        assert rt.poisoned_slots() == [rt.plan.slot_of[0]]
        snap = rt.counters.snapshot()
        assert snap["load_failures"] == 1 and snap["prefix_evictions"] == 0
        assert snap["blocks_loaded"] == 4 * (snap["loads"])  # only the layers that loaded count
        assert store.leased_bytes == 0
    finally:
        rt.close()


@pytest.mark.parametrize(("drop", "usable"), [((0, 2), [8, 8]), ((1, 0), [12, 0]), ((0, 0), [0, 8])])
def test_split_load_eviction_reports_usable_tokens_over_both_halves(drop, usable) -> None:
    """Layer 0's load of 3 + 2 prefix blocks is split as [0, 2) and [2, 5): a block missing in either half
    gives the PrefixEvictedError of the whole layer (usable tokens per request), and poisons nothing."""
    store = DroppingStore(1 << 22)
    rt, _ = _make(n=3, b=2, indexer_layers=(), store=store, critical=2)
    try:
        toks = _two_requests()
        _forward(rt, toks, [[0, 1, 2, 3], [4, 5, 6]])
        request, block = drop
        store.drop = {layer_block_keys(block_hashes(toks[request], BS), 0, model_id="test")[block]}
        assert rt.begin_forward(toks, [[7, 8, 9, 10], [11, 12, 13]]) == [12, 8]
        with pytest.raises(PrefixEvictedError) as info:
            rt.before_attention(0)
        assert (info.value.layer, info.value.usable_tokens, info.value.missing_blocks) == (0, usable, 1)
        with pytest.raises(PrefixEvictedError):
            rt.end_forward()
        assert rt.poisoned_slots() == []
        assert rt.counters.get("prefix_evictions") == 1 and rt.counters.get("load_failures") == 1
        cached, _ = _forward(rt, toks, [[7, 8, 9, 10], [11, 12, 13]])
        assert cached == usable  # the lookup now stops at the dropped block
    finally:
        rt.close()
