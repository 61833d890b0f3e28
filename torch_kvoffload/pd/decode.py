"""Decode side of P/D transfer: one decode TP rank's endpoint — pair with prefill ranks, pull each
layer-ready batch into the destinations, answer.

Destinations (:mod:`~torch_kvoffload.pd.decode_destinations`): main KV in the decode host pool (shared by
the DP rank's TP ranks — decode TP rank ``t`` receives the ``t``-th contiguous share of a request's
blocks), indexer components in rank-local (device) caches — every decode TP rank receives a request's
whole indexer, its prefill members each sending a disjoint block range.

Per request and rank, a transfer is complete when every layer was received from every member of the
rank's contribution group (``ratio = prefill_tp_size // decode_tp_size`` members; a member with nothing
to send still sends an empty batch). A request is schedulable only when it is complete on every TP rank
of its DP rank (:func:`~torch_kvoffload.pd.decode_state.all_ranks_ready`).

Threads: the control endpoint's I/O thread (:mod:`torch_kvoffload.pd.control`) runs the message
callbacks, which never block; every byte that moves — a batch pulled into the destinations, a failed
request's destinations zeroed — moves on the rank's read :class:`~torch_kvoffload.transfer.TransferStream`,
in arrival order. A request's waiters wait on its :class:`~torch_kvoffload.transfer.TransferEvent`.

Safety: only peers that proved the shared secret are heard. A batch is validated completely before any
read (:mod:`~torch_kvoffload.pd.decode_reads`). A failed validation, a read failing after
``read_retries`` retries, a peer silent for ``heartbeat_interval_s * heartbeat_misses`` or saying BYE
mid-transfer invalidates the request: its destinations are zeroed, its waiters raise, and prefill gets
READ_FAILED. A batch that does not belong to the live request it names is refused (READ_FAILED to its
sender) and leaves the request alone. An unexpected error handling a batch fails the requests it names and
is answered; the read stream keeps serving. :meth:`DecodeReceiver.release` waits for a read in flight, so
a late write can never land in a destination that was handed out again. If the control thread stops,
every pending request fails at once.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Sequence

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.counters import Counters
from torch_kvoffload.pd.auth import resolve_secret
from torch_kvoffload.pd.config import PDConfig, decode_rank_of, split_range
from torch_kvoffload.pd.control import ControlEndpoint
from torch_kvoffload.pd.decode_destinations import Destinations
from torch_kvoffload.pd.decode_reads import Refuse, Reject, plan_reads
from torch_kvoffload.pd.decode_state import PENDING, ExpectedRequest, PrefillPeer
from torch_kvoffload.pd.errors import PDTransferError
from torch_kvoffload.pd.messages import (
    Bye,
    Compatibility,
    Heartbeat,
    Hello,
    HelloAck,
    LayerReady,
    Message,
    ProtocolError,
    ReadDone,
    ReadFailed,
)
from torch_kvoffload.pd.rendezvous import Rendezvous, decode_key, make_rendezvous
from torch_kvoffload.pd.ticket import TicketPart
from torch_kvoffload.pd.transports import ReadOp, Transport, TransportError, make_transport
from torch_kvoffload.sparse.host_pool import HostKVPool
from torch_kvoffload.transfer import TransferStream

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "DecodeReceiver"]

COUNTER_NAMES = (
    "layers_received",  # layer-ready batches read and acknowledged
    "bytes_received",
    "read_seconds",
    "read_retries",
    "read_failures",  # batches answered with READ_FAILED that failed their requests
    "batches_refused",  # batches answered with READ_FAILED that named no live request of the sender
    "requests_done",
    "requests_failed",
    "handshakes",
    "handshakes_rejected",
    "peers_dead",
)

_CLOSE_WAIT_S = 5.0  # how long close() waits for a read in flight before leaving it to its thread


class DecodeReceiver:
    """One decode TP rank's endpoint: binds its control port, advertises it, pulls layers into ``pool``
    (main KV) and ``indexer`` (per layer a tuple of ``[num_blocks, block_size, *row]`` tensors, or
    ``None`` for a layer without indexer; ``None``: no indexer at all).

    ``compat`` must describe this rank's caches (:func:`~torch_kvoffload.pd.compat.make_compatibility`).
    Counters: :data:`COUNTER_NAMES`.
    """

    def __init__(
        self,
        config: PDConfig,
        *,
        pool: HostKVPool,
        compat: Compatibility,
        dp_rank: int = 0,
        tp_rank: int = 0,
        indexer: Sequence[Sequence[torch.Tensor] | None] | None = None,
        transport: Transport | None = None,
        rendezvous: Rendezvous | None = None,
    ) -> None:
        where = "DecodeReceiver"
        if not isinstance(config, PDConfig) or config.role != "decode":
            raise ValueError(f"{where}: needs a PDConfig with role='decode', got {config!r:.120}")
        self.config = config
        self.dp_rank = check_int(where, "dp_rank", dp_rank, minimum=0, maximum=config.decode_dp_size - 1)
        self.tp_rank = check_int(where, "tp_rank", tp_rank, minimum=0, maximum=config.decode_tp_size - 1)
        self._dest = Destinations(where, pool, compat, indexer)
        self.pool, self.compat = pool, compat
        self.num_layers, self.block_size = pool.num_layers, pool.block_size
        self.counters = Counters(COUNTER_NAMES)
        self.transport = transport if transport is not None else make_transport(config, rank_name=self.name)
        self._own_transport = transport is None
        self._dest.register(self.transport)
        self._lock = threading.Lock()
        self._peers: dict[bytes, PrefillPeer] = {}
        self._requests: dict[int, ExpectedRequest] = {}
        self.handshake_errors: list[str] = []
        self._closed = False
        self._last_beat = 0.0
        self.port = config.port(self.dp_rank, self.tp_rank)
        self.endpoint = f"tcp://{config.host}:{self.port}"
        # host work: the transport copies into host (or registered device) memory itself, and staged
        # indexer blocks go to the device on the default stream, ordered before decode's compute
        self._reads = TransferStream(f"{self.name}-read", device=torch.device("cpu"))
        try:
            self.rendezvous = rendezvous if rendezvous is not None else make_rendezvous(config)
            self._control = ControlEndpoint(
                "router",
                self.endpoint,
                secret=resolve_secret(config, self.rendezvous),
                on_message=self._on_message,
                on_tick=self._on_tick,
                on_protocol_error=self._on_protocol_error,
                on_down=self._on_control_down,
                max_message_bytes=config.max_message_bytes,
                name=self.name,
            )
        except BaseException:
            self._reads.close()
            if self._own_transport:
                self.transport.close()
            raise
        self._key = decode_key(config.kv_port, self.dp_rank, self.tp_rank)
        self.rendezvous.publish(
            self._key,
            {"endpoint": self.endpoint, "dp_rank": self.dp_rank, "tp_rank": self.tp_rank,
             "d_tp": config.decode_tp_size, "d_dp": config.decode_dp_size, "transport": config.transport,
             "pid": os.getpid()},
        )  # fmt: skip
        logger.info("%s listening on %s (transport %s)", self.name, self.endpoint, self.transport.name)

    @property
    def name(self) -> str:
        return f"pd-decode[dp{self.dp_rank},tp{self.tp_rank}]"

    # ------------------------------------------------------------------------------- requests
    def expect(
        self, request_id: int, num_tokens: int, main_blocks: Sequence[int], indexer_blocks: Sequence[int] = ()
    ) -> TicketPart:
        """Announce that ``request_id``'s ``num_tokens`` tokens will arrive into pool blocks ``main_blocks``
        (the request's host-pool block table, shared by the DP rank's TP ranks) and this rank's indexer
        blocks ``indexer_blocks`` (required when the rank has indexer destinations). Returns this rank's
        ticket part for :meth:`TransferTicket.combine`."""
        where = "DecodeReceiver.expect"
        request_id = check_int(where, "request_id", request_id, minimum=0)
        num_tokens = check_int(where, "num_tokens", num_tokens, minimum=1)
        main_blocks, indexer_blocks = [int(b) for b in main_blocks], [int(b) for b in indexer_blocks]
        nb = math.ceil(num_tokens / self.block_size)
        if len(main_blocks) != nb:
            raise ValueError(f"{where}: {num_tokens} tokens need {nb} main blocks, got {len(main_blocks)}")
        if len(set(main_blocks)) != nb or any(not 0 <= b < self.pool.num_blocks for b in main_blocks):
            raise ValueError(
                f"{where}: main blocks must be distinct and in [0, {self.pool.num_blocks}): {main_blocks}"
            )
        if self._dest.has_indexer:
            cap = self._dest.indexer_capacity
            if len(indexer_blocks) != nb or len(set(indexer_blocks)) != nb:
                raise ValueError(f"{where}: need {nb} distinct indexer blocks, got {indexer_blocks}")
            if any(not 0 <= b < cap for b in indexer_blocks):
                raise ValueError(f"{where}: indexer blocks must be in [0, {cap}): {indexer_blocks}")
        elif indexer_blocks:
            raise ValueError(f"{where}: this rank has no indexer destinations, got indexer blocks")
        lo, hi = split_range(nb, self.config.decode_tp_size, self.tp_rank)
        if self._control.error is not None:
            raise PDTransferError(f"{self.name}: cannot receive request {request_id}: {self._control.error}")
        with self._lock:
            old = self._requests.get(request_id)
            if old is not None and old.state == PENDING:
                raise ValueError(f"{where}: request {request_id} is already expected; release() it first")
            # random, not counted: a peer cannot name a generation it was not given in the ticket
            generation = secrets.randbits(62)
            while old is not None and generation == old.generation:
                generation = secrets.randbits(62)
            req = ExpectedRequest(
                request_id, generation, num_tokens, main_blocks[lo:hi], (lo, hi), indexer_blocks
            )
            self._requests[request_id] = req
        return TicketPart(self.tp_rank, req.generation, tuple(indexer_blocks))

    def _request(self, request_id: int) -> ExpectedRequest:
        with self._lock:
            req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"{self.name}: unknown request {request_id}")
        return req

    def state(self, request_id: int) -> str:
        """``"pending"``, ``"done"`` or ``"failed"`` on this rank (``KeyError`` if unknown)."""
        return self._request(request_id).state

    def error(self, request_id: int) -> str:
        with self._lock:
            req = self._requests.get(request_id)
        return "" if req is None else req.error

    def wait_request(self, request_id: int, timeout: float | None = None) -> None:
        """Block until the request is complete on this rank; :class:`PDTransferError` if it failed,
        ``TimeoutError`` after ``timeout`` seconds."""
        self._request(request_id).wait(self.name, self.num_layers * self.config.ratio, timeout)

    def release(self, request_id: int) -> None:
        """Forget the request (its destinations may be reused): waits for a read of it in flight; a later
        batch for it is refused."""
        with self._lock:
            req = self._requests.pop(request_id, None)
        if req is None:
            return
        with req.lock:  # no read of it in flight after this
            req.fail("released before the transfer completed")

    def _invalidate(self, req: ExpectedRequest, reason: str) -> None:
        """Mark the request failed now (waiters raise) and zero its destinations on the read stream."""
        if req.fail(reason):
            self.counters.add("requests_failed")
            self._reads.submit(self._zero, req)

    # ------------------------------------------------------------------------------ control
    def _reply(self, peer: bytes, msg: Message) -> None:
        """Send a reply to a prefill peer (a seam tests use to drop acknowledgements)."""
        self._control.send(msg, peer)

    def _on_protocol_error(self, peer: bytes, exc: ProtocolError) -> None:
        self._reply(peer, ReadFailed(-1, -1, [], f"{self.name}: undecodable message: {exc}"))

    def _on_control_down(self, reason: str) -> None:
        with self._lock:
            victims = [r for r in self._requests.values() if r.state == PENDING]
        for req in victims:
            self._invalidate(req, f"{self.name}: {reason}; request {req.request_id} cannot be received")

    def _on_message(self, peer: bytes, msg: Message) -> None:
        known = self._peers.get(peer)
        if known is not None:
            known.last_seen = time.monotonic()
        if isinstance(msg, Hello):
            self._on_hello(peer, msg)
        elif isinstance(msg, LayerReady):
            self._reads.submit(self._receive, peer, msg)
        elif isinstance(msg, Bye) and known is not None:
            self._peer_gone(known, f"said BYE ({msg.reason})")

    def _on_hello(self, peer: bytes, msg: Hello) -> None:
        cfg = self.config
        reasons = [f"compatibility {m}" for m in self.compat.mismatches(msg.compat)]
        if (msg.p_tp, msg.d_tp) != (cfg.prefill_tp_size, cfg.decode_tp_size):
            reasons.append(
                f"topology p_tp={msg.p_tp}, d_tp={msg.d_tp} != ours p_tp={cfg.prefill_tp_size}, d_tp={cfg.decode_tp_size}"
            )
        elif (
            not 0 <= msg.p_rank < cfg.prefill_tp_size
            or decode_rank_of(msg.p_rank, cfg.prefill_tp_size, cfg.decode_tp_size)[0] != self.tp_rank
        ):
            reasons.append(f"prefill rank {msg.p_rank} does not send to decode TP rank {self.tp_rank}")
        if msg.transport != self.transport.name:
            reasons.append(f"transport {msg.transport!r} != ours {self.transport.name!r}")
        remote = None
        if not reasons:
            try:
                remote = self.transport.connect(msg.regions, f"prefill rank {msg.p_rank}")
            except Exception as exc:  # whatever a peer's description makes the transport raise
                reasons.append(f"cannot open its regions: {type(exc).__name__}: {exc}")
        if reasons:
            reason = f"{self.name} rejects prefill rank {msg.p_rank}: " + "; ".join(reasons)
            logger.error("%s", reason)
            self.handshake_errors.append(reason)
            self.counters.add("handshakes_rejected")
            self._reply(peer, HelloAck(False, reason, self.tp_rank, cfg.decode_tp_size))
            return
        member = decode_rank_of(msg.p_rank, cfg.prefill_tp_size, cfg.decode_tp_size)[1]
        self._peers[peer] = PrefillPeer(
            peer, msg.p_rank, member, remote, msg.num_blocks, msg.slots, time.monotonic()
        )
        self.counters.add("handshakes")
        self._reply(peer, HelloAck(True, "", self.tp_rank, cfg.decode_tp_size))

    def _on_tick(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= self.config.heartbeat_interval_s:
            self._last_beat = now
            for p in list(self._peers.values()):
                if p.alive:
                    self._control.send(Heartbeat(time.time()), p.identity)
        for p in list(self._peers.values()):
            silent = now - p.last_seen
            if p.alive and silent > self.config.dead_after_s:
                self._peer_gone(p, f"silent for {silent:.1f} s (no heartbeat)")

    def _peer_gone(self, peer: PrefillPeer, why: str) -> None:
        peer.alive = False
        self._peers.pop(peer.identity, None)
        self._control.forget(peer.identity)
        self.counters.add("peers_dead")
        with self._lock:
            # a peer that already delivered every layer of its part is no longer needed by the request
            victims = [
                r for r in self._requests.values()
                if r.state == PENDING and peer.identity in r.peers
                and sum(1 for _, m in r.done if m == peer.member) < self.num_layers
            ]  # fmt: skip
        for req in victims:
            layers = sorted({layer for layer, m in req.done if m == peer.member})
            self._invalidate(
                req,
                f"prefill rank {peer.p_rank} (member {peer.member}) {why}; request {req.request_id} had "
                f"received layers {_ranges(layers)} of {self.num_layers} from it",
            )
        if victims:
            logger.error("%s: prefill rank %d %s; invalidated requests %s", self.name, peer.p_rank, why,
                         [r.request_id for r in victims])  # fmt: skip

    # ----------------------------------------------------------------------------- read stream
    def _receive(self, identity: bytes, msg: LayerReady) -> None:
        """Handle one batch on the read stream; an unexpected error fails the live requests it names and
        is answered, instead of leaving the sender to its deadline."""
        try:
            self._handle_layer(identity, msg)
        except Exception as exc:
            logger.exception("%s: layer work failed", self.name)
            reason = f"{self.name}: layer {msg.layer} failed unexpectedly: {type(exc).__name__}: {exc}"
            with self._lock:
                reqs = [self._requests.get(e.request_id) for e in msg.entries]
            for e, req in zip(msg.entries, reqs, strict=True):
                if req is not None and req.generation == e.generation:
                    self._invalidate(req, reason)
            self._reply(identity, ReadFailed(msg.seq, msg.layer, [e.request_id for e in msg.entries], reason))

    def _zero(self, req: ExpectedRequest) -> None:
        """Zero a failed request's destinations, unless they were released (and may be someone else's)."""
        try:
            with req.lock:
                if self._requests.get(req.request_id) is req:
                    self._dest.zero(req.main_share, req.indexer_blocks)
        except Exception:
            logger.exception("%s: zeroing the destinations of request %d failed", self.name, req.request_id)

    def _handle_layer(self, identity: bytes, msg: LayerReady) -> None:
        peer = self._peers.get(identity)
        ids = [e.request_id for e in msg.entries]
        if peer is None:
            self._reply(
                identity, ReadFailed(msg.seq, msg.layer, ids, f"{self.name}: no handshake with this peer")
            )
            return
        with self._lock:
            reqs = [self._requests.get(e.request_id) for e in msg.entries]
        live = sorted({id(r): r for r in reqs if r is not None}.values(), key=lambda r: r.request_id)
        for r in live:
            r.lock.acquire()
        try:
            try:
                ops, staged = plan_reads(self._dest, self.config.ratio, identity, peer, msg, reqs)
            except Refuse as exc:
                self._refuse_batch(identity, peer, msg, str(exc))
                return
            except Reject as exc:
                self._fail_batch(identity, peer, msg, reqs, str(exc))
                return
            try:
                nbytes, seconds = self._read(peer, ops, msg.layer)
            except TransportError as exc:
                self._fail_batch(
                    identity, peer, msg, reqs, f"read failed after {self.config.read_retries} retries: {exc}"
                )
                return
            self._dest.land_staged(msg.layer, staged)
            self.counters.add("bytes_received", nbytes)
            self.counters.add("read_seconds", seconds)
            self.counters.add("layers_received")
            for req in reqs:
                assert req is not None  # plan_reads refused the batch otherwise
                req.done.add((msg.layer, peer.member))
                req.peers.add(identity)
                req.sources.setdefault(peer.member, identity)
                if req.state == PENDING and len(req.done) == self.num_layers * self.config.ratio:
                    req.complete()
                    self.counters.add("requests_done")
        finally:
            for r in live:
                r.lock.release()
        self._reply(identity, ReadDone(msg.seq, msg.layer, ids))

    def _fail_batch(self, identity: bytes, peer: PrefillPeer, msg: LayerReady, reqs, reason: str) -> None:
        full = f"{self.name}: layer {msg.layer} from prefill rank {peer.p_rank}: {reason}"
        logger.error("%s", full)
        self.counters.add("read_failures")
        for req in reqs:
            if req is not None:
                self._invalidate(req, full)
        self._reply(identity, ReadFailed(msg.seq, msg.layer, [e.request_id for e in msg.entries], full))

    def _refuse_batch(self, identity: bytes, peer: PrefillPeer, msg: LayerReady, reason: str) -> None:
        full = (
            f"{self.name}: refused layer {msg.layer} from prefill rank {peer.p_rank} ({identity!r}): {reason}"
        )
        logger.warning("%s", full)
        self.counters.add("batches_refused")
        self._reply(identity, ReadFailed(msg.seq, msg.layer, [e.request_id for e in msg.entries], full))

    def _read(self, peer: PrefillPeer, ops: list[ReadOp], layer: int) -> tuple[int, float]:
        """Pull ``ops`` from ``peer``, retrying up to ``read_retries`` times; ``(bytes, seconds)``."""
        start = time.perf_counter()
        for attempt in range(self.config.read_retries + 1):
            try:
                self.transport.read(peer.remote, ops)
                break
            except TransportError as exc:
                if attempt == self.config.read_retries:
                    raise
                self.counters.add("read_retries")
                logger.warning(
                    "%s: read of layer %d failed (attempt %d): %s", self.name, layer, attempt + 1, exc
                )
        return sum(op.nbytes for op in ops), time.perf_counter() - start

    # ------------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Say BYE to the peers, stop the control thread and the read stream, withdraw the advertisement;
        idempotent."""
        if self._closed:
            return
        self._closed = True
        for p in list(self._peers.values()):
            self._control.send(Bye(f"{self.name} closing"), p.identity)
        try:
            self.rendezvous.remove(self._key)
        except (OSError, ConnectionError) as exc:
            logger.debug("rendezvous remove failed: %s", exc)
        self._control.close()
        drained = self._reads.submit(_nothing)
        try:
            drained.wait(_CLOSE_WAIT_S)
        except TimeoutError:
            logger.warning("%s: a read still runs after %.0f s; closing without it", self.name, _CLOSE_WAIT_S)
        else:
            self._reads.close()
        if self._own_transport:
            self.transport.close()

    def __enter__(self) -> DecodeReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nothing() -> None:
    """A barrier on the read stream: completes once the work submitted before it ran."""


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    return f"{xs[0]}..{xs[-1]}" if xs == list(range(xs[0], xs[-1] + 1)) else str(xs)
