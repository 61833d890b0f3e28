"""Shared-secret authentication of the P/D control plane (DESIGN §9 "Trust").

Secret (:func:`resolve_secret`): ``PDConfig.secret``, else the key file ``PDConfig.secret_file``, else a
key file :data:`KEY_FILE` in the file rendezvous' directory, created owner-only on first use, so that both
sides of a same-host deployment share it. A key file must be a regular file of the current user without
group / other permission bits; it is opened without following a link. Its content, surrounding ASCII
whitespace stripped, is the secret.

Handshake (mutual HMAC-SHA256 challenge-response, a fresh nonce from each side per connection; the
connecting side is the *dealer* (prefill), the bound side the *router* (decode)):

1. dealer -> router ``AUTH_START(nonce_d)``;
2. router -> dealer ``AUTH_CHALLENGE(nonce_r, proof_r)``, ``proof_r = HMAC(secret, "router" | nonce_d |
   nonce_r | identity)``: the dealer checks it before it answers (it talks to a holder of the secret);
3. dealer -> router ``AUTH_RESPONSE(proof_d)``, ``proof_d = HMAC(secret, "dealer" | ...)``.

Both sides then derive one key per direction from the secret, both nonces and the dealer's ZMQ identity
(:class:`Session`); every later frame is ``tag(32) | counter(8, big endian) | msgpack body`` with ``tag =
HMAC(key, counter | body)`` and a counter that only grows, so a frame is accepted only on the connection
it was made for, once, and untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import time
from typing import Any

from torch_kvoffload.pd._files import GROUP_OTHER_ACCESS, open_owned

__all__ = [
    "KEY_FILE",
    "NONCE_BYTES",
    "AuthError",
    "Session",
    "dealer_proof",
    "new_nonce",
    "proofs_equal",
    "read_key_file",
    "resolve_secret",
    "router_proof",
]

#: Name of the key file created in the rendezvous directory when no secret is configured.
KEY_FILE = "kvoffload-pd.key"
NONCE_BYTES = 32
_TAG = 32
_CTR = 8
_LABEL = b"torch-kvoffload pd control v1"
_KEY_WAIT_S = 5.0  # how long a reader waits for a key file another process is writing


class AuthError(Exception):
    """A peer failed to authenticate, or a frame failed its integrity / freshness check."""


# ------------------------------------------------------------------------------------------ secret
def resolve_secret(config: Any, rendezvous: Any) -> bytes:
    """The shared secret of ``config`` (a :class:`~torch_kvoffload.pd.config.PDConfig`): ``secret``, else
    the key file ``secret_file``, else :data:`KEY_FILE` in ``rendezvous.directory`` (created with a random
    32-byte key if missing). ``ValueError`` when the rendezvous has no directory (a metadata service) and
    no secret is configured; ``PermissionError`` / ``ValueError`` for a key file that is not safe."""
    if config.secret is not None:
        return config.secret.get_secret_value().encode()
    if config.secret_file is not None:
        return read_key_file(config.secret_file)
    directory = getattr(rendezvous, "directory", None)
    if directory is None:
        raise ValueError(
            f"pd: the rendezvous {rendezvous!r} has no directory to hold a shared key file; set "
            "PDConfig.secret or PDConfig.secret_file (the same on prefill and decode)"
        )
    path = os.path.join(directory, KEY_FILE)
    with contextlib.suppress(FileExistsError):  # the other side created it first
        _create_key_file(path)
    return read_key_file(path, wait_s=_KEY_WAIT_S)


def _create_key_file(path: str) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, secrets.token_bytes(32).hex().encode() + b"\n")  # one write: readers see all or nothing
        os.fsync(fd)
    finally:
        os.close(fd)


def read_key_file(path: str, wait_s: float = 0.0) -> bytes:
    """The secret in key file ``path``: a regular file owned by this user, no group / other mode bits,
    opened without following a link; its content stripped of surrounding whitespace. An empty file is
    waited for up to ``wait_s`` seconds (another process may be writing it), then a ``ValueError``."""
    where = f"pd: key file {path!r}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = open_owned(path, "pd: key file", forbid=GROUP_OTHER_ACCESS)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{where} cannot be opened: {exc.strerror}") from exc
        try:
            data = os.read(fd, 1 << 16).strip()
        finally:
            os.close(fd)
        if data:
            return data
        if time.monotonic() >= deadline:
            raise ValueError(f"{where} is empty; expected the shared secret")
        time.sleep(0.01)


# --------------------------------------------------------------------------------------- handshake
def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:  # length-prefixed: no two part lists hash alike
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def router_proof(secret: bytes, dealer_nonce: bytes, router_nonce: bytes, identity: bytes) -> bytes:
    """The router's proof of the secret for the connection of dealer ``identity``."""
    return _mac(secret, _LABEL, b"router proof", dealer_nonce, router_nonce, identity)


def dealer_proof(secret: bytes, dealer_nonce: bytes, router_nonce: bytes, identity: bytes) -> bytes:
    """The dealer's proof of the secret for its connection as ``identity``."""
    return _mac(secret, _LABEL, b"dealer proof", dealer_nonce, router_nonce, identity)


def proofs_equal(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


class Session:
    """The keys of one authenticated connection: :meth:`seal` what this side sends, :meth:`open` what it
    receives. ``side`` is ``"router"`` or ``"dealer"``; one I/O thread uses a session."""

    def __init__(self, secret: bytes, dealer_nonce: bytes, router_nonce: bytes, identity: bytes, side: str):
        to_router = _mac(secret, _LABEL, b"dealer to router", dealer_nonce, router_nonce, identity)
        to_dealer = _mac(secret, _LABEL, b"router to dealer", dealer_nonce, router_nonce, identity)
        self._send_key, self._recv_key = (
            (to_dealer, to_router) if side == "router" else (to_router, to_dealer)
        )
        self._sent = 0
        self._received = 0

    def seal(self, body: bytes) -> bytes:
        self._sent += 1
        ctr = self._sent.to_bytes(_CTR, "big")
        return hmac.new(self._send_key, ctr + body, hashlib.sha256).digest() + ctr + body

    def open(self, frame: bytes) -> bytes:
        """The body of ``frame``; :class:`AuthError` if it was not sealed by the peer of this connection,
        was altered, or was already seen (its counter is not above the last accepted one)."""
        if len(frame) < _TAG + _CTR:
            raise AuthError(f"a frame of {len(frame)} bytes is shorter than its authentication tag")
        tag, rest = frame[:_TAG], frame[_TAG:]
        if not hmac.compare_digest(tag, hmac.new(self._recv_key, rest, hashlib.sha256).digest()):
            raise AuthError("a frame failed its authentication tag (not sealed for this connection)")
        ctr = int.from_bytes(rest[:_CTR], "big")
        if ctr <= self._received:
            raise AuthError(f"a replayed frame (counter {ctr}, last accepted {self._received})")
        self._received = ctr
        return rest[_CTR:]
