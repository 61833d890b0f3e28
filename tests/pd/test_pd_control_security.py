"""The P/D control plane against a hostile local peer (DESIGN §9 "Trust").

Rogue clients on loopback — without the secret, with a wrong one, replaying captured frames, sending
malformed or oversized messages, or authenticated but naming stale generations, other slots, other
connections' requests or other requests' destinations — must never be heard, never fail a live request
they do not own, never write outside the request's allocation, and never stop an endpoint: after each
attack a real transfer on the same endpoints completes bit for bit (checked against
:func:`pd_helpers.block_data`, the KV computed independently of the transfer code).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
import time
from types import SimpleNamespace

import msgpack
import pytest
import support.pd_helpers as h
import torch
import zmq

from torch_kvoffload._utils import free_port
from torch_kvoffload.pd import (
    DecodeReceiver,
    FileRendezvous,
    HandshakeError,
    MooncakeMetadataRendezvous,
    PDConfig,
    PDTransferError,
    PrefillSender,
    ProtocolError,
    ShmTransport,
    auth,
)
from torch_kvoffload.pd.control import ControlEndpoint
from torch_kvoffload.pd.messages import (
    AuthChallenge,
    AuthResponse,
    AuthStart,
    Hello,
    HelloAck,
    LayerReady,
    ReadDone,
    ReadFailed,
    decode_message,
    encode_message,
)
from torch_kvoffload.pd.rendezvous import decode_key
from torch_kvoffload.transfer import TransferError

# ------------------------------------------------------------------------------------------ corpus
_pack = msgpack.packb
_ENTRY = {
    "request_id": 1,
    "generation": 1,
    "main_src": [0],
    "main_dst": [0],
    "indexer_src": [],
    "indexer_dst": [],
}
_LAYER = {"type": "LAYER_READY", "seq": 0, "layer": 0, "slot": 0, "member": 0, "ratio": 1,
          "main_block_bytes": [256, 64], "indexer_block_bytes": [], "entries": [_ENTRY]}  # fmt: skip
_HELLO = {"type": "HELLO", "p_rank": 0, "p_tp": 1, "d_tp": 1, "transport": "shm", "regions": {},
          "slots": [{"main": ["a"], "indexer": []}], "num_blocks": 1,
          "compat": {"library_version": "x", "model_fingerprint": "m", "kv_dtype": "bf16", "num_layers": 6,
                     "block_size": 4, "main_layout": [[[32], "bf16"]], "indexer_layout": []}}  # fmt: skip


def _deep(n: int) -> bytes:
    return b"\x91" * n + b"\xc0"  # n nested one-element arrays around nil


#: Malformed control messages: the first is the 12-byte message that used to kill decode's I/O thread.
MALFORMED = [
    _pack({"type": [1]}),
    _pack({"type": {"a": 1}}),
    _pack({"type": None}),
    _pack({"type": b"LAYER_READY"}),  # bytes where str is expected
    _pack({"type": "NOPE"}),
    _pack([1, 2, 3]),
    _pack("LAYER_READY"),
    _pack(17),
    b"\x81\x91\x01\x01",  # a map whose key is an array (unhashable)
    b"\x81\x81\x01\x01\x01",  # a map whose key is a map
    b"\x81\x01\xa4type",  # an int key
    b"\xc1",  # never used
    b"\x92\x01",  # truncated
    _pack({"type": "HEARTBEAT", "time": 1.0}) + b"\x00",  # extra data
    _deep(5000),  # deeper than msgpack's stack
    _pack({**_HELLO, "regions": msgpack.unpackb(_deep(900))}),  # deep, but not a map
    _pack({**_HELLO, "slots": msgpack.unpackb(_deep(900))}),
    b"",
    _pack({"type": "HEARTBEAT", "time": "now"}),
    _pack({"type": "HEARTBEAT", "time": (1 << 64) - 1}),  # huge int
    _pack({"type": "BYE", "reason": b"bytes"}),
    _pack({"type": "BYE"}),
    _pack({**_LAYER, "seq": True}),  # bool where int
    _pack({**_LAYER, "layer": 1 << 63}),
    _pack({**_LAYER, "slot": 1.5}),
    _pack({**_LAYER, "main_block_bytes": [True, 64]}),
    _pack({**_LAYER, "main_block_bytes": [(1 << 64) - 1]}),
    _pack({**_LAYER, "entries": [[1, 2]]}),
    _pack({**_LAYER, "entries": "x"}),
    _pack({**_LAYER, "entries": [{**_ENTRY, "main_dst": "0"}]}),
    _pack({**_LAYER, "entries": [{**_ENTRY, "request_id": (1 << 64) - 1}]}),
    _pack({**_LAYER, "entries": [{**_ENTRY, "generation": None}]}),
    _pack({**_HELLO, "slots": [["a"]]}),
    _pack({**_HELLO, "slots": [{"main": [1]}]}),
    _pack({**_HELLO, "compat": [1]}),
    _pack({**_HELLO, "compat": {**_HELLO["compat"], "main_layout": [[[32], 5]]}}),
    _pack({**_HELLO, "compat": {**_HELLO["compat"], "main_layout": msgpack.unpackb(_deep(900))}}),
    _pack({**_HELLO, "compat": {**_HELLO["compat"], "num_layers": False}}),
    _pack({"type": "HELLO_ACK", "ok": 1, "reason": "", "d_rank": 0, "d_tp": 1}),
    _pack({"type": "READ_DONE", "seq": 0, "layer": 0, "request_ids": [None]}),
    _pack({"type": "READ_FAILED", "seq": 0, "layer": 0, "request_ids": [], "reason": 5}),
    _pack({"type": "AUTH_START", "nonce": b"short"}),
    _pack({"type": "AUTH_START", "nonce": "x" * 32}),
    _pack({"type": "AUTH_RESPONSE", "proof": None}),
    msgpack.packb({"type": "HEARTBEAT", "time": msgpack.ExtType(5, b"x")}),
    msgpack.packb({"type": "HEARTBEAT", "time": msgpack.Timestamp(1, 0)}),
]


def test_decode_message_turns_every_malformed_message_into_a_protocol_error() -> None:
    for raw in MALFORMED:
        with pytest.raises(ProtocolError):
            decode_message(raw)
    # and the well-formed neighbours still decode (the checks are not blanket refusals)
    assert decode_message(_pack({"type": "HEARTBEAT", "time": 3})).time == 3.0
    assert decode_message(_pack(_LAYER)).entries[0].main_dst == [0]
    assert decode_message(_pack(_HELLO)).slots == [{"main": ["a"], "indexer": []}]
    assert decode_message(encode_message(AuthStart(b"n" * 32))) == AuthStart(b"n" * 32)


# ------------------------------------------------------------------------------------------ secret
def _cfg(**kw) -> PDConfig:
    return PDConfig(role="decode", kv_port=free_port(), **kw)


def test_secret_from_config_file_or_a_shared_owner_only_key_file(tmp_path) -> None:
    rdv = FileRendezvous(str(tmp_path / "rdv"))
    assert auth.resolve_secret(_cfg(secret="s3cret-value"), rdv) == b"s3cret-value"
    key = tmp_path / "key"
    key.write_bytes(b"from-a-file\n")
    key.chmod(0o600)
    assert auth.resolve_secret(_cfg(secret_file=str(key)), rdv) == b"from-a-file"
    # the default: one random key file in the rendezvous directory, created owner-only and shared
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(auth.resolve_secret(_cfg(), rdv))) for _ in range(8)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    path = tmp_path / "rdv" / auth.KEY_FILE
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert len(set(results)) == 1 and len(results[0]) == 64  # 32 random bytes, hex
    assert results[0] != auth.resolve_secret(_cfg(), FileRendezvous(str(tmp_path / "other")))


def test_unsafe_key_files_and_a_directoryless_rendezvous_are_clear_errors(tmp_path) -> None:
    rdv = FileRendezvous(str(tmp_path / "rdv"))
    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o640)
    with pytest.raises(PermissionError, match=r"group or others \(mode 0640"):
        auth.resolve_secret(_cfg(secret_file=str(key)), rdv)
    key.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(key)
    with pytest.raises(PermissionError, match="symbolic link"):
        auth.resolve_secret(_cfg(secret_file=str(link)), rdv)
    with pytest.raises(PermissionError, match="not a regular file"):
        auth.resolve_secret(_cfg(secret_file=str(tmp_path)), rdv)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(PermissionError, match="not a regular file"):  # and no hang on open
        auth.resolve_secret(_cfg(secret_file=str(fifo)), rdv)
    with pytest.raises(FileNotFoundError, match="cannot be opened"):
        auth.resolve_secret(_cfg(secret_file=str(tmp_path / "missing")), rdv)
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    empty.chmod(0o600)
    with pytest.raises(ValueError, match="is empty"):
        auth.resolve_secret(_cfg(secret_file=str(empty)), rdv)
    # a default key file planted as a link, or readable by others, is refused, not used
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / auth.KEY_FILE).symlink_to(key)
    with pytest.raises(PermissionError, match="symbolic link"):
        auth.resolve_secret(_cfg(), FileRendezvous(str(planted)))
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / auth.KEY_FILE).write_bytes(b"k" * 64)
    (loose / auth.KEY_FILE).chmod(0o644)
    with pytest.raises(PermissionError, match="mode 0644"):
        auth.resolve_secret(_cfg(), FileRendezvous(str(loose)))
    with pytest.raises(ValueError, match=r"no directory .* set PDConfig.secret or PDConfig.secret_file"):
        auth.resolve_secret(_cfg(), MooncakeMetadataRendezvous("http://127.0.0.1:1/metadata"))


def test_sessions_refuse_altered_replayed_and_foreign_frames() -> None:
    secret, nd, nr = b"k" * 32, auth.new_nonce(), auth.new_nonce()
    dealer = auth.Session(secret, nd, nr, b"id-a", "dealer")
    router = auth.Session(secret, nd, nr, b"id-a", "router")
    other = auth.Session(secret, nd, nr, b"id-b", "router")  # the same nonces, another identity
    wrong = auth.Session(b"x" * 32, nd, nr, b"id-a", "router")
    frames = [dealer.seal(f"msg {i}".encode()) for i in range(3)]
    with pytest.raises(auth.AuthError, match="not sealed for this connection"):
        other.open(frames[0])
    with pytest.raises(auth.AuthError, match="not sealed for this connection"):
        wrong.open(frames[0])
    with pytest.raises(auth.AuthError, match="not sealed"):  # a router does not accept its own direction
        router.open(router.seal(b"x"))
    assert router.open(frames[0]) == b"msg 0"
    altered = frames[1][:-1] + b"X"
    with pytest.raises(auth.AuthError, match="not sealed"):
        router.open(altered)
    assert router.open(frames[2]) == b"msg 2"  # a lost frame is no error
    for f in (frames[0], frames[1], frames[2]):
        with pytest.raises(auth.AuthError, match="replayed"):
            router.open(f)
    with pytest.raises(auth.AuthError, match="shorter"):
        router.open(b"abc")
    assert auth.proofs_equal(auth.dealer_proof(secret, nd, nr, b"i"), auth.dealer_proof(secret, nd, nr, b"i"))
    assert not auth.proofs_equal(
        auth.dealer_proof(secret, nd, nr, b"i"), auth.router_proof(secret, nd, nr, b"i")
    )


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture
def pair(tmp_path):
    """A decode rank (started now) and, on demand, a prefill rank in this process; shm transport."""
    made: list = []

    def make(*, decode_cls=None, requests=h.REQUESTS, **kw):
        cfg_kw = dict(transport="shm", prefill_tp_size=1, decode_tp_size=1, kv_port=free_port(), **kw)
        rdv = str(tmp_path / "rdv")
        dcfg = h.config("decode", **cfg_kw)
        pool, indexers, recvs = h.make_decode(dcfg, rdv, decode_cls)
        s = SimpleNamespace(
            cfg=dcfg, rdv=rdv, pool=pool, idx=indexers[0], recv=recvs[0], sender=None, extra=[]
        )
        s.tickets = h.make_tickets(pool, recvs, requests)
        s.wait_s = dcfg.layer_ack_timeout_s + dcfg.dead_after_s  # a transfer step's bound, from the config

        def prefill(cls=None, **over):
            conn, sender, rt, tr = h.make_prefill_rank(h.config("prefill", **{**cfg_kw, **over}), 0, rdv, cls)
            s.conn, s.sender, s.rt, s.tr = conn, sender, rt, tr
            return conn

        s.prefill = prefill
        made.append(s)
        return s

    yield make
    for s in made:
        if s.sender is not None:
            s.sender.close()
            s.rt.close()
            s.tr.close()
        for x in s.extra:
            x.close()
        s.recv.close()
        s.pool.close()


def _assert_received_exactly(s, tickets) -> None:
    """Every request of ``tickets`` done on both sides, its destinations bit for bit the KV prefill wrote."""
    for t in tickets:
        s.sender.wait_request(t.request_id, timeout=s.wait_s)
        s.recv.wait_request(t.request_id, timeout=s.wait_s)
        assert s.recv.state(t.request_id) == "done"
        n = len(t.main_blocks)
        ib = torch.tensor(t.parts[0].indexer_blocks)
        for layer in range(h.L):
            for c, view in ((0, s.pool.kv_c(layer)), (1, s.pool.k_pe(layer))):
                got = view[torch.tensor(t.main_blocks)]
                assert torch.equal(h.bits(got), h.bits(h.block_data(t.request_id, layer, c, n))), (
                    t,
                    layer,
                    c,
                )
            for c, buf in enumerate(s.idx[layer]):
                got = buf[ib.to(buf.device)]
                assert torch.equal(h.bits(got), h.bits(h.block_data(t.request_id, layer, 2 + c, n))), (
                    t,
                    layer,
                )


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.1f} s: {what}")
        time.sleep(0.01)


class RawPeer:
    """A rogue zmq DEALER on loopback that speaks whatever bytes it is given."""

    def __init__(self, endpoint: str, identity: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def replies(self, timeout: float) -> list:
        out, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(10):
                raw = self.sock.recv()
                try:
                    out.append(decode_message(raw))
                except ProtocolError:
                    out.append(raw)
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _rogue_exports(transport: ShmTransport):
    """Buffers shaped like the real prefill's, exported by the rogue and filled with its own bytes."""
    from torch_kvoffload.layerwise import plan_layer_buffers
    from torch_kvoffload.pd import export_layer_buffers
    from torch_kvoffload.pd.prefill_exports import slot_regions

    buffers = export_layer_buffers(plan_layer_buffers(h.specs(), 2, (0,)), transport)
    for slot in buffers.main + [i for i in buffers.indexer if i is not None]:
        for t in slot:
            t.view(torch.uint8).fill_(0x5A)
    return buffers, slot_regions(buffers)


