"""Prefill side of P/D transfer: the bookkeeping of one prefill TP rank — each request's share of the
layers it sends, the decode peers, the batches awaiting an answer and request completion. Nothing here
moves bytes or touches a socket.

Completion is carried by :class:`~torch_kvoffload.transfer.TransferEvent` s settled by the answers the
control thread receives: a published layer's event (:class:`LayerAnswers`) completes once every decode
peer read its batch, a request's (:class:`RequestTracker`) once every layer of it was read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch_kvoffload.pd.config import PDConfig, split_range
from torch_kvoffload.pd.control import ControlEndpoint
from torch_kvoffload.pd.errors import PDTransferError
from torch_kvoffload.pd.messages import HelloAck, LayerEntry, LayerReady
from torch_kvoffload.pd.ticket import TransferTicket
from torch_kvoffload.transfer import TransferError, TransferEvent

__all__ = [
    "DecodePeer",
    "LayerAnswers",
    "PendingBatch",
    "RequestTracker",
    "RequestTrackers",
    "Share",
    "batch_bytes",
    "layer_entries",
    "plan_shares",
]


@dataclass
class Share:
    """One request's share of every layer for this rank: prefill source blocks and decode destination
    blocks of the main KV and of the indexer."""

    request_id: int
    dp_rank: int
    generation: int
    main_src: list[int]
    main_dst: list[int]
    indexer_src: list[int]
    indexer_dst: list[int]


def plan_shares(
    where: str,
    config: PDConfig,
    *,
    d_rank: int,
    member: int,
    num_blocks: int,
    has_indexer: bool,
    tickets: Sequence[TransferTicket],
    block_tables: Sequence[Sequence[int]],
) -> list[Share]:
    """The shares of prefill rank ``(d_rank, member)`` for ``tickets[r]`` whose prefill blocks are
    ``block_tables[r]`` (of ``num_blocks``): member 0 sends the decode rank's main-KV share (blocks
    ``split_range(n, decode_tp_size, d_rank)``), member ``m`` indexer blocks ``split_range(n, ratio, m)``.
    Validates everything (``TypeError`` / ``ValueError`` prefixed ``where``)."""
    if len(tickets) != len(block_tables):
        raise ValueError(f"{where}: {len(tickets)} tickets for {len(block_tables)} block tables")
    shares = []
    seen = set()
    for r, (t, table) in enumerate(zip(tickets, block_tables, strict=True)):
        if not isinstance(t, TransferTicket):
            raise TypeError(f"{where}: tickets[{r}] must be a TransferTicket, got {type(t).__name__}")
        if t.request_id in seen:
            raise ValueError(f"{where}: request {t.request_id} appears twice")
        seen.add(t.request_id)
        n = len(t.main_blocks)
        src = [int(b) for b in table[:n]]
        if len(src) != n or any(not 0 <= b < num_blocks for b in src):
            raise ValueError(
                f"{where}: request {t.request_id} needs {n} prefill blocks in [0, {num_blocks}), "
                f"block table row {r} gives {src}"
            )
        if len(t.parts) != config.decode_tp_size or not 0 <= t.dp_rank < config.decode_dp_size:
            raise ValueError(
                f"{where}: ticket of request {t.request_id} has {len(t.parts)} parts for dp {t.dp_rank}; "
                f"expected {config.decode_tp_size} parts and dp in [0, {config.decode_dp_size})"
            )
        part = t.parts[d_rank]
        if has_indexer and len(part.indexer_blocks) != n:
            raise ValueError(
                f"{where}: ticket of request {t.request_id} has no indexer blocks for decode rank {d_rank}"
            )
        lo, hi = split_range(n, config.decode_tp_size, d_rank) if member == 0 else (0, 0)
        ilo, ihi = split_range(n, config.ratio, member) if has_indexer else (0, 0)
        shares.append(Share(t.request_id, t.dp_rank, part.generation, src[lo:hi], list(t.main_blocks[lo:hi]),
                            src[ilo:ihi], list(part.indexer_blocks[ilo:ihi])))  # fmt: skip
    return shares


def layer_entries(shares: Sequence[Share], dp_rank: int, *, with_indexer: bool) -> list[LayerEntry]:
    """The LAYER_READY entries of ``shares`` going to decode DP rank ``dp_rank`` for one layer (indexer
    blocks only ``with_indexer``: a layer without indexer sends none)."""
    return [
        LayerEntry(s.request_id, s.generation, s.main_src, s.main_dst,
                   s.indexer_src if with_indexer else [], s.indexer_dst if with_indexer else [])
        for s in shares if s.dp_rank == dp_rank
    ]  # fmt: skip


def batch_bytes(msg: LayerReady) -> int:
    """Bytes decode reads for batch ``msg``."""
    return sum(
        len(e.main_src) * sum(msg.main_block_bytes) + len(e.indexer_src) * sum(msg.indexer_block_bytes)
        for e in msg.entries
    )


class DecodePeer:
    """A decode rank (of DP rank ``dp_rank``) as one prefill rank sees it: its control endpoint, the
    handshake's answer, liveness (``dead``: why it is, ``None`` while alive)."""

    def __init__(self, dp_rank: int, endpoint: str) -> None:
        self.dp_rank, self.endpoint = dp_rank, endpoint
        self.control: ControlEndpoint | None = None
        self.acked = threading.Event()
        self.ack: HelloAck | None = None
        self.last_seen = time.monotonic()
        self.last_beat = 0.0
        self.dead: str | None = None


