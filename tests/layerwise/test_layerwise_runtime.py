"""LayerwiseOffloadRuntime: store round trip, reuse gate, prefetch, failures, registry, hook ops."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support.store_helpers import DropsBeforeLoad

from torch_kvoffload.layerwise import (
    LayerBuffers,
    LayerCacheSpec,
    LayerwiseOffloadRuntime,
    PrefixEvictedError,
    SlotPoisonedError,
    StoreMissError,
    TensorSpec,
    allocate_layer_buffers,
    plan_layer_buffers,
)
from torch_kvoffload.layerwise.store_io import Staging
from torch_kvoffload.ops import layer_prefetch, layer_save, layer_wait
from torch_kvoffload.ops.layer_hooks import runtimes
from torch_kvoffload.store.keys import block_hashes, layer_block_keys, parse_layer_block_key
from torch_kvoffload.store.local import LocalKVStore
from torch_kvoffload.transfer import TransferError, TransferEvent

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
    )
    if critical is not None:
        rt._critical_parts = critical  # the CPU split of critical-path transfers (default 2)
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
    try:
        snapshots = _run_layers(rt, tokens, tables, cached, write=write, on_layer=on_layer, on_enter=on_enter)
    finally:
        rt.end_forward()
    return cached, snapshots


def _run_layers(rt, tokens, tables, cached, *, write=True, on_layer=None, on_enter=None):
    """The layers of a begun forward: wait, fill the non-cached blocks (``write``), save; returns each
    layer's blocks in use (sorted block ids) as they were saved."""
    snapshots = {}
    for layer in range(rt.plan.num_layers):
        if on_enter is not None:
            on_enter(layer)
        rt.wait_layer(layer)
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
        rt.save_layer(layer)
    return snapshots


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
            # right after wait(): the prefix blocks hold exactly what forward 1 computed
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
            rt.wait_layer(layer)
            for got, ref in zip(rt.layer_caches(layer), first[layer], strict=True):
                # forward 1 used blocks [0..3] and [4..6]; its sorted snapshot holds them in that order
                assert torch.equal(got[[7, 8, 9, 11, 12]], ref[[0, 1, 2, 4, 5]]), layer
            rt.save_layer(layer)
        rt.end_forward()
        assert (store.via_leases, store.by_key) == (4 + critical - 1, 0)
        snap = rt.counters.snapshot()
        assert snap["loads"] == 4 and snap["blocks_loaded"] == 4 * 5
        assert snap["bytes_loaded"] == 5 * sum(rt.record_bytes(layer) for layer in range(4))
        assert store.leased_bytes == 0
        h = block_hashes(toks[0], BS)
        assert rt._lookup.layer_keys(h, 3) == layer_block_keys(h, 3, model_id=rt.fingerprint)
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


def test_idle_and_empty_requests_compute_nothing_and_read_their_full_blocks() -> None:
    rt, store = _make(n=3, b=1, indexer_layers=())
    try:
        toks = list(range(16))  # 4 full blocks: a request computing a token would recompute the last
        _, first = _forward(rt, [toks], [[0, 1, 2, 3]])
        saved = rt.counters.get("blocks_saved")
        seen = {}

        def check(layer):
            seen[layer] = [t[[4, 5, 6, 7]].clone() for t in rt.layer_caches(layer)]

        # an idle request with all its tokens, an empty one, one computing 6 tokens (1 full block)
        batch, tables = [toks, [], list(range(50, 56))], [[4, 5, 6, 7], [], [8, 9]]
        cached = rt.begin_forward(batch, tables, idle=[True, False, False])
        assert cached == [16, 0, 0]
        try:
            _run_layers(rt, batch, tables, cached, on_layer=check)
        finally:
            rt.end_forward()
        for layer in range(3):
            for got, ref in zip(seen[layer], first[layer], strict=True):
                assert torch.equal(got, ref), layer
        assert rt.counters.get("blocks_saved") - saved == 3  # request 2's full block, every layer
        # an idle request whose partial block is the caller's, alone and with no tokens at all
        assert rt.begin_forward([[*toks, 1, 2]], [[4, 5, 6, 7, 8]], idle=[True]) == [16]
        rt.end_forward()
        assert rt.begin_forward([[]], [[]]) == [0]
        rt.end_forward()
        with pytest.raises(ValueError, match=r"num_cached_tokens\[0\] = 12, but request 0 computes no token"):
            rt.begin_forward([toks], [[4, 5, 6, 7]], [12], idle=[True])
        with pytest.raises(ValueError, match="'idle' has 2 entries"):
            rt.begin_forward([toks], [[4, 5, 6, 7]], idle=[True, True])
        store.remove(layer_block_keys(block_hashes(toks, BS), 1, model_id=rt.fingerprint)[2])
        with pytest.raises(RuntimeError, match=r"request 0 computes no token .* only 2 of its 4 full blocks"):
            rt.begin_forward([toks], [[4, 5, 6, 7]], idle=[True])
        assert not rt._lookup.leases  # nothing leased after the refusal
        assert rt.begin_forward([toks], [[4, 5, 6, 7]]) == [8]  # computing a token, it recomputes them
        rt.end_forward()
    finally:
        rt.close()


