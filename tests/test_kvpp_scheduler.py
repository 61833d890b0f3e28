"""KVPPScheduler in one process: prefetch order, scratch alternation, no-history forwards, failures."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from kvpp_helpers import RecordingTransport, small_allocation

from torch_kvoffload.device import TransferError
from torch_kvoffload.kvpp import KVPPScheduler
from torch_kvoffload.ops.kvpp import get_scheduler, registered_schedulers


def _run_forward(sched: KVPPScheduler, layers, *, history: bool) -> list[int | None]:
    pending = []
    sched.schedule_forward(history)
    pending.append(sched.pending_layer)
    for layer in layers:
        sched.wait_for_layer(layer)
        pending.append(sched.pending_layer)
    sched.complete_forward()
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
        bundle = alloc.spec(0).bytes_per_block * alloc.num_blocks
        for layer, owner, ptr, nbytes, after in transport.calls:
            assert owner == alloc.plan.owners[layer]
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
    sched.schedule_forward(True)
    timer = threading.Timer(0.2, transport.gate.set)
    timer.start()
    start = time.perf_counter()
    sched.wait_for_layer(0)
    assert time.perf_counter() - start >= 0.15
    assert sched.counters.get("wait_seconds") >= 0.15
    for layer in range(1, 5):
        sched.wait_for_layer(layer)
    sched.complete_forward()
    sched.close()


def test_failed_broadcast_raises_and_stops() -> None:
    alloc = small_allocation()
    transport = RecordingTransport(fail_layers=(2,))
    sched = KVPPScheduler(alloc, transport)
    sched.schedule_forward(True)
    sched.wait_for_layer(0)
    sched.wait_for_layer(1)
    with pytest.raises(TransferError, match="layer 2 failed: link down"):
        sched.wait_for_layer(2)
    assert transport.layers == [0, 1, 2]  # nothing submitted after the failure
    assert isinstance(sched.failed, RuntimeError)
    with pytest.raises(TransferError, match="earlier broadcast failed"):
        sched.wait_for_layer(3)
    sched.complete_forward()
    with pytest.raises(TransferError, match="earlier broadcast failed"):
        sched.schedule_forward(True)
    assert transport.layers == [0, 1, 2]
    sched.close()


def test_state_errors() -> None:
    alloc = small_allocation(drafts=(5,))
    transport = RecordingTransport()
    sched = KVPPScheduler(alloc, transport)
    with pytest.raises(RuntimeError, match="no forward scheduled"):
        sched.wait_for_layer(0)
    sched.schedule_forward(True)
    with pytest.raises(RuntimeError, match=r"already scheduled|still pending"):
        sched.schedule_forward(True)
    with pytest.raises(RuntimeError, match="out of order"):
        sched.wait_for_layer(1)
    with pytest.raises(KeyError, match="no KV cache"):
        sched.wait_for_layer(17)
    sched.wait_for_layer(5)  # draft: local, no-op
    assert sched.pending_layer == 0
    sched.wait_for_layer(0)
    # a forward that ends early: complete_forward finishes the pending prefetch
    assert sched.pending_layer == 1
    sched.complete_forward()
    assert sched.pending_layer is None
    # pending prefetch left over (complete_forward skipped) -> starting a forward is an error
    sched.schedule_forward(True)
    sched._in_forward = False  # simulate an engine that forgot complete_forward
    with pytest.raises(RuntimeError, match="prefetch of layer 0 is still pending"):
        sched.schedule_forward(True)
    sched._in_forward = True
    sched.complete_forward()
    sched.close()
    with pytest.raises(RuntimeError, match="closed"):
        sched.schedule_forward(False)


def test_prefetch_layer_is_idempotent_and_bounded() -> None:
    alloc = small_allocation()
    transport = RecordingTransport()
    sched = KVPPScheduler(alloc, transport)
    sched.schedule_forward(True)
    sched.prefetch_layer(0)  # already started by schedule_forward
    with pytest.raises(RuntimeError, match="not the next layer"):
        sched.prefetch_layer(2)
    sched.wait_for_layer(0)
    sched.prefetch_layer(1)
    sched.prefetch_layer(0)
    assert transport.layers == [0, 1]
    sched.complete_forward()
    sched.close()


def test_bundle_argument_is_checked() -> None:
    alloc = small_allocation()
    sched = KVPPScheduler(alloc, RecordingTransport())
    sched.schedule_forward(False)
    sched.wait_for_layer(0, list(alloc.views(0).values()))
    sched.wait_for_layer(1, [alloc.bundle_span(1)])
    with pytest.raises(ValueError, match="bundle of layer 2"):
        sched.wait_for_layer(2, [torch.zeros(3, 4, 15)])
    sched.complete_forward()
    sched.close()


def test_ranks_must_agree_before_the_first_forward() -> None:
    alloc = small_allocation()
    transport = RecordingTransport(peers_differ={"num_blocks": 99})
    sched = KVPPScheduler(alloc, transport)
    with pytest.raises(RuntimeError, match=r"disagree on num_blocks: rank 100: 3; rank 101: 99"):
        sched.schedule_forward(False)
    assert transport.calls == []
    sched.close()


def test_registration_by_name() -> None:
    alloc = small_allocation()
    sched = KVPPScheduler(alloc, RecordingTransport(), name="sched-test-reg")
    assert get_scheduler("sched-test-reg") is sched
    with pytest.raises(ValueError, match="already registered"):
        KVPPScheduler(small_allocation(), RecordingTransport(), name="sched-test-reg")
    sched.close()
    assert "sched-test-reg" not in registered_schedulers()


def test_wait_timeout_keeps_the_broadcast_pending() -> None:
    alloc = small_allocation()
    transport = RecordingTransport()
    sched = KVPPScheduler(alloc, transport, wait_timeout=0.05)
    transport.gate.clear()
    sched.schedule_forward(True)
    with pytest.raises(TimeoutError):
        sched.wait_for_layer(0)
    assert sched.pending_layer == 0 and sched.failed is None  # a collective in flight cannot be dropped
    transport.gate.set()
    for layer in range(5):
        sched.wait_for_layer(layer)
    sched.complete_forward()
    sched.close()


def test_transport_argument_checks() -> None:
    from torch_kvoffload.kvpp import BroadcastTransport, KVPPGroup, create_kvpp_group

    with pytest.raises(ValueError, match="needs a process group"):
        BroadcastTransport(KVPPGroup((0, 1), 0, 0))
    single = BroadcastTransport(KVPPGroup((3,), 0, 0))
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        single.broadcast(0, torch.zeros(4), 0)
    with pytest.raises(ValueError, match="owner id 1 out of range"):
        single.broadcast(0, torch.zeros(4, dtype=torch.uint8), 1)
    single.broadcast(0, torch.zeros(4, dtype=torch.uint8), 0).wait(5)  # a group of one: nothing to move
    assert single.all_gather_object({"a": 1}) == [{"a": 1}]
    single.close()
    with pytest.raises(RuntimeError, match="not initialised"):
        create_kvpp_group(1, 1, 1, 2, torch.device("cpu"))