def _forged_batches(s, buffers, layer: int) -> list[LayerReady]:
    """The LAYER_READY a rogue would send for ``layer``: the real generations and destinations."""
    entries = []
    from torch_kvoffload.pd.messages import LayerEntry

    for t in s.tickets:
        n = len(t.main_blocks)
        entries.append(LayerEntry(t.request_id, t.parts[0].generation, list(range(n)), list(t.main_blocks),
                                  list(range(n)), list(t.parts[0].indexer_blocks)))  # fmt: skip
    main = [t[0].nbytes for t in buffers.main[0]]
    idx = [t[0].nbytes for t in buffers.indexer[0]]
    return [LayerReady(1000 + layer, layer, 0, 0, 1, main, idx, entries)]


def _rogue_hello(s, transport, slots) -> Hello:
    return Hello(h.compat(), 0, 1, 1, "shm", transport.describe(), slots, h.NB)


def _destinations(s, tickets) -> list[torch.Tensor]:
    """The bytes of every destination block of ``tickets`` (pool and indexer, every layer)."""
    out = []
    for t in tickets:
        ib = torch.tensor(t.parts[0].indexer_blocks)
        for layer in range(h.L):
            out += [h.bits(v[torch.tensor(t.main_blocks)]) for v in (s.pool.kv_c(layer), s.pool.k_pe(layer))]
            out += [h.bits(buf[ib.to(buf.device)]) for buf in s.idx[layer]]
    return out


