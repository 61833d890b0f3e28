"""The one interface every P/D bulk-data transport implements.

A side *registers* regions (prefill: its exported layer buffers; decode: its destinations), *describes*
them to the peer (a msgpack-able map sent in the handshake), and the reading side *connects* to that
description and *reads* batches of byte ranges of remote regions into local ones. Every read batch is
checked against the region bounds before the first byte moves.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "EngineTransport",
    "ReadOp",
    "RemotePeer",
    "Transport",
    "TransportError",
    "check_ops",
    "flat_bytes",
]


class TransportError(RuntimeError):
    """A bulk transfer could not be set up or failed."""


@dataclass(frozen=True)
class ReadOp:
    """Copy ``nbytes`` from byte ``remote_offset`` of the peer's region ``remote`` to byte ``local_offset``
    of the local region ``local``."""

    remote: str
    remote_offset: int
    local: str
    local_offset: int
    nbytes: int


@dataclass
class RemotePeer:
    """A connected peer: its name (for errors) and the sizes of its regions (plus transport state)."""

    name: str
    sizes: dict[str, int]
    state: Any = None


def flat_bytes(where: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat ``uint8`` view; it must be contiguous."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{where}: a registered region must be contiguous, got strides {tensor.stride()}")
    return tensor.reshape(-1).view(torch.uint8)


def check_ops(where: str, peer: RemotePeer, local_sizes: dict[str, int], ops: list[ReadOp]) -> None:
    """Raise :class:`TransportError` (nothing copied yet) if any op leaves its remote or local region."""
    for op in ops:
        rsize = peer.sizes.get(op.remote)
        if rsize is None:
            raise TransportError(f"{where}: peer {peer.name} has no region {op.remote!r}")
        lsize = local_sizes.get(op.local)
        if lsize is None:
            raise TransportError(f"{where}: no local region {op.local!r} is registered")
        if op.nbytes < 0 or op.remote_offset < 0 or op.local_offset < 0:
            raise TransportError(f"{where}: negative offset or size in {op}")
        if op.remote_offset + op.nbytes > rsize:
            raise TransportError(
                f"{where}: read of {op.nbytes} bytes at {op.remote_offset} leaves region {op.remote!r} of "
                f"peer {peer.name} ({rsize} bytes)"
            )
        if op.local_offset + op.nbytes > lsize:
            raise TransportError(
                f"{where}: write of {op.nbytes} bytes at {op.local_offset} leaves local region {op.local!r} "
                f"({lsize} bytes)"
            )


class Transport(abc.ABC):
    """Register regions, describe them, connect to a peer's description, read batches."""

    name: str = ""
    #: whether local regions may live in accelerator memory (else the caller stages through host memory)
    device_memory: bool = False

    def __init__(self) -> None:
        self._local: dict[str, torch.Tensor] = {}

    # -- local regions
    def allocate(self, region: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor the peer can read, registered as ``region``."""
        t = torch.zeros(shape, dtype=dtype)
        self.register(region, t)
        return t

    def register(self, region: str, tensor: torch.Tensor) -> None:
        """Make ``tensor`` (contiguous) a local region named ``region``."""
        if region in self._local:
            raise ValueError(f"{type(self).__name__}.register: region {region!r} is already registered")
        self._local[region] = flat_bytes(f"{type(self).__name__}.register({region!r})", tensor)
        self._register(region, self._local[region])

    def _register(self, region: str, data: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Transport-specific registration of a new local region (flat uint8 view)."""

    @property
    def local_sizes(self) -> dict[str, int]:
        return {k: v.numel() for k, v in self._local.items()}

    @abc.abstractmethod
    def describe(self) -> dict:
        """A msgpack-able map a peer passes to :meth:`connect` to read the local regions."""

    # -- remote regions
    @abc.abstractmethod
    def connect(self, description: dict, peer_name: str) -> RemotePeer:
        """Open a peer's regions (raises :class:`TransportError` if they cannot be read)."""

    def read(self, peer: RemotePeer, ops: list[ReadOp]) -> None:
        """Copy every op's bytes; :class:`TransportError` on failure (bounds checked before any copy)."""
        check_ops(f"{type(self).__name__}.read", peer, self.local_sizes, ops)
        if ops:
            self._read(peer, ops)

    @abc.abstractmethod
    def _read(self, peer: RemotePeer, ops: list[ReadOp]) -> None: ...

    def disconnect(self, peer: RemotePeer) -> None:  # noqa: B027 (optional hook)
        """Forget a peer's regions."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release the transport's resources; idempotent."""


class EngineTransport(Transport):
    """A transport over a transfer engine with ``register_memory(addr, nbytes) -> int``,
    ``batch_transfer_sync_read(target, local_addrs, remote_addrs, lengths) -> int`` (0 = ok) and
    ``unregister_memory(addr)`` — the API Mooncake's and MemFabric's engines share.

    Subclasses set ``self._engine`` and ``self._target`` (the name a peer reads this instance by), and
    ``target_key`` (the key of that name in :meth:`describe`).
    """

    target_key: str = ""

    def __init__(self) -> None:
        super().__init__()
        self._engine: Any = None
        self._target = ""
        self._addrs: dict[str, int] = {}

    def _register(self, region: str, data: torch.Tensor) -> None:
        ptr = data.data_ptr()
        rc = self._engine.register_memory(ptr, max(data.numel(), 1))
        if rc != 0:
            raise TransportError(f"{type(self).__name__}.register({region!r}): register_memory returned {rc}")
        self._addrs[region] = ptr

    def describe(self) -> dict:
        return {
            "kind": self.name,
            self.target_key: self._target,
            "regions": {r: {"addr": self._addrs[r], "nbytes": self._local[r].numel()} for r in self._addrs},
        }

    def _peer(self, description: dict, peer_name: str) -> RemotePeer:
        """The peer a :meth:`describe` map names (its state: ``(target, region -> address)``)."""
        target = description.get(self.target_key)
        if description.get("kind") != self.name or not isinstance(target, str):
            raise TransportError(
                f"{type(self).__name__}.connect: peer {peer_name} does not describe {self.name} regions: "
                f"{description.get('kind')!r}"
            )
        regions = description.get("regions", {})
        addrs = {r: int(info["addr"]) for r, info in regions.items()}
        sizes = {r: int(info["nbytes"]) for r, info in regions.items()}
        return RemotePeer(f"{peer_name} ({target})", sizes, (target, addrs))

    def connect(self, description: dict, peer_name: str) -> RemotePeer:
        return self._peer(description, peer_name)

    def _read(self, peer: RemotePeer, ops: list[ReadOp]) -> None:
        target, addrs = peer.state
        ops = [op for op in ops if op.nbytes]
        lengths = [op.nbytes for op in ops]
        rc = self._engine.batch_transfer_sync_read(
            target,
            [self._local[op.local].data_ptr() + op.local_offset for op in ops],
            [addrs[op.remote] + op.remote_offset for op in ops],
            lengths,
        )
        if rc != 0:
            raise TransportError(
                f"{type(self).__name__}.read: batch_transfer_sync_read of {len(lengths)} ranges "
                f"({sum(lengths)} bytes) from peer {peer.name} returned {rc}"
            )

    def close(self) -> None:
        for ptr in self._addrs.values():
            try:
                self._engine.unregister_memory(ptr)
            except (RuntimeError, AttributeError) as exc:
                logger.debug("unregister_memory failed: %s", exc)
        self._addrs.clear()
