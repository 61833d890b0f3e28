"""The device layer: detection, pinned host memory, transfer streams and events (CPU worker threads)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from support.op_impls import requires_cpp

from torch_kvoffload import device, transfer
from torch_kvoffload.transfer import TransferError, TransferEvent, TransferStream


def test_cpu_detection_and_host_memory() -> None:
    assert device.accelerator_type() == "cpu"
    assert device.default_device() == torch.device("cpu")
    assert not device.pin_memory_enabled()
    t = device.empty_host((3, 4), torch.bfloat16)
    assert t.shape == (3, 4) and t.dtype == torch.bfloat16 and not t.is_pinned()
    assert torch.count_nonzero(device.zeros_host((5,), torch.float32)) == 0


@pytest.mark.parametrize("failure", [ImportError, RuntimeError])
def test_npu_probe_is_guarded(tmp_path, monkeypatch, failure: type[Exception]) -> None:
    """A torch_npu that fails to import (missing, or installed without CANN) just means 'no NPU'."""
    (tmp_path / "torch_npu.py").write_text(f"raise {failure.__name__}('no CANN here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    device.probe_npu.cache_clear()
    try:
        assert device.probe_npu() is False
    finally:
        device.probe_npu.cache_clear()


def test_submit_is_asynchronous_and_ordered() -> None:
    release = threading.Event()
    order: list[int] = []
    with TransferStream("t") as stream:
        first = stream.submit(lambda: (release.wait(10), order.append(1)))
        second = stream.submit(order.append, 2)
        # the caller is not blocked while the first transfer is in flight
        assert not first.query() and not second.query()
        release.set()
        second.wait(10)
        assert first.query() and order == [1, 2]
        assert stream.counters.get("completed") == 2


def test_two_streams_have_two_transfers_in_flight() -> None:
    """Both tasks must be running at the same moment for the barrier to open."""
    barrier = threading.Barrier(2, timeout=10)
    with TransferStream("a") as a, TransferStream("b") as b:
        ea, eb = a.submit(barrier.wait), b.submit(barrier.wait)
        ea.wait(15)
        eb.wait(15)


@requires_cpp
def test_two_copies_overlap_in_time() -> None:
    """Two large copy_rows calls on two streams run at the same time (the kernel releases the GIL).

    If the copies were serialised — one worker, or a kernel holding the GIL — the second copy could not
    start before the first ended.
    """
    src = torch.randn(2048, 64, 128)
    n = src.shape[0] * src.shape[1]
    dsts = [torch.empty_like(src), torch.empty_like(src)]
    perm = torch.randperm(n)
    barrier = threading.Barrier(2, timeout=10)
    spans: dict[int, tuple[float, float]] = {}

    def copy(i: int) -> None:
        barrier.wait()
        start = time.perf_counter()
        for _ in range(4):
            torch.ops.kvoffload.copy_rows(src, dsts[i], perm, torch.arange(n))
        spans[i] = (start, time.perf_counter())

    with TransferStream("a") as a, TransferStream("b") as b:
        events = [a.submit(copy, 0), b.submit(copy, 1)]
        for ev in events:
            ev.wait(60)
    (s0, e0), (s1, e1) = spans[0], spans[1]
    assert s0 < e1 and s1 < e0, spans
    assert torch.equal(dsts[0], dsts[1])


def test_after_orders_across_streams() -> None:
    gate = threading.Event()
    log: list[str] = []
    with TransferStream("a") as a, TransferStream("b") as b:
        ea = a.submit(lambda: (gate.wait(10), log.append("a")))
        eb = b.submit(log.append, "b", after=[ea])
        time.sleep(0.05)
        assert log == []  # b waits for a
        gate.set()
        eb.wait(10)
        assert log == ["a", "b"]


def test_errors_reach_every_waiter_and_dependants() -> None:
    def boom() -> None:
        raise OSError("disk on fire")

    with TransferStream("t") as stream:
        failed = stream.submit(boom)
        dependant = stream.submit(lambda: None, after=[failed])
        later = stream.submit(lambda: None)
        for waiter in (failed.wait, failed.wait_on_compute, dependant.wait):
            with pytest.raises(TransferError, match="disk on fire"):
                waiter()
        later.wait(10)  # the stream keeps working after a failure
        assert isinstance(failed.error, OSError)
        assert stream.counters.get("failed") == 2


def test_completed_event_and_compute_event() -> None:
    TransferEvent.completed().wait()
    transfer.record_compute_event().wait_on_compute()
    with pytest.raises(TransferError):
        TransferEvent.failed(ValueError("x")).wait()
    ev = TransferEvent()
    with pytest.raises(TimeoutError):
        ev.wait(timeout=0.01)


def test_closed_stream_rejects_work() -> None:
    stream = TransferStream("t")
    stream.close()
    stream.close()
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(lambda: None)


@requires_cpp
def test_cpp_copy_releases_the_gil() -> None:
    """While a large copy_rows runs on the transfer thread, Python code keeps running on this thread."""
    src = torch.randn(4096, 128, 64)
    dst = torch.empty_like(src)
    n = src.shape[0] * src.shape[1]
    slots = torch.randperm(n)
    window: dict[str, float] = {}

    def copy() -> None:
        window["start"] = time.perf_counter()
        for _ in range(3):
            torch.ops.kvoffload.copy_rows(src, dst, slots, torch.arange(n))
        window["end"] = time.perf_counter()

    ticks: list[float] = []
    with TransferStream("t") as stream:
        ev = stream.submit(copy)
        while not ev.query():
            ticks.append(time.perf_counter())
        ev.wait()
    inside = [t for t in ticks if window["start"] < t < window["end"]]
    duration = window["end"] - window["start"]
    # with the GIL held for the whole copy this thread could not tick at all inside the window
    assert len(inside) > 100, (len(inside), duration)
    assert torch.equal(dst.view(n, 64)[torch.arange(n)], src.view(n, 64)[slots])


def test_host_pools_are_advised_to_use_huge_pages() -> None:
    big = device.empty_host((8, 1 << 20), torch.uint8)  # 8 MiB
    small = torch.empty(1024)
    if sys.platform.startswith("linux"):
        assert device.advise_huge_pages(big)
    assert not device.advise_huge_pages(small)
    big.fill_(7)
    assert int(big.sum()) == 7 * big.numel()


def test_event_releases_every_waiter_once_set() -> None:
    ev = TransferEvent()
    assert not ev.query() and not ev.succeeded()
    released = []
    waiters = [threading.Thread(target=lambda: (ev.wait(10), released.append(1))) for _ in range(4)]
    for w in waiters:
        w.start()
    time.sleep(0.02)
    assert released == []
    ev.set_done()
    ev.set_done()  # setting twice is harmless
    for w in waiters:
        w.join(10)
    assert released == [1] * 4 and ev.query() and ev.succeeded()
    ev.wait(0)  # and later waits return at once
    failed = TransferEvent.failed(OSError("x"))
    assert failed.query() and not failed.succeeded()


@requires_cpp
def test_transfer_threads_copy_on_one_intraop_thread() -> None:
    """A CPU transfer stream's worker runs its kernels with one intra-op thread, whatever the process-wide
    count; the calling thread keeps its own."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        with TransferStream("t") as stream:
            stream.submit(lambda: seen.append(torch.get_num_threads())).wait(10)
        assert seen == [1]
        assert torch.get_num_threads() == 2
        seen.clear()
        worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        worker.start()
        worker.join(10)
        assert seen == [2]  # other new threads still get the process-wide count
    finally:
        torch.set_num_threads(before)


