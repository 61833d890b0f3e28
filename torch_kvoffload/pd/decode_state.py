"""Decode side of P/D transfer: the bookkeeping of one decode TP rank — the requests it expects and the
prefill peers it paired with. Nothing here moves bytes or touches a socket.

A request is ``"pending"`` until every layer arrived from every member of the rank's contribution group,
then ``"done"``; ``"failed"`` once invalidated (or released before it completed). Its
:attr:`ExpectedRequest.landed` is the :class:`~torch_kvoffload.transfer.TransferEvent` its waiters wait
on: it completes when the request's last part landed in the destinations and fails when the request is
invalidated.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch_kvoffload.pd.errors import PDTransferError
from torch_kvoffload.pd.transports import RemotePeer
from torch_kvoffload.transfer import TransferError, TransferEvent

__all__ = ["DONE", "FAILED", "PENDING", "ExpectedRequest", "PrefillPeer", "all_ranks_ready"]

PENDING, DONE, FAILED = "pending", "done", "failed"


def all_ranks_ready(states: Sequence[str]) -> bool:
    """Whether a request may be scheduled: every decode TP rank reached ``"done"``. Raises
    :class:`PDTransferError` if any rank ``"failed"`` (the request must be recomputed or dropped)."""
    if any(s == FAILED for s in states):
        raise PDTransferError(
            f"P/D transfer failed on decode rank(s) {[i for i, s in enumerate(states) if s == FAILED]}"
        )
    return bool(states) and all(s == DONE for s in states)


@dataclass
class PrefillPeer:
    """A prefill rank that passed the handshake, as one decode rank sees it: the connection that proved
    the secret (``identity``), its rank and member index in the contribution group, its transport handle,
    block count and exported physical buffers (``slots``: per buffer ``{"main": [...], "indexer": [...]}``
    region ids)."""

    identity: bytes
    p_rank: int
    member: int
    remote: RemotePeer
    num_blocks: int
    slots: list
    last_seen: float
    alive: bool = True


@dataclass
class ExpectedRequest:
    """One request this rank expects: its random ``generation`` (named by every batch of it), this rank's
    share of the main blocks and its indexer blocks, and what arrived from whom.

    ``lock`` is held while a batch of the request is validated and read, and by whatever zeroes or
    forgets its destinations, so that none of them sees half a read.
    """

    request_id: int
    generation: int
    num_tokens: int
    main_share: list[int]  # this rank's share of the main blocks
    main_share_range: tuple[int, int]
    indexer_blocks: list[int]
    state: str = PENDING
    error: str = ""
    done: set = field(default_factory=set)  # {(layer, member)}
    peers: set = field(default_factory=set)
    sources: dict = field(default_factory=dict)  # member -> identity of the connection that delivered it
    lock: threading.Lock = field(default_factory=threading.Lock)
    landed: TransferEvent = field(default_factory=TransferEvent)

    def complete(self) -> None:
        """Every part landed: ``"done"``; its waiters return."""
        self.state = DONE
        self.landed.set_done()

    def fail(self, reason: str) -> bool:
        """``"failed"`` with ``reason`` (its waiters raise); False if it had already left ``"pending"``."""
        if self.state != PENDING:
            return False
        self.state, self.error = FAILED, reason
        self.landed.set_error(PDTransferError(reason))
        return True

    def wait(self, where: str, parts: int, timeout: float | None) -> None:
        """Block until the request left ``"pending"``; :class:`PDTransferError` if it failed,
        ``TimeoutError`` after ``timeout`` seconds (``parts``: the layer parts it needs, for the message)."""
        try:
            self.landed.wait(timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{where}: request {self.request_id} not complete after {timeout} s "
                f"({len(self.done)} of {parts} layer parts)"
            ) from None
        except TransferError:
            raise PDTransferError(f"{where}: request {self.request_id} failed: {self.error}") from None
