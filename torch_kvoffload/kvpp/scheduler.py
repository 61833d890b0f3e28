"""One-layer-ahead broadcast prefetch of KVPP bundles.

Per forward (the engine calls these on every rank of the group, with the same arguments):

* :meth:`KVPPScheduler.begin_forward` — takes the forward's block tables; with history, start the
  first target layer's broadcast at once; without history (first prefill, dummy / profiling runs)
  nothing is broadcast in this forward. A broadcast moves only the blocks the forward reads: the union of
  its block tables in a few contiguous runs (:func:`~torch_kvoffload.kvpp.blocks.block_runs`), one span
  per run and component, so traffic follows the tokens, not the pool.
* :meth:`KVPPScheduler.wait_layer` — after the layer's projections and before its first KV read or
  write: wait for the layer's broadcast, then start the next target layer's. The next layer's destination
  is the other scratch buffer (index among target layers % 2), last read by the layer before this one,
  whose compute is done; the broadcast is still ordered after a compute event. On CPU the caller blocks;
  on an accelerator the compute stream waits on the broadcast's event (no host synchronize).
* :meth:`KVPPScheduler.prefetch_layer` — start a layer's broadcast explicitly (idempotent).
* :meth:`KVPPScheduler.end_forward` — finish a pending broadcast (a forward may end early) and reset.

The owner of a layer also waits for its broadcast: the owner's persistent buffer is the source, and
attention must not write the layer's new rows into it while peers are still reading it. Draft / MTP
layers are local: waiting on them is a no-op.

A failed broadcast raises :class:`~torch_kvoffload.transfer.TransferError` from ``wait_layer`` (or
``end_forward``); the scheduler is then failed — nothing further is submitted and every later call
raises. Before the first forward, the ranks exchange their plans (``all_gather_object``) and refuse to run
when layouts, owners or block counts differ.

Agreement per forward: before anything is broadcast, ``begin_forward`` all-gathers from every rank a
fingerprint of its ``has_history`` flag and block tables and whether it could schedule the forward (its
arguments were valid). A rank with bad arguments still takes part, then raises its own error; its peers
raise ``RuntimeError`` naming it; ranks whose fingerprints differ all raise ``RuntimeError`` naming each
rank's. Nothing is broadcast then and the group stays consistent: the next forward may proceed. The
exchange is bounded by ``wait_timeout`` (through the transport): a peer that never joins makes it raise
``TimeoutError``, and the scheduler is failed (the group holds an unfinished collective).

Counters: ``broadcasts`` issued (one per layer), ``broadcast_spans`` (collectives), ``bytes_broadcast``,
``broadcast_seconds`` (the broadcasts' time on the transfer thread: on CPU the serial broadcast time, so
``1 - wait_seconds / broadcast_seconds`` is the share of it hidden behind compute), ``waits``,
``wait_seconds``, ``forwards``, ``forwards_with_history``, ``forwards_refused`` (by the agreement: a
mismatch or a rank that could not schedule the forward, counted on every rank).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.counters import Counters
from torch_kvoffload.kvpp.allocation import KVPPAllocation
from torch_kvoffload.kvpp.blocks import BlockTables, block_runs, forward_digest
from torch_kvoffload.kvpp.transport import BroadcastTransport
from torch_kvoffload.ops import sync_copies
from torch_kvoffload.ops.kvpp import runtimes
from torch_kvoffload.transfer import TransferError, TransferEvent, record_compute_event

logger = logging.getLogger(__name__)

__all__ = ["KVPPScheduler"]


class KVPPScheduler:
    """Drives the bundle broadcasts of one rank.

    Parameters
    ----------
    allocation : the rank's buffers (its ``plan`` gives owners and target order).
    transport : broadcasts over the group (:class:`BroadcastTransport` or anything with its interface:
        ``group``, ``device``, ``broadcast``, ``all_gather_object``, ``exchange``, ``close``). Its
        ``device`` says what a wait does: host blocking on CPU, a compute-stream wait on an accelerator.
        It bounds its own collectives (``BroadcastTransport(timeout=...)``; :func:`~torch_kvoffload.kvpp.build.build_kvpp_runtime`
        passes ``wait_timeout_s``).
    name : if given, register in :data:`torch_kvoffload.ops.kvpp.runtimes` under this name for
        ``torch.ops.kvoffload.kvpp_*``; unregistered by :meth:`close`.
    wait_timeout : seconds a wait on CPU blocks before raising ``TimeoutError`` (``None``: forever).
    max_runs : at most this many block runs per broadcast (``None``: one per contiguous run of the
        forward's blocks); see :func:`~torch_kvoffload.kvpp.blocks.block_runs`.
    """

    def __init__(
        self,
        allocation: KVPPAllocation,
        transport: BroadcastTransport,
        *,
        name: str | None = None,
        wait_timeout: float | None = None,
        max_runs: int | None = None,
    ) -> None:
        if wait_timeout is not None and not wait_timeout > 0:
            raise ValueError(f"KVPPScheduler: wait_timeout must be positive or None, got {wait_timeout!r}")
        if max_runs is not None:
            max_runs = check_int("KVPPScheduler", "max_runs", max_runs, minimum=1)
        self.allocation = allocation
        self.plan = allocation.plan
        self.transport = transport
        self.name = name
        self.wait_timeout = wait_timeout
        self.max_runs = max_runs
        self.counters = Counters(
            [
                "broadcasts",
                "broadcast_spans",
                "bytes_broadcast",
                "broadcast_seconds",
                "waits",
                "wait_seconds",
                "forwards",
                "forwards_with_history",
                "forwards_refused",
            ]
        )
        self._stream_waits = torch.device(transport.device).type != "cpu"
        self._targets = self.plan.target_layers
        self._verified = False
        self._in_forward = False
        self._has_history = False
        self._runs: list[tuple[int, int]] | None = None  # this forward's block runs; None: every block
        self._next = 0  # index in target layers of the next broadcast to start
        self._current: int | None = None  # the target layer waited last in this forward
        self._pending: tuple[int, TransferEvent] | None = None
        self._failed: BaseException | None = None
        self._failed_what = "broadcast"  # what failed: a broadcast or the agreement exchange
        self._closed = False
        if name is not None:
            runtimes.register(name, self)

    # --------------------------------------------------------------------------------------- agreement

    def _description(self) -> dict[str, Any]:
        alloc = self.allocation
        return {
            "owners": sorted(self.plan.owners.items()),
            "layouts": sorted((layer, spec.describe()) for layer, spec in alloc.bundles.items()),
            "draft_layouts": sorted((layer, spec.describe()) for layer, spec in alloc.draft_bundles.items()),
            "num_blocks": alloc.num_blocks,
            "max_runs": self.max_runs,  # different budgets would cut different runs: mismatched collectives
            "group_ranks": list(self.transport.group.ranks),
        }

    def verify_agreement(self) -> None:
        """Check that every rank of the group has the same owners, layouts and block count (collective)."""
        mine = self._description()
        everyone = self.transport.all_gather_object(mine)
        ranks = self.transport.group.ranks
        for key in mine:
            values = [d[key] for d in everyone]
            if any(v != values[0] for v in values[1:]):
                per_rank = "; ".join(f"rank {r}: {v}" for r, v in zip(ranks, values, strict=True))
                raise RuntimeError(f"KVPP ranks disagree on {key}: {per_rank}")
        self._verified = True

    # ----------------------------------------------------------------------------------------- forward

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"KVPPScheduler.{what}: the scheduler is closed")
        if self._failed is not None:
            raise TransferError(
                f"KVPPScheduler.{what}: an earlier {self._failed_what} failed: {self._failed}"
            ) from self._failed

    def begin_forward(self, has_history: bool, block_tables: BlockTables | None = None) -> None:
        """Begin a forward; with history, start the first target layer's broadcast now.

        Parameters
        ----------
        has_history : whether any request of the forward has computed tokens (cached KV to read).
        block_tables : the physical blocks the forward reads — an integer tensor (any shape, ``-1``
            padding, e.g. ``[num_requests, max_blocks]``) or one sequence of block ids per request. Only
            their union, in contiguous runs, is broadcast. ``None``: every block of the pool (traffic
            then grows with the pool). Every rank of the group must pass the same tables.

        Collective: the ranks first agree on the forward (see the module docstring). Raises this rank's
        ``TypeError`` / ``ValueError`` for bad tables, ``RuntimeError`` when a peer could not schedule the
        forward or the ranks' tables differ (nothing broadcast, nothing changed: the next forward may
        proceed), ``TimeoutError`` when a peer did not join within ``wait_timeout``.
        """
        self._check_usable("begin_forward")
        if self._pending is not None:
            raise RuntimeError(
                f"KVPPScheduler.begin_forward: the prefetch of layer {self._pending[0]} is still pending; "
                "call end_forward() first"
            )
        if self._in_forward:
            raise RuntimeError("KVPPScheduler.begin_forward: a forward is already scheduled")
        if not self._verified:
            self.verify_agreement()
        runs, digest, error = None, 0, None
        try:
            if block_tables is not None:
                runs = block_runs(block_tables, self.allocation.num_blocks, max_runs=self.max_runs)
            digest = forward_digest(bool(has_history), block_tables)
        except (TypeError, ValueError) as exc:
            error = type(exc)(f"KVPPScheduler.begin_forward: {exc}")
        except Exception as exc:  # still tell the peers, then raise it unchanged
            error = exc
        self._agree_on_forward(digest, error)
        self._in_forward = True
        # a forward whose tables hold no block has nothing to fetch, like one without history
        self._has_history = bool(has_history) and (runs is None or len(runs) > 0)
        self._runs = runs
        self._next = 0
        self._current = None
        self.counters.add("forwards")
        if has_history:
            self.counters.add("forwards_with_history")
        if self._has_history and self._targets:
            self._start(self._targets[0])

    def _agree_on_forward(self, digest: int, error: BaseException | None) -> None:
        """All-gather ``[digest, status]`` (status 1: this rank could not schedule the forward); raise
        ``error`` here, and on every rank when a rank failed or the digests differ."""
        where = "KVPPScheduler.begin_forward"
        try:
            everyone = self.transport.exchange([digest, int(error is not None)])
        except TimeoutError as exc:
            self._failed, self._failed_what = exc, "agreement exchange"
            if error is not None:
                raise error from exc
            raise TimeoutError(
                f"{where}: {exc}; the scheduler is failed (the group holds an unfinished collective)"
            ) from exc
        except Exception as exc:
            self._failed, self._failed_what = exc, "agreement exchange"
            if error is not None:
                raise error from exc
            raise TransferError(f"{where}: the agreement exchange failed: {exc}") from exc
        ranks = self.transport.group.ranks
        failed = [r for r, (_, status) in zip(ranks, everyone, strict=True) if status]
        digests = [d for d, _ in everyone]
        if error is None and not failed and all(d == digests[0] for d in digests):
            return
        self.counters.add("forwards_refused")
        if error is not None:
            raise error
        if failed:
            who = "rank" if len(failed) == 1 else "ranks"
            raise RuntimeError(
                f"{where}: {who} {', '.join(map(str, failed))} could not schedule this forward (see the error "
                "raised there); nothing was broadcast, the next forward may proceed"
            )
        per_rank = ", ".join(f"rank {r}: {d & (2**64 - 1):016x}" for r, d in zip(ranks, digests, strict=True))
        raise RuntimeError(
            f"{where}: the KVPP ranks disagree on the forward's block tables or has_history (fingerprint per "
            f"rank: {per_rank}); every rank of the group must schedule the same forward. Nothing was "
            "broadcast, the next forward may proceed"
        )

    @property
    def block_runs(self) -> list[tuple[int, int]] | None:
        """The current forward's block runs ``[(start, stop), ...]`` (``None``: every block)."""
        return None if self._runs is None else list(self._runs)

    def _start(self, layer: int) -> None:
        index = self.plan.target_index(layer)
        assert index == self._next and self._pending is None
        spans = self.allocation.run_spans(layer, self._runs)
        nbytes = sum(s.numel() for s in spans)
        event = self.transport.broadcast(
            layer,
            spans,
            self.plan.owners[layer],
            after=[record_compute_event()],
            seconds=self._broadcast_took,
        )
        self._pending = (layer, event)
        self._next = index + 1
        logger.debug(
            "KVPP broadcast of layer %d (%d bytes in %d spans) from owner %d",
            layer,
            nbytes,
            len(spans),
            self.plan.owners[layer],
        )
        self.counters.add("broadcasts")
        self.counters.add("broadcast_spans", len(spans))
        self.counters.add("bytes_broadcast", nbytes)

    def _check_bundle(
        self, what: str, layer: int, bundle: Sequence[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        """The layer's own tensors matching ``bundle`` (component views, or ``[byte span]``)."""
        if bundle is None:
            return None
        views = list(self.allocation.views(layer).values())
        span = self.allocation.bundle_span(layer)
        expected = [(tuple(v.shape), v.dtype, v.device) for v in views]
        got = [(tuple(t.shape), t.dtype, t.device) for t in bundle]
        if got == expected:
            return views
        if got == [(tuple(span.shape), span.dtype, span.device)]:
            return [span]
        raise ValueError(
            f"KVPPScheduler.{what}: bundle of layer {layer} must be its component tensors "
            f"{[e[:2] for e in expected]} on {span.device} (or its byte span), got {got}"
        )

    @staticmethod
    def _sync_into(bundle: Sequence[torch.Tensor] | None, own: list[torch.Tensor] | None) -> None:
        """Copy the layer's cache into the given tensors that are not the cache itself (a functionalizing
        backend passes copies; the graph reads those, so they must hold what the broadcast wrote)."""
        if bundle is not None and own is not None:
            sync_copies(bundle, own)

    def _broadcast_took(self, seconds: float) -> None:
        self.counters.add("broadcast_seconds", seconds)

    def _wait_pending(self, what: str) -> None:
        assert self._pending is not None
        layer, event = self._pending
        start = time.perf_counter()
        try:
            if self._stream_waits:
                event.wait_on_compute()  # the compute stream waits on the broadcast; the host goes on
            else:
                event.wait(self.wait_timeout)
        except TransferError as exc:
            self._failed = exc.__cause__ or exc
            self._pending = None
            raise TransferError(
                f"KVPPScheduler.{what}: broadcast of layer {layer} failed: {self._failed}"
            ) from exc
        finally:
            self.counters.add("waits")
            self.counters.add("wait_seconds", time.perf_counter() - start)
        self._pending = None

    def _hook_layer(self, what: str, layer: int) -> bool:
        """The checks :meth:`wait_layer` and :meth:`prefetch_layer` share (usable, in a forward, a layer
        with a cache on this rank); whether ``layer`` is a target layer (else a draft / MTP layer)."""
        self._check_usable(what)
        if not self._in_forward:
            raise RuntimeError(f"KVPPScheduler.{what}: no forward scheduled (call begin_forward first)")
        if self.plan.is_target(layer):
            return True
        if layer not in self.allocation.draft_bundles:
            raise KeyError(f"KVPPScheduler.{what}: layer {layer} has no KV cache on this rank")
        return False

    def wait_layer(self, layer: int, bundle: Sequence[torch.Tensor] | None = None) -> None:
        """Wait for ``layer``'s broadcast (owners wait for their send), then start the next layer's.

        ``bundle`` (optional): the tensors the caller reads — the layer's component views
        (:meth:`KVPPAllocation.views` order) or its byte span, or copies of them (a functionalizing
        backend), which then receive the layer's cache. On CPU a wait blocks (at most ``wait_timeout``);
        on an accelerator the compute stream waits on the broadcast's event. Waiting again for the layer
        waited last (a graph that places the wait twice) only refreshes ``bundle``.
        """
        if not self._hook_layer("wait_layer", layer):
            self._sync_into(bundle, self._check_bundle("wait_layer", layer, bundle))
            return
        own = self._check_bundle("wait_layer", layer, bundle)
        if self._has_history and layer != self._current:
            index = self.plan.target_index(layer)
            if self._pending is None or self._pending[0] != layer:
                expected = self._pending[0] if self._pending is not None else None
                raise RuntimeError(
                    f"KVPPScheduler.wait_layer: layer {layer} (target #{index}) waited out of order; "
                    f"the pending broadcast is for layer {expected}"
                )
            self._wait_pending("wait_layer")
            self._current = layer
            nxt = self.plan.next_target(layer)
            if nxt is not None:
                self._start(nxt)
        self._sync_into(bundle, own)

    def prefetch_layer(self, layer: int, bundle: list[torch.Tensor] | None = None) -> None:
        """Start ``layer``'s broadcast if it is the next one and not started yet; otherwise a no-op.

        ``wait_layer`` already starts the next layer, so this only matters for graphs that place the
        prefetch explicitly. Asking for a layer beyond the next one is an error (only one is in flight).
        """
        if not self._hook_layer("prefetch_layer", layer):
            return
        self._check_bundle("prefetch_layer", layer, bundle)
        if not self._has_history:
            return
        index = self.plan.target_index(layer)
        if index < self._next:
            return  # started already (pending or finished)
        if index > self._next or self._pending is not None:
            raise RuntimeError(
                f"KVPPScheduler.prefetch_layer: layer {layer} is not the next layer to prefetch "
                f"(next: {self._targets[self._next] if self._next < len(self._targets) else None})"
            )
        self._start(layer)

    def end_forward(self) -> None:
        """End the forward: finish any broadcast still in flight, then reset the layer cursor."""
        if self._closed:
            raise RuntimeError("KVPPScheduler.end_forward: the scheduler is closed")
        try:
            if self._pending is not None:
                self._wait_pending("end_forward")
        finally:
            self._in_forward = False
            self._has_history = False
            self._runs = None
            self._current = None
            self._next = 0

    @property
    def pending_layer(self) -> int | None:
        return None if self._pending is None else self._pending[0]

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    def close(self) -> None:
        """Finish in-flight work, stop the transfer thread and unregister; idempotent."""
        if self._closed:
            return
        if self._pending is not None:
            try:
                self._pending[1].wait(self.wait_timeout)
            except (TransferError, TimeoutError) as exc:
                logger.warning("KVPP broadcast of layer %s failed during close: %s", self._pending[0], exc)
            self._pending = None
        self._closed = True
        self.transport.close()
        if self.name is not None:
            runtimes.unregister(self.name)

    def __enter__(self) -> KVPPScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
