"""Configuration of disaggregated prefill -> decode transfer (DESIGN §9) and its rank / port rules."""

from __future__ import annotations

import ipaddress
import math
import re
import urllib.parse
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from torch_kvoffload._utils import check_int
from torch_kvoffload.config import ConfigModel, parse_lax_bool

__all__ = ["TRANSPORTS", "PDConfig", "decode_rank_of", "endpoint_port", "split_range"]

#: Mooncake TransferEngine protocols a P/D deployment may ask for (the TCP / RDMA engines of the wheel).
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
#: Schemes of a Mooncake metadata server URL (besides ``"P2PHANDSHAKE"``: no server).
MOONCAKE_METADATA_SCHEMES = ("http", "https", "etcd", "redis")
#: Upper bound of every timeout / interval: far beyond any useful wait, far below ``threading.TIMEOUT_MAX``.
MAX_SECONDS = 86400.0
#: Upper bound of retry / miss counts.
MAX_RETRIES = 100

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_MASK = str(SecretStr("x"))  # what str() and JSON dumps write instead of a secret

#: Bulk-data transports: same-host shared memory, Mooncake TransferEngine (TCP / RDMA), MemFabric (Ascend).
TRANSPORTS = ("shm", "mooncake", "memfabric")


def decode_rank_of(p_rank: int, p_tp: int, d_tp: int) -> tuple[int, int]:
    """``(d_rank, member)`` of prefill TP rank ``p_rank``: ``ratio = p_tp // d_tp``, ``d_rank = p_rank //
    ratio``, ``member = p_rank % ratio``. Raises ``ValueError`` unless ``p_tp >= d_tp``, ``p_tp % d_tp ==
    0`` and ``0 <= p_rank < p_tp``."""
    p_tp = check_int("decode_rank_of", "p_tp", p_tp, minimum=1)
    d_tp = check_int("decode_rank_of", "d_tp", d_tp, minimum=1)
    p_rank = check_int("decode_rank_of", "p_rank", p_rank, minimum=0, maximum=p_tp - 1)
    if p_tp < d_tp or p_tp % d_tp:
        raise ValueError(
            f"decode_rank_of: prefill TP {p_tp} must be >= decode TP {d_tp} and a multiple of it"
        )
    ratio = p_tp // d_tp
    return p_rank // ratio, p_rank % ratio