def _untouched(s, before: list[torch.Tensor]) -> None:
    """Nothing was received: every request pending, no layer read, its destinations as they were."""
    assert s.recv.counters.get("layers_received") == 0
    assert all(s.recv.state(t.request_id) == "pending" for t in s.tickets)
    assert all(torch.equal(a, b) for a, b in zip(before, _destinations(s, s.tickets), strict=True))


# ------------------------------------------------------------------------------------- rogue clients
@pytest.mark.parametrize("secret", ["none", "wrong"])
def test_rogue_without_the_secret_is_refused_and_the_real_transfer_completes(pair, secret, caplog) -> None:
    s = pair()
    rogue_tr = ShmTransport()
    s.extra.append(rogue_tr)
    buffers, slots = _rogue_exports(rogue_tr)
    hello, batches = (
        _rogue_hello(s, rogue_tr, slots),
        [b for layer in range(h.L) for b in _forged_batches(s, buffers, layer)],
    )
    rogue = RawPeer(s.recv.endpoint, identity=b"rogue-" + secret.encode())
    s.extra.append(rogue)
    caplog.set_level(logging.WARNING, logger="torch_kvoffload.pd.control")
    before = _destinations(s, s.tickets)
    if secret == "none":
        rogue.send(encode_message(hello))
        for b in batches:
            rogue.send(encode_message(b))
        replies = rogue.replies(1.0)
    else:
        nonce = auth.new_nonce()
        rogue.send(encode_message(AuthStart(nonce)))
        challenge = next(m for m in rogue.replies(1.0) if isinstance(m, AuthChallenge))
        bad = b"not-the-secret"
        rogue.send(
            encode_message(AuthResponse(auth.dealer_proof(bad, nonce, challenge.nonce, b"rogue-wrong")))
        )
        session = auth.Session(bad, nonce, challenge.nonce, b"rogue-wrong", "dealer")
        rogue.send(session.seal(encode_message(hello)))
        for b in batches:
            rogue.send(session.seal(encode_message(b)))
        replies = rogue.replies(1.0)
        assert s.recv._control.counters.get("auth_refused") == 1
    assert not any(isinstance(m, HelloAck) and m.ok for m in replies), replies  # HELLO not acked
    assert not any(isinstance(m, ReadDone | ReadFailed) for m in replies)  # LAYER_READY never acted on
    assert s.recv.counters.get("handshakes") == 0
    _untouched(s, before)
    assert any(f"rogue-{secret}" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    h.run_prefill(s.prefill(), s.tickets)
    _assert_received_exactly(s, s.tickets)


@pytest.mark.parametrize("challenge", ["forged", "none"])
def test_prefill_refuses_an_endpoint_that_cannot_prove_the_secret(tmp_path, challenge: str) -> None:
    """A port squatter advertised as decode that accepts the HELLO and acknowledges every batch (the
    replies of a real decode, replayed): prefill hears none of it and fails the handshake."""
    from torch_kvoffload.pd import TicketPart, TransferTicket

    port = free_port()
    rdv = str(tmp_path / "rdv")
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.ROUTER)
    squatter.setsockopt(zmq.LINGER, 0)
    squatter.bind(f"tcp://127.0.0.1:{port}")
    FileRendezvous(rdv).publish(decode_key(port, 0, 0), {"endpoint": f"tcp://127.0.0.1:{port}"})
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not squatter.poll(10):
                continue
            ident, raw = squatter.recv_multipart()[:2]
            try:
                msg = decode_message(raw)
            except ProtocolError:
                msg = None
            out = [HelloAck(True, "", 0, 1), *(ReadDone(seq, seq, [5]) for seq in range(h.L))]
            if isinstance(msg, LayerReady):
                out.append(ReadDone(msg.seq, msg.layer, [e.request_id for e in msg.entries]))
            if isinstance(msg, AuthStart) and challenge == "forged":
                out.append(AuthChallenge(auth.new_nonce(), os.urandom(32)))
            for m in out:
                squatter.send_multipart([ident, encode_message(m)])

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    cfg = h.config("prefill", transport="shm", kv_port=port, handshake_timeout_s=2.0)
    conn, sender, rt, tr = h.make_prefill_rank(cfg, 0, rdv)
    ticket = TransferTicket.combine(5, 8, 0, (0, 1), [TicketPart(0, 1, (0, 1))])
    match = (
        "did not prove the shared secret" if challenge == "forged" else "never answered the authentication"
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match=match):
            h.run_prefill(conn, [ticket])
        took = time.monotonic() - t0
        assert (
            took < cfg.handshake_timeout_s / 2
            if challenge == "forged"
            else took < 2 * cfg.handshake_timeout_s
        )
        with pytest.raises(KeyError):  # no request was ever tracked, let alone acknowledged
            sender.request_state(5)
        assert sender.counters.get("layers_acked") == 0
    finally:
        stop.set()
        th.join(5)
        sender.close()
        rt.close()
        tr.close()
        squatter.close(0)
        ctx.term()


