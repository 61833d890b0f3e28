"""Prefill side of P/D transfer: one prefill TP rank's sender — publish each layer to the decode peers,
gate buffer reuse on their reads — and the connector that puts it before the layerwise runtime.

:class:`PrefillSender` is one prefill TP rank's sender. Its :meth:`PrefillSender.provider` is a layerwise
completion provider (``fn(slot, layer) -> TransferEvent``): when a layer's KV is written it sends one
LAYER_READY batch per decode peer and returns an event that completes when every peer answered
READ_DONE — the layerwise runtime keeps the physical buffer until then (and until its host save is done).
The event fails with :class:`~torch_kvoffload.pd.errors.ReadFailedError` (READ_FAILED),
:class:`~torch_kvoffload.pd.errors.AckTimeoutError` (no answer within ``layer_ack_timeout_s``) or
:class:`~torch_kvoffload.pd.errors.PeerDeadError` (no heartbeat for ``heartbeat_interval_s *
heartbeat_misses``, or BYE), each naming the layer, requests and peer.

Only a decode endpoint that proves the shared secret is talked to (:mod:`torch_kvoffload.pd.control`);
an acknowledgement counts only for the batch it names (sequence number, layer and requests). If the
control thread stops, every outstanding layer fails at once.

Threads: each peer's control endpoint runs an I/O thread whose callbacks settle the events
(:mod:`~torch_kvoffload.pd.prefill_state`). A LAYER_READY leaves only once the layer's KV is written
(:func:`~torch_kvoffload.transfer.record_compute_event`): the send is submitted to the sender's
:class:`~torch_kvoffload.transfer.TransferStream` after that event — run at once on the caller when the
writes are done and no earlier send waits, else in order on the stream's worker.

Request completion (every layer of a request acknowledged) is tracked apart from buffer completion:
:meth:`PrefillSender.wait_request`. The layer buffers are exported by
:mod:`~torch_kvoffload.pd.prefill_exports`. :class:`PrefillMultiConnector` combines the layerwise store connector
(the :class:`~torch_kvoffload.layerwise.LayerwiseOffloadRuntime`) with senders, providers first whatever
order they are given in.

Non-uniform TP: prefill rank ``p`` serves decode TP rank ``p // ratio`` as member ``p % ratio``; member 0
sends the decode rank's main-KV share (blocks :func:`~torch_kvoffload.pd.config.split_range` ``(n, d_tp,
d_rank)``), member ``m`` indexer blocks ``split_range(n, ratio, m)``; every member sends every layer, an
empty batch included.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.counters import Counters
from torch_kvoffload.layerwise import LayerBuffers, LayerwiseOffloadRuntime
from torch_kvoffload.pd.auth import resolve_secret
from torch_kvoffload.pd.config import PDConfig, decode_rank_of
from torch_kvoffload.pd.control import ControlEndpoint
from torch_kvoffload.pd.errors import (
    AckTimeoutError,
    HandshakeError,
    PDTransferError,
    PeerDeadError,
    ReadFailedError,
)
from torch_kvoffload.pd.messages import (
    Bye,
    Compatibility,
    Heartbeat,
    Hello,
    HelloAck,
    LayerReady,
    Message,
    ReadDone,
    ReadFailed,
)
from torch_kvoffload.pd.prefill_exports import slot_regions
from torch_kvoffload.pd.prefill_state import (
    DecodePeer,
    LayerAnswers,
    PendingBatch,
    RequestTrackers,
    Share,
    batch_bytes,
    layer_entries,
    plan_shares,
)
from torch_kvoffload.pd.rendezvous import Rendezvous, decode_key, make_rendezvous
from torch_kvoffload.pd.ticket import TransferTicket
from torch_kvoffload.pd.transports import Transport
from torch_kvoffload.transfer import TransferEvent, TransferStream, record_compute_event

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "PrefillMultiConnector", "PrefillSender"]

COUNTER_NAMES = (
    "layers_sent",  # LAYER_READY batches
    "layers_acked",
    "layers_failed",
    "requests_done",
    "requests_failed",
    "ack_wait_seconds",  # from LAYER_READY to READ_DONE, summed
    "bytes_read_by_decode",  # bytes of the acknowledged batches
)


class PrefillSender:
    """Prefill TP rank ``p_rank``'s sender over ``buffers`` (from
    :func:`~torch_kvoffload.pd.prefill_exports.export_layer_buffers` on
    ``transport``). ``compat`` describes the caches (:func:`~torch_kvoffload.pd.compat.make_compatibility`).
    Counters: :data:`COUNTER_NAMES`."""

    def __init__(
        self,
        config: PDConfig,
        *,
        p_rank: int,
        buffers: LayerBuffers,
        transport: Transport,
        compat: Compatibility,
        rendezvous: Rendezvous | None = None,
    ) -> None:
        where = "PrefillSender"
        if not isinstance(config, PDConfig) or config.role != "prefill":
            raise ValueError(f"{where}: needs a PDConfig with role='prefill', got {config!r:.120}")
        self.config = config
        self.p_rank = check_int(where, "p_rank", p_rank, minimum=0, maximum=config.prefill_tp_size - 1)
        self.d_rank, self.member = decode_rank_of(p_rank, config.prefill_tp_size, config.decode_tp_size)
        self.buffers, self.transport, self.compat = buffers, transport, compat
        self.slots = slot_regions(buffers)
        sizes = transport.local_sizes
        missing = [r for s in self.slots for r in (*s["main"], *s["indexer"]) if r not in sizes]
        if missing:
            raise ValueError(
                f"{where}: buffers are not exported by the transport (regions {missing[:3]}...); allocate "
                "them with export_layer_buffers(plan, transport)"
            )
        plan = buffers.plan
        if compat.num_layers != plan.num_layers:
            raise ValueError(
                f"{where}: compat.num_layers {compat.num_layers} != the plan's {plan.num_layers}"
            )
        self.num_layers = plan.num_layers
        self.num_blocks = buffers.main[0][0].shape[0]
        self.rendezvous = rendezvous if rendezvous is not None else make_rendezvous(config)
        self._secret = resolve_secret(config, self.rendezvous)
        self.counters = Counters(COUNTER_NAMES)
        self._lock = threading.Lock()
        self._peers: dict[int, DecodePeer] = {}
        self._seq = itertools.count()
        self._pending: dict[tuple[int, int], PendingBatch] = {}
        self._requests = RequestTrackers(self.name, self.num_layers)
        self._shares: list[Share] | None = None
        #: one entry per acknowledged batch: layer, decode DP rank, seconds from LAYER_READY to READ_DONE, bytes
        self.layer_log: list[dict] = []
        self._closed = False
        # sends wait here for the layer's writes: host work only (an event wait, then a socket hand-off)
        self._sends = TransferStream(f"{self.name}-send", device=torch.device("cpu"))

    @property
    def name(self) -> str:
        return f"pd-prefill[tp{self.p_rank}]"

    # ------------------------------------------------------------------------------ handshake
    def connect(self, dp_rank: int = 0) -> None:
        """Find decode rank ``(dp_rank, p_rank // ratio)`` in the rendezvous and handshake with it.

        Raises :class:`HandshakeError` if no accepted HELLO_ACK arrives within ``handshake_timeout_s``
        (rendezvous lookup included), the endpoint fails to prove the shared secret or refuses ours, or
        decode rejects the pairing (the reason says what differs).
        """
        dp_rank = check_int(
            "PrefillSender.connect", "dp_rank", dp_rank, minimum=0, maximum=self.config.decode_dp_size - 1
        )
        with self._lock:
            old = self._peers.get(dp_rank)
            if old is not None and old.dead is None:
                return
        if old is not None and old.control is not None:  # a dead peer's endpoint: reconnect afresh
            old.control.close()
        timeout = self.config.handshake_timeout_s
        deadline = time.monotonic() + timeout
        key = decode_key(self.config.kv_port, dp_rank, self.d_rank)
        try:
            record = self.rendezvous.lookup(key, timeout)
        except TimeoutError as exc:
            raise HandshakeError(
                f"{self.name}: decode rank (dp {dp_rank}, tp {self.d_rank}) never advertised: {exc}"
            ) from exc
        peer = DecodePeer(dp_rank, record["endpoint"])
        peer.control = ControlEndpoint(
            "dealer",
            peer.endpoint,
            secret=self._secret,
            on_message=lambda _id, msg, p=peer: self._on_message(p, msg),
            on_tick=lambda p=peer: self._on_tick(p),
            on_down=lambda reason, p=peer: self._on_control_down(p, reason),
            max_message_bytes=self.config.max_message_bytes,
            name=f"{self.name}->dp{dp_rank}",
        )
        peer.control.send(
            Hello(self.compat, self.p_rank, self.config.prefill_tp_size, self.config.decode_tp_size, self.transport.name,
                  self.transport.describe(), self.slots, self.num_blocks)
        )  # fmt: skip
        if not peer.acked.wait(max(0.0, deadline - time.monotonic())):
            unauthenticated = not peer.control.authenticated()
            peer.control.close()
            raise HandshakeError(
                f"{self.name}: no HELLO_ACK from decode rank (dp {dp_rank}, tp {self.d_rank}) at {peer.endpoint} "
                f"within {timeout:.1f} s (handshake_timeout_s)"
                + ("; it never answered the authentication challenge" if unauthenticated else "")
            )
        if peer.ack is None:  # woken by the control endpoint going down
            peer.control.close()
            raise HandshakeError(
                f"{self.name}: handshake with decode rank (dp {dp_rank}, tp {self.d_rank}) at {peer.endpoint} "
                f"failed: {peer.dead}"
            )
        if not peer.ack.ok:
            peer.control.close()
            raise HandshakeError(f"{self.name}: decode rejected the handshake: {peer.ack.reason}")
        peer.last_seen = time.monotonic()
        with self._lock:
            self._peers[dp_rank] = peer
        logger.info("%s: connected to decode %s", self.name, peer.endpoint)

    # ------------------------------------------------------------------------------- forward
    def begin_forward(
        self, tickets: Sequence[TransferTicket], block_tables: Sequence[Sequence[int]] | torch.Tensor
    ) -> None:
        """Set the requests whose layers the next :meth:`provider` calls publish: ``tickets[r]`` (from
        decode, through the router) and ``block_tables[r]``, request ``r``'s prefill block ids (the ones
        given to the layerwise runtime). Connects to new decode DP ranks. Validates everything first."""
        where = "PrefillSender.begin_forward"
        if self._shares is not None:
            raise RuntimeError(f"{where}: a forward is running; call end_forward()")
        if isinstance(block_tables, torch.Tensor):
            block_tables = block_tables.tolist()
        shares = plan_shares(
            where,
            self.config,
            d_rank=self.d_rank,
            member=self.member,
            num_blocks=self.num_blocks,
            has_indexer=any(i is not None for i in self.buffers.indexer),
            tickets=tickets,
            block_tables=block_tables,
        )
        for dp in sorted({s.dp_rank for s in shares}):
            self.connect(dp)
        self._requests.start([s.request_id for s in shares])
        self._shares = shares

    def end_forward(self) -> None:
        """Close the forward (acknowledgements still outstanding keep gating their buffers)."""
        self._shares = None

    def provider(self, slot: int, layer: int) -> TransferEvent:
        """The completion provider: publish ``layer`` (in physical buffer ``slot``) to the decode peers;
        the returned event completes when every peer read it."""
        shares = self._shares
        if not shares:
            return TransferEvent.completed()
        main = self.buffers.layer_main(layer)
        idx = self.buffers.layer_indexer(layer)
        main_bytes = [t[0].nbytes for t in main]
        idx_bytes = [t[0].nbytes for t in idx] if idx is not None else []
        compute = record_compute_event()  # decode must not read before the layer's writes finished
        dps = sorted({s.dp_rank for s in shares})
        answers = LayerAnswers(len(dps))
        for dp in dps:
            entries = layer_entries(shares, dp, with_indexer=idx is not None)
            msg = LayerReady(
                next(self._seq), layer, slot, self.member, self.config.ratio, main_bytes, idx_bytes, entries
            )
            self._publish(dp, self._layer_ready(msg), compute, answers)
        return answers.event

    def _layer_ready(self, msg: LayerReady) -> LayerReady:
        """The batch about to be sent (a seam tests and the example use to corrupt metadata)."""
        return msg

    def _publish(self, dp: int, msg: LayerReady, compute: TransferEvent, answers: LayerAnswers) -> None:
        """Send ``msg`` to decode DP rank ``dp`` once ``compute`` (the layer's writes) completed; its answer
        settles ``answers``."""
        ids = [e.request_id for e in msg.entries]
        with self._lock:
            peer = self._peers.get(dp)
        if peer is None or peer.dead is not None:
            err = PeerDeadError(
                f"{self.name}: layer {msg.layer} of requests {ids}: decode peer dp {dp} is "
                f"{'not connected' if peer is None else 'dead: ' + str(peer.dead)}"
            )
            self._fail_requests(ids, err)
            answers.failed(err)
            return
        now = time.monotonic()
        with self._lock:
            self._pending[(dp, msg.seq)] = PendingBatch(
                dp, msg.layer, ids, answers, now, now + self.config.layer_ack_timeout_s, batch_bytes(msg)
            )
        self.counters.add("layers_sent")
        sent = self._sends.submit(self._send, peer, msg, after=(compute,), inline=True)
        if sent.error is not None:  # ran at once and failed: the caller hears it, as from a direct send
            raise sent.error

    def _send(self, peer: DecodePeer, msg: LayerReady) -> None:
        assert peer.control is not None  # set before the peer is registered
        try:
            peer.control.send(msg)
        except Exception:
            logger.exception("%s: LAYER_READY %d (layer %d) to decode dp %d not sent", self.name, msg.seq,
                             msg.layer, peer.dp_rank)  # fmt: skip
            raise

    # ----------------------------------------------------------------------- control messages
    def _on_control_down(self, peer: DecodePeer, reason: str) -> None:
        self._peer_dead(peer, reason)
        peer.acked.set()  # wake a handshake waiting for an answer that cannot come

    def _on_message(self, peer: DecodePeer, msg: Message) -> None:
        peer.last_seen = time.monotonic()
        if isinstance(msg, HelloAck):
            if not peer.acked.is_set():
                peer.ack = msg
                peer.acked.set()
        elif isinstance(msg, ReadDone):
            with self._lock:
                p = self._pending.get((peer.dp_rank, msg.seq))
                if p is not None and (p.layer, sorted(p.request_ids)) == (msg.layer, sorted(msg.request_ids)):
                    del self._pending[(peer.dp_rank, msg.seq)]
                elif p is not None:
                    logger.error("%s: READ_DONE %d names layer %d of requests %s, the batch was layer %d of %s; "
                                 "ignored", self.name, msg.seq, msg.layer, msg.request_ids, p.layer,
                                 p.request_ids)  # fmt: skip
                    p = None
            if p is None:
                return
            seconds = time.monotonic() - p.sent
            self.counters.add("layers_acked")
            self.counters.add("ack_wait_seconds", seconds)
            self.counters.add("bytes_read_by_decode", p.nbytes)
            with self._lock:
                self.layer_log.append(
                    {"layer": p.layer, "dp_rank": p.dp_rank, "seconds": seconds, "bytes": p.nbytes}
                )
            p.answers.read()
            self._layer_done(p)
        elif isinstance(msg, ReadFailed):
            with self._lock:
                p = self._pending.pop((peer.dp_rank, msg.seq), None)
            if p is None:
                logger.error("%s: READ_FAILED for an unknown batch: %s", self.name, msg.reason)
                return
            self._fail(p, ReadFailedError(
                f"{self.name}: decode dp {peer.dp_rank} ({peer.endpoint}) failed layer {p.layer} of requests "
                f"{p.request_ids}: {msg.reason}"
            ))  # fmt: skip
        elif isinstance(msg, Bye):
            self._peer_dead(peer, f"said BYE ({msg.reason})")

    def _on_tick(self, peer: DecodePeer) -> None:
        now = time.monotonic()
        if peer.dead is not None or peer.control is None:  # the first tick may precede the assignment
            return
        if now - peer.last_beat >= self.config.heartbeat_interval_s:
            peer.last_beat = now
            peer.control.send(Heartbeat(time.time()))
        silent = now - peer.last_seen
        if peer.acked.is_set() and silent > self.config.dead_after_s:
            self._peer_dead(peer, f"silent for {silent:.1f} s (no heartbeat)")
            return
        with self._lock:
            late = [k for k, p in self._pending.items() if k[0] == peer.dp_rank and p.deadline <= now]
            expired = [self._pending.pop(k) for k in late]
        for p in expired:
            self._fail(p, AckTimeoutError(
                f"{self.name}: layer {p.layer} of requests {p.request_ids}: no READ_DONE / READ_FAILED from "
                f"decode dp {peer.dp_rank} ({peer.endpoint}) within {self.config.layer_ack_timeout_s:.1f} s"
            ))  # fmt: skip

    def _peer_dead(self, peer: DecodePeer, why: str) -> None:
        peer.dead = why
        with self._lock:
            keys = [k for k in self._pending if k[0] == peer.dp_rank]
            lost = [self._pending.pop(k) for k in keys]
        if lost:
            logger.error("%s: decode dp %d (%s) %s; failing %d outstanding layers", self.name, peer.dp_rank,
                         peer.endpoint, why, len(lost))  # fmt: skip
        for p in lost:
            self._fail(p, PeerDeadError(
                f"{self.name}: layer {p.layer} of requests {p.request_ids}: decode dp {peer.dp_rank} "
                f"({peer.endpoint}) {why}"
            ))  # fmt: skip

    def _fail(self, p: PendingBatch, err: PDTransferError) -> None:
        logger.error("%s", err)
        self.counters.add("layers_failed")
        p.answers.failed(err)
        self._fail_requests(p.request_ids, err)

    def _fail_requests(self, ids: list[int], err: BaseException) -> None:
        self.counters.add("requests_failed", self._requests.fail(ids, err))

    def _layer_done(self, p: PendingBatch) -> None:
        self.counters.add("requests_done", self._requests.layer_read(p.request_ids, p.layer))

    # ------------------------------------------------------------------------------ requests
    def request_state(self, request_id: int) -> str:
        """``"pending"``, ``"done"`` (every layer acknowledged) or ``"failed"``."""
        return self._requests.state(request_id)

    def wait_request(self, request_id: int, timeout: float | None = None) -> None:
        """Block until every layer of the request was acknowledged; raise its transfer error if one
        failed, ``TimeoutError`` after ``timeout``."""
        self._requests.wait_request(request_id, timeout)

    def forget(self, request_id: int) -> None:
        self._requests.forget(request_id)

    def close(self) -> None:
        """Say BYE, fail what is outstanding, stop the control threads and the send stream; idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            if peer.control is not None:
                peer.control.send(Bye(f"{self.name} closing"))
            self._peer_dead(peer, "closed by prefill")
            if peer.control is not None:
                peer.control.close()
        self._sends.close()

    def __enter__(self) -> PrefillSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PrefillMultiConnector:
    """The layerwise store connector (a :class:`LayerwiseOffloadRuntime`) plus remote senders.

    ``connectors`` in any order: exactly one runtime and one or more :class:`PrefillSender`. The senders'
    providers are registered with the runtime, which calls them when a layer's KV is written *before* it
    starts the host save; a physical buffer's next user waits for the save and every read.
    """

    def __init__(self, connectors: Sequence[LayerwiseOffloadRuntime | PrefillSender]) -> None:
        runtimes = [c for c in connectors if isinstance(c, LayerwiseOffloadRuntime)]
        senders = [c for c in connectors if isinstance(c, PrefillSender)]
        other = [
            type(c).__name__ for c in connectors if not isinstance(c, LayerwiseOffloadRuntime | PrefillSender)
        ]
        if len(runtimes) != 1 or not senders or other:
            raise ValueError(
                f"PrefillMultiConnector: needs one LayerwiseOffloadRuntime and at least one PrefillSender, got "
                f"{len(runtimes)} runtime(s), {len(senders)} sender(s) and {other or 'nothing else'}"
            )
        self.runtime, self.senders = runtimes[0], senders
        self.order = [*senders, self.runtime]  # completion providers first, whatever the given order
        for s in senders:
            self.runtime.register_completion_provider(s.provider)

    def begin_forward(
        self, token_ids, block_tables, tickets: Sequence[TransferTicket], **kwargs
    ) -> list[int]:
        """Start a forward on every connector; returns the runtime's cached-token counts."""
        if isinstance(block_tables, torch.Tensor):
            block_tables = block_tables.tolist()
        started = []
        try:
            for s in self.senders:
                s.begin_forward(tickets, block_tables)
                started.append(s)
            return self.runtime.begin_forward(token_ids, block_tables, **kwargs)
        except BaseException:
            for s in started:
                s.end_forward()
            raise

    def wait_layer(self, layer: int, caches=None) -> None:
        """The runtime's ``wait_layer``: block until ``layer`` may use its buffer (previous user's save and
        remote reads done) and its prefix is loaded."""
        self.runtime.wait_layer(layer, caches)

    def save_layer(self, layer: int, caches=None) -> None:
        """The runtime's ``save_layer``: publish ``layer`` to the decode peers (providers first), then start its
        host save."""
        self.runtime.save_layer(layer, caches)

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, ...]:
        return self.runtime.layer_caches(layer)

    def end_forward(self) -> None:
        try:
            self.runtime.end_forward()
        finally:
            for s in self.senders:
                s.end_forward()

    def wait_request(self, request_id: int, timeout: float | None = None) -> None:
        """Request completion: every sender's layers of the request acknowledged."""
        for s in self.senders:
            s.wait_request(request_id, timeout)
