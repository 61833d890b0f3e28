"""``ResidencyTable``: one layer's hot-buffer residency state and its update (kvoffload::residency_update)."""

from __future__ import annotations

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.ops.residency import (
    POLICIES,
    ResidencyOutputs,
    new_residency_outputs,
    new_residency_state,
    residency_update,
)

__all__ = ["ResidencyTable"]


def step_counts(topk: torch.Tensor, out: ResidencyOutputs) -> dict[str, torch.Tensor]:
    """``hits``, ``misses`` and ``evictions`` of one step of ``int32 topk [R, K]`` (``int64`` scalar
    tensors on the step's device: every valid top-k entry that is not a miss is a hit)."""
    misses = out.miss_count.sum(dtype=torch.int64)
    return {
        "hits": (topk >= 0).sum() - misses,
        "misses": misses,
        "evictions": out.evictions.sum(dtype=torch.int64),
    }


class ResidencyTable:
    """Residency of ``num_rows`` decode rows in hot buffers of ``capacity`` slots each (one layer).

    State tensors (``int32 slot_to_token [R, C]``, ``int32 lru_order [R, C]``, ``int64 row_request [R]``)
    live on ``device``; :meth:`update` runs ``kvoffload::residency_update`` (the C++ kernel on CPU) over
    every row and returns the step's :class:`~torch_kvoffload.ops.residency.ResidencyOutputs`. Counters:
    ``hits``, ``misses``, ``evictions``, ``updates``.

    A step over a subset of rows (``int64 rows [T]`` of row indices, in any order) runs on scratch copies:
    :meth:`gather` copies the rows' state out, the ops update the copies, and :meth:`commit` writes them
    back once the whole step succeeded, so a step that fails part-way leaves the table as it was.

    >>> table = ResidencyTable(num_rows=2, capacity=8, top_k=4)
    >>> res = table.update(torch.tensor([[0, 1, 2, -1], [5, 6, 7, 8]], dtype=torch.int32),
    ...                    torch.tensor([1, 2]), torch.tensor([100, 100]))
    >>> res.miss_count.tolist()
    [3, 4]
    """

    def __init__(
        self,
        num_rows: int,
        capacity: int,
        top_k: int,
        policy: str = "lru",
        device: torch.device | str = "cpu",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"ResidencyTable: policy must be one of {list(POLICIES)}, got {policy!r}")
        if num_rows < 0 or top_k < 0:
            raise ValueError(f"ResidencyTable: num_rows and top_k must be >= 0, got {num_rows}, {top_k}")
        if capacity < top_k:
            raise ValueError(f"ResidencyTable: capacity {capacity} must be >= top_k {top_k}")
        self.num_rows, self.capacity, self.top_k, self.policy = num_rows, capacity, top_k, policy
        self.device = torch.device(device)
        self.slot_to_token, self.lru_order, self.row_request = new_residency_state(
            num_rows, capacity, self.device
        )
        self.counters = Counters(["hits", "misses", "evictions", "updates"])

    @property
    def state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.slot_to_token, self.lru_order, self.row_request

    def _check_rows(self, where: str, rows: torch.Tensor) -> None:
        if rows.dtype != torch.int64 or rows.dim() != 1 or rows.device != self.device:
            raise ValueError(
                f"ResidencyTable.{where}: 'rows' must be int64 [T] on {self.device}, got {rows.dtype} "
                f"{list(rows.shape)} on {rows.device}"
            )

    def gather(
        self, rows: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scratch copies ``(slot_to_token [T, C], lru_order [T, C], row_request [T])`` of ``rows``.

        ``out``: preallocated contiguous scratch of those shapes and dtypes, written and returned (a step
        that must not allocate, e.g. one captured in a CUDA graph).
        """
        self._check_rows("gather", rows)
        if out is None:
            return tuple(t.index_select(0, rows) for t in self.state)  # type: ignore[return-value]
        for src, dst in zip(self.state, out, strict=True):
            torch.index_select(src, 0, rows, out=dst)
        return out

    def commit(self, rows: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Write the (updated) scratch ``state`` of :meth:`gather` back to ``rows`` (distinct)."""
        self._check_rows("commit", rows)
        for dst, src in zip(self.state, state, strict=True):
            dst.index_copy_(0, rows, src)

    def drop_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Empty slot ``slots[i, j]`` (``int32 [T, M]``, ``-1`` = none) of row ``rows[i]``.

        For a step that failed after its copies may have started: those slots may hold rows the state
        does not know about, so they must not count as hits later.
        """
        self._check_rows("drop_slots", rows)
        stt = self.slot_to_token.index_select(0, rows)
        sink = torch.full((stt.shape[0], 1), -1, dtype=stt.dtype, device=stt.device)
        padded = torch.cat([stt, sink], dim=1)
        idx = torch.where(slots >= 0, slots, self.capacity).long()
        padded.scatter_(1, idx, -1)
        self.slot_to_token.index_copy_(0, rows, padded[:, : self.capacity].contiguous())

    def forget_from(self, rows: torch.Tensor, length: int) -> None:
        """Empty every slot of ``rows`` holding a logical position ``>= length`` (their request dropped
        those positions: a later row written at one of them must be a miss, not a hit on the old row).
        The slots keep their place in the order."""
        self._check_rows("forget_from", rows)
        stt = self.slot_to_token.index_select(0, rows)
        stt.masked_fill_(stt >= length, -1)
        self.slot_to_token.index_copy_(0, rows, stt)

    def forget_rows(self, rows: torch.Tensor) -> None:
        """Detach ``rows`` from their request: they are reset at their next update."""
        self._check_rows("forget_rows", rows)
        self.row_request.index_fill_(0, rows, -1)

    def new_outputs(self) -> ResidencyOutputs:
        return new_residency_outputs(self.num_rows, self.top_k, self.device)

    def update(
        self,
        topk: torch.Tensor,
        request_ids: torch.Tensor,
        stable_len: torch.Tensor,
        scores: torch.Tensor | None = None,
        out: ResidencyOutputs | None = None,
    ) -> ResidencyOutputs:
        """Apply one step's ``int32 topk [R, K]`` (``K == top_k``); see ``residency_update`` for semantics.

        ``request_ids``, ``stable_len``: ``int64 [R]``; ``scores``: ``float32 [R, L]`` (``"score"`` policy).
        """
        if topk.dim() != 2 or topk.shape[1] != self.top_k:
            raise ValueError(
                f"ResidencyTable.update: 'topk' must have shape [R, {self.top_k}], got {list(topk.shape)}"
            )
        out = out if out is not None else self.new_outputs()
        residency_update(
            self.slot_to_token, self.lru_order, self.row_request, topk, request_ids, stable_len,
            scores, self.policy, out,
        )  # fmt: skip
        self.record(topk, out)
        return out

    def record(self, topk: torch.Tensor, out: ResidencyOutputs) -> None:
        """Add a step's hits / misses / evictions to the counters (also used after the fused op).

        The sums stay tensors: on an accelerator they accumulate there without a host sync.
        """
        for name, amount in step_counts(topk, out).items():
            self.counters.add(name, amount)
        self.counters.add("updates")

    def reset(self) -> None:
        """Forget every row (all slots empty, identity order, no request)."""
        stt, lru, req = new_residency_state(self.num_rows, self.capacity, self.device)
        self.slot_to_token.copy_(stt)
        self.lru_order.copy_(lru)
        self.row_request.copy_(req)