def test_partial_layer_presence_limits_the_prefix() -> None:
    rt, store = _make(n=4, b=1, indexer_layers=())
    try:
        toks = list(range(40, 61))
        _forward(rt, [toks], [[0, 1, 2, 3, 4, 5]])
        h = block_hashes(toks, BS)
        store.remove(layer_block_keys(h, 2, model_id=rt.fingerprint)[3])  # layer 2, block 3 evicted
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
    rt, store = _make(n=7, b=3, indexer_layers=(), depth=depth)
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
        rt.wait_layer(0)
        rt.save_layer(0)
        rt.wait_layer(1)
        rt.end_forward()  # aborted after layer 1: buffer 1's occupant is layer 1
        cached = rt.begin_forward(toks, [[8, 9, 10, 11]])
        assert cached == [12]
        rt.wait_layer(0)
        rt.save_layer(0)
        rt.wait_layer(1)
        rt._io.load_stream.synchronize()  # let any load issued for a later layer land before we look
        got = rt.layer_caches(1)[0][[8, 9, 10]]
        assert torch.equal(got, first[1][0][:3])
        rt.save_layer(1)
        for layer in (2, 3):
            rt.wait_layer(layer)
            assert torch.equal(rt.layer_caches(layer)[0][[8, 9, 10]], first[layer][0][:3])
            rt.save_layer(layer)
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
        rt.wait_layer(0)
        rt.save_layer(0)
        rt.wait_layer(1)
        rt.save_layer(1)
        assert calls == [(0, 0), (1, 1)]
        entered = threading.Event()

        def enter2():
            rt.wait_layer(2)  # slot 1 previously used by layer 1: waits for its provider event
            entered.set()

        th = threading.Thread(target=enter2)
        th.start()
        time.sleep(0.1)
        assert not entered.is_set()
        releases[1].set_done()
        th.join(5)
        assert entered.is_set()
        rt.save_layer(2)
        releases[2].set_error(ConnectionError("remote read failed"))
        with pytest.raises(TransferError, match="remote read failed"):
            rt.wait_layer(3)
        assert rt.poisoned_slots() == [1]
        rt.end_forward()
        with pytest.raises(SlotPoisonedError):
            rt.begin_forward([list(range(9))], [[0, 1, 2]])
        rt.reset()
        assert rt.poisoned_slots() == []
    finally:
        for ev in releases.values():
            if not ev.query():
                ev.set_done()
        rt.close()