def endpoint_port(kv_port: int, dp_rank: int, tp_rank: int, tp_size: int) -> int:
    """The control-plane port of decode rank ``(dp_rank, tp_rank)`` of a decode side with ``tp_size`` ranks
    per DP replica: ``kv_port + dp_rank * tp_size + tp_rank`` (DP and TP endpoints never overlap).

    ``ValueError`` naming the argument for a rank out of range or a port outside 1..65535.
    """
    if tp_size <= 0:
        raise ValueError(f"endpoint_port: tp_size must be positive, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"endpoint_port: tp_rank {tp_rank} out of range [0, {tp_size})")
    if dp_rank < 0:
        raise ValueError(f"endpoint_port: dp_rank must be >= 0, got {dp_rank}")
    port = kv_port + dp_rank * tp_size + tp_rank
    if not 0 < port < 65536:
        raise ValueError(f"endpoint_port: port {port} out of range (1..65535)")
    return port


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[begin, end)`` of part ``index`` when ``n`` items are cut into ``parts`` contiguous, disjoint,
    near-equal ranges (the first ``n % parts`` one longer); empty ranges when ``n < parts``."""
    base, extra = divmod(n, parts)
    begin = index * base + min(index, extra)
    return begin, begin + base + (1 if index < extra else 0)


def check_host(field: str, value: Any) -> str:
    """``value`` if it is a concrete IPv4 address or an RFC 1123 host name (it becomes the host of a
    ``tcp://host:port`` endpoint that is both bound and advertised); ``ValueError`` naming ``field``
    otherwise."""
    expected = "an IPv4 address (not 0.0.0.0, multicast or broadcast) or an RFC 1123 host name"
    if not isinstance(value, str):
        raise ValueError(f"pd: {field} expected {expected}, got {value!r}")
    try:
        addr = ipaddress.ip_address(value)
    except ValueError:
        addr = None
    if addr is not None:
        if addr.version != 4:
            raise ValueError(
                f"pd: {field} expected {expected}, got {value!r} (IPv6 endpoints are not supported)"
            )
        if addr.is_unspecified or addr.is_multicast or value == "255.255.255.255":
            raise ValueError(f"pd: {field} expected {expected}, got {value!r} (peers cannot connect to it)")
        return value
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if (
        not value
        or len(value) > 253
        or not all(_LABEL.fullmatch(label) for label in labels)
        or labels[-1].isdigit()  # a malformed dotted IPv4 address, not a name
    ):
        raise ValueError(f"pd: {field} expected {expected}, got {value!r}")
    return value


def _check_url(field: str, value: str, schemes: tuple[str, ...], *, need_port: bool = False) -> str:
    """``value`` if it is ``scheme://host[:port][/path]`` with ``scheme`` in ``schemes``, a valid host,
    a port in 1..65535 (required with ``need_port``) and no credentials."""
    expected = f"a URL {'|'.join(schemes)}://host{':port' if need_port else '[:port]'}[/path]"
    try:
        url = urllib.parse.urlsplit(value)
        port = url.port
    except ValueError as exc:
        raise ValueError(f"pd: {field} expected {expected}, got {value!r} ({exc})") from None
    if url.scheme not in schemes or not url.hostname or url.username is not None or url.password is not None:
        raise ValueError(f"pd: {field} expected {expected}, got {value!r}")
    if (need_port and port is None) or port == 0 or any(c.isspace() for c in value):
        raise ValueError(f"pd: {field} expected {expected}, got {value!r}")
    check_host(f"{field} host", url.hostname)
    return value


class PDConfig(ConfigModel):
    """Disaggregated prefill -> decode KV transfer.

    Fields
    ------
    role : ``"prefill"`` (sends KV) or ``"decode"`` (pulls it).
    transport : ``"shm"`` (same host, default), ``"mooncake"`` (Mooncake TransferEngine) or
        ``"memfabric"`` (``memfabric_hybrid``, Ascend).
    host : the address decode endpoints bind and advertise (loopback by default): an IPv4 address other
        than 0.0.0.0 / multicast / broadcast, or an RFC 1123 host name.
    kv_port : base control-plane port; decode rank ``(dp, tp)`` listens on
        :func:`endpoint_port` ``(kv_port, dp, tp, decode_tp_size)``, which must lie in 1..65535 for every rank.
    prefill_tp_size, prefill_dp_size, decode_tp_size, decode_dp_size : parallel sizes of both sides; ``prefill_tp_size >= decode_tp_size``
        and ``prefill_tp_size % decode_tp_size == 0``.
    handshake_timeout_s : the first metadata handshake of an endpoint fails after this (default 100 s).
    layer_ack_timeout_s : a layer whose READ_DONE / READ_FAILED has not arrived this long after its
        layer-ready fails with an error naming the layer, requests and peer.
    read_retries : extra attempts of a failed bulk read before READ_FAILED.
    heartbeat_interval_s, heartbeat_misses : both sides send a heartbeat every interval; a peer silent
        for ``interval * misses`` (default 0.4 s * 4 = 1.6 s) is dead.
        Every ``*_s`` field is a finite number of seconds in (0, 86400]; ``read_retries`` is in 0..100,
        ``heartbeat_misses`` in 1..100.
    rendezvous : where decode advertises its endpoints — a directory (embedded default; one host) or a
        Mooncake HTTP metadata server URL ``http(s)://host[:port]/path``; ``None``: a directory under the
        system temp dir named after ``kv_port``. The directory and its records must belong to the user
        and not be group / world writable.
    mooncake_protocol, mooncake_metadata_server : Mooncake TransferEngine protocol (``"tcp"`` /
        ``"rdma"``) and metadata server (``"P2PHANDSHAKE"``: none needed; else an
        ``http(s)`` / ``etcd`` / ``redis`` ``://host[:port]`` URL).
    memfabric_store_url : ``tcp://ip:port`` of the MemFabric config store (``"memfabric"`` transport).
    kvpp_enabled : whether KVPP is on for this node; a decode-only node cannot run KVPP.
    secret, secret_file : the shared secret every control-plane peer proves before it is heard — the
        value itself (kept out of ``repr``, ``str`` and JSON dumps) or the path of a key file holding it
        (its owner and mode are checked where it is read); at most one of them.
    max_message_bytes : the largest control-plane message a socket accepts (ZMQ ``MAXMSGSIZE``); a
        bigger one drops the connection. 1 KiB < value <= 1 GiB (default 1 MiB).
    """

    role: Literal["prefill", "decode"]
    transport: str = "shm"
    host: str = "127.0.0.1"
    kv_port: int = 30000
    prefill_tp_size: int = Field(default=1, ge=1)
    prefill_dp_size: int = Field(default=1, ge=1)
    decode_tp_size: int = Field(default=1, ge=1)
    decode_dp_size: int = Field(default=1, ge=1)
    handshake_timeout_s: float = 100.0
    layer_ack_timeout_s: float = 10.0
    read_retries: int = 2
    heartbeat_interval_s: float = 0.4
    heartbeat_misses: int = 4
    rendezvous: str | None = None
    mooncake_protocol: str = "tcp"
    mooncake_metadata_server: str = "P2PHANDSHAKE"
    memfabric_store_url: str | None = None
    kvpp_enabled: bool = False
    secret: SecretStr | None = None
    secret_file: str | None = None
    max_message_bytes: int = Field(default=1 << 20, gt=1 << 10, le=1 << 30)

    @field_validator("kvpp_enabled", mode="before")
    @classmethod
    def _lax_bool(cls, value: Any, info: Any) -> bool:
        return parse_lax_bool(info.field_name, value)

    @field_validator("handshake_timeout_s", "layer_ack_timeout_s", "heartbeat_interval_s")
    @classmethod
    def _seconds(cls, value: float, info: Any) -> float:
        if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
            raise ValueError(
                f"pd: {info.field_name} expected a finite number of seconds in (0, {MAX_SECONDS:g}], got {value!r}"
            )
        return value

    @field_validator("read_retries", "heartbeat_misses")
    @classmethod
    def _count(cls, value: int, info: Any) -> int:
        low = 0 if info.field_name == "read_retries" else 1
        if not low <= value <= MAX_RETRIES:
            raise ValueError(f"pd: {info.field_name} expected an int in {low}..{MAX_RETRIES}, got {value!r}")
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str, info: Any) -> str:
        return check_host(info.field_name, value)

    @field_validator("mooncake_protocol", mode="before")
    @classmethod
    def _mooncake_protocol(cls, value: Any) -> str:
        name = value.lower() if isinstance(value, str) else value
        if name not in MOONCAKE_PROTOCOLS:
            raise ValueError(
                f"pd: mooncake_protocol expected one of {list(MOONCAKE_PROTOCOLS)}, got {value!r}"
            )
        return name

    @field_validator("mooncake_metadata_server")
    @classmethod
    def _metadata_server(cls, value: str, info: Any) -> str:
        if value == "P2PHANDSHAKE":
            return value
        return _check_url(info.field_name, value, MOONCAKE_METADATA_SCHEMES)

    @field_validator("memfabric_store_url")
    @classmethod
    def _store_url(cls, value: str | None, info: Any) -> str | None:
        return value if value is None else _check_url(info.field_name, value, ("tcp",), need_port=True)

    @field_validator("rendezvous")
    @classmethod
    def _rendezvous(cls, value: str | None, info: Any) -> str | None:
        if value is None:
            return value
        expected = "a directory path or an http(s)://host[:port]/path URL of a Mooncake metadata server"
        if "://" in value or value.lower().startswith(("http:", "https:")):
            return _check_url(info.field_name, value, ("http", "https"))
        if not value.strip() or "\0" in value or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:/", value):
            raise ValueError(f"pd: rendezvous expected {expected}, got {value!r}")
        return value

    @field_validator("secret")
    @classmethod
    def _secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return value
        text = value.get_secret_value()
        if not text:
            raise ValueError("pd: secret is empty; expected a non-empty shared secret (or use secret_file)")
        if text == _MASK:
            # a JSON dump writes the mask in place of the secret: reloading it must not pass for a secret
            raise ValueError(
                f"pd: secret is the mask {_MASK!r} a JSON dump writes in its place; pass the secret itself "
                "or secret_file"
            )
        return value

    @field_validator("secret_file")
    @classmethod
    def _secret_file(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or "\0" in value):
            raise ValueError(f"pd: secret_file must be a path, got {value!r}")
        return value

    @field_validator("transport", mode="before")
    @classmethod
    def _transport(cls, value: Any) -> str:
        name = str(value).strip().lower()
        if name not in TRANSPORTS:
            raise ValueError(f"pd: unknown transport {value!r}; expected one of {list(TRANSPORTS)}")
        return name

    @model_validator(mode="after")
    def _check(self) -> PDConfig:
        if self.prefill_tp_size < self.decode_tp_size:
            raise ValueError(
                f"pd: prefill TP size {self.prefill_tp_size} is smaller than decode TP size {self.decode_tp_size}; "
                "prefill_tp_size >= decode_tp_size is required"
            )
        if self.prefill_tp_size % self.decode_tp_size:
            raise ValueError(
                f"pd: prefill TP size {self.prefill_tp_size} is not a multiple of decode TP size {self.decode_tp_size}"
            )
        top = self.kv_port + (self.decode_dp_size - 1) * self.decode_tp_size + self.decode_tp_size - 1
        if self.kv_port < 1 or top > 65535:
            raise ValueError(
                f"pd: control-plane ports kv_port + dp_rank * decode_tp_size + tp_rank span {self.kv_port}..{top} "
                f"for decode_dp_size={self.decode_dp_size}, decode_tp_size={self.decode_tp_size}; every port must be in 1..65535"
            )
        if self.kvpp_enabled and self.role == "decode":
            raise ValueError("pd: KVPP cannot be enabled on a decode-only node (role='decode')")
        if self.secret is not None and self.secret_file is not None:
            raise ValueError("pd: give secret or secret_file, not both")
        if self.transport == "memfabric" and not self.memfabric_store_url:
            raise ValueError("pd: transport 'memfabric' needs memfabric_store_url ('tcp://ip:port')")
        return self

    @property
    def ratio(self) -> int:
        """Prefill TP ranks per decode TP rank (the contribution group size)."""
        return self.prefill_tp_size // self.decode_tp_size

    @property
    def dead_after_s(self) -> float:
        """Seconds of silence after which a peer is declared dead."""
        return self.heartbeat_interval_s * self.heartbeat_misses

    def port(self, dp_rank: int, tp_rank: int) -> int:
        """Control-plane port of decode rank ``(dp_rank, tp_rank)``."""
        check_int("PDConfig.port", "dp_rank", dp_rank, minimum=0, maximum=self.decode_dp_size - 1)
        return endpoint_port(self.kv_port, dp_rank, tp_rank, self.decode_tp_size)