class LayerAnswers:
    """The answers one published layer waits for, one per decode peer it was sent to: :attr:`event`
    completes once every peer read its batch and fails with the first failure."""

    def __init__(self, peers: int) -> None:
        self.event = TransferEvent()
        self._left = peers
        self._lock = threading.Lock()

    def read(self) -> None:
        """One peer read its batch."""
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.event.set_done()

    def failed(self, error: BaseException) -> None:
        """One peer's batch failed: the layer fails (the first failure stays)."""
        self.event.set_error(error)


@dataclass
class PendingBatch:
    """A LAYER_READY batch sent to decode DP rank ``dp_rank``, awaiting READ_DONE / READ_FAILED until
    ``deadline`` (monotonic seconds)."""

    dp_rank: int
    layer: int
    request_ids: list[int]
    answers: LayerAnswers
    sent: float
    deadline: float
    nbytes: int = 0


@dataclass
class RequestTracker:
    """The layers of one request not yet read by decode; :attr:`acked` completes when none is left and
    fails with the request's first transfer error."""

    remaining: set[int]
    acked: TransferEvent = field(default_factory=TransferEvent)

    def finished(self) -> bool:
        return self.acked.query()

    def layer_read(self, layer: int) -> bool:
        """``layer`` was read; True if that completed the request."""
        if self.finished():
            return False
        self.remaining.discard(layer)
        if self.remaining:
            return False
        self.acked.set_done()
        return True

    def fail(self, error: BaseException) -> bool:
        """The request failed with ``error``; False if it had already finished."""
        if self.finished():
            return False
        self.acked.set_error(error)
        return True


class RequestTrackers:
    """Request completion on one sender (``name``, for errors): a :class:`RequestTracker` per request of
    ``num_layers`` layers, from the forward that sends it until :meth:`forget`; thread-safe."""

    def __init__(self, name: str, num_layers: int) -> None:
        self.name, self.num_layers = name, num_layers
        self._lock = threading.Lock()
        self._trackers: dict[int, RequestTracker] = {}

    def start(self, request_ids: Sequence[int]) -> None:
        """Track ``request_ids`` afresh (every layer still to be read)."""
        with self._lock:
            for rid in request_ids:
                self._trackers[rid] = RequestTracker(set(range(self.num_layers)))

    def _get(self, request_id: int) -> RequestTracker:
        with self._lock:
            t = self._trackers.get(request_id)
        if t is None:
            raise KeyError(f"{self.name}: unknown request {request_id}")
        return t

    def _some(self, request_ids: Sequence[int]) -> list[RequestTracker]:
        with self._lock:
            return [t for t in map(self._trackers.get, request_ids) if t is not None]

    def layer_read(self, request_ids: Sequence[int], layer: int) -> int:
        """Decode read ``layer`` of ``request_ids``; how many requests that completed."""
        return sum(t.layer_read(layer) for t in self._some(request_ids))

    def fail(self, request_ids: Sequence[int], error: BaseException) -> int:
        """``request_ids`` failed with ``error``; how many had not finished before."""
        return sum(t.fail(error) for t in self._some(request_ids))

    def state(self, request_id: int) -> str:
        """``"pending"``, ``"done"`` or ``"failed"`` (``KeyError`` if unknown)."""
        t = self._get(request_id)
        if not t.finished():
            return "pending"
        return "failed" if t.acked.error is not None else "done"

    def wait_request(self, request_id: int, timeout: float | None) -> None:
        """Block until every layer of the request was read; :class:`PDTransferError` (caused by its
        transfer error) if one failed, ``TimeoutError`` after ``timeout`` seconds."""
        t = self._get(request_id)
        try:
            t.acked.wait(timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{self.name}: request {request_id}: layers {sorted(t.remaining)} not acknowledged after {timeout} s"
            ) from None
        except TransferError:
            error = t.acked.error
            raise PDTransferError(f"{self.name}: request {request_id} failed: {error}") from error

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._trackers.pop(request_id, None)