@pytest.mark.parametrize("streams", [1, 2])
def test_save_failure_poisons_slot_and_next_user_never_loads(streams: int) -> None:
    rt, store = _make(n=6, b=2, indexer_layers=(), streams=streams)
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
    rt, store = _make(n=3, b=1, indexer_layers=())
    try:
        toks = list(range(13))
        _forward(rt, [toks], [[0, 1, 2, 3]])
        cached = rt.begin_forward([toks], [[4, 5, 6, 7]])
        assert cached == [12]
        rt.end_forward()  # loads issued for layers 0..2 complete; now evict and retry
        store.remove(layer_block_keys(block_hashes(toks, BS), 2, model_id=rt.fingerprint)[1])
        rt.begin_forward([toks], [[4, 5, 6, 7]], num_cached_tokens=[12])
        rt.wait_layer(0)
        rt.save_layer(0)
        rt.wait_layer(1)
        rt.save_layer(1)
        with pytest.raises(PrefixEvictedError) as info:
            rt.wait_layer(2)
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
        store.drop = {layer_block_keys(block_hashes(toks[0], BS), 2, model_id=rt.fingerprint)[1]}
        cached = rt.begin_forward(toks, [[7, 8, 9, 10], [11, 12, 13]])
        assert cached == [12, 8]
        for layer in range(2):
            rt.wait_layer(layer)
            rt.save_layer(layer)
        with pytest.raises(PrefixEvictedError, match="usable cached tokens per request: \\[4, 8\\]") as info:
            rt.wait_layer(2)
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
            rt.wait_layer(layer)
            check(layer)
            rt.save_layer(layer)
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
        keys1 = layer_block_keys(block_hashes(toks[1], BS), 3, model_id=rt.fingerprint)
        store.drop = {keys1[0]}
        runs = []

        def body(cached):
            runs.append(list(cached))
            for layer in range(4):
                rt.wait_layer(layer)
                rt.save_layer(layer)
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
            k
            for layer in range(n)
            for k in layer_block_keys(block_hashes(toks, BS), layer, model_id=rt.fingerprint)
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
    rt, store = _make(n=3, b=1, indexer_layers=())
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
        rt.wait_layer(0)
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
        with pytest.raises(ValueError, match=r"begin_forward: max_cached_tokens\[0\] must be >= 0, got -4"):
            rt.begin_forward([toks], [[4, 5, 6, 7]], max_cached_tokens=[-4])
        with pytest.raises(
            TypeError, match=r"begin_forward: max_cached_tokens\[0\] must be an int, got float"
        ):
            rt.begin_forward([toks], [[4, 5, 6, 7]], max_cached_tokens=[4.0])
    finally:
        rt.close()


def test_call_order_and_argument_errors() -> None:
    rt, _ = _make(n=3, b=1, indexer_layers=())
    try:
        with pytest.raises(RuntimeError, match="no forward is running"):
            rt.wait_layer(0)
        with pytest.raises(ValueError, match="block table only 1"):
            rt.begin_forward([list(range(9))], [[0]])
        with pytest.raises(IndexError, match=r"block_tables\[0\]\[1\] is 99"):
            rt.begin_forward([list(range(9))], [[0, 99, 2]])
        with pytest.raises(ValueError, match="requests 0 and 1 both write block 0"):
            rt.begin_forward([list(range(4)), list(range(4))], [[0], [0]])
        with pytest.raises(
            ValueError, match=r"request 0 uses block 2 twice \(block_tables\[0\]\[0\] and \[2\]\)"
        ):
            rt.begin_forward([list(range(9))], [[2, 1, 2]])
        with pytest.raises(TypeError, match=r"block_tables\[0\]\[1\] must be an int, got float"):
            rt.begin_forward([list(range(9))], [[0, 1.0, 2]])
        with pytest.raises(ValueError, match="multiple of 4"):
            rt.begin_forward([list(range(9))], [[0, 1, 2]], num_cached_tokens=[3])
        with pytest.raises(ValueError, match="leaves no token"):
            rt.begin_forward([list(range(8))], [[0, 1]], num_cached_tokens=[8])
        rt.begin_forward([list(range(9))], torch.tensor([[0, 1, 2, -1]]))
        with pytest.raises(RuntimeError, match="forward is running"):
            rt.begin_forward([list(range(9))], [[0, 1, 2]])
        with pytest.raises(RuntimeError, match=r"call wait\(\d+\) first"):
            rt.save_layer(0)
        with pytest.raises(ValueError, match=r"'layer' must be an int in \[0, 3\)"):
            rt.wait_layer(3)
        rt.wait_layer(1)
        rt.wait_layer(1)  # re-entering the running layer is a no-op wait
        with pytest.raises(RuntimeError, match="increasing order"):
            rt.wait_layer(0)
        with pytest.raises(ValueError, match="must hold 2 tensors"):
            rt.save_layer(1, [rt.layer_caches(1)[0]])
        with pytest.raises(TypeError, match="dtype"):
            rt.save_layer(1, [rt.layer_caches(1)[0], rt.layer_caches(1)[0]])
        rt.save_layer(1)
        rt.end_forward()
    finally:
        rt.close()
    plan = plan_layer_buffers(_specs(2), 1)
    with pytest.raises(ValueError, match="'buffers' must be the LayerBuffers allocated for 'plan'"):
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


