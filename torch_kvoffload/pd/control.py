"""The control-plane socket of one P/D endpoint: pyzmq ROUTER (decode) or DEALER (prefill).

One I/O thread owns the socket. Other threads hand it messages through an ``inproc`` PUSH socket of
their own, so sending never touches the network socket from two threads. ``on_tick()`` runs on the I/O
thread every ``tick_s`` (heartbeats, deadlines). Callbacks must not block.

Not a transfer: the I/O thread is no :class:`~torch_kvoffload.transfer.TransferStream` because it
carries small control messages, never KV bytes, and a poll loop that must own its socket for the
endpoint's whole life is not work submitted and waited for. What does move or wait for KV bytes goes
through :mod:`torch_kvoffload.transfer`: decode's reads (its read stream) and prefill's wait for a
layer's writes before it announces the layer (its send stream).

Trust: every connection first proves the shared ``secret`` (:mod:`torch_kvoffload.pd.auth`; the dealer
starts, the router challenges, each side checks the other). Only then are its frames — each sealed for
that connection, once — decoded (:func:`~torch_kvoffload.pd.messages.decode_message`) and passed to
``on_message(peer, msg)``; anything from a peer that has not authenticated is dropped and logged with
the peer's identity. The dealer queues what it is given to send until it is authenticated; the router
sends only to authenticated peers. A frame over ``max_message_bytes`` drops the connection (ZMQ
``MAXMSGSIZE``). No exception from a peer's bytes or from a callback stops the I/O thread; if it stops
anyway (or the dealer's handshake fails), ``on_down(reason)`` runs once so that no waiter waits for a
thread that is gone.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

from torch_kvoffload.counters import Counters
from torch_kvoffload.pd import auth
from torch_kvoffload.pd.messages import (
    AuthChallenge,
    AuthRefused,
    AuthResponse,
    AuthStart,
    Message,
    ProtocolError,
    decode_message,
    encode_message,
    import_zmq,
)

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "ControlEndpoint"]

COUNTER_NAMES = (
    "peers_authenticated",
    "auth_refused",  # handshakes that failed (wrong secret, no challenge, replayed response)
    "frames_unauthenticated",  # frames dropped because their peer had not authenticated
    "frames_rejected",  # sealed frames failing their tag or counter (altered, replayed, other session)
    "protocol_errors",  # authenticated but undecodable messages
    "callback_errors",
)

_ids = itertools.count()
_MAX_PENDING = 1024  # challenges awaiting a response (a flood of AUTH_START evicts the oldest)
_MAX_QUEUED = 4096  # dealer messages waiting for the handshake


class ControlEndpoint:
    """``kind="router"`` binds ``address`` (decode); ``kind="dealer"`` connects to it (prefill)."""

    def __init__(
        self,
        kind: str,
        address: str,
        *,
        secret: bytes,
        on_message: Callable[[bytes, Message], None],
        on_tick: Callable[[], None] | None = None,
        on_protocol_error: Callable[[bytes, ProtocolError], None] | None = None,
        on_down: Callable[[str], None] | None = None,
        max_message_bytes: int = 1 << 20,
        tick_s: float = 0.02,
        name: str = "pd",
    ) -> None:
        if kind not in ("router", "dealer"):
            raise ValueError(f"ControlEndpoint: kind must be 'router' or 'dealer', got {kind!r}")
        if not isinstance(secret, bytes) or not secret:
            raise ValueError("ControlEndpoint: 'secret' must be non-empty bytes (pd.auth.resolve_secret)")
        zmq = import_zmq()
        self._zmq = zmq
        self.kind, self.address, self.name = kind, address, name
        self._secret = secret
        self._on_message, self._on_tick = on_message, on_tick
        self._on_protocol_error, self._on_down = on_protocol_error, on_down
        self._tick_s = tick_s
        self.counters = Counters(COUNTER_NAMES)
        #: why the endpoint cannot talk any more (handshake failed, I/O thread stopped); None while it can
        self.error: str | None = None
        self._lock = threading.Lock()
        self._sessions: dict[bytes, auth.Session] = {}  # router: per peer identity; dealer: b""
        self._challenges: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()  # router
        self._refused: OrderedDict[bytes, int] = OrderedDict()  # router: refusals per identity, for logs
        self._queued: list[bytes] = []  # dealer: bodies waiting for the handshake
        self._nonce = auth.new_nonce()  # dealer
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER if kind == "router" else zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
        if kind == "dealer":
            self.identity = f"{name}-{uuid.uuid4().hex}".encode()
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

    # ------------------------------------------------------------------------------ public
    def send(self, msg: Message, peer: bytes = b"") -> None:
        """Queue ``msg`` for ``peer`` (router) or the connected side (dealer); thread-safe."""
        self.send_bytes(encode_message(msg), peer)

    def send_bytes(self, body: bytes, peer: bytes = b"") -> None:
        """Queue an encoded message body (sealed for the peer's session on the I/O thread); thread-safe."""
        if self._stop.is_set() or self.error is not None:
            return  # nobody would drain the queue: a sender must never block on a dead endpoint
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._ctx.socket(self._zmq.PUSH)
            push.setsockopt(self._zmq.LINGER, 0)
            push.connect(self._inproc)
            self._local.push = push
        push.send_multipart([peer, body])

    def authenticated(self, peer: bytes = b"") -> bool:
        with self._lock:
            return peer in self._sessions

    def forget(self, peer: bytes) -> None:
        """Drop ``peer``'s session (router): nothing it sends is heard until it authenticates again."""
        with self._lock:
            self._sessions.pop(peer, None)

    def close(self) -> None:
        """Stop the I/O thread and close every socket; idempotent."""
        if self._stop.is_set():
            return
        time.sleep(2 * self._tick_s)  # give queued messages (a BYE) a moment to leave
        self._stop.set()
        self._thread.join(5)
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------------------ I/O thread
    def _loop(self) -> None:
        zmq = self._zmq
        reason = "the control I/O thread stopped"
        try:
            if self.kind == "dealer":
                self._send_plain(b"", AuthStart(self._nonce))
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(self._pull, zmq.POLLIN)
            next_tick = time.monotonic()
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(max(1, int(self._tick_s * 1000))))
                except zmq.ZMQError:
                    if self._stop.is_set():
                        break
                    raise
                try:
                    if self._pull in events:
                        self._drain_outgoing()
                    if self._sock in events:
                        self._drain_incoming()
                except Exception:
                    self.counters.add("callback_errors")
                    logger.exception("%s: control I/O step failed; still serving", self.name)
                now = time.monotonic()
                if now >= next_tick and self._on_tick is not None:
                    next_tick = now + self._tick_s
                    try:
                        self._on_tick()
                    except Exception:
                        self.counters.add("callback_errors")
                        logger.exception("%s: tick failed", self.name)
        except BaseException as exc:
            reason = f"the control I/O thread died: {type(exc).__name__}: {exc}"
            logger.critical("%s: %s", self.name, reason, exc_info=True)
        finally:
            if not self._stop.is_set():
                self._down(reason)

    def _down(self, reason: str) -> None:
        if self.error is not None:
            return
        self.error = reason
        if self._on_down is not None:
            try:
                self._on_down(reason)
            except Exception:
                logger.exception("%s: on_down failed", self.name)

    def _send_plain(self, peer: bytes, msg: Message) -> None:
        self._send_frame(peer, encode_message(msg))

    def _send_frame(self, peer: bytes, frame: bytes) -> None:
        zmq = self._zmq
        try:
            if self.kind == "router":
                self._sock.send_multipart([peer, frame], zmq.NOBLOCK)
            else:
                self._sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone / queue full: heartbeats and deadlines report it
            logger.debug("%s: send dropped: %s", self.name, exc)

    def _drain_outgoing(self) -> None:
        while True:
            try:
                peer, body = self._pull.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return
            with self._lock:
                session = self._sessions.get(peer if self.kind == "router" else b"")
            if session is not None:
                self._send_frame(peer, session.seal(body))
            elif self.kind == "dealer" and self.error is None and len(self._queued) < _MAX_QUEUED:
                self._queued.append(body)
            else:
                logger.debug("%s: not sent to unauthenticated peer %r", self.name, peer)

    def _drain_incoming(self) -> None:
        zmq = self._zmq
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            want = 2 if self.kind == "router" else 1
            if len(frames) != want:
                peer = frames[0] if self.kind == "router" else b""
                self._unheard(peer, f"a message of {len(frames) - want + 1} frames")
                continue
            peer, frame = (frames[0], frames[1]) if self.kind == "router" else (b"", frames[0])
            try:
                self._receive(peer, frame)
            except Exception:
                self.counters.add("callback_errors")
                logger.exception("%s: handling a message from %r failed; still serving", self.name, peer)

    def _receive(self, peer: bytes, frame: bytes) -> None:
        with self._lock:
            session = self._sessions.get(peer)
        if session is None:
            self._handshake(peer, frame)
            return
        try:
            body = session.open(frame)
        except auth.AuthError as exc:
            self.counters.add("frames_rejected")
            logger.warning("%s: dropped a frame from %r: %s", self.name, peer, exc)
            return
        try:
            msg = decode_message(body)
        except ProtocolError as exc:
            self.counters.add("protocol_errors")
            logger.error("%s: bad message from %r: %s", self.name, peer, exc)
            if self._on_protocol_error is not None:
                self._on_protocol_error(peer, exc)
            return
        self._on_message(peer, msg)

    # ------------------------------------------------------------------------------ handshake
    def _handshake(self, peer: bytes, frame: bytes) -> None:
        try:
            msg = decode_message(frame)
        except ProtocolError as exc:
            self._unheard(peer, f"an undecodable message ({exc})")
            return
        if self.kind == "dealer":
            self._dealer_handshake(msg)
        elif isinstance(msg, AuthStart):
            self._challenges[peer] = (msg.nonce, auth.new_nonce())
            self._challenges.move_to_end(peer)
            while len(self._challenges) > _MAX_PENDING:
                self._challenges.popitem(last=False)
            dealer_nonce, router_nonce = self._challenges[peer]
            proof = auth.router_proof(self._secret, dealer_nonce, router_nonce, peer)
            self._send_plain(peer, AuthChallenge(router_nonce, proof))
        elif isinstance(msg, AuthResponse):
            nonces = self._challenges.pop(peer, None)
            if nonces is None or not auth.proofs_equal(
                auth.dealer_proof(self._secret, *nonces, peer), msg.proof
            ):
                self.counters.add("auth_refused")
                why = "no challenge was issued to it" if nonces is None else "wrong shared secret"
                self._warn(peer, f"refused authentication ({why})")
                self._send_plain(peer, AuthRefused("authentication failed"))
                return
            with self._lock:
                self._sessions[peer] = auth.Session(self._secret, *nonces, peer, "router")
            self.counters.add("peers_authenticated")
            logger.info("%s: peer %r authenticated", self.name, peer)
        else:
            self._unheard(peer, f"{msg.TYPE} before authenticating")
            self._send_plain(peer, AuthRefused("not authenticated"))

    def _dealer_handshake(self, msg: Message) -> None:
        if self.error is not None:
            self._unheard(b"", f"{msg.TYPE} after the handshake failed")
        elif isinstance(msg, AuthChallenge):
            proof = auth.router_proof(self._secret, self._nonce, msg.nonce, self.identity)
            if not auth.proofs_equal(proof, msg.proof):
                self.counters.add("auth_refused")
                reason = (
                    f"the peer at {self.address} did not prove the shared secret (wrong secret on one side, "
                    "or not the decode endpoint)"
                )
                logger.error("%s: %s", self.name, reason)
                self._send_plain(b"", AuthRefused("authentication failed"))
                self._down(reason)
                return
            self._send_plain(
                b"", AuthResponse(auth.dealer_proof(self._secret, self._nonce, msg.nonce, self.identity))
            )
            session = auth.Session(self._secret, self._nonce, msg.nonce, self.identity, "dealer")
            with self._lock:
                self._sessions[b""] = session
            self.counters.add("peers_authenticated")
            for body in self._queued:
                self._send_frame(b"", session.seal(body))
            self._queued.clear()
        elif isinstance(msg, AuthRefused):
            self.counters.add("auth_refused")
            reason = f"the peer at {self.address} refused authentication ({msg.reason[:200]}); check the shared secret"
            logger.error("%s: %s", self.name, reason)
            self._down(reason)
        else:
            self._unheard(b"", f"{msg.TYPE} before authenticating")

    def _unheard(self, peer: bytes, what: str) -> None:
        """Drop what an unauthenticated peer sent."""
        self.counters.add("frames_unauthenticated")
        self._warn(peer, f"dropped {what} from an unauthenticated peer")

    def _warn(self, peer: bytes, what: str) -> None:
        """Log a refusal on a peer's first few, then on every 1000th (a rogue cannot flood the log)."""
        n = self._refused.pop(peer, 0) + 1
        self._refused[peer] = n
        while len(self._refused) > _MAX_PENDING:
            self._refused.popitem(last=False)
        if n <= 3 or n % 1000 == 0:
            logger.warning("%s: peer %r: %s (refusal %d)", self.name, peer, what, n)