def test_wake_delay_holds_back_an_idle_worker_only() -> None:
    """Work submitted with wake_delay to an idle CPU worker starts no earlier than the delay; results,
    order and errors are those of a plain submit."""
    delay = 0.05
    with TransferStream("t") as stream:
        stream.synchronize()  # idle
        log = []
        t0 = time.perf_counter()
        first = stream.submit(lambda: log.append(("a", time.perf_counter())), wake_delay=delay)
        second = stream.submit(lambda: log.append(("b", time.perf_counter())), wake_delay=delay)
        failed = stream.submit(lambda: 1 / 0, after=[second], wake_delay=delay)
        first.wait(10)
        second.wait(10)
        with pytest.raises(TransferError, match="division by zero"):
            failed.wait(10)
        assert [name for name, _ in log] == ["a", "b"]
        assert log[0][1] - t0 >= delay


def test_event_finishes_once_and_short_timeouts_do_not_block() -> None:
    ev = TransferEvent()
    for timeout in (0, -1.0, 0.001):
        with pytest.raises(TimeoutError):
            ev.wait(timeout=timeout)
    ev.set_error(OSError("first"))
    ev.set_done()  # a later outcome does not replace the first
    with pytest.raises(TransferError, match="first"):
        ev.wait(0)
    racing = [TransferEvent() for _ in range(200)]
    setters = [
        threading.Thread(target=lambda f=f: [f(ev) for ev in racing])
        for f in (TransferEvent.set_done, lambda ev: ev.set_error(OSError("x")))
    ]
    for t in setters:
        t.start()
    for t in setters:
        t.join(10)
    for ev in racing:  # each finished exactly once, and waiting returns at once
        assert ev.query()
        ev._wait_finished(0)