def test_prefill_and_decode_with_different_secrets_do_not_pair(pair) -> None:
    s = pair(secret="decode-side-secret")
    before = _destinations(s, s.tickets)
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="did not prove the shared secret"):
        h.run_prefill(s.prefill(secret="prefill-side-secret"), s.tickets)
    assert time.monotonic() - t0 < s.cfg.handshake_timeout_s / 2
    assert s.recv.counters.get("handshakes") == 0
    _untouched(s, before)


def test_captured_frames_replayed_on_another_connection_are_refused(pair, monkeypatch) -> None:
    """Every frame the real prefill sent (handshake and sealed), replayed from other identities, is not heard."""
    sent: list = []
    real_send_frame = ControlEndpoint._send_frame

    def recording(self, peer, frame):
        if self.kind == "dealer":
            sent.append(frame)
        return real_send_frame(self, peer, frame)

    monkeypatch.setattr(ControlEndpoint, "_send_frame", recording)
    s = pair(requests=[(5, 8)])
    h.run_prefill(s.prefill(), s.tickets)
    _assert_received_exactly(s, s.tickets)
    counters = s.recv._control.counters
    assert len(sent) >= h.L + 3 and counters.get("peers_authenticated") == 1  # auth, HELLO, layers
    recv_layers = s.recv.counters.get("layers_received")
    frames = list(sent)
    # the same frames in order from a new identity: the handshake is refused (its proof was for another
    # connection and challenge), every sealed frame dropped
    s.recv.release(5)
    s.pool.free(5)
    s.tickets = h.make_tickets(s.pool, [s.recv], [(5, 8)])
    for k in range(2):
        rogue = RawPeer(s.recv.endpoint, identity=f"replayer-{k}".encode())
        s.extra.append(rogue)
        for f in frames:
            rogue.send(f)
        _until(lambda k=k: counters.get("auth_refused") == k + 1, s.wait_s, "the replayed handshake refused")
    _until(
        lambda: counters.get("frames_unauthenticated") == 2 * (len(frames) - 2), s.wait_s, "frames dropped"
    )
    assert counters.get("peers_authenticated") == 1
    assert s.recv.counters.get("layers_received") == recv_layers and s.recv.state(5) == "pending"


