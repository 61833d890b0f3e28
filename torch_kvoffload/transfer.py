"""The one transfer interface: every byte the library moves between memories goes through it.

Every runtime moves data through :class:`TransferStream` and orders work with :class:`TransferEvent`:

* On an accelerator (CUDA, or Ascend NPU through ``torch_npu``) a transfer stream is a ``torch.Stream``
  plus a host worker thread: the worker runs the submitted host-side work (store lookups, bookkeeping)
  with the stream current, so the copies it issues are enqueued on the stream, then records an event
  after them. The submitting (compute) thread never blocks on a copy; waiting from compute makes the
  compute stream wait on the event (``wait_on_compute``) — never a whole-device ``synchronize()``.
* On CPU there are no streams: each transfer stream owns a worker thread that runs submitted work in
  order. The C++ kernels release the GIL, so a copy in flight really overlaps compute on the caller's
  thread, and several streams have several copies in flight.
* ``submit(..., inline=True)`` on a CPU stream with nothing in flight and every dependency complete runs the
  work at once on the caller's thread (a host-to-host copy of a few rows costs less than the thread round
  trip it would otherwise wait for); otherwise it is queued as usual, so ordering never changes.

Events are polled with :meth:`TransferEvent.query` and waited on with :meth:`TransferEvent.wait` (host) or
:meth:`TransferEvent.wait_on_compute` (the compute stream).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.device import accelerator_type, default_device, set_thread_intraop_threads

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "TransferError",
    "TransferEvent",
    "TransferStream",
    "record_compute_event",
    "submit_split",
]


class TransferError(RuntimeError):
    """Work submitted to a transfer stream failed; raised by every waiter on its event."""


# -------------------------------------------------------------------------------------------- events


class TransferEvent:
    """Completion of work on a transfer stream (or of compute up to a point).

    ``wait()`` blocks the calling host thread until the work finished and raises :class:`TransferError`
    if it failed. ``wait_on_compute()`` orders the current compute stream after the event: on an
    accelerator without blocking the host, on CPU by blocking (compute runs on the caller's thread).
    A waiter of work submitted with :func:`submit_split` first runs, on its own thread, the parts no
    worker has started yet (untimed waits only), instead of idling while they wait for a worker.
    """

    __slots__ = ("_assist", "_device_event", "_error", "_finished", "_gate")
    _setting = threading.Lock()  # makes "finish once" atomic when two threads race to finish an event

    def __init__(self, *, device_event: Any = None) -> None:
        # A lock held until the work finished: waiters pass through it one after the other. Cheaper to
        # make and to wait on than a threading.Event, and runtimes make one per transfer.
        self._gate = threading.Lock()
        self._gate.acquire()
        self._finished = False
        self._error: BaseException | None = None
        self._device_event = device_event
        self._assist: Callable[[], None] | None = None  # runs unclaimed parts (submit_split)

    @classmethod
    def completed(cls) -> TransferEvent:
        ev = cls()
        ev.set_done()
        return ev

    @classmethod
    def issued(cls, device_event: Any) -> TransferEvent:
        """Work already enqueued on a device stream, ``device_event`` recorded after it: done on the host,
        ``wait_on_compute`` makes the compute stream wait on the device event."""
        ev = cls(device_event=device_event)
        ev.set_done()
        return ev

    @classmethod
    def failed(cls, error: BaseException) -> TransferEvent:
        ev = cls()
        ev.set_error(error)
        return ev

    def set_done(self) -> None:
        """Settle a pending event as succeeded (for completions that arrive from outside a stream, such as
        a peer's answer); the first outcome stays, a later one is ignored."""
        self._finish(None)

    def set_error(self, error: BaseException) -> None:
        """Settle a pending event as failed with ``error`` (waiters raise :class:`TransferError`)."""
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        with TransferEvent._setting:
            if self._finished:  # the first outcome stays
                return
            self._error = error
            self._finished = True
        self._gate.release()

    def _wait_finished(self, timeout: float | None = None) -> bool:
        """Block until the work finished (successfully or not); False on timeout (``<= 0``: no wait)."""
        if self._finished:
            return True
        if timeout is None:
            assist = self._assist
            if assist is not None:
                assist()  # the parts nobody started run here; returns once every part was claimed
            got = self._gate.acquire()
        elif timeout <= 0:
            got = self._gate.acquire(False)
        else:
            got = self._gate.acquire(timeout=timeout)
        if not got:
            return self._finished
        self._gate.release()
        return True

    @property
    def error(self) -> BaseException | None:
        """The failure of the submitted work, once it has failed."""
        return self._error

    def query(self) -> bool:
        """True once the work finished (successfully or not); never blocks."""
        if not self._finished:
            return False
        if self._device_event is not None and self._error is None:
            return bool(self._device_event.query())
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Block until the work finished; raise :class:`TransferError` if it failed."""
        if not self._wait_finished(timeout):
            raise TimeoutError(f"transfer did not complete within {timeout} s")
        if self._error is not None:
            raise TransferError(f"transfer failed: {self._error}") from self._error
        if self._device_event is not None:
            self._device_event.synchronize()

    def succeeded(self) -> bool:
        """True once the work finished without error on the host and there is no device work left to
        order after (waiting would return at once); never blocks."""
        return self._finished and self._error is None and self._device_event is None

    def wait_on_compute(self) -> None:
        """Order subsequent compute after this event (raises if the work failed)."""
        self._wait_finished()
        if self._error is not None:
            raise TransferError(f"transfer failed: {self._error}") from self._error
        if self._device_event is not None:
            torch.accelerator.current_stream().wait_event(self._device_event)


# One finished event for what is done when asked (CPU compute, synchronous on the caller's thread; inline
# work that succeeded): a finished event never changes, its first outcome stays
_FINISHED = TransferEvent.completed()


def record_compute_event() -> TransferEvent:
    """An event marking everything submitted to the compute stream so far.

    Pass it as ``after=`` to :meth:`TransferStream.submit` to order a transfer after compute that reads
    or writes its buffers. On CPU compute is synchronous on the caller's thread, so it is already done.
    """
    if accelerator_type() == "cpu":
        return _FINISHED
    ev = torch.Event(default_device())
    ev.record(torch.accelerator.current_stream())
    return TransferEvent.issued(ev)


# ------------------------------------------------------------------------------------------- streams


class TransferStream:
    """An in-order queue of transfers that runs concurrently with compute.

    ``submit(fn, *args, after=events)`` runs ``fn(*args)`` after every event in ``after`` completed and
    after all work submitted earlier to this stream; it returns a :class:`TransferEvent`. If ``fn`` raises,
    or an event in ``after`` failed, the returned event carries the error and later work still runs.

    Counters: ``submitted``, ``completed``, ``failed``, ``busy_seconds``.
    """

    def __init__(self, name: str = "transfer", device: torch.device | None = None) -> None:
        self.name = name
        self.device = device if device is not None else default_device()
        self.counters = Counters(["submitted", "completed", "failed", "busy_seconds", "inline"])
        self._closed = False
        # work queued and not finished; inline work runs only when it is 0 (so order never changes), and
        # _order is held while any work runs, on the worker or inline
        self._lock = threading.Lock()
        self._in_flight = 0
        self._order = threading.Lock()
        # On an accelerator the worker enqueues onto this stream; on CPU there is none (the worker copies).
        self._stream = None if self.device.type == "cpu" else torch.Stream(self.device)
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], TransferEvent, tuple, float] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._worker, name=f"kvoffload-{name}", daemon=True)
        self._thread.start()

    # -- worker thread (CPU: runs the copies; accelerator: enqueues them on the stream)
    def _worker(self) -> None:
        # Copies on this thread run on it alone: an intra-op team per transfer thread would compete with
        # the compute threads for the cores the overlap is meant to leave them.
        set_thread_intraop_threads(1)
        if self._stream is not None:
            # the current stream is per thread: every copy this worker issues goes to the transfer stream
            torch.accelerator.set_device_index(self.device.index)
            torch.accelerator.set_stream(self._stream)
        q = self._queue
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                item = q.get()  # idle until new work
                if item is not None and item[3] > 0:
                    # the submitter is starting its next op right now; let it through first
                    time.sleep(item[3])
            if item is None:
                return
            fn, event, after, _ = item
            with self._order:
                self._run(fn, event, after)
            with self._lock:
                self._in_flight -= 1

    def _run(self, fn: Callable[[], None], event: TransferEvent, after: Sequence[TransferEvent]) -> None:
        start = time.perf_counter()
        try:
            if self._stream is None:
                for dep in after:
                    dep.wait()
                fn()
            else:
                for dep in after:  # host side: the dependency was issued; device side: a stream wait
                    dep._wait_finished()
                    if dep.error is not None:
                        raise TransferError(f"dependency failed: {dep.error}") from dep.error
                    if dep._device_event is not None:
                        self._stream.wait_event(dep._device_event)
                fn()
                device_event = torch.Event(self.device)
                device_event.record(self._stream)
                event._device_event = device_event
        except BaseException as exc:  # delivered to waiters, not lost in the worker thread
            self.counters.add("failed")
            logger.debug("transfer on %s failed: %s", self.name, exc)
            event.set_error(exc)
        else:
            self.counters.add("completed")
            event.set_done()
        finally:
            self.counters.add("busy_seconds", time.perf_counter() - start)

    def submit(
        self,
        fn: Callable[..., None],
        *args: Any,
        after: Sequence[TransferEvent] = (),
        wake_delay: float = 0.0,
        inline: bool = False,
        **kwargs: Any,
    ) -> TransferEvent:
        """Enqueue ``fn(*args, **kwargs)``; return the event that completes when it has run.

        ``inline``: on a CPU stream with no work in flight and every event in ``after`` finished, run
        ``fn`` now on the calling thread (the returned event is finished, carrying ``fn``'s error if it
        raised); otherwise queue it as without ``inline``. For host-to-host copies on a step's critical
        path, where the hand-off to the worker thread costs more than the copy.

        ``wake_delay`` (seconds, CPU only): when the worker was idle, it waits this long (GIL released)
        before running ``fn``. For work submitted by a thread that goes on computing: torch ops take
        the GIL for a moment right after they start (tensor reference counts), and a worker woken by
        the submit would otherwise take it first and make the op wait for its Python.
        """
        if self._closed:
            raise RuntimeError(f"transfer stream {self.name!r} is closed")
        with self._lock:
            now = inline and self._stream is None and self._in_flight == 0 and all(d.query() for d in after)
            self._in_flight += 1
        if now:
            return self._run_inline(fn, args, kwargs)
        self.counters.add("submitted")
        call = functools.partial(fn, *args, **kwargs) if kwargs else (lambda: fn(*args))
        event = TransferEvent()
        self._queue.put((call, event, tuple(after), wake_delay if self._stream is None else 0.0))
        return event

    def _run_inline(self, fn: Callable[..., None], args: tuple, kwargs: dict[str, Any]) -> TransferEvent:
        """``fn(*args, **kwargs)`` on the calling thread (CPU stream, nothing in flight, ``after`` done;
        counted in flight by the caller): a decode step's host copies take this path once per layer, so
        it makes no event or closure unless ``fn`` fails."""
        start = time.perf_counter()
        try:
            with self._order:
                fn(*args, **kwargs)
        except BaseException as exc:  # delivered to waiters, as from the worker
            logger.debug("transfer on %s failed: %s", self.name, exc)
            outcome, event = "failed", TransferEvent.failed(exc)
        else:
            outcome, event = "completed", _FINISHED
        finally:
            with self._lock:
                self._in_flight -= 1
        self.counters.add_many({"submitted": 1, "inline": 1, outcome: 1,
                                "busy_seconds": time.perf_counter() - start})  # fmt: skip
        return event

    def synchronize(self) -> None:
        """Block until all work submitted so far has run (errors stay with their events)."""
        barrier = self.submit(lambda: None)
        barrier._wait_finished()
        if barrier._device_event is not None:
            barrier._device_event.synchronize()

    def close(self) -> None:
        """Finish queued work and stop the worker thread; idempotent."""
        if self._closed:
            return
        self.synchronize()
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> TransferStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------- split work


class _SplitJob:
    """One piece of work cut into contiguous parts that stream workers and waiters claim in turn."""

    __slots__ = (
        "_bounds",
        "_done",
        "_errors",
        "_left",
        "_lock",
        "_next",
        "_part",
        "_results",
        "after",
        "event",
    )

    def __init__(
        self,
        n: int,
        parts: int,
        part: Callable[[int, int], Any],
        after: tuple[TransferEvent, ...],
        done: Callable[[list[Any], BaseException | None], None] | None,
    ) -> None:
        self._bounds = [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]
        self._part = part
        self._done = done
        self.after = after
        self._lock = threading.Lock()
        self._next = 0
        self._left = parts
        self._results: list[Any] = [None] * parts
        self._errors: list[BaseException | None] = [None] * parts
        self.event = TransferEvent()

    def drain(self) -> None:
        """Run on a stream's worker or a waiter: claim and run parts until none is left (never raises)."""
        blocked: BaseException | None = None
        try:
            for dep in self.after:
                dep.wait()
        except BaseException as exc:  # a failed dependency fails the parts this thread claims
            blocked = exc
        while True:
            with self._lock:
                i = self._next
                if i == len(self._bounds):
                    return
                self._next = i + 1
            if blocked is not None:
                self._errors[i] = blocked
            else:
                try:
                    self._results[i] = self._part(*self._bounds[i])
                except BaseException as exc:  # delivered through the event
                    self._errors[i] = exc
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self._finish()

    def _finish(self) -> None:
        self.event._assist = None  # nothing left to claim; drop the job's references
        error = next((e for e in self._errors if e is not None), None)
        try:
            if self._done is not None:
                self._done(self._results, error)
        except BaseException as exc:
            error = exc
        if error is not None:
            logger.debug("split transfer failed: %s", error)
            self.event.set_error(error)
        else:
            self.event.set_done()


def submit_split(
    streams: Sequence[TransferStream],
    n: int,
    part: Callable[[int, int], T],
    *,
    after: Sequence[TransferEvent] = (),
    done: Callable[[list[T], BaseException | None], None] | None = None,
    parts: int | None = None,
) -> TransferEvent:
    """Run one transfer of ``n`` items as ``part(begin, end)`` calls on CPU transfer streams and on the
    thread that waits for it, at once.

    ``range(n)`` is cut into ``max(1, min(parts, n))`` contiguous parts (``parts`` defaults to one per
    stream; ``n = 0``: one empty part). Each of the first ``min(len(streams), parts)`` streams' workers,
    once the events in ``after`` completed and the work submitted to it earlier ran, claims the next
    part nobody runs yet until none is left, and so does any thread that waits for the returned event
    without a timeout (``wait``, ``wait_on_compute``) before it blocks: idle workers and the waiter
    share the work, a busy worker leaves its share to the others. For work a thread waits for at once,
    whose core would otherwise idle; workers copy on one intra-op thread, a waiter on its own setting.
    Only ``after`` orders the parts: a waiter may run them before work submitted earlier to the streams.

    The returned event completes once every part ran. ``done(results, error)`` (optional) is then called
    once, on the thread that finished the last part, with the parts' results in order and the first failure in
    part order (``None`` if every part succeeded; a failed dependency counts as the failure of every
    part); what ``done`` raises becomes the event's error, else the event carries ``error``. Every part
    runs even when another failed, so the event never completes while a part is still running.
    """
    if not streams:
        raise ValueError("submit_split: 'streams' must hold at least one TransferStream")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"submit_split: 'n' must be an int >= 0, got {n!r}")
    if parts is None:
        parts = len(streams)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"submit_split: 'parts' must be an int >= 1, got {parts!r}")
    if any(s._stream is not None for s in streams):
        raise ValueError("submit_split: every stream must be a CPU transfer stream (worker thread)")
    job = _SplitJob(n, max(1, min(parts, n)), part, tuple(after), done)
    job.event._assist = job.drain
    for stream in streams[: len(job._bounds)]:
        stream.submit(job.drain)
    return job.event