# ------------------------------------------------------------------------------------- submit_split


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 13])
def test_submit_split_runs_each_part_once_and_reports_once(n: int, workers: int) -> None:
    """range(n) is cut into max(1, min(workers, n)) contiguous parts, each run exactly once; done sees the
    results in part order, once, with no error."""
    streams = [TransferStream(f"s{i}") for i in range(workers)]
    try:
        calls, lock, reports = [], threading.Lock(), []

        def part(begin: int, end: int) -> list[int]:
            with lock:
                calls.append((begin, end))
            return list(range(begin, end))

        ev = transfer.submit_split(
            streams, n, part, done=lambda results, error: reports.append((results, error))
        )
        ev.wait(10)
        parts = max(1, min(workers, n))
        assert sorted(calls) == [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]
        assert len(reports) == 1 and reports[0][1] is None
        assert [x for r in reports[0][0] for x in r] == list(range(n))
        for s in streams:
            s.synchronize()
        assert len(reports) == 1  # a worker that found nothing left to claim reports nothing
    finally:
        for s in streams:
            s.close()


def test_submit_split_parts_run_at_once_on_idle_workers() -> None:
    """Both halves must be running at the same moment for the barrier to open: two threads, not one."""
    barrier = threading.Barrier(2, timeout=10)
    names = set()
    with TransferStream("a") as a, TransferStream("b") as b:

        def part(begin: int, end: int) -> None:
            names.add(threading.current_thread().name)
            barrier.wait()

        transfer.submit_split([a, b], 8, part).wait(15)
    assert names == {"kvoffload-a", "kvoffload-b"}


def test_submit_split_busy_worker_leaves_its_share_to_the_others() -> None:
    release = threading.Event()
    with TransferStream("busy") as busy, TransferStream("idle") as idle:
        blocked = busy.submit(release.wait, 10)
        names = []
        ev = transfer.submit_split(
            [busy, idle], 4, lambda begin, end: names.append((begin, end, threading.current_thread().name))
        )
        ev.wait(10)  # completes while the busy worker is still blocked
        assert not blocked.query()
        assert [(b, e) for b, e, _ in names] == [(0, 2), (2, 4)]
        assert {name for _, _, name in names} == {"kvoffload-idle"}
        release.set()


def test_submit_split_failure_of_one_part_fails_the_event_after_every_part_ran() -> None:
    gate = threading.Event()
    started = threading.Event()
    reports = []
    with TransferStream("a") as a, TransferStream("b") as b:

        def part(begin: int, end: int) -> int:
            if begin == 0:
                started.wait(10)  # the other half is running
                raise OSError("first half failed")
            started.set()
            gate.wait(10)
            return end - begin

        ev = transfer.submit_split(
            [a, b], 6, part, done=lambda results, error: reports.append((results, error))
        )
        started.wait(10)
        time.sleep(0.05)
        assert not ev.query()  # the second half is still running: the buffer is still being written
        gate.set()
        with pytest.raises(TransferError, match="first half failed"):
            ev.wait(10)
    assert len(reports) == 1
    results, error = reports[0]
    assert isinstance(error, OSError) and results == [None, 3]


def test_submit_split_done_and_dependencies_decide_the_outcome() -> None:
    with TransferStream("a") as a, TransferStream("b") as b:
        # what done raises becomes the event's error
        def fail_done(results, error):
            raise ValueError(f"missing {sum(results)}")

        ev = transfer.submit_split([a, b], 4, lambda begin, end: end - begin, done=fail_done)
        with pytest.raises(TransferError, match="missing 4"):
            ev.wait(10)
        # a failed dependency fails every part without running it
        ran, reports = [], []
        ev = transfer.submit_split(
            [a, b],
            4,
            lambda begin, end: ran.append(begin),
            after=[TransferEvent.failed(OSError("dependency lost"))],
            done=lambda results, error: reports.append(error),
        )
        with pytest.raises(TransferError, match="dependency lost"):
            ev.wait(10)
        assert ran == [] and len(reports) == 1 and isinstance(reports[0], TransferError)
        # ordered after its dependencies, like submit
        gate = TransferEvent()
        order = []
        ev = transfer.submit_split([a, b], 2, lambda begin, end: order.append(begin), after=[gate])
        time.sleep(0.05)
        assert order == [] and not ev.query()
        gate.set_done()
        ev.wait(10)
        assert sorted(order) == [0, 1]
        with pytest.raises(ValueError, match="'streams' must hold at least one"):
            transfer.submit_split([], 1, lambda begin, end: None)
        for bad in (-1, True, 1.0):
            with pytest.raises(ValueError, match="'n' must be an int >= 0"):
                transfer.submit_split([a], bad, lambda begin, end: None)  # type: ignore[arg-type]


