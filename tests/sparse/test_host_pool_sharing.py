"""Host-pool blocks shared by forks, copy-on-write: reference counts, the free list, copies before writes.

Every check compares pool rows with what a plain per-request copy of the rows (the reference) holds.
"""

from __future__ import annotations

import pytest
import torch

from torch_kvoffload.sparse import (
    DecodeRows,
    HostKVPool,
    IndexerInputs,
    SparseDecodeConfig,
    SparseDecodeOffload,
)

L, DC, DR = 2, 6, 2


def _fill(pool: HostKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.num_layers):
        pool.kv_c(layer).copy_(torch.randn(pool.kv_c(layer).shape, generator=g))
        pool.k_pe(layer).copy_(torch.randn(pool.k_pe(layer).shape, generator=g))


def _rows(pool: HostKVPool, rid: int, n: int) -> list[torch.Tensor]:
    """Every layer's ``kv_c`` / ``k_pe`` rows of positions ``0..n-1`` of ``rid`` (copies)."""
    slots = pool.slots(rid, torch.arange(n))
    out = []
    for layer in range(pool.num_layers):
        out.append(pool.kv_c(layer).reshape(-1, DC)[slots].clone())
        out.append(pool.k_pe(layer).reshape(-1, DR)[slots].clone())
    return out