def test_cpu_tuning_is_not_part_of_the_constructor() -> None:
    plan = plan_layer_buffers(_specs(2), 1)
    for knob in ("critical_parts", "wake_delay"):
        with pytest.raises(TypeError, match=knob):
            LayerwiseOffloadRuntime(plan, allocate_layer_buffers(plan, "cpu"), LocalKVStore(64), **{knob: 1})
    rt, _ = _make(n=2, b=1)
    try:
        assert not hasattr(rt, "critical_parts") and not hasattr(rt, "wake_delay")
    finally:
        rt.close()


def test_registry() -> None:
    rt, _ = _make(n=2, b=1)
    try:
        runtimes.register("reg-test", rt)
        assert runtimes.get("reg-test") is rt and "reg-test" in runtimes.names()
        with pytest.raises(ValueError, match="already registered"):
            runtimes.register("reg-test", rt)
        runtimes.register("reg-test", rt, replace=True)
        runtimes.unregister("reg-test")
        with pytest.raises(KeyError, match="no layerwise runtime named 'reg-test'"):
            runtimes.get("reg-test")
        # an object without the hook methods the ops call is refused, naming what is missing
        with pytest.raises(
            TypeError, match=r"no hook method\(s\) \['wait_layer', 'prefetch_layer', 'save_layer'\]"
        ):
            runtimes.register("x", object())
        with pytest.raises(ValueError, match="non-empty str"):
            runtimes.register("", rt)
        assert "x" not in runtimes.names()
    finally:
        rt.close()


def test_hook_methods_are_the_op_names_without_their_prefix() -> None:
    """``layer_wait`` / ``layer_prefetch`` / ``layer_save`` call ``wait`` / ``prefetch`` / ``save``."""
    calls = []

    class Recorder:
        def wait_layer(self, layer, caches=None):
            calls.append(("wait", layer, len(caches)))

        def prefetch_layer(self, layer, caches=None):
            calls.append(("prefetch", layer, len(caches)))

        def save_layer(self, layer, caches=None):
            calls.append(("save", layer, len(caches)))

    runtimes.register("recorder", Recorder())
    try:
        caches = [torch.zeros(2, 2), torch.zeros(2, 3)]
        layer_wait("recorder", 3, caches)
        layer_prefetch("recorder", 4, caches)
        layer_save("recorder", 5, caches)
    finally:
        runtimes.unregister("recorder")
    assert calls == [("wait", 3, 2), ("prefetch", 4, 2), ("save", 5, 2)]


# ---------------------------------------------------------------------------------------- hook ops


@pytest.fixture
def hooked():
    rt, store = _make(n=4, b=1, indexer_layers=(1,))
    runtimes.register("hook-test", rt, replace=True)
    yield rt, store
    runtimes.unregister("hook-test")
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
        keys = layer_block_keys(
            block_hashes(toks, BS), 3, model_id=rt.fingerprint
        )  # the last layer's 4 blocks
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
        store.fail_keys = {layer_block_keys(block_hashes(toks, BS), 0, model_id=rt.fingerprint)[2 * half + 1]}
        rt.counters.reset()
        assert rt.begin_forward([toks], [[5, 6, 7, 8, 9]]) == [16]
        with pytest.raises(SlotPoisonedError, match="injected get failure"):
            rt.wait_layer(0)
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
        store.drop = {layer_block_keys(block_hashes(toks[request], BS), 0, model_id=rt.fingerprint)[block]}
        assert rt.begin_forward(toks, [[7, 8, 9, 10], [11, 12, 13]]) == [12, 8]
        with pytest.raises(PrefixEvictedError) as info:
            rt.wait_layer(0)
        assert (info.value.layer, info.value.usable_tokens, info.value.missing_blocks) == (0, usable, 1)
        with pytest.raises(PrefixEvictedError):
            rt.end_forward()
        assert rt.poisoned_slots() == []
        assert rt.counters.get("prefix_evictions") == 1 and rt.counters.get("load_failures") == 1
        cached, _ = _forward(rt, toks, [[7, 8, 9, 10], [11, 12, 13]])
        assert cached == usable  # the lookup now stops at the dropped block
    finally:
        rt.close()


# ------------------------------------------------------------------------------ shared physical blocks