def test_submit_split_waiter_runs_the_parts_no_worker_started() -> None:
    """More parts than streams: the thread that waits (untimed) runs the unclaimed ones itself; a timed
    wait never runs work and times out while the only worker is busy."""
    release = threading.Event()
    with TransferStream("busy") as busy:
        blocked = busy.submit(release.wait, 10)
        names, reports = [], []
        ev = transfer.submit_split(
            [busy],
            5,
            lambda begin, end: names.append((begin, end, threading.current_thread().name)),
            done=lambda results, error: reports.append(error),
            parts=2,
        )
        with pytest.raises(TimeoutError):
            ev.wait(timeout=0.05)
        assert names == []
        ev.wait()  # runs both parts here: the worker is still blocked
        me = threading.current_thread().name
        assert names == [(0, 2, me), (2, 5, me)] and reports == [None]
        assert not blocked.query()
        release.set()
        busy.synchronize()  # the worker's turn finds nothing left to claim
        assert len(names) == 2 and len(reports) == 1
        with pytest.raises(ValueError, match="'parts' must be an int >= 1"):
            transfer.submit_split([busy], 4, lambda begin, end: None, parts=0)


requires_accelerator = pytest.mark.skipif(
    device.accelerator_type() == "cpu", reason="needs an accelerator (CUDA / NPU)"
)


@requires_accelerator
def test_device_stream_copies_run_on_the_transfer_stream_and_compute_waits_on_its_event() -> None:
    """On an accelerator: submit returns at once (the worker enqueues the copy on the transfer stream);
    compute ordered with wait_on_compute sees the copied data without a device synchronize."""
    dev = device.default_device()
    host = torch.randn(4096, 1024).pin_memory()
    dst = torch.empty(4096, 1024, device=dev)
    streams_seen = []
    with TransferStream("h2d", dev) as stream:

        def copy() -> None:
            streams_seen.append(torch.accelerator.current_stream())
            dst.copy_(host, non_blocking=True)

        ev = stream.submit(copy, after=[transfer.record_compute_event()])
        ev.wait_on_compute()
        total = dst.sum()  # queued on the compute stream after the event
        assert streams_seen and streams_seen[0] != torch.accelerator.current_stream()
        torch.testing.assert_close(total.cpu(), host.sum(), rtol=1e-4, atol=1e-2)


@requires_accelerator
def test_device_stream_failure_reaches_every_waiter() -> None:
    dev = device.default_device()
    with TransferStream("h2d", dev) as stream:
        ev = stream.submit(lambda: (_ for _ in ()).throw(ValueError("boom")))
        with pytest.raises(TransferError, match="boom"):
            ev.wait_on_compute()
        with pytest.raises(TransferError, match="boom"):
            ev.wait()
        ok = stream.submit(lambda: None, after=[ev])
        with pytest.raises(TransferError, match="dependency failed"):
            ok.wait()


def test_inline_submit_runs_on_the_caller_only_when_the_stream_is_idle() -> None:
    """``inline=True``: an idle CPU stream runs the work at once on the calling thread; with work in
    flight (or a dependency pending) it is queued behind it, so the order of a stream never changes."""
    with TransferStream("inline", torch.device("cpu")) as stream:
        caller = threading.get_ident()
        ran_on: list[int] = []
        ev = stream.submit(lambda: ran_on.append(threading.get_ident()), inline=True)
        assert ev.query() and ev.succeeded() and ran_on == [caller]
        assert stream.counters.snapshot()["inline"] == 1

        gate = threading.Event()
        order: list[str] = []
        first = stream.submit(lambda: (gate.wait(10), order.append("queued")))
        second = stream.submit(lambda: order.append("inline"), inline=True)
        assert not second.query()  # queued behind the blocked work, not run now
        gate.set()
        second.wait(10)
        first.wait(10)
        assert order == ["queued", "inline"]

        pending = TransferEvent()
        third = stream.submit(lambda: order.append("after"), after=[pending], inline=True)
        assert not third.query()  # its dependency is not finished: queued
        pending.set_done()
        third.wait(10)
        assert order[-1] == "after"

        def boom() -> None:
            raise ValueError("inline failure")

        failed = stream.submit(boom, inline=True)
        assert failed.query() and isinstance(failed.error, ValueError)
        with pytest.raises(TransferError):
            failed.wait(1)
        assert stream.submit(lambda: order.append("again"), inline=True).succeeded()
        snap = stream.counters.snapshot()
        assert snap["inline"] == 3 and snap["failed"] == 1
        assert snap["submitted"] == snap["completed"] + snap["failed"] == 6
