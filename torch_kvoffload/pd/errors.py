"""Errors of P/D transfer; each message names the layer, the request(s) and the peer involved."""

from __future__ import annotations

from torch_kvoffload.transfer import TransferError

__all__ = ["AckTimeoutError", "HandshakeError", "PDTransferError", "PeerDeadError", "ReadFailedError"]


class PDTransferError(TransferError):
    """A P/D transfer failed; the KV it was moving must not be used."""


class HandshakeError(PDTransferError):
    """The metadata handshake timed out or found the sides incompatible."""


class ReadFailedError(PDTransferError):
    """Decode reported READ_FAILED (validation or read failure) for a layer."""


class AckTimeoutError(PDTransferError):
    """No READ_DONE / READ_FAILED arrived within the per-layer deadline."""


class PeerDeadError(PDTransferError):
    """The peer stopped sending heartbeats (or said BYE) while transfers were outstanding."""
