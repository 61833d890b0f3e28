"""Control-plane messages of P/D transfer: typed classes, msgpack on the wire, validated when decoded.

Every message is a msgpack map with a ``"type"`` key. :func:`decode_message` rejects unknown types,
missing keys and wrongly typed values with :class:`ProtocolError` naming the message and the field, so a
peer speaking another version fails loudly instead of being misread.

Messages: ``HELLO`` (prefill -> decode: compatibility record, topology, exported regions) and
``HELLO_ACK`` (decode -> prefill: accepted or the mismatch); ``LAYER_READY`` (one batch per layer:
requests, source blocks, destination blocks, member, TP ratio, the source block sizes); ``READ_DONE`` /
``READ_FAILED`` (with the reason); ``HEARTBEAT`` both ways; ``BYE`` on orderly close. Before any of
them, the authentication handshake (:mod:`torch_kvoffload.pd.auth`): ``AUTH_START``, ``AUTH_CHALLENGE``,
``AUTH_RESPONSE`` and ``AUTH_REFUSED``.

Every field is checked for its type (``bool`` is not an ``int``, ``bytes`` not a ``str``), ints for the
signed 64-bit range, the nested layouts and slot tables for their structure; anything else a peer can
put in a message ends in :class:`ProtocolError`, never in another exception.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "AuthChallenge",
    "AuthRefused",
    "AuthResponse",
    "AuthStart",
    "Bye",
    "Compatibility",
    "Heartbeat",
    "Hello",
    "HelloAck",
    "LayerEntry",
    "LayerReady",
    "Message",
    "ProtocolError",
    "ReadDone",
    "ReadFailed",
    "decode_message",
    "encode_message",
    "import_msgpack",
    "import_zmq",
]


class ProtocolError(ValueError):
    """A control-plane message that cannot be understood (wrong type, missing or ill-typed field)."""


def import_msgpack() -> Any:
    try:
        return importlib.import_module("msgpack")
    except ImportError as exc:
        raise ImportError(
            "torch_kvoffload.pd needs msgpack for its control plane: pip install 'torch-kvoffload[pd]' "
            f"(or pip install msgpack): {exc}"
        ) from exc


def import_zmq() -> Any:
    try:
        return importlib.import_module("zmq")
    except ImportError as exc:
        raise ImportError(
            "torch_kvoffload.pd needs pyzmq for its control plane: pip install 'torch-kvoffload[pd]' "
            f"(or pip install pyzmq): {exc}"
        ) from exc


_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and _INT_MIN <= v <= _INT_MAX


def _field(msg: str, data: dict, key: str, kind: Any) -> Any:
    if key not in data:
        raise ProtocolError(f"{msg}: missing field {key!r}")
    value = data[key]
    if kind == "ints":
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise ProtocolError(
                f"{msg}: field {key!r} must be a list of ints (signed 64-bit), got {_short(value)}"
            )
        return value
    if kind is float and _is_int(value):
        return float(value)
    if kind is int and not _is_int(value):
        raise ProtocolError(f"{msg}: field {key!r} must be int, got {_short(value)} (a signed 64-bit int)")
    if kind is not None and not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ProtocolError(f"{msg}: field {key!r} must be {names}, got {type(value).__name__}")
    return value


def _short(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{type(value).__name__} {str(value)[:60]}"
    return type(value).__name__


def _layout(msg: str, key: str, value: list) -> list:
    """``[[row_shape ints], dtype_name], ...`` or a ProtocolError."""
    for item in value:
        if (
            not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], list)
            or not all(_is_int(d) for d in item[0]) or not isinstance(item[1], str)
        ):  # fmt: skip
            raise ProtocolError(f"{msg}: {key!r} must be a list of [row shape ints, dtype name] pairs")
    return value


def _bytes(msg: str, data: dict, key: str, size: int) -> bytes:
    value = _field(msg, data, key, bytes)
    if len(value) != size:
        raise ProtocolError(f"{msg}: field {key!r} must be {size} bytes, got {len(value)}")
    return value


@dataclass(frozen=True)
class Compatibility:
    """What both sides must agree on before any data moves.

    ``main_layout`` / ``indexer_layout``: per component ``[row_shape, dtype_name]`` — the shape of one
    token row (``[kv_lora_rank]``, ``[rope_dim]``; ``[index_dim]`` and the int8 scale ``[1]``) and its
    dtype; an empty indexer layout means no indexer.
    """

    library_version: str
    model_fingerprint: str
    kv_dtype: str
    num_layers: int
    block_size: int
    main_layout: list = field(default_factory=list)
    indexer_layout: list = field(default_factory=list)

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> Compatibility:
        if not isinstance(data, dict):
            raise ProtocolError(f"HELLO: 'compat' must be a map, got {type(data).__name__}")
        kinds = {"library_version": str, "model_fingerprint": str, "kv_dtype": str, "num_layers": int,
                 "block_size": int, "main_layout": list, "indexer_layout": list}  # fmt: skip
        kw = {k: _field("compat", data, k, t) for k, t in kinds.items()}
        for key in ("main_layout", "indexer_layout"):
            _layout("HELLO compat", key, kw[key])
        return cls(**kw)

    def mismatches(self, other: Compatibility) -> list[str]:
        """One line per differing field, ``"field: ours != theirs"``."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if _norm(a) != _norm(b):
                out.append(f"{f.name}: {a!r} != {b!r}")
        return out