class BlockSpy(LoggingStore):
    """Records, per layer, the device blocks every load wrote and every save read (one entry per call)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loaded: dict[int, list[list[int]]] = {}
        self.saved: dict[int, list[list[int]]] = {}
        self._outer = threading.local()

    def _record(self, book, layer, blocks) -> None:
        with self._log_lock:
            book.setdefault(layer, []).append([int(b) for b in blocks])

    def batch_get_blocks(self, keys, layout, blocks):
        if not getattr(self._outer, "leased", False):  # not the keyed fallback of a leased read
            self._record(self.loaded, parse_layer_block_key(keys[0])[1], blocks)
        return super().batch_get_blocks(keys, layout, blocks)

    def batch_get_leased_blocks(self, segments, layout, blocks):
        lease, start, _ = segments[0]
        self._record(self.loaded, parse_layer_block_key(lease.keys[start])[1], blocks)
        self._outer.leased = True
        try:
            return super().batch_get_leased_blocks(segments, layout, blocks)
        finally:
            self._outer.leased = False

    def batch_put_blocks(self, keys, layout, blocks) -> None:
        self._record(self.saved, parse_layer_block_key(keys[0])[1], blocks)
        super().batch_put_blocks(keys, layout, blocks)


class UnpinnedSpy(DropsBeforeLoad, BlockSpy):
    """A BlockSpy that cannot pin (loads read by key) and can lose keys before their load."""


def _shared_batch(k: int, suffixes: list[int], seed: int):
    """Requests whose first ``k`` full blocks are the same tokens, each with its own suffix."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 1000, (k * BS,), generator=g).tolist()
    return prefix, [[*prefix, *torch.randint(1000, 2000, (n,), generator=g).tolist()] for n in suffixes]


