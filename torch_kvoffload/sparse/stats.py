"""The sparse decode runtime's counters: per layer and in total, and the device step's device tallies."""

from __future__ import annotations

import threading

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.ops.residency import ResidencyOutputs

__all__ = ["COUNTER_NAMES", "StepCounters"]

COUNTER_NAMES = (
    "hits", "misses", "evictions", "bytes_h2d", "bytes_d2h", "waits", "wait_seconds",
    "fork_shared_blocks", "cow_copies",
)  # fmt: skip
#: Deferred steps of one layer are counted together once this many wait, or once their top-k tensors hold
#: this many entries (bounds what is kept: 256 KiB of int32 top-k per layer).
DEFERRED_STEPS = 256
DEFERRED_ENTRIES = 1 << 16
#: Counted in the totals only (table operations of every layer at once): 0 in the per-layer counters.
TOTAL_ONLY = ("fork_shared_blocks", "cow_copies")
#: What the per-layer tallies count once folded (``rows_h2d`` becomes ``bytes_h2d``); a tally holds the valid
#: top-k entries in place of the hits (hits = entries - misses, derived when read).
_TALLY_NAMES = ("hits", "misses", "evictions", "rows_h2d")


def _counts(topk: torch.Tensor, miss_count: torch.Tensor, evictions: torch.Tensor) -> list[torch.Tensor]:
    """``int64`` scalars of a tally: the valid entries of ``topk`` (hits are those that did not miss,
    derived when folded), the misses and the evictions (of one step, or of several concatenated)."""
    return [(topk >= 0).sum(), miss_count.sum(dtype=torch.int64), evictions.sum(dtype=torch.int64)]


class StepCounters:
    """:data:`COUNTER_NAMES` per layer (:attr:`layers`) and over every layer (:attr:`total`); those of
    :data:`TOTAL_ONLY` (``fork_shared_blocks``: host-pool blocks forks shared instead of copying,
    ``cow_copies``: shared blocks copied before a write into them) in the totals only.

    ``row_bytes``: bytes of one host-pool row (``kv_c`` + ``k_pe`` of one layer). A step's valid top-k
    entries, misses, evictions and copied rows are added in place to an ``int64 [4]`` tally per layer on ``tally_device``
    (the steps' device, default CPU), moved into the counters only by :meth:`fold` (when they are read).
    On an accelerator a step so reads nothing back (the fold is a device sync) and can be captured in a
    CUDA graph; on the CPU one in-place add per step costs less than bumping eight counters. Safe to
    bump from transfer threads.
    """

    def __init__(
        self,
        num_layers: int,
        row_bytes: int,
        tally_device: torch.device | None = None,
        *,
        deferred: bool = False,
    ) -> None:
        self.row_bytes = row_bytes
        self.deferred = deferred
        # deferred: per layer, the steps' (topk, miss_count, evictions, copied) not counted yet
        self._pending: list[list[tuple]] = [[] for _ in range(num_layers)]
        self._pending_entries = [0] * num_layers  # top-k entries those steps keep
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
        """Count a committed step of ``int32 topk [T, K]`` that copied ``copied`` rows host→device (an int,
        or an integer tensor whose sum it is).

        ``deferred`` (steps whose outputs are new tensors every step, the CPU host step): the step's
        tensors are kept and counted together, by :meth:`fold` or once :data:`DEFERRED_STEPS` steps (or
        :data:`DEFERRED_ENTRIES` top-k entries) of a layer wait, so a step runs no counting op."""
        if self.deferred:
            with self._tally_lock:
                pending = self._pending[layer]
                pending.append((topk, res.miss_count, res.evictions, copied))
                self._pending_entries[layer] += topk.numel()
                if len(pending) >= DEFERRED_STEPS or self._pending_entries[layer] >= DEFERRED_ENTRIES:
                    self._count_pending(layer)
            return
        parts = _counts(topk, res.miss_count, res.evictions)
        tally = self._tally[layer]
        if isinstance(copied, torch.Tensor):
            parts.append(copied.to(torch.int64).sum())
            copied = 0
        step = torch.stack(parts)
        if self._on_device:  # in place on the device (a CUDA graph replay adds to them too)
            tally[: len(parts)].add_(step)
            if copied:
                tally[3].add_(copied)
            return
        with self._tally_lock:
            tally[: len(parts)].add_(step)
            self._copied[layer] += copied

    def _count_pending(self, layer: int) -> None:
        """Add the deferred steps of ``layer`` to its tally (the lock held)."""
        pending, self._pending[layer] = self._pending[layer], []
        self._pending_entries[layer] = 0
        if not pending:
            return
        topk, misses, evictions, copied = zip(*pending, strict=True)
        step = _counts(torch.cat([t.reshape(-1) for t in topk]), torch.cat(misses), torch.cat(evictions))
        self._tally[layer][:3].add_(torch.stack(step))
        for c in copied:
            self._copied[layer] += int(c.sum()) if isinstance(c, torch.Tensor) else int(c)

    def fold(self) -> None:
        """Move the tallies into the counters (on the device path a device synchronisation: only when
        read)."""
        with self._tally_lock:
            for layer in range(len(self._tally)):
                self._count_pending(layer)
            for layer, tally in enumerate(self._tally):
                entries, misses, evictions, rows = tally.tolist()
                values = [entries - misses, misses, evictions, rows + self._copied[layer]]
                if not any(values):
                    continue
                tally.zero_()
                self._copied[layer] = 0
                for name, v in zip(_TALLY_NAMES, values, strict=True):
                    if name == "rows_h2d":
                        name, v = "bytes_h2d", v * self.row_bytes
                    self.count(layer, name, v)
