"""Broadcast of a layer bundle from its owner to the rest of the KVPP group.

One layer's broadcast moves a list of contiguous ``uint8`` spans of its bundle — the block runs the forward
reads, one span per run and component, or the whole bundle — each with ``torch.distributed.broadcast``
(issued asynchronously, then waited together) on the dedicated KVPP process group (gloo on CPU, nccl on CUDA, hccl on Ascend). It runs on the device layer's
:class:`~torch_kvoffload.transfer.TransferStream` — a worker thread on CPU, a side stream on an accelerator —
ordered after the given events (the compute that last read the destination). The returned event completes
when the transfer finished, including the owner's reads of its source: on CPU gloo returns only then; on
an accelerator the stream waits on the collective's work and an event is recorded after it.

Collectives of one group must be issued in the same order on every rank; all KVPP broadcasts of a rank go
through its one transfer stream, in layer order, so that holds as long as every rank schedules the same
forwards — which the scheduler checks before each forward with :meth:`BroadcastTransport.exchange`.

With a ``timeout`` every collective on CPU (the broadcasts, the exchange) gives up after that many seconds
instead of blocking until the process group's own timeout: a peer that failed or is gone then surfaces as
an error within the configured time.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_kvoffload.kvpp.groups import KVPPGroup
from torch_kvoffload.transfer import TransferEvent, TransferStream

logger = logging.getLogger(__name__)

__all__ = ["BroadcastTransport"]


class BroadcastTransport:
    """Owner → peers broadcast of bundle spans inside one :class:`KVPPGroup`.

    ``stream`` defaults to a new :class:`TransferStream` named ``kvpp-prefetch`` on ``device``; it is
    closed by :meth:`close` only if this object created it. ``timeout`` (seconds, ``None``: none) bounds
    each host-side collective: the broadcasts on CPU and every :meth:`exchange`; one that does not
    complete in time raises ``TimeoutError`` (the group then holds an unfinished collective).
    """

    def __init__(
        self,
        group: KVPPGroup,
        device: torch.device | str = "cpu",
        stream: TransferStream | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        if group.size > 1 and group.process_group is None:
            raise ValueError("BroadcastTransport: a group of more than one rank needs a process group")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"BroadcastTransport: timeout must be positive or None, got {timeout!r}")
        self.group = group
        self.device = torch.device(device)
        self.timeout = timeout
        self._own_stream = stream is None
        self.stream = stream if stream is not None else TransferStream("kvpp-prefetch", self.device)

    @property
    def _control(self) -> Any:
        """The group of the host-side exchanges (gloo when the group has one)."""
        return self.group.control_group if self.group.control_group is not None else self.group.process_group

    def _wait(self, what: str, work: Any) -> None:
        """Wait for a collective's ``work``, at most ``timeout`` seconds (``TimeoutError`` past it)."""
        if self.timeout is None:
            work.wait()
            return
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            if work.is_completed():
                raise
            raise TimeoutError(
                f"BroadcastTransport: {what} did not complete within {self.timeout} s on rank "
                f"{self.group.ranks[self.group.local_rank]} (a peer of group {list(self.group.ranks)} failed, "
                "is behind or gone)"
            ) from exc

    @property
    def rank(self) -> int:
        return self.group.local_rank

    def _broadcast(
        self, layer: int, spans: list[torch.Tensor], src: int, seconds: Callable[[float], None] | None
    ) -> None:
        import torch.distributed as dist

        start = time.perf_counter()
        works = [dist.broadcast(s, src=src, group=self.group.process_group, async_op=True) for s in spans]
        for work in works:
            if self.device.type == "cpu":
                self._wait(f"the broadcast of layer {layer}", work)
            else:  # the transfer stream waits on the collective; the host does not block
                work.wait()
        if seconds is not None:
            seconds(time.perf_counter() - start)

    def broadcast(
        self,
        layer: int,
        spans: Sequence[torch.Tensor],
        owner: int,
        after: Sequence[TransferEvent] = (),
        *,
        seconds: Callable[[float], None] | None = None,
    ) -> TransferEvent:
        """Broadcast ``spans`` (each ``uint8 [bytes]``, contiguous, 1-D) from group-local ``owner``.

        Every rank of the group calls this for the same layers in the same order with spans of the same
        sizes: the owner's spans are the source, the others' spans are overwritten. ``seconds`` is called
        on the transfer thread with the time the collectives took there (on CPU, from issue to completion;
        on an accelerator, the host time to enqueue them on the transfer stream).
        """
        if isinstance(spans, torch.Tensor) or not isinstance(spans, Sequence) or not spans:
            raise ValueError(
                "BroadcastTransport.broadcast: argument 'spans' must be a non-empty list of tensors, "
                f"got {type(spans).__name__}"
            )
        for i, span in enumerate(spans):
            if span.dtype != torch.uint8 or span.dim() != 1 or not span.is_contiguous():
                raise ValueError(
                    f"BroadcastTransport.broadcast: 'spans[{i}]' must be a contiguous 1-D uint8 tensor, "
                    f"got {span.dtype} {list(span.shape)} contiguous={span.is_contiguous()}"
                )
        src = self.group.global_rank(owner)
        if self.group.size == 1:
            return self.stream.submit(lambda: None, after=after)
        return self.stream.submit(self._broadcast, layer, list(spans), src, seconds, after=after)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a picklable object from every rank of the group (main thread, no broadcast in flight)."""
        if self.group.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.group.size
        dist.all_gather_object(out, obj, group=self._control)
        return out

    def exchange(self, values: Sequence[int]) -> list[list[int]]:
        """Gather ``values`` (a few ``int64``, the same count on every rank) from every rank of the group,
        in group order, bounded by ``timeout``. Main thread, no broadcast in flight."""
        if self.group.size == 1:
            return [list(values)]
        import torch.distributed as dist

        backend = dist.get_backend(self._control)
        device = torch.device("cpu") if backend == "gloo" else self.device
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        out = [torch.empty_like(mine) for _ in range(self.group.size)]
        self._wait("the agreement exchange", dist.all_gather(out, mine, group=self._control, async_op=True))
        return [t.tolist() for t in out]

    def close(self) -> None:
        if self._own_stream:
            self.stream.close()
