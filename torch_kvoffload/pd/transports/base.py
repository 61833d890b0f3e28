"""The one interface every P/D bulk-data transport implements.

A side *registers* regions (prefill: its exported layer buffers; decode: its destinations), *describes*
them to the peer (a msgpack-able map sent in the handshake), and the reading side *connects* to that
description and *reads* batches of byte ranges of remote regions into local ones. Every read batch is
checked against the region bounds before the first byte moves.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ReadOp", "RemotePeer", "Transport", "TransportError", "check_ops", "flat_bytes"]


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
