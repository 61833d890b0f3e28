"""The errors of the layerwise runtime, and the error a waiter of a failed transfer raises."""

from __future__ import annotations

from torch_kvoffload.transfer import TransferError

__all__ = ["PrefixEvictedError", "SlotPoisonedError", "StoreMissError", "waiter_error"]


class StoreMissError(TransferError):
    """A block found at lookup was gone when its layer was loaded (evicted in between)."""


class PrefixEvictedError(StoreMissError):
    """Blocks of the cached prefix were gone from the store when layer ``layer`` loaded them.

    Happens only with stores that cannot pin what ``begin_forward`` found (``StoreLease.pinned`` false:
    remote pools evict on their own). The forward cannot continue — the layer's cached tokens are
    missing — but nothing is poisoned: close it with ``end_forward()`` (which raises this error again)
    and run it again with ``begin_forward(..., max_cached_tokens=err.usable_tokens)``, or let
    :meth:`~torch_kvoffload.layerwise.runtime.LayerwiseOffloadRuntime.run_forward` do both.

    Attributes:
        layer: the layer whose load found blocks missing.
        usable_tokens: per request, the cached tokens still usable: its prefix up to the first missing
            block of ``layer`` (never more than the request's cached tokens of this forward).
        missing_blocks: blocks of ``layer`` that were missing.
    """

    def __init__(self, message: str, *, layer: int, usable_tokens: list[int], missing_blocks: int) -> None:
        super().__init__(message)
        self.layer = layer
        self.usable_tokens = list(usable_tokens)
        self.missing_blocks = missing_blocks


class SlotPoisonedError(TransferError):
    """A physical buffer's last save or load failed; it is not handed out until ``reset()``."""


def waiter_error(exc: TransferError, context: str) -> TransferError:
    """A waiter's error: the class of the transfer's own failure when it is a TransferError (e.g.
    PrefixEvictedError, with its attributes), else SlotPoisonedError; the message names the context and
    the cause."""
    cause = exc.__cause__
    if isinstance(cause, PrefixEvictedError):
        err: TransferError = PrefixEvictedError(
            f"{context}: {cause}",
            layer=cause.layer,
            usable_tokens=cause.usable_tokens,
            missing_blocks=cause.missing_blocks,
        )
        err.__cause__ = cause
        return err
    cls = type(cause) if isinstance(cause, TransferError) else SlotPoisonedError
    err = cls(f"{context}: {cause if cause is not None else exc}")
    err.__cause__ = cause if cause is not None else exc
    return err
