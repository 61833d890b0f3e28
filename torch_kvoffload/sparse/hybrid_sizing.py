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
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.sparse.config import SparseOptions
from torch_kvoffload.sparse.device_blocks import DeviceBlocks
from torch_kvoffload.sparse.placement import DeviceBudget
from torch_kvoffload.sparse.runtime import SparseDecodeOffload

__all__ = ["FREE_DEVICE_SHARE", "check_options", "chunk", "device_budget", "fit"]

#: Share of the free device memory the KV may take when no ``serving.device_kv_budget`` is given.
FREE_DEVICE_SHARE = 0.9


def chunk(slots: int) -> int:
    """Hot rows allocated at a time for ``slots`` requests: an eighth of them (a change forgets every hot
    row, so it should be rare; an idle row costs a hot buffer's bytes)."""
    return max(1, -(-slots // 8))


def check_options(
    spec: ModelSpec, options: SparseOptions, budget: int | None, main_row: int, index_row: int
) -> None:
    """``ValueError`` when ``budget`` cannot hold one offloaded request's hot buffers and indexer rows of
    ``capacity`` tokens (``main_row`` / ``index_row``: a token's latent / indexer bytes over every layer)."""
    capacity = options.capacity or 2 * (options.top_k or spec.index_topk)
    need = capacity * (main_row + index_row)
    if budget is not None and budget < need:
        raise ValueError(
            f"serving.device_kv_budget={budget} bytes cannot hold one offloaded request: its hot buffers and "
            f"indexer rows of {capacity} tokens over {spec.num_layers} layers take {need} bytes"
        )


def device_budget(
    budget: int | None, layout: KVLayout, rt: SparseDecodeOffload, blocks: DeviceBlocks, index: DeviceBlocks,
    rest: int, fixed_index: bool = False,
) -> tuple[DeviceBudget, tuple[int, int]]:  # fmt: skip
    """The :class:`DeviceBudget` of ``layout`` (``rest``: bytes of the other backends' device caches; ``blocks``
    / ``index``: the latent and indexer pools; ``fixed_index``: the indexer pool never moves), and ``(the
    offloaded footprint of every slot, the latent pool of every request resident)`` in bytes. ``ValueError``
    when ``budget`` cannot hold every request offloaded (its indexer rows and hot buffers)."""
    hot_row = rt.capacity * rt.pool.row_bytes * rt.num_layers  # one decode row's hot buffers
    per_slot = index.blocks_for(layout.tokens)
    full = layout.slots * blocks.blocks_for(layout.tokens)
    block, index_block = blocks.block_bytes, index.block_bytes
    floor = rest + layout.slots * (hot_row + per_slot * index_block)
    if budget is None:  # what is allocated now is not free
        now = sum(t.nbytes for t in (*rt.hot_kv_c, *rt.hot_k_pe, *blocks.tensors(), *index.tensors()))
        avail = int(FREE_DEVICE_SHARE * free_device_bytes(rt.device)) + now
    elif budget < floor:
        raise ValueError(
            f"serving.device_kv_budget={budget} bytes cannot hold {layout.slots} offloaded request(s) of "
            f"{layout.tokens} tokens: their hot buffers and indexer rows and the other device caches take "
            f"{floor} bytes; lower the requests or their tokens, or raise the budget"
        )
    else:
        avail = budget - rest
    total = min(avail, floor - rest + full * block)
    dev = DeviceBudget(total, block, hot_row, chunk(layout.slots), layout.slots, index_block,
                       layout.slots * per_slot, fixed_index)  # fmt: skip
    return dev, (floor, full * block)


def fit(
    rt: SparseDecodeOffload, blocks: DeviceBlocks, index: DeviceBlocks, budget: DeviceBudget, layout: KVLayout,
    offloaded: int, index_need: int,
) -> None:  # fmt: skip
    """Hot rows for ``offloaded`` requests, an indexer pool for ``index_need`` blocks (with slack where the
    latent pool leaves room; every slot's when fixed), the rest of ``budget`` to the latent pool (at most
    what every request of ``layout`` resident takes); whatever shrinks goes first, so the device never holds
    more than the budget."""
    rows = budget.rows_for(offloaded)
    full = layout.slots * blocks.blocks_for(layout.tokens)
    index_blocks = budget.index_pool(index_need, index.num_blocks)
    if not budget.fixed_index:
        # the indexer pool's slack only from what the latent pool cannot use: resident rows come first
        spare = budget.total - budget.hot_bytes(offloaded) - index_need * budget.index_block
        spare -= min(full, budget.pool_blocks(offloaded, index_need)) * budget.block
        index_blocks = min(index_blocks, index_need + spare // budget.index_block)
    pool = min(full, budget.pool_blocks(offloaded, index_blocks))
    resizes = [
        (rt.max_rows, rows, rt.resize_rows),
        (index.num_blocks, index_blocks, index.allocate),
        (blocks.num_blocks, pool, blocks.allocate),
    ]
    for now, want, resize in sorted(resizes, key=lambda r: r[1] - r[0]):  # the largest shrink first
        if want != now:
            resize(want)