def _norm(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return [_norm(x) for x in v]
    return v


class Message:
    """Base of the control-plane messages."""

    TYPE: ClassVar[str] = ""
    _kinds: ClassVar[dict[str, Any]] = {}

    def to_wire(self) -> dict:
        out = {"type": self.TYPE}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = v.to_wire() if hasattr(v, "to_wire") else v
        return out

    @classmethod
    def from_wire(cls, data: dict) -> Message:
        return cls(**{k: _field(cls.TYPE, data, k, t) for k, t in cls._kinds.items()})


@dataclass(frozen=True)
class Hello(Message):
    """Prefill rank -> decode rank: the first message of an endpoint pair.

    ``slots[s]``: ``{"main": [region ids], "indexer": [region ids]}`` of physical buffer ``s``;
    ``regions``: the transport's description of those regions (:meth:`Transport.describe`).
    """

    TYPE: ClassVar[str] = "HELLO"
    compat: Compatibility
    p_rank: int
    p_tp: int
    d_tp: int
    transport: str
    regions: dict
    slots: list
    num_blocks: int

    _kinds: ClassVar[dict[str, Any]] = {"p_rank": int, "p_tp": int, "d_tp": int, "transport": str,
                                        "regions": dict, "slots": list, "num_blocks": int}  # fmt: skip

    @classmethod
    def from_wire(cls, data: dict) -> Hello:
        kw = {k: _field(cls.TYPE, data, k, t) for k, t in cls._kinds.items()}
        for slot in kw["slots"]:
            if not (
                isinstance(slot, dict) and set(slot) <= {"main", "indexer"}
                and all(isinstance(v, list) and all(isinstance(r, str) for r in v) for v in slot.values())
            ):  # fmt: skip
                raise ProtocolError(
                    "HELLO: 'slots' must be maps {'main': [region ids], 'indexer': [region ids]}"
                )
        return cls(compat=Compatibility.from_wire(_field(cls.TYPE, data, "compat", dict)), **kw)


@dataclass(frozen=True)
class HelloAck(Message):
    TYPE: ClassVar[str] = "HELLO_ACK"
    ok: bool
    reason: str
    d_rank: int
    d_tp: int
    _kinds: ClassVar[dict[str, Any]] = {"ok": bool, "reason": str, "d_rank": int, "d_tp": int}


@dataclass(frozen=True)
class LayerEntry:
    """One request's share of a layer: blocks ``main_src[i] -> main_dst[i]`` (main KV, member 0 only) and
    ``indexer_src[i] -> indexer_dst[i]`` (this member's indexer range); ``generation`` is the decode
    destination's generation the blocks were allocated under."""

    request_id: int
    generation: int
    main_src: list
    main_dst: list
    indexer_src: list
    indexer_dst: list

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> LayerEntry:
        if not isinstance(data, dict):
            raise ProtocolError(f"LAYER_READY: an entry must be a map, got {type(data).__name__}")
        kinds = {"request_id": int, "generation": int, "main_src": "ints", "main_dst": "ints",
                 "indexer_src": "ints", "indexer_dst": "ints"}  # fmt: skip
        return cls(**{k: _field("LAYER_READY entry", data, k, t) for k, t in kinds.items()})


@dataclass(frozen=True)
class LayerReady(Message):
    """Prefill -> decode: ``layer`` sits in physical buffer ``slot``; pull ``entries``.

    ``main_block_bytes`` / ``indexer_block_bytes``: bytes of one block of each source component, checked
    by decode against its destinations before any read.
    """

    TYPE: ClassVar[str] = "LAYER_READY"
    seq: int
    layer: int
    slot: int
    member: int
    ratio: int
    main_block_bytes: list
    indexer_block_bytes: list
    entries: list

    _kinds: ClassVar[dict[str, Any]] = {"seq": int, "layer": int, "slot": int, "member": int, "ratio": int,
                                        "main_block_bytes": "ints", "indexer_block_bytes": "ints"}  # fmt: skip

    def to_wire(self) -> dict:
        out = super().to_wire()
        out["entries"] = [e.to_wire() for e in self.entries]
        return out

    @classmethod
    def from_wire(cls, data: dict) -> LayerReady:
        kw = {k: _field(cls.TYPE, data, k, t) for k, t in cls._kinds.items()}
        entries = [LayerEntry.from_wire(e) for e in _field(cls.TYPE, data, "entries", list)]
        return cls(entries=entries, **kw)


@dataclass(frozen=True)
class ReadDone(Message):
    TYPE: ClassVar[str] = "READ_DONE"
    seq: int
    layer: int
    request_ids: list
    _kinds: ClassVar[dict[str, Any]] = {"seq": int, "layer": int, "request_ids": "ints"}


@dataclass(frozen=True)
class ReadFailed(Message):
    TYPE: ClassVar[str] = "READ_FAILED"
    seq: int
    layer: int
    request_ids: list
    reason: str
    _kinds: ClassVar[dict[str, Any]] = {"seq": int, "layer": int, "request_ids": "ints", "reason": str}


@dataclass(frozen=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "HEARTBEAT"
    time: float
    _kinds: ClassVar[dict[str, Any]] = {"time": float}


@dataclass(frozen=True)
class Bye(Message):
    TYPE: ClassVar[str] = "BYE"
    reason: str
    _kinds: ClassVar[dict[str, Any]] = {"reason": str}


@dataclass(frozen=True)
class AuthStart(Message):
    """Dealer -> router: the dealer's fresh nonce (:mod:`torch_kvoffload.pd.auth`)."""

    TYPE: ClassVar[str] = "AUTH_START"
    nonce: bytes

    @classmethod
    def from_wire(cls, data: dict) -> AuthStart:
        return cls(_bytes(cls.TYPE, data, "nonce", _NONCE))


@dataclass(frozen=True)
class AuthChallenge(Message):
    """Router -> dealer: the router's fresh nonce and its proof of the secret."""

    TYPE: ClassVar[str] = "AUTH_CHALLENGE"
    nonce: bytes
    proof: bytes

    @classmethod
    def from_wire(cls, data: dict) -> AuthChallenge:
        return cls(_bytes(cls.TYPE, data, "nonce", _NONCE), _bytes(cls.TYPE, data, "proof", _PROOF))


@dataclass(frozen=True)
class AuthResponse(Message):
    """Dealer -> router: the dealer's proof of the secret."""

    TYPE: ClassVar[str] = "AUTH_RESPONSE"
    proof: bytes

    @classmethod
    def from_wire(cls, data: dict) -> AuthResponse:
        return cls(_bytes(cls.TYPE, data, "proof", _PROOF))


@dataclass(frozen=True)
class AuthRefused(Message):
    """Either side: authentication failed, nothing this connection sends is heard."""

    TYPE: ClassVar[str] = "AUTH_REFUSED"
    reason: str
    _kinds: ClassVar[dict[str, Any]] = {"reason": str}


_NONCE, _PROOF = 32, 32  # auth.NONCE_BYTES, SHA-256 digest size

_ALL = (Hello, HelloAck, LayerReady, ReadDone, ReadFailed, Heartbeat, Bye)
_TYPES: dict[str, type[Message]] = {
    c.TYPE: c for c in (*_ALL, AuthStart, AuthChallenge, AuthResponse, AuthRefused)
}


def encode_message(msg: Message) -> bytes:
    return import_msgpack().packb(msg.to_wire(), use_bin_type=True)


def decode_message(raw: bytes) -> Message:
    """The message in ``raw``; :class:`ProtocolError` — and no other exception — if it is not one."""
    msgpack = import_msgpack()
    try:
        # map keys must be str: no unhashable or odd keys reach the field checks
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises ValueError, TypeError, StackError, ExtraData, ...
        raise ProtocolError(
            f"control plane: undecodable message ({len(raw)} bytes): {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(data, dict):
        raise ProtocolError(f"control plane: a message must be a map, got {type(data).__name__}")
    kind = data.get("type")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(
            f"control plane: unknown message type {_short(kind) if not isinstance(kind, str) else repr(kind[:40])}; "
            f"expected one of {sorted(_TYPES)}"
        )
    try:
        return cls.from_wire(data)
    except ProtocolError:
        raise
    except Exception as exc:  # a check this module forgot: still the peer's fault, never the endpoint's
        raise ProtocolError(f"{kind}: malformed message: {type(exc).__name__}: {exc}") from exc
