"""sparse.device_blocks.DeviceBlocks: the resident requests' block pool of hybrid sparse attention.

Reference: a dict of each request's rows by logical position, kept beside the pool."""

from __future__ import annotations

import pytest
import torch

from torch_kvoffload.sparse.device_blocks import DeviceBlocks
from torch_kvoffload.sparse.placement import DeviceBudget, plan_pressure, plan_promotions

BS = 4
COMPONENTS = [(6, torch.float32), (2, torch.float32)]


def _pool(num_blocks: int, layers: int = 2) -> DeviceBlocks:
    pool = DeviceBlocks(layers, COMPONENTS, BS, torch.device("cpu"))
    pool.allocate(num_blocks)
    return pool


def _write(pool: DeviceBlocks, ref: dict, rid: int, start: int, end: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    assert pool.ensure(rid, end)
    pos = torch.arange(start, end)
    for layer in range(pool.num_layers):
        vals = [torch.randn(end - start, w, generator=g) for w, _ in COMPONENTS]
        pool.write(layer, pool.rows(rid, pos), vals)
        got = ref.setdefault((rid, layer), [torch.empty(0, w) for w, _ in COMPONENTS])
        ref[(rid, layer)] = [torch.cat([g_[:start], v]) for g_, v in zip(got, vals, strict=True)]


def _check(pool: DeviceBlocks, ref: dict, lengths: dict[int, int]) -> None:
    for (rid, layer), want in ref.items():
        if rid not in lengths:
            continue
        got = pool.read(layer, rid, 0, lengths[rid])
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w[: lengths[rid]])


