"""Where hybrid sparse attention keeps each request's latent KV: the decisions, made on block counts alone
(no rows move here; :class:`~torch_kvoffload.sparse.hybrid_backend.HybridSparseBackend` carries them out).

One device budget in bytes (:class:`DeviceBudget`) holds the live requests' indexer blocks (every request
needs them), the resident requests' latent blocks and the offloaded requests' hot buffers (``hot_row``
bytes a decode row; allocated ``chunk`` rows at a time, so that their count changes rarely: a change
forgets every hot row). The indexer pool grows and shrinks with some slack for the same reason.

* :func:`plan_pressure`: while a forward's claims (its resident requests' growth, its new requests' first
  rows) do not fit, the longest context among the resident requests and the claimants gives way: a
  resident one is spilled, a new one starts offloaded (``pinned`` requests never do).
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
    """``total`` bytes of device budget for indexer blocks of ``index_block`` bytes (at most ``index_full``:
    every slot's full length; always that many with ``fixed_index``), resident latent blocks of ``block``
    bytes and hot rows of ``hot_row`` bytes (one decode row's hot buffers, every layer); hot rows come
    ``chunk`` at a time (none for none), at most ``max_rows``."""

    total: int
    block: int
    hot_row: int
    chunk: int
    max_rows: int
    index_block: int = 0
    index_full: int = 0
    fixed_index: bool = False

    def index_pool(self, need: int, current: int) -> int:
        """Indexer blocks to allocate for ``need`` held (``current`` allocated): ``index_full`` when
        ``fixed_index`` (a transfer lands keys in the pool: it never moves); else unchanged while ``need``
        fits with at most twice the slack (a sixteenth of ``index_full``) spare, else ``need`` plus it."""
        if self.fixed_index:
            return self.index_full
        slack = max(1, -(-self.index_full // 16))
        if need <= current <= need + 2 * slack:
            return current
        return min(self.index_full, need + slack)

    def rows_for(self, offloaded: int) -> int:
        """Hot rows allocated for ``offloaded`` requests (none for none)."""
        return min(self.max_rows, -(-offloaded // self.chunk) * self.chunk)

    def hot_bytes(self, offloaded: int) -> int:
        return self.rows_for(offloaded) * self.hot_row

    def pool_blocks(self, offloaded: int, index_blocks: int) -> int:
        """Latent blocks left beside the hot rows of ``offloaded`` requests and ``index_blocks``."""
        return (self.total - self.hot_bytes(offloaded) - index_blocks * self.index_block) // self.block


def _held(blocks: DeviceBlocks, skip: Collection[int]) -> int:
    return sum(blocks.held(r) for r in blocks.holders() if r not in skip)


def plan_pressure(
    blocks: DeviceBlocks, budget: DeviceBudget, claims: Mapping[int, int], lengths: Mapping[int, int],
    pinned: Collection[int], offloaded: int, index_blocks: int = 0,
) -> tuple[list[int], list[int], dict[int, int]]:  # fmt: skip
    """``(resident requests to spill, in order; new requests to start offloaded; the claims that then fit)``
    for ``claims`` (request id → rows it must hold after the forward), ``lengths`` (rows each live request
    holds now), ``pinned`` requests (never spilled), ``offloaded`` requests now and the indexer pool's
    ``index_blocks`` after the forward. ``RuntimeError`` when
    even that does not fit (the budget is checked at sizing to hold every request offloaded)."""
    kept: dict[int, int] = dict(claims)
    spill: list[int] = []
    start: list[int] = []

    def used() -> int:
        held = _held(blocks, {*spill, *kept})
        held += sum(max(blocks.held(r), blocks.blocks_for(n)) for r, n in kept.items())
        fixed = index_blocks * budget.index_block
        return held * budget.block + budget.hot_bytes(offloaded + len(spill) + len(start)) + fixed

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
    blocks: DeviceBlocks,
    budget: DeviceBudget,
    waiting: Mapping[int, int],
    offloaded: int,
    index_blocks: int = 0,
) -> list[tuple[int, int]]:
    """``(request id, rows)`` of the ``waiting`` offloaded requests (id → rows it must hold; ``offloaded``
    requests in all) to promote, in order: shortest first, while each one's blocks and one block of growth
    per resident request (those promoted before it included) fit beside the hot rows the others keep and
    the indexer pool's ``index_blocks``."""
    used, holders, out = _held(blocks, ()), len(blocks.holders()), []
    fixed = index_blocks * budget.index_block
    for rid, tokens in sorted(waiting.items(), key=lambda kv: (kv[1], kv[0])):
        need = blocks.blocks_for(tokens)
        if (used + need + holders + 1) * budget.block + budget.hot_bytes(
            offloaded - 1
        ) + fixed > budget.total:
            break
        out.append((rid, tokens))
        used, holders, offloaded = used + need, holders + 1, offloaded - 1
    return out
