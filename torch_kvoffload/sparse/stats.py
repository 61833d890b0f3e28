"""The sparse decode runtime's counters: per layer and in total, and the device step's device tallies."""

from __future__ import annotations

import threading

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.ops.residency import ResidencyOutputs
from torch_kvoffload.sparse.residency import step_counts

__all__ = ["COUNTER_NAMES", "StepCounters"]

COUNTER_NAMES = (
    "hits", "misses", "evictions", "bytes_h2d", "bytes_d2h", "waits", "wait_seconds",
    "fork_shared_blocks", "cow_copies",
)  # fmt: skip
#: Counted in the totals only (table operations of every layer at once): 0 in the per-layer counters.
TOTAL_ONLY = ("fork_shared_blocks", "cow_copies")
#: What the device step's per-layer tallies count (``rows_h2d`` becomes ``bytes_h2d`` when read).
_TALLY_NAMES = ("hits", "misses", "evictions", "rows_h2d")


class StepCounters:
    """:data:`COUNTER_NAMES` per layer (:attr:`layers`) and over every layer (:attr:`total`); those of
    :data:`TOTAL_ONLY` (``fork_shared_blocks``: host-pool blocks forks shared instead of copying,
    ``cow_copies``: shared blocks copied before a write into them) in the totals only.

    ``row_bytes``: bytes of one host-pool row (``kv_c`` + ``k_pe`` of one layer). A step's hits, misses,
    evictions and copied rows are added in place to an ``int64 [4]`` tally per layer on ``tally_device``
    (the steps' device, default CPU), moved into the counters only by :meth:`fold` (when they are read).
    On an accelerator a step so reads nothing back (the fold is a device sync) and can be captured in a
    CUDA graph; on the CPU one in-place add per step costs less than bumping eight counters. Safe to
    bump from transfer threads.
    """

    def __init__(self, num_layers: int, row_bytes: int, tally_device: torch.device | None = None) -> None:
        self.row_bytes = row_bytes
        self.layers = [Counters(COUNTER_NAMES) for _ in range(num_layers)]
        self.total = Counters(COUNTER_NAMES)
        where = tally_device if tally_device is not None else torch.device("cpu")
        self._on_device = where.type != "cpu"
        self._tally = [
            torch.zeros(len(_TALLY_NAMES), dtype=torch.int64, device=where) for _ in range(num_layers)
        ]
        self._copied = [0] * num_layers  # rows copied by CPU steps that counted them as ints
        self._tally_lock = threading.Lock()

    def count(self, layer: int, name: str, amount: float | torch.Tensor) -> None:
        self.layers[layer].add(name, amount)
        self.total.add(name, amount)

    def count_total(self, name: str, amount: float) -> None:
        """Count one of :data:`TOTAL_ONLY` (not per layer)."""
        self.total.add(name, amount)

    def count_wait(self, layer: int, seconds: float) -> None:
        self.count(layer, "waits", 1)
        self.count(layer, "wait_seconds", seconds)

    def record(
        self, layer: int, topk: torch.Tensor, res: ResidencyOutputs, copied: int | torch.Tensor
    ) -> None:
        """Count a committed step of ``int32 topk [T, K]`` that copied ``copied`` rows host→device."""
        counts = step_counts(topk, res)
        tally = self._tally[layer]
        if self._on_device:  # in place on the device (a CUDA graph replay adds to them too)
            if isinstance(copied, torch.Tensor):
                tally.add_(torch.stack([counts["hits"], counts["misses"], counts["evictions"], copied]))
            else:
                tally[:3].add_(torch.stack([counts["hits"], counts["misses"], counts["evictions"]]))
                tally[3].add_(copied)
            return
        parts = [counts["hits"], counts["misses"], counts["evictions"]]
        if isinstance(copied, torch.Tensor):
            parts.append(copied.to(torch.int64))
            copied = 0
        step = torch.stack(parts)
        with self._tally_lock:
            tally[: len(parts)].add_(step)
            self._copied[layer] += copied

    def fold(self) -> None:
        """Move the tallies into the counters (on the device path a device synchronisation: only when
        read)."""
        with self._tally_lock:
            for layer, tally in enumerate(self._tally):
                values = tally.tolist()
                values[3] += self._copied[layer]
                if not any(values):
                    continue
                tally.zero_()
                self._copied[layer] = 0
                for name, v in zip(_TALLY_NAMES, values, strict=True):
                    if name == "rows_h2d":
                        name, v = "bytes_h2d", v * self.row_bytes
                    self.count(layer, name, v)
