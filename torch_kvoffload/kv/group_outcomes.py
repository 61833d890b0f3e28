"""Every rank of a tensor-parallel group learns every rank's outcome of a step, so all return or all raise.

A step that allocates or attaches per rank (a shared host pool, a transfer receiver) can fail on one rank
only; the others must not go on into a collective that rank never reaches. :func:`exchange_outcomes` runs
the step on this rank, catches its error, and gathers every rank's result or error over the group (one
``all_gather_object``). The caller then raises: this rank's own error first
(:meth:`GroupOutcomes.raise_own`), then one naming the ranks that failed (:meth:`GroupOutcomes.failures`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch_kvoffload.kv.spec import TensorParallel

__all__ = ["GroupOutcomes", "exchange_outcomes"]


@dataclass
class GroupOutcomes:
    """``values[r]``: rank ``r``'s result (``None`` where it failed); ``failed[r] = (error type name,
    message)`` for each rank that failed; ``error``: this rank's own exception, if any."""

    values: list[Any]
    failed: dict[int, tuple[str, str]]
    error: Exception | None

    def raise_own(self) -> None:
        """Re-raise this rank's own error, if it failed."""
        if self.error is not None:
            raise self.error

    def values_or_raise(self, what: str) -> list[Any]:
        """Every rank's result, or this rank's own error, or ``RuntimeError("{what} failed on TP rank r:
        ...")`` naming the ranks that failed."""
        self.raise_own()
        if self.failed:
            raise RuntimeError(f"{what} failed on {self.failures()}")
        return self.values

    def failures(self) -> str:
        """``"TP rank r: Type: message; ..."`` over the failed ranks."""
        return "; ".join(f"TP rank {r}: {kind}: {msg}" for r, (kind, msg) in sorted(self.failed.items()))

    @property
    def all_timeouts(self) -> bool:
        return bool(self.failed) and all(kind == "TimeoutError" for kind, _ in self.failed.values())


def exchange_outcomes(tp: TensorParallel | None, fn: Callable[[], Any]) -> GroupOutcomes:
    """``fn()`` on this rank, then every rank's outcome over ``tp.group`` (``fn`` alone without a group:
    its error still comes back in :attr:`GroupOutcomes.error`). A collective: every rank must call it."""
    error: Exception | None = None
    try:
        mine: tuple[bool, Any] = (True, fn())
    except Exception as exc:  # every rank must join the exchange before anyone raises
        error, mine = exc, (False, (type(exc).__name__, str(exc)))
    if tp is None or tp.size == 1:
        gathered = [mine]
    else:
        import torch.distributed as dist

        gathered = [None] * tp.size
        dist.all_gather_object(gathered, mine, group=tp.group)
    return GroupOutcomes(
        values=[g[1] if g[0] else None for g in gathered],
        failed={r: tuple(g[1]) for r, g in enumerate(gathered) if not g[0]},
        error=error,
    )