def test_requests_grow_block_by_block_and_give_blocks_back() -> None:
    pool, ref = _pool(6), {}
    _write(pool, ref, 1, 0, 5, seed=0)  # 2 blocks
    _write(pool, ref, 2, 0, 3, seed=1)  # 1 block
    assert (pool.held(1), pool.held(2), pool.free_blocks) == (2, 1, 3)
    _write(pool, ref, 1, 5, 9, seed=2)  # a third block for request 1
    assert pool.free_blocks == 2 and pool.need(2, 12) == 2
    assert not pool.ensure(2, 13), "4 blocks asked, 2 free: nothing is taken"
    assert pool.held(2) == 1 and pool.free_blocks == 2
    _check(pool, ref, {1: 9, 2: 3})
    pool.shrink(1, 4)
    assert pool.held(1) == 1 and pool.free_blocks == 4
    _check(pool, ref, {1: 4, 2: 3})
    pool.drop(2)
    assert not pool.holds(2) and pool.free_blocks == 5
    # the flat rows follow the block table: position p at blocks[p // BS] * BS + p % BS
    table = pool.table([1], torch.device("cpu"))
    pos = torch.arange(4)
    assert torch.equal(pool.rows(1, pos), table[0, pos // BS] * BS + pos % BS)


def test_reallocating_keeps_the_held_rows_and_refuses_to_drop_them() -> None:
    pool, ref = _pool(8), {}
    _write(pool, ref, 1, 0, 7, seed=3)
    _write(pool, ref, 2, 0, 2, seed=4)
    _write(pool, ref, 3, 0, 9, seed=5)
    pool.drop(2)
    pool.allocate(5)  # 2 + 3 blocks held
    assert (pool.num_blocks, pool.free_blocks) == (5, 0)
    _check(pool, ref, {1: 7, 3: 9})
    with pytest.raises(ValueError, match="5 blocks are held, 4 asked"):
        pool.allocate(4)
    _check(pool, ref, {1: 7, 3: 9})
    pool.allocate(7)
    _write(pool, ref, 3, 9, 17, seed=6)
    _check(pool, ref, {1: 7, 3: 17})


def test_copy_rows_gives_a_fork_the_source_rows() -> None:
    pool, ref = _pool(6), {}
    _write(pool, ref, 1, 0, 6, seed=7)
    assert pool.ensure(2, 6)
    pool.copy_rows(1, 2, 6)
    for layer in range(2):
        for a, b in zip(pool.read(layer, 1, 0, 6), pool.read(layer, 2, 0, 6), strict=True):
            assert torch.equal(a, b)
    assert pool.block_bytes == (6 + 2) * 4 * BS * 2


def _holding(pool: DeviceBlocks, held: dict[int, int]) -> None:
    for rid, rows in held.items():
        assert pool.ensure(rid, rows)


def _budget(pool: DeviceBlocks, *, total: int, hot_cost: int, chunk: int) -> DeviceBudget:
    """A budget of ``total`` blocks of ``pool`` whose hot rows take ``hot_cost`` blocks each."""
    block = pool.block_bytes
    return DeviceBudget(total * block, block, hot_cost * block, chunk, max_rows=8)


def test_pressure_spills_the_longest_and_new_requests_start_offloaded_when_longest() -> None:
    pool = _pool(12)
    _holding(pool, {1: 16, 2: 8, 3: 4})  # 4 + 2 + 1 blocks
    lengths = {1: 16, 2: 8, 3: 4}
    # 10 blocks of budget, a hot row costs one block, rows come one at a time (none while none is offloaded)
    budget = _budget(pool, total=10, hot_cost=1, chunk=1)
    # request 2 grows by a block, a new request 4 needs 3: 4 + 3 + 1 + 3 = 11 > 10: the longest, request 1,
    # is spilled (its 4 blocks for a hot row)
    spill, start, kept = plan_pressure(pool, budget, {2: 9, 4: 12}, lengths, pinned=(), offloaded=0)
    assert (spill, start, kept) == ([1], [], {2: 9, 4: 12})
    # request 1 taking part in a begun part of the forward is never spilled: the new one, now the
    # longest claimant, starts offloaded instead
    spill, start, kept = plan_pressure(pool, budget, {2: 9, 4: 12}, lengths, pinned={1}, offloaded=0)
    assert (spill, start, kept) == ([], [4], {2: 9})
    # a new request longer than every resident one starts offloaded; nothing moves while the claims fit
    assert plan_pressure(pool, budget, {5: 40}, lengths, pinned=(), offloaded=0) == ([], [5], {})
    assert plan_pressure(pool, budget, {3: 5, 5: 4}, lengths, pinned=(), offloaded=0) == (
        [],
        [],
        {3: 5, 5: 4},
    )
    # hot rows costly enough that offloading frees nothing, and every resident request pinned: refused
    dear = _budget(pool, total=8, hot_cost=6, chunk=1)
    with pytest.raises(RuntimeError, match="cannot hold the requests of this forward"):
        plan_pressure(pool, dear, {4: 12}, lengths, pinned={1, 2, 3}, offloaded=0)


def test_promotions_take_the_shortest_first_and_leave_a_block_of_growth_per_resident_request() -> None:
    pool = _pool(12)
    _holding(pool, {1: 8})  # 2 blocks held, one resident request
    budget = _budget(pool, total=12, hot_cost=1, chunk=1)
    # 7 rows (2 blocks): 2 + 2 + growth for two + one hot row left = 7 <= 12; then 13 rows (4 blocks):
    # 4 + 4 + growth for three, no hot row left = 11 <= 12
    assert plan_promotions(pool, budget, {3: 13, 2: 7}, offloaded=2) == [(2, 7), (3, 13)]
    # 21 rows (6 blocks): 4 + 6 + growth for three, no hot row left = 13 > 12
    assert plan_promotions(pool, budget, {3: 21, 2: 7}, offloaded=2) == [(2, 7)]
    assert plan_promotions(pool, budget, {2: 60}, offloaded=1) == []
    # rows come in chunks: promoting one of five offloaded requests keeps a chunk of four rows either way
    chunked = _budget(pool, total=12, hot_cost=1, chunk=4)
    assert chunked.rows_for(5) == 8 and chunked.rows_for(4) == 4 and chunked.rows_for(0) == 0
    assert plan_promotions(pool, chunked, {2: 4}, offloaded=5) == [(2, 4)]  # 2 + 1 + 2 + 4 = 9


def test_a_fixed_indexer_pool_keeps_every_slots_rows() -> None:
    """On a P/D decode node transfers write into the indexer pool: it is always every slot's full size."""
    elastic = DeviceBudget(1000, 10, 5, 1, 4, index_block=2, index_full=64)
    fixed = DeviceBudget(1000, 10, 5, 1, 4, index_block=2, index_full=64, fixed_index=True)
    assert elastic.index_pool(8, 0) == 8 + 4 and elastic.index_pool(8, 12) == 12
    assert fixed.index_pool(8, 0) == fixed.index_pool(0, 64) == fixed.index_pool(64, 64) == 64