def _shared_tables(k: int, toks, first_block: int, shared: list[int]):
    """Block tables: the first ``k`` entries of every request are the physical blocks ``shared``."""
    tables, nxt = [], first_block
    for t in toks:
        own = -(-len(t) // BS) - k
        tables.append([*shared, *range(nxt, nxt + own)])
        nxt += own
    return tables


@pytest.mark.parametrize("pinning", [True, False])
@pytest.mark.parametrize(
    ("k", "suffixes", "critical", "fixed"),
    [(1, [3, 5], 1, False), (2, [1, 4, 9], 2, False), (3, [6, 2], 2, True), (2, [5, 5, 5, 1], 1, True)],
)
def test_shared_prefix_blocks_are_loaded_once_and_saved_once(k, suffixes, critical, fixed, pinning) -> None:
    """Requests reading the same physical prefix blocks: begin_forward accepts the tables, each shared
    block is loaded once per layer with what was saved for that prefix, no block is saved twice."""
    n = 4
    store = BlockSpy(1 << 22) if pinning else UnpinnedSpy(1 << 22)
    rt, _ = _make(n=n, b=2, indexer_layers=(1,), store=store, critical=critical)
    try:
        prefix, toks = _shared_batch(k, suffixes, seed=k * 10 + len(suffixes))
        # forward 1 computes the prefix alone (plus one token), in blocks 0..k
        _, first = _forward(rt, [[*prefix, 7]], [list(range(k + 1))])
        rt.counters.reset()
        store.loaded.clear()
        store.saved.clear()
        shared = [NB - 1 - i for i in range(k)]  # other physical blocks than forward 1's
        tables = _shared_tables(k, toks, k + 1, shared)
        seen = {}

        def look(layer):
            seen[layer] = [t[shared].clone() for t in rt.layer_caches(layer)]

        cached = rt.begin_forward(toks, tables, [k * BS] * len(toks) if fixed else None)
        assert cached == [k * BS] * len(toks)
        _run_layers(rt, toks, tables, cached, on_layer=look)
        rt.end_forward()

        for layer in range(n):
            # the prefix blocks hold what forward 1 computed into blocks 0..k-1 (its snapshot order)
            for got, ref in zip(seen[layer], first[layer], strict=True):
                assert torch.equal(got, ref[:k]), layer
            loads = [b for call in store.loaded[layer] for b in call]
            assert sorted(loads) == sorted(shared), layer  # each shared block once, nothing else
            saves = [b for call in store.saved[layer] for b in call]
            own_full = [b for t, tab in zip(toks, tables, strict=True) for b in tab[k : len(t) // BS]]
            assert sorted(saves) == sorted(own_full), layer  # every new full block, each once
        snap = rt.counters.snapshot()
        assert snap["blocks_loaded"] == n * k and snap["loads"] == n
        assert snap["blocks_saved"] == n * sum(len(t) // BS - k for t in toks)
        assert snap["load_failures"] == snap["save_failures"] == 0
        if pinning:
            assert store.leased_bytes == 0
    finally:
        rt.close()


@pytest.mark.parametrize("fixed", [True, False])
def test_a_block_one_request_computes_is_read_by_the_others_not_loaded(fixed: bool) -> None:
    """Nothing is in the store: the first request computes the shared prefix blocks, the others read
    them (given as cached tokens, or found by begin_forward), nothing is loaded and each is saved once."""
    store = BlockSpy(1 << 22)
    rt, _ = _make(n=3, b=1, indexer_layers=(), store=store)
    try:
        prefix, toks = _shared_batch(2, [3, 6, 1], seed=5)
        tables = _shared_tables(2, toks, 0, [10, 11])
        given = [0, 8, 8] if fixed else None
        cached = rt.begin_forward(toks, tables, given)
        assert cached == [0, 8, 8]
        _run_layers(rt, toks, tables, cached)
        rt.end_forward()
        assert store.loaded == {}
        own_full = [b for t, tab in zip(toks, tables, strict=True) for b in tab[2 : len(t) // BS]]
        for layer in range(3):
            saves = sorted(b for call in store.saved[layer] for b in call)
            assert saves == sorted([10, 11, *own_full]), layer
        snap = rt.counters.snapshot()
        # requests 1 and 2 read 2 blocks each that request 0 computes: nothing came from the store
        assert snap["blocks_loaded"] == 0 and snap["store_hits"] == 0
        assert snap["batch_shared_blocks"] == 4 and snap["store_misses"] == 2 + 1 + 0
        # the next forward of the prefix finds what request 0 computed
        assert rt.lookup([*prefix, 1]) == 8
    finally:
        rt.close()


def test_block_conflicts_are_rejected_and_change_nothing() -> None:
    store = BlockSpy(1 << 22)
    rt, _ = _make(n=2, b=1, indexer_layers=(), store=store)
    try:
        prefix, toks = _shared_batch(2, [3, 3], seed=2)
        _forward(rt, [[*prefix, 1]], [[0, 1, 2]])  # the store holds the prefix
        before = rt.counters.snapshot()
        other = [[9, *prefix[1:], 5, 5, 5]]  # other first token: other content in every block
        bad = [
            # two requests compute into block 4
            (toks, [[0, 1, 4], [2, 3, 4]], None, "requests 0 and 1 both write block 4"),
            (toks, [[0, 1, 4], [0, 1, 4]], None, "requests 0 and 1 both write block 4"),
            # request 1 reads block 0 as another prefix than request 0's
            (
                [toks[0], *other],
                [[0, 1, 4], [0, 5, 6]],
                [8, 8],
                "requests 0 and 1 share block 0 but hold different",
            ),
            # request 0 computes tokens into partial block 4, request 1 reads it as a full block
            (
                [[*prefix[:4], 1, 2], [*prefix, 3]],
                [[0, 4], [0, 4, 5]],
                [0, 8],
                "requests 0 and 1 share block 4",
            ),
        ]
        for tokens, tables, given, match in bad:
            with pytest.raises(ValueError, match=match):
                rt.begin_forward(tokens, tables, given)
            assert rt.counters.snapshot() == before and store.leased_bytes == 0
        assert store.loaded == {}
        cached, _ = _forward(rt, toks, [[0, 1, 4], [0, 1, 5]])  # the good batch runs as usual
        assert cached == [8, 8] and sorted(b for call in store.loaded[0] for b in call) == [0, 1]
    finally:
        rt.close()


def test_shared_block_evicted_before_its_load_is_recomputed_once() -> None:
    """A non-pinning store loses a shared prefix block: both readers learn the same usable prefix, and
    run_forward's retry has the first request compute the block and the second read it."""
    store = UnpinnedSpy(1 << 22)
    rt, _ = _make(n=3, b=2, indexer_layers=(), store=store)
    try:
        prefix, toks = _shared_batch(3, [2, 5], seed=8)
        _forward(rt, [[*prefix, 1]], [[0, 1, 2, 3]])
        tables = _shared_tables(3, toks, 4, [12, 13, 14])
        store.drop = {layer_block_keys(block_hashes(prefix, BS), 1, model_id=rt.fingerprint)[1]}
        runs = []

        def body(cached):
            runs.append(list(cached))
            _run_layers(rt, toks, tables, cached)

        rt.run_forward(toks, tables, body)
        assert runs == [[12, 12], [4, 12]]  # block 1 of layer 1 gone: request 0 recomputes 1 and 2
        assert rt.counters.get("forward_retries") == 1 and rt.counters.get("batch_shared_blocks") == 2
        assert rt.poisoned_slots() == []
    finally:
        rt.close()


# --------------------------------------------------------------------------------- model fingerprint


def _runtime_on(store, specs, model_id=""):
    plan = plan_layer_buffers(specs, 1, (0,))
    return LayerwiseOffloadRuntime(plan, allocate_layer_buffers(plan, "cpu"), store, model_id=model_id)


def _layout(n=3, row=12, dtype=torch.float32, indexer=False, nb=NB):
    main = (TensorSpec((nb, BS, row), dtype), TensorSpec((nb, BS, 4), torch.bfloat16))
    idx = (TensorSpec((nb, BS, 6), torch.int8),) if indexer else None
    return [LayerCacheSpec(main, idx) for _ in range(n)]


@pytest.mark.parametrize(
    ("other", "other_id", "shares"),
    [
        (_layout(), "", True),  # same layout, same (empty) id
        (_layout(nb=NB + 8), "", True),  # a larger pool holds the same blocks
        (_layout(row=8), "", False),  # other row width, both ids empty
        (_layout(dtype=torch.bfloat16), "", False),
        (_layout(indexer=True), "", False),
        (_layout(n=4), "", False),  # other layer count: layer 1 of another model
        (_layout(), "other-model", False),  # same layout, other weights
    ],
)
def test_runtimes_on_one_store_share_blocks_only_for_the_same_model(other, other_id, shares) -> None:
    store = LocalKVStore(1 << 22)
    writer = _runtime_on(store, _layout())
    reader = _runtime_on(store, other, other_id)
    try:
        toks = [list(range(300, 317))]  # 4 full blocks
        _forward(writer, toks, [[0, 1, 2, 3, 4]])
        assert writer.lookup(toks[0]) == 16
        expect = 16 if shares else 0
        assert reader.lookup(toks[0]) == expect
        cached, _ = _forward(reader, toks, [[5, 6, 7, 8, 9]])
        assert (
            cached == [expect]
            and reader.counters.get("blocks_loaded") == expect // BS * reader.plan.num_layers
        )
        # the keys name the model and its layout; a block was stored under each runtime's own prefix
        assert (writer.fingerprint == reader.fingerprint) == shares
        h = block_hashes(toks[0], BS)
        assert store.exists(layer_block_keys(h, 0, model_id=reader.fingerprint)[0])
    finally:
        writer.close()
        reader.close()


# ---------------------------------------------------------------------------------------- staging path


def _strided_runtime(store, n=3, ring=None):
    """A runtime over non-contiguous host buffers: records go through the staging tensors, the path
    device buffers take."""
    plan = plan_layer_buffers(_specs(n, indexer_layers=(1,)), 1)

    def strided(spec):
        return tuple(torch.zeros(NB, BS, 2 * c.shape[2], dtype=c.dtype)[:, :, : c.shape[2]] for c in spec)

    main = [strided(s) for s in plan.slot_main_specs]
    indexer = [None if s is None else strided(s) for s in plan.slot_indexer_specs]
    rt = LayerwiseOffloadRuntime(plan, LayerBuffers(plan, main, indexer), store)
    assert all(lay.records is None for lay in rt._layouts)  # the staging path, not direct records
    if ring is not None:
        rt._io.staging_ring = {kind: [Staging() for _ in range(ring)] for kind in ("load", "save")}
        rt._io.staging_next = {"load": 0, "save": 0}
    return rt


def test_staging_path_round_trip_with_shared_blocks() -> None:
    store = LocalKVStore(1 << 22)
    rt = _strided_runtime(store)
    try:
        prefix, toks = _shared_batch(2, [3, 1], seed=4)
        _, first = _forward(rt, [[*prefix, 9]], [[0, 1, 2]])
        tables = _shared_tables(2, toks, 3, [14, 15])
        seen = {}
        cached, _ = _forward(
            rt,
            toks,
            tables,
            on_layer=lambda layer: seen.setdefault(
                layer, [t[[14, 15]].clone() for t in rt.layer_caches(layer)]
            ),
        )
        assert cached == [8, 8]
        for layer in range(3):
            for got, ref in zip(seen[layer], first[layer], strict=True):
                assert torch.equal(got, ref[:2]), layer
        assert rt.counters.get("blocks_loaded") == 3 * 2
    finally:
        rt.close()


class _FakeCopyEvent:
    """Stands in for the device event of the copies a staging buffer took part in."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name
        self.done = False

    def synchronize(self) -> None:
        self.done = True
        self.log.append(("sync", self.name))


class _OrderStore(LocalKVStore):
    def __init__(self, *args, log, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log = log

    def batch_get(self, keys, outs):
        self.log.append(("get", parse_layer_block_key(keys[0])[1]))
        return super().batch_get(keys, outs)

    def batch_put(self, keys, values):
        self.log.append(("put", parse_layer_block_key(keys[0])[1]))
        super().batch_put(keys, values)


def test_staging_reuse_and_host_reads_wait_for_the_copy_events() -> None:
    """With device buffers each staging buffer carries the event of its last copy: a save's store write
    (a host read of device-written bytes) waits for its copy's event, and a staging buffer is refilled
    only after the copy that read it completed. Checked on host buffers with events standing in."""
    log: list = []
    store = _OrderStore(1 << 22, log=log)
    rt = _strided_runtime(store, n=3, ring=2)
    issued = []

    def copies_issued(entry, device):
        kind = "load" if any(entry is e for e in rt._io.staging_ring["load"]) else "save"
        name = f"{kind}{len([i for i in issued if i.startswith(kind)])}"
        issued.append(name)
        entry.event = _FakeCopyEvent(log, name)
        log.append(("issue", name))

    rt._io.copies_issued = copies_issued
    try:
        toks = [list(range(13))]
        _forward(rt, toks, [[0, 1, 2, 3]])
        # every save: copies issued, their event waited for, then the store reads the staging bytes
        saves = [e for e in log if e[0] in ("issue", "sync", "put")]
        assert saves == [
            x for i in range(3) for x in (("issue", f"save{i}"), ("sync", f"save{i}"), ("put", i))
        ]
        log.clear()
        _forward(rt, toks, [[4, 5, 6, 7]])
        loads = [e for e in log if e[0] in ("get", "sync") or e[1].startswith("load")]
        loads = [e for e in loads if not str(e[1]).startswith("save")]
        # ring of 2: layer 2's load refills layer 0's staging buffer only after load0's event
        assert loads == [
            ("get", 0), ("issue", "load0"), ("get", 1), ("issue", "load1"),
            ("sync", "load0"), ("get", 2), ("issue", "load2"),
        ]  # fmt: skip
    finally:
        rt.close()


@pytest.mark.parametrize("critical", [1, 2])
@pytest.mark.parametrize("pinning", [True, False])
def test_shared_and_private_cached_blocks_load_from_the_right_entries(pinning, critical) -> None:
    """Each request caches the shared prefix and blocks of its own: the loads read every request's own
    entries (through its lease, or by key) and the shared ones once, also when a load is cut in parts."""
    store = BlockSpy(1 << 22) if pinning else UnpinnedSpy(1 << 22)
    rt, _ = _make(n=3, b=2, indexer_layers=(1,), store=store, critical=critical)
    try:
        _, toks = _shared_batch(2, [6, 5, 9], seed=3)  # 3, 3 and 4 full blocks
        private = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]]
        _, first = _forward(rt, toks, private)  # stores every full block (the prefix as request 0's)
        store.loaded.clear()
        tables = [[14, 15, 0, 1], [14, 15, 2, 3], [14, 15, 4, 5, 6]]
        seen = {}
        cached, _ = _forward(
            rt,
            toks,
            tables,
            on_layer=lambda layer: seen.setdefault(layer, [t.clone() for t in rt.layer_caches(layer)]),
        )
        assert cached == [12, 12, 16]
        # where each loaded block's content was computed in forward 1 (its snapshot holds blocks 0..12)
        source = {14: 0, 15: 1, 0: 2, 2: 6, 4: 10, 5: 11}
        for layer in range(3):
            loads = sorted(b for call in store.loaded[layer] for b in call)
            assert loads == sorted(source), layer
            for got, ref in zip(seen[layer], first[layer], strict=True):
                for dst, src in source.items():
                    assert torch.equal(got[dst], ref[src]), (layer, dst)
        assert rt.counters.get("blocks_loaded") == 3 * len(source)
    finally:
        rt.close()
