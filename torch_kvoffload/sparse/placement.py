"""Where hybrid sparse attention keeps each request's latent KV: the decisions, made on block counts alone
(no rows move here; :class:`~torch_kvoffload.sparse.hybrid_backend.HybridSparseBackend` carries them out).

One device budget in bytes (:class:`DeviceBudget`) holds the resident requests' blocks and the offloaded
requests' hot buffers (``hot_row`` bytes a decode row; allocated ``chunk`` rows at a time, so that their
count changes rarely: a change forgets every hot row).

* :func:`plan_pressure`: while a forward's claims (its resident requests' growth, its new requests' first
  rows) do not fit, the longest context among the resident requests not taking part in a begun part of
  the forward and the claimants gives way: a resident one is spilled, a new one starts offloaded.
* :func:`plan_promotions`: offloaded requests, shortest first, take blocks while their rows and one block
  of growth per resident request fit.

Longest first: a long context frees the most blocks per spill, and its decode step reads a top-k that is
a small share of its rows, so it loses the least from living in the host pool.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from torch_kvoffload.sparse.device_blocks import DeviceBlocks

__all__ = ["DeviceBudget", "plan_pressure", "plan_promotions"]


@dataclass(frozen=True)
class DeviceBudget:
    """``total`` bytes of device budget for resident blocks of ``block`` bytes and hot rows of ``hot_row``
    bytes (one decode row's hot buffers, every layer); hot rows come ``chunk`` at a time, at least ``chunk``
    and at most ``max_rows``."""

    total: int
    block: int
    hot_row: int
    chunk: int
    max_rows: int

    def rows_for(self, offloaded: int) -> int:
        """Hot rows allocated for ``offloaded`` requests."""
        return min(self.max_rows, max(1, -(-offloaded // self.chunk)) * self.chunk)

    def hot_bytes(self, offloaded: int) -> int:
        return self.rows_for(offloaded) * self.hot_row

    def pool_blocks(self, offloaded: int) -> int:
        """Blocks left to the resident pool beside the hot rows of ``offloaded`` requests."""
        return (self.total - self.hot_bytes(offloaded)) // self.block


def _held(blocks: DeviceBlocks, skip: Collection[int]) -> int:
    return sum(blocks.held(r) for r in blocks.holders() if r not in skip)


def plan_pressure(
    blocks: DeviceBlocks, budget: DeviceBudget, claims: Mapping[int, int], lengths: Mapping[int, int],
    pinned: Collection[int], offloaded: int,
) -> tuple[list[int], list[int], dict[int, int]]:  # fmt: skip
    """``(resident requests to spill, in order; new requests to start offloaded; the claims that then fit)``
    for ``claims`` (request id → rows it must hold after the forward), ``lengths`` (rows each live request
    holds now), ``pinned`` requests (never spilled) and ``offloaded`` requests now. ``RuntimeError`` when
    even that does not fit (the budget is checked at sizing to hold every request offloaded)."""
    kept: dict[int, int] = dict(claims)
    spill: list[int] = []
    start: list[int] = []

    def used() -> int:
        held = _held(blocks, {*spill, *kept})
        held += sum(max(blocks.held(r), blocks.blocks_for(n)) for r, n in kept.items())
        return held * budget.block + budget.hot_bytes(offloaded + len(spill) + len(start))

    while used() > budget.total:
        others = [r for r in blocks.holders() if r not in pinned and r not in kept and r not in spill]
        if not others and not kept:
            raise RuntimeError(
                f"hybrid sparse: the device budget of {budget.total} bytes cannot hold the requests of this "
                f"forward ({used()} bytes with every movable one offloaded)"
            )
        victim = max([*others, *kept], key=lambda r: (kept.get(r, lengths.get(r, 0)), r))
        if victim in kept:
            del kept[victim]
            if not blocks.holds(victim):  # its first rows: it starts offloaded
                start.append(victim)
                continue
        spill.append(victim)
    return spill, start, kept


def plan_promotions(
    blocks: DeviceBlocks, budget: DeviceBudget, waiting: Mapping[int, int], offloaded: int
) -> list[tuple[int, int]]:
    """``(request id, rows)`` of the ``waiting`` offloaded requests (id → rows it must hold; ``offloaded``
    requests in all) to promote, in order: shortest first, while each one's blocks and one block of growth
    per resident request (those promoted before it included) fit beside the hot rows the others keep."""
    used, holders, out = _held(blocks, ()), len(blocks.holders()), []
    for rid, tokens in sorted(waiting.items(), key=lambda kv: (kv[1], kv[0])):
        need = blocks.blocks_for(tokens)
        if (used + need + holders + 1) * budget.block + budget.hot_bytes(offloaded - 1) > budget.total:
            break
        out.append((rid, tokens))
        used, holders, offloaded = used + need, holders + 1, offloaded - 1
    return out