# ----------------------------------------------------------------------------------- malformed input
def test_malformed_and_oversized_messages_never_stop_decode(pair) -> None:
    s = pair(max_message_bytes=1 << 16)
    control = s.recv._control
    rogue = RawPeer(s.recv.endpoint, identity=b"garbage")
    s.extra.append(rogue)
    for raw in MALFORMED:
        rogue.send(raw)
    rogue.send(b"a", b"b")  # two frames
    dropped = len(MALFORMED) + 1
    _until(lambda: control.counters.get("frames_unauthenticated") == dropped, s.wait_s, "dropped")
    # the same corpus from an authenticated peer: answered, and nothing else
    answers: list = []
    peer = ControlEndpoint("dealer", s.recv.endpoint, secret=auth.resolve_secret(s.cfg, FileRendezvous(s.rdv)),
                           on_message=lambda _p, m: answers.append(m), name="authenticated-garbage")  # fmt: skip
    s.extra.append(peer)
    for raw in MALFORMED:
        peer.send_bytes(raw)
    _until(lambda: len(answers) >= len(MALFORMED), s.wait_s, "answers to the malformed messages")
    assert all(isinstance(m, ReadFailed) and "undecodable" in m.reason for m in answers)
    assert control.counters.get("protocol_errors") == len(MALFORMED)
    big = RawPeer(s.recv.endpoint, identity=b"big")
    s.extra.append(big)
    big.send(b"\x00" * (1 << 17))  # over max_message_bytes: the connection is dropped
    assert control.error is None and control._thread.is_alive()
    h.run_prefill(s.prefill(max_message_bytes=1 << 16), s.tickets)
    _assert_received_exactly(s, s.tickets)
    assert control.counters.get("callback_errors") == 0
    assert control.counters.get("frames_unauthenticated") == dropped  # the oversized one never arrived


