"""Decode side of P/D transfer: validate each layer-ready batch, pull it into the destinations, answer.

Destinations: main KV in the decode host pool (:class:`~torch_kvoffload.sparse.HostKVPool`, shared by the
DP rank's TP ranks — decode TP rank ``t`` receives the ``t``-th contiguous share of a request's blocks),
indexer components in rank-local (device) caches ``[num_blocks, block_size, *row]`` — every decode TP
rank receives a request's whole indexer, its prefill members each sending a disjoint block range.

Per request and rank, a transfer is complete when every layer was received from every member of the
rank's contribution group (``ratio = p_tp // d_tp`` members; a member with nothing to send still sends an
empty batch). A request is schedulable only when it is complete on every TP rank of its DP rank
(:func:`all_ranks_ready`).

Safety: only peers that proved the shared secret are heard (:mod:`torch_kvoffload.pd.control`). A batch
is validated completely before any read (main tensor count and block sizes, indexer presence and sizes —
the int8 scale included —, destination blocks equal to the ones allocated, source blocks inside the
peer's buffers). A failed validation, a read failing after ``read_retries`` retries, a peer silent for
``heartbeat_interval_s * heartbeat_misses`` or saying BYE mid-transfer invalidates the request: its
destinations are zeroed, its waiters raise, and prefill gets READ_FAILED. A batch that does not belong to
the live request it names — another (random) generation, a request no longer pending, a layer already
received, a physical buffer the peer never exported, a connection other than the one that delivered the
request's earlier layers — is refused (READ_FAILED to its sender) and leaves the request alone.
:meth:`DecodeReceiver.release` waits for a read in flight, so a late write can never land in a destination
that was handed out again. If the control thread stops, every pending request fails at once.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.counters import Counters
from torch_kvoffload.pd.auth import resolve_secret
from torch_kvoffload.pd.compat import row_layout
from torch_kvoffload.pd.config import PDConfig, decode_rank_of, split_range
from torch_kvoffload.pd.control import ControlEndpoint
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
from torch_kvoffload.pd.transports import ReadOp, RemotePeer, Transport, TransportError, make_transport
from torch_kvoffload.sparse.host_pool import HostKVPool

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "DecodeReceiver", "all_ranks_ready"]

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

PENDING, DONE, FAILED = "pending", "done", "failed"


def all_ranks_ready(states: Sequence[str]) -> bool:
    """Whether a request may be scheduled: every decode TP rank reached ``"done"``. Raises
    :class:`PDTransferError` if any rank ``"failed"`` (the request must be recomputed or dropped)."""
    if any(s == FAILED for s in states):
        raise PDTransferError(
            f"P/D transfer failed on decode rank(s) {[i for i, s in enumerate(states) if s == FAILED]}"
        )
    return bool(states) and all(s == DONE for s in states)


@dataclass
class _Peer:
    identity: bytes
    p_rank: int
    member: int
    remote: RemotePeer
    num_blocks: int
    slots: list
    last_seen: float
    alive: bool = True


@dataclass
class _Request:
    request_id: int
    generation: int
    num_tokens: int
    main_share: list[int]  # this rank's share of the main blocks
    main_share_range: tuple[int, int]
    indexer_blocks: list[int]
    state: str = PENDING
    error: str = ""
    done: set = field(default_factory=set)  # {(layer, member)}
    peers: set = field(default_factory=set)
    sources: dict = field(default_factory=dict)  # member -> identity of the connection that delivered it
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: threading.Event = field(default_factory=threading.Event)


class _Reject(Exception):
    """The batch fails the requests it names."""


class _Refuse(_Reject):
    """The batch is not the named live requests' own (stale, replayed, foreign): refuse it, fail nothing."""


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
        if not isinstance(pool, HostKVPool):
            raise TypeError(f"{where}: 'pool' must be a HostKVPool, got {type(pool).__name__}")
        self.pool, self.compat = pool, compat
        self.num_layers, self.block_size = pool.num_layers, pool.block_size
        own = row_layout([pool.kv_c(0), pool.k_pe(0)])
        problems = []
        if compat.num_layers != pool.num_layers:
            problems.append(f"num_layers {compat.num_layers} != pool's {pool.num_layers}")
        if compat.block_size != pool.block_size:
            problems.append(f"block_size {compat.block_size} != pool's {pool.block_size}")
        if [list(x) for x in compat.main_layout] != own:
            problems.append(f"main_layout {compat.main_layout} != pool's {own}")
        self._indexer = self._check_indexer(indexer, compat, problems)
        if problems:
            raise ValueError(f"{where}: 'compat' does not describe the destinations: " + "; ".join(problems))
        esz = pool.kv_c(0).element_size()
        self._main_bytes = [self.block_size * pool.kv_lora_rank * esz, self.block_size * pool.rope_dim * esz]
        self._idx_bytes = [[] if comps is None else [c[0].nbytes for c in comps] for comps in self._indexer]
        self.counters = Counters(COUNTER_NAMES)
        self.transport = transport if transport is not None else make_transport(config, rank_name=self.name)
        self._own_transport = transport is None
        for layer in range(self.num_layers):
            self.transport.register(_main_region(layer, 0), pool.kv_c(layer))
            self.transport.register(_main_region(layer, 1), pool.k_pe(layer))
        self._staging: dict[int, torch.Tensor] = {}
        for layer, comps in enumerate(self._indexer):
            for c, t in enumerate(comps or ()):
                if t.device.type == "cpu" or self.transport.device_memory:
                    self.transport.register(_idx_region(layer, c), t)
                elif c not in self._staging:  # device destination, host-only transport: stage
                    self._staging[c] = torch.zeros(t.shape, dtype=t.dtype)
                    self.transport.register(_stage_region(c), self._staging[c])
        self._lock = threading.Lock()
        self._peers: dict[bytes, _Peer] = {}
        self._requests: dict[int, _Request] = {}
        self.handshake_errors: list[str] = []
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._last_beat = 0.0
        self.port = config.port(self.dp_rank, self.tp_rank)
        self.endpoint = f"tcp://{config.host}:{self.port}"
        self._worker = threading.Thread(
            target=self._work_loop, name=f"kvoffload-{self.name}-read", daemon=True
        )
        self._worker.start()
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
            self._work.put(None)
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

    def _check_indexer(self, indexer, compat: Compatibility, problems: list[str]) -> list:
        if indexer is None:
            if compat.indexer_layout:
                problems.append(f"indexer_layout {compat.indexer_layout} but no indexer destinations")
            return [None] * self.num_layers
        indexer = list(indexer)
        if len(indexer) != self.num_layers:
            raise ValueError(
                f"DecodeReceiver: 'indexer' has {len(indexer)} layers, the pool {self.num_layers}"
            )
        for layer, comps in enumerate(indexer):
            if comps is None:
                continue
            for c in comps:
                if not isinstance(c, torch.Tensor) or c.dim() < 3 or c.shape[1] != self.block_size:
                    raise ValueError(
                        f"DecodeReceiver: indexer of layer {layer} must be [num_blocks, {self.block_size}, ...] "
                        f"tensors, got {getattr(c, 'shape', c)}"
                    )
                if not c.is_contiguous():
                    raise ValueError(f"DecodeReceiver: indexer of layer {layer} must be contiguous")
            layout = row_layout(comps)
            if [[list(r), d] for r, d in compat.indexer_layout] != layout:
                problems.append(f"indexer_layout {compat.indexer_layout} != layer {layer}'s {layout}")
        return [None if comps is None else tuple(comps) for comps in indexer]

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
        has_idx = any(c is not None for c in self._indexer)
        if has_idx:
            cap = min(c[0].shape[0] for c in self._indexer if c is not None)
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
            req = _Request(request_id, generation, num_tokens, main_blocks[lo:hi], (lo, hi), indexer_blocks)
            self._requests[request_id] = req
        return TicketPart(self.tp_rank, req.generation, tuple(indexer_blocks))

    def state(self, request_id: int) -> str:
        """``"pending"``, ``"done"`` or ``"failed"`` on this rank (``KeyError`` if unknown)."""
        with self._lock:
            req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"{self.name}: unknown request {request_id}")
        return req.state

    def error(self, request_id: int) -> str:
        with self._lock:
            req = self._requests.get(request_id)
        return "" if req is None else req.error

    def wait_request(self, request_id: int, timeout: float | None = None) -> None:
        """Block until the request is complete on this rank; :class:`PDTransferError` if it failed,
        ``TimeoutError`` after ``timeout`` seconds."""
        with self._lock:
            req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"{self.name}: unknown request {request_id}")
        if not req.finished.wait(timeout):
            raise TimeoutError(f"{self.name}: request {request_id} not complete after {timeout} s "
                               f"({len(req.done)} of {self.num_layers * self.config.ratio} layer parts)")  # fmt: skip
        if req.state == FAILED:
            raise PDTransferError(f"{self.name}: request {request_id} failed: {req.error}")

    def release(self, request_id: int) -> None:
        """Forget the request (its destinations may be reused): waits for a read of it in flight; a later
        batch for it is refused."""
        with self._lock:
            req = self._requests.pop(request_id, None)
        if req is None:
            return
        with req.lock:  # no read of it in flight after this
            if req.state == PENDING:
                req.state, req.error = FAILED, "released before the transfer completed"
                req.finished.set()

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
            self._work.put(("layer", peer, msg))
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
        self._peers[peer] = _Peer(
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

    def _peer_gone(self, peer: _Peer, why: str) -> None:
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

    def _invalidate(self, req: _Request, reason: str) -> None:
        """Mark the request failed now (waiters raise) and zero its destinations on the read thread."""
        if req.state != PENDING:
            return
        req.state, req.error = FAILED, reason
        self.counters.add("requests_failed")
        req.finished.set()
        self._work.put(("zero", req))

    # ----------------------------------------------------------------------------- read thread
    def _work_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            try:
                if item[0] == "layer":
                    self._handle_layer(item[1], item[2])
                else:
                    self._zero(item[1])
            except Exception as exc:
                logger.exception("%s: %s work failed", self.name, item[0])
                if item[0] == "layer":
                    self._fail_unexpectedly(item[1], item[2], exc)

    def _fail_unexpectedly(self, identity: bytes, msg: LayerReady, exc: Exception) -> None:
        """A batch whose handling raised: its live requests may hold part of it, so they fail; the
        sender is answered instead of waiting for its deadline."""
        reason = f"{self.name}: layer {msg.layer} failed unexpectedly: {type(exc).__name__}: {exc}"
        with self._lock:
            reqs = [self._requests.get(e.request_id) for e in msg.entries]
        for e, req in zip(msg.entries, reqs, strict=True):
            if req is not None and req.generation == e.generation:
                self._invalidate(req, reason)
        self._reply(identity, ReadFailed(msg.seq, msg.layer, [e.request_id for e in msg.entries], reason))

    def _zero(self, req: _Request) -> None:
        with req.lock:
            if self._requests.get(req.request_id) is not req:
                return  # released: its destinations belong to someone else now
            main = torch.tensor(req.main_share, dtype=torch.int64)
            idx = torch.tensor(req.indexer_blocks, dtype=torch.int64)
            for layer in range(self.num_layers):
                if main.numel():
                    self.pool.kv_c(layer)[main] = 0
                    self.pool.k_pe(layer)[main] = 0
                for c in self._indexer[layer] or ():
                    if idx.numel():
                        c[idx.to(c.device)] = 0

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
                ops, staged = self._validate(identity, peer, msg, reqs)
            except _Refuse as exc:
                self._refuse_batch(identity, peer, msg, str(exc))
                return
            except _Reject as exc:
                self._fail_batch(identity, peer, msg, reqs, str(exc))
                return
            try:
                nbytes, seconds = self._read(peer, ops, msg.layer)
            except TransportError as exc:
                self._fail_batch(
                    identity, peer, msg, reqs, f"read failed after {self.config.read_retries} retries: {exc}"
                )
                return
            for c, blocks in staged:
                dst = self._indexer[msg.layer][c]
                index = torch.tensor(blocks, dtype=torch.int64)
                dst[index.to(dst.device)] = self._staging[c][index].to(dst.device)
            self.counters.add("bytes_received", nbytes)
            self.counters.add("read_seconds", seconds)
            self.counters.add("layers_received")
            for req in reqs:
                assert req is not None
                req.done.add((msg.layer, peer.member))
                req.peers.add(identity)
                req.sources.setdefault(peer.member, identity)
                if req.state == PENDING and len(req.done) == self.num_layers * self.config.ratio:
                    req.state = DONE
                    self.counters.add("requests_done")
                    req.finished.set()
        finally:
            for r in live:
                r.lock.release()
        self._reply(identity, ReadDone(msg.seq, msg.layer, ids))

    def _fail_batch(self, identity: bytes, peer: _Peer, msg: LayerReady, reqs, reason: str) -> None:
        full = f"{self.name}: layer {msg.layer} from prefill rank {peer.p_rank}: {reason}"
        logger.error("%s", full)
        self.counters.add("read_failures")
        for req in reqs:
            if req is not None:
                self._invalidate(req, full)
        self._reply(identity, ReadFailed(msg.seq, msg.layer, [e.request_id for e in msg.entries], full))

    def _refuse_batch(self, identity: bytes, peer: _Peer, msg: LayerReady, reason: str) -> None:
        full = (
            f"{self.name}: refused layer {msg.layer} from prefill rank {peer.p_rank} ({identity!r}): {reason}"
        )
        logger.warning("%s", full)
        self.counters.add("batches_refused")
        self._reply(identity, ReadFailed(msg.seq, msg.layer, [e.request_id for e in msg.entries], full))

    def _validate(
        self, identity: bytes, peer: _Peer, msg: LayerReady, reqs: list
    ) -> tuple[list[ReadOp], list]:
        """The reads of the batch; :class:`_Refuse` if it is not the named live requests' own, :class:`_Reject`
        if it is but cannot be read (it fails them)."""
        cfg = self.config
        if len({e.request_id for e in msg.entries}) != len(msg.entries):
            raise _Refuse(f"a request appears twice in the batch: {[e.request_id for e in msg.entries]}")
        for entry, req in zip(msg.entries, reqs, strict=True):
            rid = entry.request_id
            if req is None or req.generation != entry.generation:
                raise _Refuse(
                    f"request {rid} generation {entry.generation} is not expected here (stale or unknown)"
                )
            if req.state != PENDING:
                raise _Refuse(f"request {rid} is {req.state} ({req.error})")
            if (msg.layer, peer.member) in req.done:
                raise _Refuse(f"request {rid}: layer {msg.layer} of member {peer.member} arrived twice")
            if req.sources.get(peer.member, identity) != identity:
                raise _Refuse(
                    f"request {rid}: member {peer.member}'s earlier layers came over another connection"
                )
        if not 0 <= msg.slot < len(peer.slots):
            raise _Refuse(f"physical buffer {msg.slot} out of range [0, {len(peer.slots)})")
        if msg.member != peer.member or msg.ratio != cfg.ratio:
            raise _Reject(f"member {msg.member} / ratio {msg.ratio}, expected {peer.member} / {cfg.ratio}")
        if not 0 <= msg.layer < self.num_layers:
            raise _Reject(f"layer {msg.layer} out of range [0, {self.num_layers})")
        if list(msg.main_block_bytes) != self._main_bytes:
            raise _Reject(
                f"main KV metadata: {len(msg.main_block_bytes)} tensors of block bytes {msg.main_block_bytes}, "
                f"the destination has {len(self._main_bytes)} of {self._main_bytes}"
            )
        want_idx = self._idx_bytes[msg.layer]
        if list(msg.indexer_block_bytes) != want_idx:
            raise _Reject(
                f"indexer metadata: block bytes {msg.indexer_block_bytes or 'none'}, the destination has "
                f"{want_idx or 'no indexer'} (presence, size and int8 scale layout must match)"
            )
        slot = peer.slots[msg.slot]
        main_regions, idx_regions = list(slot.get("main", [])), list(slot.get("indexer", []))
        if len(main_regions) != len(self._main_bytes) or (want_idx and len(idx_regions) != len(want_idx)):
            raise _Reject(
                f"physical buffer {msg.slot} exports {len(main_regions)} main / {len(idx_regions)} indexer regions"
            )
        ops: list[ReadOp] = []
        staged: list = []
        for entry, req in zip(msg.entries, reqs, strict=True):
            rid = entry.request_id
            want_main = req.main_share if peer.member == 0 else []
            if list(entry.main_dst) != want_main or len(entry.main_src) != len(entry.main_dst):
                raise _Reject(
                    f"request {rid}: main destination blocks {entry.main_dst} (from {len(entry.main_src)} sources), "
                    f"expected {want_main}"
                )
            lo, hi = split_range(len(req.indexer_blocks), cfg.ratio, peer.member)
            want_idx_blocks = req.indexer_blocks[lo:hi] if want_idx else []
            if list(entry.indexer_dst) != want_idx_blocks or len(entry.indexer_src) != len(entry.indexer_dst):
                raise _Reject(
                    f"request {rid}: indexer destination blocks {entry.indexer_dst} (from "
                    f"{len(entry.indexer_src)} sources), expected {want_idx_blocks}"
                )
            for b in (*entry.main_src, *entry.indexer_src):
                if not 0 <= b < peer.num_blocks:
                    raise _Reject(
                        f"request {rid}: source block {b} outside the peer's {peer.num_blocks} blocks"
                    )
            for c, n in enumerate(self._main_bytes):
                ops += _runs(main_regions[c], _main_region(msg.layer, c), entry.main_src, entry.main_dst, n)
            for c, n in enumerate(want_idx):
                local = _idx_region(msg.layer, c) if c not in self._staging else _stage_region(c)
                ops += _runs(idx_regions[c], local, entry.indexer_src, entry.indexer_dst, n)
                if c in self._staging and entry.indexer_dst:
                    staged.append((c, list(entry.indexer_dst)))
        return ops, staged

    def _read(self, peer: _Peer, ops: list[ReadOp], layer: int) -> tuple[int, float]:
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
        """Say BYE to the peers, stop the threads, withdraw the advertisement; idempotent."""
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
        self._work.put(None)
        self._worker.join(5)
        if self._own_transport:
            self.transport.close()

    def __enter__(self) -> DecodeReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _main_region(layer: int, c: int) -> str:
    return f"main.{layer}.{c}"


def _idx_region(layer: int, c: int) -> str:
    return f"idx.{layer}.{c}"


def _stage_region(c: int) -> str:
    return f"stage.{c}"


def _runs(remote: str, local: str, src: list[int], dst: list[int], n: int) -> list[ReadOp]:
    """Read ops for blocks ``src[i] -> dst[i]`` of ``n`` bytes each, merging runs consecutive on both sides."""
    ops: list[ReadOp] = []
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        ops.append(ReadOp(remote, src[i] * n, local, dst[i] * n, (j - i) * n))
        i = j
    return ops


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    return f"{xs[0]}..{xs[-1]}" if xs == list(range(xs[0], xs[-1] + 1)) else str(xs)
