"""The control-plane socket of one P/D endpoint: pyzmq ROUTER (decode) or DEALER (prefill).

One I/O thread owns the socket. Other threads hand it messages through an ``inproc`` PUSH socket of
their own, so sending never touches the network socket from two threads. Incoming messages are decoded
(:func:`~torch_kvoffload.pd.messages.decode_message`) and passed to ``on_message(peer, msg)`` on the I/O
thread; ``on_tick()`` runs there every ``tick_s`` (heartbeats, deadlines). Callbacks must not block.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable

from torch_kvoffload.pd.messages import Message, ProtocolError, decode_message, encode_message, import_zmq

logger = logging.getLogger(__name__)

__all__ = ["ControlEndpoint"]

_ids = itertools.count()


class ControlEndpoint:
    """``kind="router"`` binds ``address`` (decode); ``kind="dealer"`` connects to it (prefill)."""

    def __init__(
        self,
        kind: str,
        address: str,
        *,
        on_message: Callable[[bytes, Message], None],
        on_tick: Callable[[], None] | None = None,
        on_protocol_error: Callable[[bytes, ProtocolError], None] | None = None,
        tick_s: float = 0.02,
        name: str = "pd",
    ) -> None:
        if kind not in ("router", "dealer"):
            raise ValueError(f"ControlEndpoint: kind must be 'router' or 'dealer', got {kind!r}")
        zmq = import_zmq()
        self._zmq = zmq
        self.kind, self.address, self.name = kind, address, name
        self._on_message, self._on_tick, self._on_protocol_error = on_message, on_tick, on_protocol_error
        self._tick_s = tick_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER if kind == "router" else zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if kind == "dealer":
            self.identity = f"{name}-{uuid.uuid4().hex[:8]}".encode()
            self._sock.setsockopt(zmq.IDENTITY, self.identity)
            self._sock.connect(address)
        else:
            self.identity = b""
            try:
                self._sock.bind(address)
            except zmq.ZMQError as exc:
                self._sock.close()
                self._ctx.term()
                raise OSError(f"ControlEndpoint: cannot bind {address}: {exc}") from exc
        self._inproc = f"inproc://kvoffload-pd-{next(_ids)}-{uuid.uuid4().hex[:6]}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._inproc)
        self._local = threading.local()  # one PUSH socket per sending thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvoffload-{name}-io", daemon=True)
        self._thread.start()

    def send(self, msg: Message, peer: bytes = b"") -> None:
        """Queue ``msg`` for ``peer`` (router) or the connected side (dealer); thread-safe."""
        if self._stop.is_set():
            return
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._ctx.socket(self._zmq.PUSH)
            push.setsockopt(self._zmq.LINGER, 0)
            push.connect(self._inproc)
            self._local.push = push
        push.send_multipart([peer, encode_message(msg)])

    def _loop(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(max(1, int(self._tick_s * 1000))))
            except zmq.ZMQError:
                break
            if self._pull in events:
                self._drain_outgoing()
            if self._sock in events:
                self._drain_incoming()
            now = time.monotonic()
            if now >= next_tick and self._on_tick is not None:
                next_tick = now + self._tick_s
                try:
                    self._on_tick()
                except Exception:
                    logger.exception("%s: tick failed", self.name)

    def _drain_outgoing(self) -> None:
        zmq = self._zmq
        while True:
            try:
                peer, payload = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if self.kind == "router":
                    self._sock.send_multipart([peer, payload], zmq.NOBLOCK)
                else:
                    self._sock.send(payload, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone / queue full: heartbeats and deadlines report it
                logger.debug("%s: send dropped: %s", self.name, exc)

    def _drain_incoming(self) -> None:
        zmq = self._zmq
        while True:
            try:
                if self.kind == "router":
                    peer, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                else:
                    peer, payload = b"", self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # a router frame set of unexpected length
                continue
            try:
                msg = decode_message(payload)
            except ProtocolError as exc:
                logger.error("%s: bad message from %r: %s", self.name, peer, exc)
                if self._on_protocol_error is not None:
                    self._on_protocol_error(peer, exc)
                continue
            try:
                self._on_message(peer, msg)
            except Exception:
                logger.exception("%s: handling %s from %r failed", self.name, msg.TYPE, peer)

    def close(self) -> None:
        """Stop the I/O thread and close every socket; idempotent."""
        if self._stop.is_set():
            return
        self._drain_before_close()
        self._stop.set()
        self._thread.join(5)
        self._ctx.destroy(linger=0)

    def _drain_before_close(self) -> None:
        # give queued messages (a BYE) a moment to leave
        time.sleep(2 * self._tick_s)