def test_malformed_messages_never_stop_prefill(pair) -> None:
    class Garbling(DecodeReceiver):
        """Sends the malformed corpus (sealed: from the authenticated decode) before its HELLO_ACK."""

        def _reply(self, peer, msg):
            if isinstance(msg, HelloAck):
                for raw in MALFORMED:
                    self._control.send_bytes(raw, peer)
                self._control.send(ReadDone(123456, 0, [5]), peer)  # for no batch: ignored
            super()._reply(peer, msg)

    s = pair(decode_cls=Garbling)
    h.run_prefill(s.prefill(), s.tickets)
    _assert_received_exactly(s, s.tickets)
    control = s.sender._peers[0].control
    assert control.counters.get("protocol_errors") == len(MALFORMED) and control.error is None


# ------------------------------------------------------------------------ stale, replayed, foreign
def test_replays_stale_generations_and_wrong_slots_never_fail_the_live_request(pair) -> None:
    captured: list[LayerReady] = []

    class Capturing(PrefillSender):
        def _layer_ready(self, msg):
            captured.append(msg)
            return msg

    s = pair()
    secret = auth.resolve_secret(s.cfg, FileRendezvous(s.rdv))
    rogue_tr = ShmTransport()
    s.extra.append(rogue_tr)
    buffers, slots = _rogue_exports(rogue_tr)
    answers: list = []
    conn = s.prefill(Capturing)
    refused: list[str] = []

    def attack(layer: int) -> None:
        if layer != 3:
            return
        first = captured[0]  # layer 0, read already (layer 3's buffer is free only after layer 1's read)
        _until(lambda: s.recv.counters.get("layers_received") >= 1, s.wait_s, "layer 0 received")
        # another holder of the secret, paired as prefill rank 0 with buffers of its own
        rogue = ControlEndpoint("dealer", s.recv.endpoint, secret=secret, name="authenticated-rogue",
                                on_message=lambda _p, m: answers.append(m))  # fmt: skip
        s.extra.append(rogue)
        rogue.send(_rogue_hello(s, rogue_tr, slots))
        _until(
            lambda: any(isinstance(m, HelloAck) and m.ok for m in answers), s.wait_s, "the rogue's HELLO_ACK"
        )
        stale = [dataclasses.replace(e, generation=e.generation ^ 1) for e in first.entries]
        legit = s.sender._peers[0].control
        forged = [
            # over the real, authenticated connection
            (legit, dataclasses.replace(first, seq=10_001)),  # a replay of layer 0
            (legit, dataclasses.replace(first, seq=10_002, layer=5, entries=stale)),  # stale generation
            (legit, dataclasses.replace(first, seq=10_003, layer=5, slot=99)),  # a slot never exported
            (legit, dataclasses.replace(first, seq=10_004, layer=5, entries=first.entries * 2)),
            # over another authenticated connection, pointing at the rogue's own buffers
            (rogue, dataclasses.replace(first, seq=10_005)),
            (rogue, dataclasses.replace(_forged_batches(s, buffers, 5)[0], seq=10_006)),
        ]
        for sender, msg in forged:
            sender.send(msg)
        _until(lambda: s.recv.counters.get("batches_refused") == len(forged), s.wait_s, "the refusals")
        rogue_answers = lambda: [m.reason for m in answers if isinstance(m, ReadFailed)]  # noqa: E731
        _until(lambda: len(rogue_answers()) == 2, s.wait_s, "the rogue's two READ_FAILED")
        refused.extend(rogue_answers())

    h.run_prefill(conn, s.tickets, on_layer=attack)
    _assert_received_exactly(s, s.tickets)
    c = s.recv.counters.snapshot()
    assert c["requests_failed"] == 0 and c["read_failures"] == 0 and c["batches_refused"] == 6
    assert c["layers_received"] == h.L
    assert len(refused) == 2
    assert "arrived twice" in refused[0] or "another connection" in refused[0]
    assert "another connection" in refused[1]


