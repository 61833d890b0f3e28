"""Where hybrid sparse attention keeps each request's latent KV: the decisions, made on block counts alone
(no rows move here; :class:`~torch_kvoffload.sparse.hybrid_backend.HybridSparseBackend` carries them out).

* :func:`plan_pressure`: when a forward's claims for blocks (its resident requests' growth, its new
  requests' first rows) exceed the free blocks, the longest context among the resident requests not
  taking part in a begun part of the forward and the claimants gives way, until the rest fit: a resident
  one is spilled (its blocks come free), a new one starts offloaded.
* :func:`plan_promotions`: offloaded requests, shortest first, take blocks while their rows and one block
  of growth per resident request fit.

Longest first: a long context frees the most blocks per spill, and its decode step reads a top-k that is
a small share of its rows, so it loses the least from living in the host pool.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from torch_kvoffload.sparse.device_blocks import DeviceBlocks

__all__ = ["plan_pressure", "plan_promotions"]


def plan_pressure(
    blocks: DeviceBlocks, claims: Mapping[int, int], lengths: Mapping[int, int], pinned: Collection[int]
) -> tuple[list[int], list[int], dict[int, int]]:
    """``(resident requests to spill, in order; new requests to start offloaded; the claims that then fit)``
    for ``claims`` (request id → rows it must hold after the forward), ``lengths`` (rows each live request
    holds now) and ``pinned`` requests (never spilled)."""
    kept, spill, start = dict(claims), [], []
    free = blocks.free_blocks
    while sum(blocks.need(r, n) for r, n in kept.items()) > free:
        others = [r for r in blocks.holders() if r not in pinned and r not in kept and r not in spill]
        victim = max([*others, *kept], key=lambda r: (kept.get(r, lengths.get(r, 0)), r))
        if victim in kept:
            del kept[victim]
            if not blocks.holds(victim):  # its first rows: it starts offloaded
                start.append(victim)
                continue
        spill.append(victim)
        free += blocks.held(victim)
    return spill, start, kept


def plan_promotions(blocks: DeviceBlocks, waiting: Mapping[int, int]) -> list[tuple[int, int]]:
    """``(request id, rows)`` of the ``waiting`` offloaded requests (id → rows it must hold) to promote, in
    order: shortest first, while each one's blocks and one block of growth per resident request (those
    promoted before it included) fit in the free blocks."""
    free, holders, out = blocks.free_blocks, len(blocks.holders()), []
    for rid, tokens in sorted(waiting.items(), key=lambda kv: (kv[1], kv[0])):
        need = blocks.blocks_for(tokens)
        if need + holders + 1 > free:
            break
        out.append((rid, tokens))
        free -= need
        holders += 1
    return out
