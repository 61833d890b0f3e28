"""KVPPScheduler in one process: prefetch order, scratch alternation, no-history forwards, failures."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support.kvpp_helpers import RecordingTransport, small_allocation

from torch_kvoffload.kvpp import KVPPScheduler
from torch_kvoffload.kvpp.blocks import forward_digest
from torch_kvoffload.ops.kvpp import runtimes
from torch_kvoffload.transfer import TransferError


def _run_forward(sched: KVPPScheduler, layers, *, history: bool) -> list[int | None]:
    pending = []
    sched.begin_forward(history)
    pending.append(sched.pending_layer)
    for layer in layers:
        sched.wait_layer(layer)
        pending.append(sched.pending_layer)
    sched.end_forward()
    return pending


@pytest.mark.parametrize(
    ("num_layers", "size", "rank"), [(5, 2, 0), (5, 2, 1), (4, 4, 3), (3, 4, 3), (7, 3, 1)]
)
def test_one_layer_ahead_into_alternating_scratch(num_layers: int, size: int, rank: int) -> None:
    alloc = small_allocation(num_layers, size, rank, drafts=(num_layers,))
    transport = RecordingTransport(size, rank)
    with KVPPScheduler(alloc, transport) as sched:
        layers = [*range(num_layers), num_layers]  # the draft layer last: a no-op wait
        pending = _run_forward(sched, layers, history=True)
        # exactly one broadcast in flight, always the next target layer
        assert pending == [*range(num_layers), None, None]
        assert transport.layers == list(range(num_layers))
        bundle = 4 * (16 + 8 + 8) * 4 * alloc.num_blocks  # block_size x dims x fp32 x blocks
        for layer, owner, spans, after in transport.calls:
            assert owner == alloc.plan.owners[layer]
            assert len(spans) == 1  # no block tables: the whole bundle span
            ptr, nbytes = spans[0]
            assert nbytes == bundle
            assert ptr == alloc.bundle_span(layer).data_ptr()
            assert len(after) == 1  # ordered after a compute event
            if alloc.plan.is_persistent(layer):
                assert ptr == alloc.persistent[layer].data_ptr()
            else:
                assert ptr == alloc.scratch[layer % 2].data_ptr()
        c = sched.counters.snapshot()
        assert c["broadcasts"] == num_layers and c["waits"] == num_layers
        assert c["bytes_broadcast"] == num_layers * bundle
        assert c["forwards"] == 1 and c["forwards_with_history"] == 1
    assert transport.closed


def test_no_history_forward_broadcasts_nothing() -> None:
    alloc = small_allocation()
    transport = RecordingTransport()
    sched = KVPPScheduler(alloc, transport)
    for _ in range(3):
        assert _run_forward(sched, range(5), history=False) == [None] * 6
    assert transport.calls == []
    assert sched.counters.get("broadcasts") == 0 and sched.counters.get("waits") == 0
    _run_forward(sched, range(5), history=True)
    assert sched.counters.get("broadcasts") == 5
    sched.close()


def test_wait_really_waits_and_counts_seconds() -> None:
    alloc = small_allocation()
    transport = RecordingTransport()
    sched = KVPPScheduler(alloc, transport)
    transport.gate.clear()
    sched.begin_forward(True)
    timer = threading.Timer(0.2, transport.gate.set)
    timer.start()
    start = time.perf_counter()
    sched.wait_layer(0)
    assert time.perf_counter() - start >= 0.15
    assert sched.counters.get("wait_seconds") >= 0.15
    # the broadcast itself was held as long on the transfer thread
    assert sched.counters.get("broadcast_seconds") >= 0.15
    for layer in range(1, 5):
        sched.wait_layer(layer)
    sched.end_forward()
    sched.close()


def test_failed_broadcast_raises_and_stops() -> None:
    alloc = small_allocation()
    transport = RecordingTransport(fail_layers=(2,))
    sched = KVPPScheduler(alloc, transport)
    sched.begin_forward(True)
    sched.wait_layer(0)
    sched.wait_layer(1)
    with pytest.raises(TransferError, match="layer 2 failed: link down"):
        sched.wait_layer(2)
    assert transport.layers == [0, 1, 2]  # nothing submitted after the failure
    assert isinstance(sched.failed, RuntimeError)
    with pytest.raises(TransferError, match="earlier broadcast failed"):
        sched.wait_layer(3)
    sched.end_forward()
    with pytest.raises(TransferError, match="earlier broadcast failed"):
        sched.begin_forward(True)
    assert transport.layers == [0, 1, 2]
    sched.close()


def test_state_errors() -> None:
    alloc = small_allocation(drafts=(5,))
    transport = RecordingTransport()
    sched = KVPPScheduler(alloc, transport)
    with pytest.raises(RuntimeError, match="no forward scheduled"):
        sched.wait_layer(0)
    sched.begin_forward(True)
    with pytest.raises(RuntimeError, match=r"already scheduled|still pending"):
        sched.begin_forward(True)
    with pytest.raises(RuntimeError, match="out of order"):
        sched.wait_layer(1)
    with pytest.raises(KeyError, match="no KV cache"):
        sched.wait_layer(17)
    sched.wait_layer(5)  # draft: local, no-op
    assert sched.pending_layer == 0
    sched.wait_layer(0)
    # a forward that ends early: end_forward finishes the pending prefetch
    assert sched.pending_layer == 1
    sched.end_forward()
    assert sched.pending_layer is None
    # pending prefetch left over (end_forward skipped) -> starting a forward is an error
    sched.begin_forward(True)
    sched._in_forward = False  # simulate an engine that forgot end_forward
    with pytest.raises(RuntimeError, match="prefetch of layer 0 is still pending"):
        sched.begin_forward(True)
    sched._in_forward = True
    sched.end_forward()
    sched.close()
    with pytest.raises(RuntimeError, match="closed"):
        sched.begin_forward(False)


def test_prefetch_layer_is_idempotent_and_bounded() -> None:
    alloc = small_allocation()
    transport = RecordingTransport()
    sched = KVPPScheduler(alloc, transport)
    sched.begin_forward(True)
    sched.prefetch_layer(0)  # already started by begin_forward
    with pytest.raises(RuntimeError, match="not the next layer"):
        sched.prefetch_layer(2)
    sched.wait_layer(0)
    sched.prefetch_layer(1)
    sched.prefetch_layer(0)
    assert transport.layers == [0, 1]
    with pytest.raises(KeyError, match="prefetch_layer: layer 17 has no KV cache"):
        sched.prefetch_layer(17)
    sched.end_forward()
    sched.close()


def test_bundle_argument_is_checked() -> None:
    alloc = small_allocation()
    sched = KVPPScheduler(alloc, RecordingTransport())
    sched.begin_forward(False)
    sched.wait_layer(0, list(alloc.views(0).values()))
    sched.wait_layer(1, [alloc.bundle_span(1)])
    with pytest.raises(ValueError, match="bundle of layer 2"):
        sched.wait_layer(2, [torch.zeros(3, 4, 15)])
    sched.end_forward()
    sched.close()


def test_ranks_must_agree_before_the_first_forward() -> None:
    alloc = small_allocation()
    transport = RecordingTransport(peers_differ={"num_blocks": 99})
    sched = KVPPScheduler(alloc, transport)
    with pytest.raises(RuntimeError, match=r"disagree on num_blocks: rank 100: 3; rank 101: 99"):
        sched.begin_forward(False)
    assert transport.calls == []
    sched.close()


def test_registration_by_name() -> None:
    alloc = small_allocation()
    sched = KVPPScheduler(alloc, RecordingTransport(), name="sched-test-reg")
    assert runtimes.get("sched-test-reg") is sched
    with pytest.raises(ValueError, match="already registered"):
        KVPPScheduler(small_allocation(), RecordingTransport(), name="sched-test-reg")
    sched.close()
    assert "sched-test-reg" not in runtimes.names()


def test_wait_timeout_keeps_the_broadcast_pending() -> None:
    alloc = small_allocation()
    transport = RecordingTransport()
    sched = KVPPScheduler(alloc, transport, wait_timeout=0.05)
    transport.gate.clear()
    sched.begin_forward(True)
    with pytest.raises(TimeoutError):
        sched.wait_layer(0)
    assert sched.pending_layer == 0 and sched.failed is None  # a collective in flight cannot be dropped
    transport.gate.set()
    for layer in range(5):
        sched.wait_layer(layer)
    sched.end_forward()
    sched.close()


def test_transport_argument_checks() -> None:
    from torch_kvoffload.kvpp import BroadcastTransport, KVPPGroup, create_kvpp_group

    with pytest.raises(ValueError, match="needs a process group"):
        BroadcastTransport(KVPPGroup((0, 1), 0, 0))
    single = BroadcastTransport(KVPPGroup((3,), 0, 0))
    with pytest.raises(ValueError, match=r"'spans\[0\]' must be a contiguous 1-D uint8"):
        single.broadcast(0, [torch.zeros(4)], 0)
    with pytest.raises(ValueError, match="non-empty list of tensors"):
        single.broadcast(0, torch.zeros(4, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="owner id 1 out of range"):
        single.broadcast(0, [torch.zeros(4, dtype=torch.uint8)], 1)
    single.broadcast(0, [torch.zeros(4, dtype=torch.uint8)], 0).wait(5)  # a group of one: nothing to move
    assert single.all_gather_object({"a": 1}) == [{"a": 1}]
    assert single.exchange([5, 0]) == [[5, 0]]
    single.close()
    with pytest.raises(ValueError, match="timeout must be positive or None"):
        BroadcastTransport(KVPPGroup((3,), 0, 0), timeout=0)
    with pytest.raises(RuntimeError, match="not initialised"):
        create_kvpp_group(1, 1, 1, 2, torch.device("cpu"))


# ------------------------------------------------------------------------------------ block tables


@pytest.mark.parametrize(
    ("tables", "runs"),
    [
        ([[1, 2], [2, 3]], [(1, 4)]),
        ([[0], [5, 6], [9]], [(0, 1), (5, 7), (9, 10)]),
        (torch.tensor([[7, 8, -1], [2, -1, -1]]), [(2, 3), (7, 9)]),
    ],
)
def test_broadcasts_move_only_the_block_runs(tables, runs) -> None:
    alloc = small_allocation(4, 2, 1, num_blocks=10)
    transport = RecordingTransport(2, 1)
    per_block = [4 * 16 * 4, 4 * 8 * 4, 4 * 8 * 4]  # c_kv, k_pe, index_k: block_size x dim x fp32
    with KVPPScheduler(alloc, transport) as sched:
        sched.begin_forward(True, tables)
        assert sched.block_runs == runs
        for layer in range(4):
            sched.wait_layer(layer)
        sched.end_forward()
        for layer, _, spans, _ in transport.calls:
            base = alloc.bundle_span(layer).data_ptr()
            expected = []
            for c, bpb in enumerate(per_block):
                offset = sum(per_block[:c]) * 10  # component-major: earlier components hold all 10 blocks
                for s, t in runs:
                    begin, nbytes = base + offset + s * bpb, (t - s) * bpb
                    if expected and sum(expected[-1]) == begin:  # touches the previous range: one span
                        expected[-1] = (expected[-1][0], expected[-1][1] + nbytes)
                    else:
                        expected.append((begin, nbytes))
            assert spans == expected
        blocks = sum(t - s for s, t in runs)
        assert sched.counters.get("bytes_broadcast") == 4 * blocks * sum(per_block)
        assert sched.counters.get("broadcast_spans") == sum(len(c[2]) for c in transport.calls)


def test_max_runs_caps_the_collectives_per_layer() -> None:
    alloc = small_allocation(2, 2, 1, num_blocks=21)
    transport = RecordingTransport(2, 1)
    with KVPPScheduler(alloc, transport, max_runs=2) as sched:
        # runs (0,1) (2,3) (10,12) (19,20): gaps 1, 7, 7; two runs keep the leftmost largest gap
        sched.begin_forward(True, [[0], [2], [10], [11], [19]])
        assert sched.block_runs == [(0, 3), (10, 20)]
        sched.wait_layer(0)
        sched.wait_layer(1)
        sched.end_forward()
    assert [len(c[2]) for c in transport.calls] == [6, 6]


def test_tables_without_blocks_or_history_broadcast_nothing() -> None:
    alloc = small_allocation(3, 2, 1, num_blocks=8)
    transport = RecordingTransport(2, 1)
    with KVPPScheduler(alloc, transport) as sched:
        for history, tables in ((True, [[-1, -1]]), (True, []), (False, [[1, 2]]), (False, None)):
            sched.begin_forward(history, tables)
            for layer in range(3):
                sched.wait_layer(layer)
            sched.end_forward()
        assert transport.calls == []
        assert sched.counters.get("forwards") == 4 and sched.counters.get("forwards_with_history") == 2


def test_bad_tables_leave_the_scheduler_untouched() -> None:
    alloc = small_allocation(3, 2, 1, num_blocks=8)
    transport = RecordingTransport(2, 1)
    with KVPPScheduler(alloc, transport) as sched:
        with pytest.raises(ValueError, match=r"begin_forward: block_runs: .*block 8, out of range"):
            sched.begin_forward(True, torch.tensor([[1, 8]]))
        with pytest.raises(TypeError, match=r"begin_forward: .*integer tensor"):
            sched.begin_forward(True, torch.zeros(1, 2))
        assert transport.calls == [] and sched.counters.get("forwards") == 0
        assert sched.pending_layer is None
        sched.begin_forward(True, [[1]])  # not "already scheduled": nothing changed
        for layer in range(3):
            sched.wait_layer(layer)
        sched.end_forward()
        assert transport.layers == [0, 1, 2]


# ------------------------------------------------------------------------- waits and given tensors


def test_accelerator_waits_are_stream_waits() -> None:
    """With a transport on a device the scheduler orders compute after the broadcast's event
    (``wait_on_compute``) and never blocks the host on it (``wait``)."""
    alloc = small_allocation(3, 2, 1)
    transport = RecordingTransport(2, 1, device="cuda")
    with KVPPScheduler(alloc, transport) as sched:
        sched.begin_forward(True, [[0, 1]])
        for layer in range(3):
            sched.wait_layer(layer)
        sched.end_forward()
    assert transport.wait_log == ["wait_on_compute"] * 3
    cpu = RecordingTransport(2, 1)
    with KVPPScheduler(small_allocation(3, 2, 1), cpu) as sched:  # on CPU the host blocks: real waits
        cpu.gate.clear()
        sched.begin_forward(True, [[0]])
        threading.Timer(0.1, cpu.gate.set).start()
        start = time.perf_counter()
        sched.wait_layer(0)
        assert time.perf_counter() - start >= 0.05
        sched.end_forward()


def test_wait_copies_the_cache_into_tensors_that_are_not_it() -> None:
    alloc = small_allocation(3, 2, 1, drafts=(3,))
    with KVPPScheduler(alloc, RecordingTransport(2, 1)) as sched:
        for layer in range(4):
            for v in alloc.views(layer).values():
                v.copy_(torch.randn(v.shape))
        sched.begin_forward(True, [[0, 2]])
        for layer in range(4):
            own = list(alloc.views(layer).values())
            clones = [torch.full_like(v, -7.0) for v in own]
            sched.wait_layer(layer, clones)
            assert all(torch.equal(c, v) for c, v in zip(clones, own, strict=True))
            sched.wait_layer(layer, clones)  # the layer waited last: no-op wait, refreshes the tensors
            span = torch.zeros_like(alloc.bundle_span(layer))
            sched.wait_layer(layer, [span])  # the byte-span form
            assert torch.equal(span, alloc.bundle_span(layer))
            before = [v.clone() for v in own]
            sched.wait_layer(layer, own)  # the cache itself: nothing copied, nothing changed
            assert all(torch.equal(b, v) for b, v in zip(before, own, strict=True))
        sched.end_forward()
        with pytest.raises(ValueError, match="wait_layer: bundle of layer 0"):
            sched.begin_forward(False)
            sched.wait_layer(0, [torch.zeros(3, 4, 16, dtype=torch.float64)])
        sched.end_forward()


# ------------------------------------------------------------------------ agreement before a forward


def test_every_forward_exchanges_its_tables_fingerprint_and_status() -> None:
    alloc = small_allocation(3, 2, 1, num_blocks=8)
    transport = RecordingTransport(2, 1)
    with KVPPScheduler(alloc, transport) as sched:
        for history, tables in ((True, [[1, 2]]), (False, None), (True, torch.tensor([[1, 2]]))):
            sched.begin_forward(history, tables)
            for layer in range(3):
                sched.wait_layer(layer)
            sched.end_forward()
        digests = [d for d, _ in transport.exchanges]
        assert [s for _, s in transport.exchanges] == [0, 0, 0]
        assert digests == [forward_digest(True, [[1, 2]]), forward_digest(False, None),
                           forward_digest(True, torch.tensor([[1, 2]]))]  # fmt: skip
        assert len(set(digests)) == 3


@pytest.mark.parametrize("peer", ["other-tables", "failed"])
def test_a_disagreeing_or_failed_peer_refuses_the_forward_on_this_rank(peer: str) -> None:
    """A peer with other tables, or one that could not schedule the forward: this rank raises naming the
    ranks, broadcasts nothing and stays usable (the exchange completed: the group is consistent)."""
    alloc = small_allocation(3, 2, 0, num_blocks=8)
    transport = RecordingTransport(2, 0)
    with KVPPScheduler(alloc, transport) as sched:
        if peer == "other-tables":
            transport.peer_exchange = [forward_digest(True, [[1, 3]]), 0]
            match = r"ranks disagree on the forward's block tables .*rank 100: .*rank 101: "
        else:
            transport.peer_exchange = [0, 1]
            match = "rank 101 could not schedule this forward"
        with pytest.raises(RuntimeError, match=match):
            sched.begin_forward(True, [[1, 2]])
        assert transport.calls == [] and sched.pending_layer is None and sched.failed is None
        assert sched.counters.get("forwards_refused") == 1 and sched.counters.get("forwards") == 0
        transport.peer_exchange = None  # the peers agree again: the next forward runs
        sched.begin_forward(True, [[1, 2]])
        for layer in range(3):
            sched.wait_layer(layer)
        sched.end_forward()
        assert transport.layers == [0, 1, 2]


def test_bad_tables_are_reported_to_the_peers_before_raising() -> None:
    alloc = small_allocation(3, 2, 1, num_blocks=8)
    transport = RecordingTransport(2, 1)
    with KVPPScheduler(alloc, transport) as sched:
        with pytest.raises(ValueError, match="block 8, out of range"):
            sched.begin_forward(True, torch.tensor([[1, 8]]))
        assert transport.exchanges == [[0, 1]]  # took part, with status "could not schedule"
        assert sched.counters.get("forwards_refused") == 1


def test_a_peer_that_never_joins_fails_the_scheduler() -> None:
    alloc = small_allocation(3, 2, 1, num_blocks=8)
    transport = RecordingTransport(2, 1)
    with KVPPScheduler(alloc, transport, wait_timeout=0.5) as sched:
        transport.exchange_error = TimeoutError("the agreement exchange did not complete within 0.5 s")
        with pytest.raises(TimeoutError, match=r"within 0\.5 s; the scheduler is failed"):
            sched.begin_forward(True, [[1]])
        assert transport.calls == [] and sched.failed is not None
        transport.exchange_error = None
        with pytest.raises(TransferError, match="an earlier agreement exchange failed"):
            sched.begin_forward(True, [[1]])


def test_forward_digest_tells_forwards_apart() -> None:
    base = forward_digest(True, [[1, 2], [5]])
    assert base == forward_digest(True, [[1, 2], [5]]) == forward_digest(True, ([1, 2], (5,)))
    others = [
        forward_digest(False, [[1, 2], [5]]),
        forward_digest(True, [[1, 2, 5]]),
        forward_digest(True, [[1], [2, 5]]),
        forward_digest(True, [[1, 2], [6]]),
        forward_digest(True, None),
        forward_digest(True, torch.tensor([[1, 2], [5, -1]])),
    ]
    assert len({base, *others}) == 1 + len(others)
    t = torch.tensor([[1, 2], [5, -1]])
    assert (
        forward_digest(True, t) == forward_digest(True, t.int()) == forward_digest(True, t.T.contiguous().T)
    )
    assert forward_digest(True, t) != forward_digest(True, t.view(1, 4))