def test_a_late_batch_of_a_released_generation_never_fails_the_reused_id(pair) -> None:
    s = pair(requests=[(5, 8)])
    old = s.tickets[0]
    s.recv.release(5)
    s.pool.free(5)
    new = h.make_tickets(s.pool, [s.recv], [(5, 8)])[0]  # the same request id, handed out again
    assert new.parts[0].generation != old.parts[0].generation
    conn = s.prefill()
    with pytest.raises(TransferError, match=r"generation .* not expected"):
        h.run_prefill(conn, [old])
        s.sender.wait_request(5, timeout=s.wait_s)
    assert s.recv.state(5) == "pending" and s.recv.counters.get("requests_failed") == 0
    assert s.recv.counters.get("batches_refused") >= 1
    sent = s.sender.counters
    _until(lambda: sent.get("layers_failed") == sent.get("layers_sent"), s.wait_s, "every refusal answered")
    s.rt.reset()  # prefill's buffers were poisoned by the refused layers
    h.run_prefill(conn, [new])
    _assert_received_exactly(s, [new])


# ----------------------------------------------------------------------------- destination blocks
@pytest.mark.parametrize("where", ["main-other", "indexer-other", "main-outside", "indexer-outside"])
def test_destination_blocks_outside_the_allocation_are_refused(pair, where: str) -> None:
    """A batch naming destination blocks other than the request's own fails that request; nothing lands
    in another request's destinations (here a request expected, not yet sent, whose blocks stay zero)."""
    s = pair(requests=[(5, 8), (6, 8)])
    victim = s.tickets[1]
    comp, kind = where.split("-")

    class Redirecting(PrefillSender):
        def _layer_ready(self, msg):
            if msg.layer != 2:
                return msg
            e = msg.entries[0]
            if kind == "other":
                dst = list(victim.main_blocks if comp == "main" else victim.parts[0].indexer_blocks)
            else:
                dst = [h.POOL_BLOCKS + 3 + i for i in range(len(e.main_dst))]
            field = "main_dst" if comp == "main" else "indexer_dst"
            return dataclasses.replace(msg, entries=[dataclasses.replace(e, **{field: dst})])

    before = _destinations(s, [victim])
    conn = s.prefill(Redirecting)
    with pytest.raises(TransferError, match=f"{comp} destination blocks"):
        h.run_prefill(conn, s.tickets[:1])
        s.sender.wait_request(5, timeout=s.wait_s)
    assert s.recv.state(5) == "failed" and "layer 2" in s.recv.error(5)
    assert s.recv.state(6) == "pending"
    _until(lambda: s.recv.counters.get("layers_received") == 2, s.wait_s, "layers 0 and 1 received")
    after = _destinations(s, [victim])
    assert [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if not torch.equal(a, b)] == []


