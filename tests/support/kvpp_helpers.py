"""Test helpers for KVPP: a recording transport, block runs written out, small allocations, and a bounded
local gloo launcher."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from torch_kvoffload.kvpp import BundleSpec, KVPPAllocation, KVPPGroup, KVPPPlan, assign_owners
from torch_kvoffload.transfer import TransferEvent, TransferStream


class SpyEvent:
    """A completed event that records how it was waited on (``"wait"`` or ``"wait_on_compute"``)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self, timeout: float | None = None) -> None:
        self.log.append("wait")

    def wait_on_compute(self) -> None:
        self.log.append("wait_on_compute")


class RecordingTransport:
    """Stands in for :class:`BroadcastTransport` in one process: records each broadcast (layer, owner,
    ``[(data_ptr, numel)]`` of its spans, ordering events) and runs a task on a real
    :class:`TransferStream`, which fails for ``fail_layers`` and, while ``gate`` is clear, blocks — so
    waits really wait. With ``device`` other than CPU it returns :class:`SpyEvent` s instead (what a
    device transport's events are waited with is then in ``wait_log``)."""

    def __init__(
        self,
        size: int = 2,
        rank: int = 0,
        fail_layers: tuple[int, ...] = (),
        peers_differ: dict | None = None,
        device: str = "cpu",
    ):
        self.group = KVPPGroup(tuple(range(100, 100 + size)), rank, 0)
        self.device = torch.device(device)
        self.stream = TransferStream("kvpp-test", torch.device("cpu"))
        self.calls: list[tuple[int, int, list[tuple[int, int]], tuple[TransferEvent, ...]]] = []
        self.fail_layers = set(fail_layers)
        self.gate = threading.Event()
        self.gate.set()
        self.peers_differ = peers_differ or {}
        self.wait_log: list[str] = []
        self.exchanges: list[list[int]] = []
        self.peer_exchange: list[int] | None = None
        self.exchange_error: BaseException | None = None
        self.closed = False

    def broadcast(self, layer, spans, owner, after=(), *, seconds=None):
        self.calls.append((layer, owner, [(s.data_ptr(), s.numel()) for s in spans], tuple(after)))
        if self.device.type != "cpu":
            return SpyEvent(self.wait_log)

        def run() -> None:
            start = time.perf_counter()
            if not self.gate.wait(10):
                raise TimeoutError("gate never opened")
            if layer in self.fail_layers:
                raise RuntimeError(f"link down during layer {layer}")
            if seconds is not None:
                seconds(time.perf_counter() - start)

        return self.stream.submit(run, after=after)

    def all_gather_object(self, obj):
        others = [{**obj, **self.peers_differ} for _ in range(self.group.size - 1)]
        return [obj, *others]

    def exchange(self, values):
        """Every peer sends what ``peer_exchange`` holds (default: the same as this rank); a set
        ``exchange_error`` is raised instead (a peer that never joins). Records what this rank sent."""
        self.exchanges.append(list(values))
        if self.exchange_error is not None:
            raise self.exchange_error
        peer = list(values) if self.peer_exchange is None else list(self.peer_exchange)
        out = [peer] * self.group.size
        out[self.group.local_rank] = list(values)
        return out

    def close(self) -> None:
        self.closed = True
        self.stream.close()

    @property
    def layers(self) -> list[int]:
        return [c[0] for c in self.calls]


def consecutive_runs(blocks: set[int]) -> list[tuple[int, int]]:
    """The sorted ``blocks`` as half-open runs ``[(start, stop), ...]`` of consecutive ids, written out
    independently of :func:`~torch_kvoffload.kvpp.block_runs`."""
    out: list[tuple[int, int]] = []
    for b in sorted(blocks):
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out


SMALL_BLOCK_SIZE = 4
SMALL_DIMS = {"c_kv": 16, "k_pe": 8, "index_k": 8}  # fp32, per token


def small_spec() -> BundleSpec:
    return BundleSpec.mla(SMALL_BLOCK_SIZE, 16, 8, torch.float32, index_dim=8, index_dtype=torch.float32)


def small_allocation(
    num_layers: int = 5, size: int = 2, rank: int = 0, drafts: tuple[int, ...] = (), num_blocks: int = 3
) -> KVPPAllocation:
    spec = small_spec()
    layers = list(range(num_layers))
    owners = assign_owners(layers, size)
    plan = KVPPPlan(
        dict.fromkeys(layers, spec.bytes_per_block), owners, rank, spec.bytes_per_block * len(drafts)
    )
    return KVPPAllocation(plan, dict.fromkeys(layers, spec), num_blocks, "cpu", dict.fromkeys(drafts, spec))


# ------------------------------------------------------------------------------------ process launcher


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, args: tuple) -> None:
    import torch.distributed as dist

    from support.gloo import init_gloo

    torch.set_num_threads(1)
    init_gloo(rank, world, port, 60.0)
    try:
        fn(rank, world, *args)
        # no rank tears its gloo context down while a peer still exchanges with it (an abort in gloo's
        # threads: "terminate called without an active exception")
        dist.barrier()
    except BaseException:
        raise RuntimeError(f"rank {rank}:\n{traceback.format_exc()}") from None
    finally:
        dist.destroy_process_group()
    # A rank that passed leaves without the interpreter's finalisation: gloo's and the store's C++ threads
    # were seen aborting the process there (SIGABRT after every check had passed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_gloo(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes joined by gloo on 127.0.0.1.

    The processes fork from the test session's forkserver, which imported torch, transformers and the
    package once (:func:`support.pd_helpers.hf_context`): a rank starts in milliseconds instead of importing
    for seconds, and inherits no thread of the test process. Raises the first failing rank's error (with its
    traceback); terminates every process and raises ``TimeoutError`` when they are not done within
    ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    from support.gloo import master_store
    from support.pd_helpers import hf_context

    hf_context()  # the forkserver's preload, set before the server starts
    store = master_store(timeout)  # served here until the ranks are done
    ctx = mp.start_processes(
        _entry, args=(fn, world, store.port, args), nprocs=world, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)
            raise TimeoutError(f"spawn_gloo: {world} ranks still running after {timeout} s")


class LoopbackTransport(RecordingTransport):
    """A :class:`RecordingTransport` that moves data: for a layer this rank does not own, each span
    receives the bytes at the same offsets of ``sources[layer]`` (``uint8``, the remote owner's bundle),
    on the transfer stream — a one-process stand-in for the owner's broadcast."""

    def __init__(self, allocation: KVPPAllocation, sources: dict[int, torch.Tensor], size: int = 2) -> None:
        super().__init__(size, allocation.plan.rank)
        self.allocation = allocation
        self.sources = sources

    def broadcast(self, layer, spans, owner, after=(), *, seconds=None):
        self.calls.append((layer, owner, [(s.data_ptr(), s.numel()) for s in spans], tuple(after)))
        if owner == self.group.local_rank:
            return self.stream.submit(lambda: None, after=after)
        base = self.allocation.bundle_span(layer).data_ptr()

        def run() -> None:
            for s in spans:
                offset = s.data_ptr() - base
                s.copy_(self.sources[layer][offset : offset + s.numel()])

        return self.stream.submit(run, after=after)
