"""Sizing of hybrid sparse attention: one device KV budget split between the resident requests' block pool
and the offloaded requests' hot buffers (:class:`~torch_kvoffload.sparse.placement.DeviceBudget`).

The budget (``serving.device_kv_budget``, else :data:`FREE_DEVICE_SHARE` of what is free on the device)
first holds every other device cache (the other backends', the indexer cache) and must hold hot buffers
for every request slot (each request admitted can be offloaded); what is left, up to the pool every request
fully resident would take, is shared as requests come and go (:func:`fit`).
"""

from __future__ import annotations

from torch_kvoffload.device import free_device_bytes
from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.sparse.device_blocks import DeviceBlocks
from torch_kvoffload.sparse.placement import DeviceBudget
from torch_kvoffload.sparse.runtime import SparseDecodeOffload

__all__ = ["FREE_DEVICE_SHARE", "check_budget_holds_one", "chunk", "device_budget", "fit"]

#: Share of the free device memory the KV may take when no ``serving.device_kv_budget`` is given.
FREE_DEVICE_SHARE = 0.9


def chunk(slots: int) -> int:
    """Hot rows allocated at a time for ``slots`` requests: an eighth of them (a change forgets every hot
    row, so it should be rare; an idle row costs a hot buffer's bytes)."""
    return max(1, -(-slots // 8))


def check_budget_holds_one(budget: int, num_layers: int, capacity: int, row_bytes: int) -> None:
    """``ValueError`` when ``budget`` bytes cannot hold one offloaded request's hot buffers and indexer rows
    of ``capacity`` tokens (``row_bytes``: a token's latent and indexer bytes in one layer)."""
    need = num_layers * capacity * row_bytes
    if budget < need:
        raise ValueError(
            f"serving.device_kv_budget={budget} bytes cannot hold one offloaded request: its hot buffers and "
            f"indexer rows of {capacity} tokens over {num_layers} layers take {need} bytes"
        )


def device_budget(
    budget: int | None, layout: KVLayout, rt: SparseDecodeOffload, blocks: DeviceBlocks, rest: int
) -> tuple[DeviceBudget, tuple[int, int]]:
    """The :class:`DeviceBudget` of ``layout`` (``rest``: bytes of every other device cache), and ``(the
    offloaded footprint of every slot, the pool of every request resident)`` in bytes. ``ValueError`` when
    ``budget`` cannot hold every request offloaded."""
    hot_row = rt.capacity * rt.pool.row_bytes * rt.num_layers  # one decode row's hot buffers
    full = layout.slots * blocks.blocks_for(layout.tokens)
    block = blocks.block_bytes
    floor = rest + layout.slots * hot_row
    if budget is None:  # what is allocated now is not free
        hot_now = sum(t.nbytes for t in (*rt.hot_kv_c, *rt.hot_k_pe))
        pool_now = sum(t.nbytes for t in blocks.tensors())
        avail = int(FREE_DEVICE_SHARE * free_device_bytes(rt.device)) + pool_now + hot_now
    elif budget < floor:
        raise ValueError(
            f"serving.device_kv_budget={budget} bytes cannot hold {layout.slots} offloaded request(s) of "
            f"{layout.tokens} tokens: their hot buffers and indexer cache and the other device caches take "
            f"{floor} bytes; lower the requests or their tokens, or raise the budget"
        )
    else:
        avail = budget - rest
    total = min(avail, full * block + layout.slots * hot_row)
    return DeviceBudget(total, block, hot_row, chunk(layout.slots), layout.slots), (floor, full * block)


def fit(
    rt: SparseDecodeOffload, blocks: DeviceBlocks, budget: DeviceBudget, layout: KVLayout, offloaded: int
) -> None:
    """Hot rows for ``offloaded`` requests, the rest of ``budget`` to the resident pool (at most what every
    request of ``layout`` resident takes); the one that shrinks goes first."""
    rows = budget.rows_for(offloaded)
    pool = min(layout.slots * blocks.blocks_for(layout.tokens), budget.pool_blocks(offloaded))
    if rows > rt.max_rows:
        blocks.allocate(pool)
        rt.resize_rows(rows)
    elif rows < rt.max_rows:
        rt.resize_rows(rows)
        blocks.allocate(pool)
    elif pool != blocks.num_blocks:
        blocks.allocate(pool)