def _assert_rows(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("bs", "n"), [(4, 10), (4, 8), (3, 1), (5, 0), (2, 12)])
def test_fork_shares_full_blocks_and_copies_the_partial_one(bs, n):
    with HostKVPool.create(L, 16, bs, DC, DR, torch.float32) as pool:
        per = -(-12 // bs)
        pool.allocate(0, 12)
        pool.allocate(1, 12)
        _fill(pool, seed=bs + n)
        src = _rows(pool, 0, 12)
        free = pool.free_blocks
        shared = pool.fork(0, 1, n)
        assert shared == n // bs and pool.block_tables.shared_blocks == shared
        assert pool.blocks_of(1)[:shared] == pool.blocks_of(0)[:shared]
        assert len(set(pool.blocks_of(1)[shared:]) & set(pool.blocks_of(0))) == 0
        assert pool.free_blocks == free + shared and len(pool.blocks_of(1)) == per
        assert all(pool.block_tables.refs(b) == 2 for b in pool.blocks_of(0)[:shared])
        _assert_rows(_rows(pool, 1, n), [t[:n] for t in _rows(pool, 0, n)])
        _assert_rows(_rows(pool, 0, 12), src)  # the source is untouched
        pool.free(0)  # the source ends first: the shared blocks stay the fork's
        assert pool.free_blocks == free + per
        _assert_rows(_rows(pool, 1, n), [t[:n] for t in src])
        pool.free(1)
        assert pool.free_blocks == pool.num_blocks


def test_make_writable_copies_only_shared_blocks_and_keeps_the_source():
    with HostKVPool.create(L, 12, 4, DC, DR, torch.float32) as pool:
        for rid in (0, 1, 2):
            pool.allocate(rid, 12)
        _fill(pool, seed=1)
        pool.fork(0, 1, 12)
        pool.fork(0, 2, 6)  # block 0 held thrice, block 1 twice
        src = _rows(pool, 0, 12)
        assert [pool.block_tables.refs(b) for b in pool.blocks_of(0)] == [3, 2, 2]
        before = pool.blocks_of(1)
        pairs = pool.make_writable("test", 1, [0, 2, 0])
        assert pairs == [(before[0], pool.blocks_of(1)[0]), (before[2], pool.blocks_of(1)[2])]
        assert pool.blocks_of(1)[1] == before[1] == pool.blocks_of(0)[1]
        pool.copy_blocks(pairs)
        _assert_rows(_rows(pool, 1, 12), src)
        assert pool.make_writable("test", 1, [0, 2]) == []  # private now
        assert pool.block_tables.cow_copies == 2
        for layer in range(L):  # a write into the copy leaves the source alone
            pool.kv_c(layer).reshape(-1, DC)[pool.slots(1, torch.arange(3))] = 0.0
        _assert_rows(_rows(pool, 0, 12), src)
        _assert_rows(_rows(pool, 2, 6), [t[:6] for t in src])
        for rid in (0, 1, 2):
            pool.free(rid)
        assert pool.free_blocks == pool.num_blocks


def test_allocation_keeps_the_blocks_copies_on_write_need():
    with HostKVPool.create(L, 8, 4, DC, DR, torch.float32) as pool:
        pool.allocate(0, 16)
        pool.allocate(1, 16)
        pool.fork(0, 1, 16)
        assert pool.free_blocks == 4
        with pytest.raises(RuntimeError, match="4 of them kept for copy-on-write"):
            pool.allocate(2, 4)
        assert not pool.knows(2) and pool.free_blocks == 4
        assert len(pool.make_writable("test", 1, [0, 1, 2, 3])) == 4  # always room: the invariant
        assert pool.free_blocks == 0 and pool.block_tables.cow_copies == 4


def test_fork_errors_change_nothing():
    with HostKVPool.create(L, 12, 4, DC, DR, torch.float32) as pool:
        pool.allocate(0, 8)
        pool.allocate(1, 8)
        pool.allocate(2, 8)
        pool.fork(0, 1, 8)
        state = (pool.blocks_of(0), pool.blocks_of(1), pool.blocks_of(2), pool.free_blocks)
        with pytest.raises(IndexError, match="request 0"):
            pool.fork(0, 2, 9)
        with pytest.raises(ValueError, match="shares blocks"):
            pool.fork(2, 1, 4)  # 1 holds shared blocks
        with pytest.raises(ValueError, match="shares blocks"):
            pool.copy_rows(2, 1, 4)  # a copy into a shared block would change 0's rows
        with pytest.raises(ValueError, match="must differ"):
            pool.fork(2, 2, 4)
        assert (pool.blocks_of(0), pool.blocks_of(1), pool.blocks_of(2), pool.free_blocks) == state


def test_replayed_calls_give_identical_tables():
    """A reader rank replays the writer's calls without copying: the same tables."""
    pools = [HostKVPool.create(L, 16, 4, DC, DR, torch.float32) for _ in range(2)]
    try:
        for i, pool in enumerate(pools):
            for rid in (3, 1, 7):
                pool.allocate(rid, 14)
            pool.fork(3, 1, 9, copy=i == 0)
            pool.fork(1, 7, 13, copy=i == 0)
            pool.make_writable("test", 7, [1])
            pool.free(3)
            pool.allocate(9, 8)
        assert all(pools[0].blocks_of(r) == pools[1].blocks_of(r) for r in (1, 7, 9))
    finally:
        for pool in pools:
            pool.close()


def _runtime(writer: bool = True) -> SparseDecodeOffload:
    cfg = SparseDecodeConfig(top_k=8, capacity=8, host_pool_blocks=8, block_size=4, kv_dtype="fp32")
    return SparseDecodeOffload(cfg, num_layers=L, max_rows=2, kv_lora_rank=DC, rope_dim=DR,
                               device=torch.device("cpu"), writer=writer)  # fmt: skip


def _decode(rt: SparseDecodeOffload, rid: int, length: int, g: torch.Generator):
    bt = rt.pool.block_table([rid], max_blocks=4)
    seq = torch.tensor([length], dtype=torch.int32)
    idx = IndexerInputs(q=torch.randn(1, 2, 8, generator=g), weights=torch.rand(1, 2, generator=g),
                        block_table=bt, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seq_lens_k=seq,
                        k_cache=torch.randn(8, 4, 8, generator=g))  # fmt: skip
    return idx, DecodeRows(torch.tensor([rid]), seq.long(), bt)


def test_runtime_append_into_a_shared_block_copies_it_first_and_stales_checked_rows():
    g = torch.Generator().manual_seed(0)
    writer, reader = _runtime(), _runtime(writer=False)
    try:
        for rt in (writer, reader):
            rt.reserve(0, 16)
            rt.reserve(1, 16)
        for layer in range(L):  # positions 0..9 of request 0
            kv, pe = torch.randn(10, DC, generator=g), torch.randn(10, DR, generator=g)
            for rt in (writer, reader):
                rt.append(layer, [0] * 10, torch.arange(10), kv, pe)
        writer.sync()
        for rt in (writer, reader):
            rt.fork(0, 1, 10)
        assert writer.counters.get("fork_shared_blocks") == 2 and writer.counters.get("cow_copies") == 0
        src = _rows(writer.pool, 0, 10)
        idx, rows = _decode(writer, 1, 7, g)
        checked = writer.check_rows(rows, idx.cu_seqlens_q, idx.seq_lens_k)
        new = [(torch.randn(1, DC, generator=g), torch.randn(1, DR, generator=g)) for _ in range(L)]
        for rt in (writer, reader):  # request 1 rewrites position 6 (shared block 1), as after a truncate
            for layer in range(L):
                rt.append(layer, [1], torch.tensor([6]), *new[layer])
        writer.sync()
        assert writer.counters.get("cow_copies") == 1 and writer.layer_counters[0].get("cow_copies") == 0
        assert writer.pool.blocks_of(1) == reader.pool.blocks_of(1) != writer.pool.blocks_of(0)
        _assert_rows(_rows(writer.pool, 0, 10), src)  # the source keeps its rows
        want = [t.clone() for t in src]
        for layer in range(L):
            want[2 * layer][6], want[2 * layer + 1][6] = new[layer][0][0], new[layer][1][0]
        _assert_rows(_rows(writer.pool, 1, 10), want)
        q = (torch.randn(1, 2, DC, generator=g), torch.randn(1, 2, DR, generator=g))
        with pytest.raises(ValueError, match="stale"):
            writer.attend(0, *q, 0.5, idx, checked)
        with pytest.raises(ValueError, match="blocks in the host pool are"):
            writer.attend(0, *q, 0.5, idx, rows)  # the block table from before the copy
    finally:
        writer.close()
        reader.close()