# ------------------------------------------------------------------------------- I/O thread death
class _Die(BaseException):
    """What no ``except Exception`` contains: the I/O thread ends."""


def test_a_dead_decode_io_thread_fails_its_waiters_at_once(pair) -> None:
    class Dying(DecodeReceiver):
        def _on_message(self, peer, msg):
            if isinstance(msg, LayerReady) and msg.layer == 2:
                raise _Die("injected")
            super()._on_message(peer, msg)

    s = pair(decode_cls=Dying)
    conn = s.prefill()
    raised: list = []

    def run() -> None:
        try:
            h.run_prefill(conn, s.tickets)
        except TransferError as exc:  # prefill: the silent decode fails the layer at its deadline
            raised.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    t0 = time.monotonic()
    for t in s.tickets:
        with pytest.raises(PDTransferError, match="control I/O thread died: _Die: injected"):
            s.recv.wait_request(t.request_id, timeout=s.wait_s)
    assert time.monotonic() - t0 < s.cfg.layer_ack_timeout_s
    with pytest.raises(PDTransferError, match="cannot receive request 99"):
        s.recv.expect(99, 4, [30], [30])
    th.join(2 * s.wait_s)
    assert raised


def test_a_dead_prefill_io_thread_fails_its_waiters_at_once(pair) -> None:
    class Dying(PrefillSender):
        def _on_message(self, peer, msg):
            if isinstance(msg, ReadDone) and msg.layer == 2:
                raise _Die("injected")
            super()._on_message(peer, msg)

    s = pair()
    conn = s.prefill(Dying)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="control I/O thread died: _Die: injected"):
        h.run_prefill(conn, s.tickets)
        for t in s.tickets:
            s.sender.wait_request(t.request_id, timeout=s.wait_s)
    assert time.monotonic() - t0 < s.cfg.layer_ack_timeout_s
    for t in s.tickets:
        assert s.sender.request_state(t.request_id) == "failed"


def test_a_dead_prefill_io_thread_fails_the_handshake_at_once(pair) -> None:
    class Dying(PrefillSender):
        def _on_message(self, peer, msg):
            if isinstance(msg, HelloAck):
                raise _Die("injected")
            super()._on_message(peer, msg)

    s = pair()
    conn = s.prefill(Dying)
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match="control I/O thread died: _Die: injected"):
        h.run_prefill(conn, s.tickets)
    assert time.monotonic() - t0 < s.cfg.handshake_timeout_s / 2


def test_an_unexpected_error_handling_a_batch_is_answered_and_decode_keeps_serving(pair) -> None:
    class Broken(DecodeReceiver):
        def _read(self, peer, ops, layer):
            if layer == 2 and not getattr(self, "broke", False):
                self.broke = True
                raise RuntimeError("injected")
            return super()._read(peer, ops, layer)

    s = pair(decode_cls=Broken, requests=[(5, 8)])
    conn = s.prefill()
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="layer 2 failed unexpectedly: RuntimeError: injected"):
        h.run_prefill(conn, s.tickets)
        s.sender.wait_request(5, timeout=s.wait_s)
    assert time.monotonic() - t0 < s.cfg.layer_ack_timeout_s  # answered, not left to the ack deadline
    assert s.recv.state(5) == "failed" and "injected" in s.recv.error(5)
    sent = s.sender.counters
    _until(
        lambda: sent.get("layers_failed") + sent.get("layers_acked") == sent.get("layers_sent"),
        s.wait_s,
        "answers",
    )
    s.rt.reset()
    s.recv.release(5)
    s.pool.free(5)
    again = h.make_tickets(s.pool, [s.recv], [(6, 8)])
    h.run_prefill(conn, again)
    _assert_received_exactly(s, again)
