"""torch_kvoffload.sparse: config, ResidencyTable, policies (Belady), HostKVPool (incl. cross-process)."""

from __future__ import annotations

import functools
import itertools
import multiprocessing as mp
import os

import pytest
import torch

from torch_kvoffload.sparse import (
    HostKVPool,
    ResidencyTable,
    SparseDecodeConfig,
    Trace,
    belady_misses,
    control_plane_port,
    make_reuse_trace,
    simulate_policy,
)

# ------------------------------------------------------------------------------------------ config


def test_config_defaults_and_port() -> None:
    cfg = SparseDecodeConfig(top_k=2048, host_pool_blocks=100)
    assert cfg.hot_capacity == 4096 and cfg.policy == "lru" and cfg.fused and cfg.kv_dtype == "bf16"
    assert SparseDecodeConfig(top_k=4, host_pool_blocks=1, kv_dtype="torch.float32").kv_dtype == "fp32"
    assert SparseDecodeConfig(top_k=4, host_pool_blocks=1, fused="False").fused is False
    assert control_plane_port(5000, 0, 4, 0) == 5000
    assert control_plane_port(5000, 2, 4, 3) == 5011
    ports = {control_plane_port(7000, dp, 4, tp) for dp in range(3) for tp in range(4)}
    assert len(ports) == 12  # DP and TP endpoints never overlap
    cfg = SparseDecodeConfig(top_k=4, host_pool_blocks=1, tensor_parallel_size=4, data_parallel_size=2)
    assert cfg.port(9000, 1, 2) == 9006
    with pytest.raises(ValueError, match="tp_rank 4 out of range"):
        control_plane_port(5000, 0, 4, 4)
    with pytest.raises(ValueError, match="dp_rank 2 out of range"):
        cfg.port(9000, 2, 0)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(capacity=3), "capacity 3 is smaller than top_k 4"),
        (dict(kv_dtype="int8"), "main KV dtype 'int8' is not supported"),
        (dict(kv_dtype="fp8_e4m3"), "packed / quantised main caches"),
        (dict(kv_dtype="c8"), "main KV dtype 'c8'"),
        (dict(context_parallel_size=2), "does not support context parallelism"),
        (dict(pipeline_parallel_size=2), "does not support pipeline parallelism"),
        (dict(hybrid_kv_layout="true"), "does not support hybrid KV cache layouts"),
        (dict(policy="fifo"), "policy"),
        (dict(policy="score", indexer_dtype="int8"), "int8 indexer path"),
        (dict(indexer_dtype="fp8"), "indexer_dtype"),
        (dict(unknown=1), "unknown"),
    ],
)
def test_config_rejections(kwargs, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        SparseDecodeConfig(top_k=4, host_pool_blocks=8, **kwargs)


# ---------------------------------------------------------------------------------- ResidencyTable


def test_residency_table_counts_and_reset() -> None:
    table = ResidencyTable(num_rows=2, capacity=4, top_k=2)
    ids, stable = torch.tensor([1, 2]), torch.tensor([100, 100])
    r = table.update(torch.tensor([[0, 1], [5, -1]], dtype=torch.int32), ids, stable)
    assert r.miss_count.tolist() == [2, 1]
    r = table.update(torch.tensor([[1, 2], [5, 6]], dtype=torch.int32), ids, stable)
    assert r.miss_count.tolist() == [1, 1]
    c = table.counters.snapshot()
    assert (c["hits"], c["misses"], c["evictions"], c["updates"]) == (2, 5, 0, 2)
    table.reset()
    assert table.slot_to_token.eq(-1).all() and table.row_request.eq(-1).all()
    with pytest.raises(ValueError, match=r"'topk' must have shape \[R, 2\]"):
        table.update(torch.zeros(2, 3, dtype=torch.int32), ids, stable)
    with pytest.raises(ValueError, match="capacity 1 must be >= top_k 2"):
        ResidencyTable(1, 1, 2)
    with pytest.raises(ValueError, match="policy"):
        ResidencyTable(1, 4, 2, policy="mru")


# ----------------------------------------------------------------------------------------- policies


def _brute_force_min_misses(seqs: list[list[int]], capacity: int) -> int:
    """Exhaustive offline optimum over every eviction choice (tiny traces only)."""

    @functools.cache
    def best(t: int, resident: frozenset[int]) -> int:
        if t == len(seqs):
            return 0
        sel = set(seqs[t])
        new = sel - resident
        keep_pool = resident - sel
        room = capacity - len(sel)
        options = []
        for n in range(min(room, len(keep_pool)), -1, -1):
            for kept in itertools.combinations(sorted(keep_pool), n):
                options.append(len(new) + best(t + 1, frozenset(sel | set(kept))))
            break  # keeping fewer than possible never helps (monotone)
        return min(options)

    return best(0, frozenset())


def test_belady_equals_brute_force_optimum() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        K = int(torch.randint(1, 3, (1,), generator=g))
        C = K + int(torch.randint(0, 2, (1,), generator=g))
        P = 6
        seqs = [torch.randperm(P, generator=g)[:K].tolist() for _ in range(7)]
        trace = Trace([torch.tensor(s, dtype=torch.int32) for s in seqs], [torch.zeros(P) for _ in seqs])
        assert belady_misses(trace, C).misses == _brute_force_min_misses(seqs, C), (seqs, C)


@pytest.mark.parametrize("reuse", [0.5, 0.9])
def test_belady_bounds_online_policies(reuse: float) -> None:
    trace = make_reuse_trace(40, 32, reuse, seed=3)
    assert abs(trace.measured_reuse() - reuse) < 0.05
    for factor in (1, 2):
        C = 32 * factor
        opt = belady_misses(trace, C)
        for policy in ("lru", "score"):
            res = simulate_policy(trace, C, policy)
            assert res.hits + res.misses == trace.accesses
            assert opt.misses <= res.misses
        assert opt.hits + opt.misses == trace.accesses
    # capacity == top_k: nothing beyond the current selection fits, every policy hits exactly the reuse
    lru, opt = simulate_policy(trace, 32, "lru"), belady_misses(trace, 32)
    assert lru.misses == opt.misses


def test_trace_topk_is_top_of_scores() -> None:
    trace = make_reuse_trace(5, 16, 0.7, seed=0)
    for tk, sc in zip(trace.topk, trace.scores, strict=True):
        assert set(torch.topk(sc, 16).indices.tolist()) == set(tk.tolist())


# --------------------------------------------------------------------------------------- host pool


def test_host_pool_allocation_and_slots() -> None:
    with HostKVPool.create(2, 6, 4, 8, 2, torch.float32) as pool:
        assert pool.allocate(7, 5) == [0, 1]
        assert pool.allocate(9, 4) == [2]
        assert pool.allocate(7, 9) == [0, 1, 3]
        assert pool.slots(7, torch.tensor([0, 5, 8])).tolist() == [0, 5, 12]
        with pytest.raises(IndexError, match="must lie in"):
            pool.slots(7, torch.tensor([12]))
        with pytest.raises(RuntimeError, match="needs 3 more blocks"):
            pool.allocate(11, 12)
        assert pool.free_blocks == 2 and pool.blocks_of(11) == []
        pool.free(7)
        assert pool.allocate(11, 4) == [0]  # lowest free block first: deterministic across ranks
        bt = pool.block_table([9, -1, 11], max_blocks=3)
        assert bt.tolist() == [[2, 0, 0], [0, 0, 0], [0, 0, 0]] and bt.dtype == torch.int32
        assert pool.row_bytes == 10 * 4 and pool.kv_c(1).shape == (6, 4, 8)


def _read_in_child(name: str, queue) -> None:
    pool = HostKVPool.attach(name)
    # plain Python data: tensors would travel as shared-memory handles tied to this short-lived process
    queue.put((pool.kv_c(1).float().tolist(), pool.k_pe(0).float().tolist(), str(pool.dtype), pool.owner))
    pool.close()


@pytest.mark.slow
def test_shared_pool_attach_from_spawned_process() -> None:
    pool = HostKVPool.create(2, 3, 4, 8, 2, torch.bfloat16, shared=True)
    path = os.path.join("/dev/shm", pool.name)
    try:
        assert os.path.exists(path)
        pool.kv_c(1).copy_(torch.randn(3, 4, 8).bfloat16())
        pool.k_pe(0).copy_(torch.randn(3, 4, 2).bfloat16())
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_read_in_child, args=(pool.name, queue))
        proc.start()
        kv, pe, dtype, owner = queue.get(timeout=120)
        proc.join(timeout=60)
        assert proc.exitcode == 0
        assert torch.equal(torch.tensor(kv), pool.kv_c(1).float())
        assert torch.equal(torch.tensor(pe), pool.k_pe(0).float())
        assert dtype == "torch.bfloat16" and owner is False
        assert os.path.exists(path), "an attached reader must not remove the owner's pool"
        # the mapping is shared both ways: a second attach in-process sees later writes
        other = HostKVPool.attach(pool.name)
        pool.kv_c(0)[1, 2].fill_(3.0)
        assert float(other.kv_c(0)[1, 2, 0]) == 3.0
        other.close()
    finally:
        pool.close()
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError, match="no shared pool named"):
        HostKVPool.attach(pool.name)


def test_host_pool_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        HostKVPool.create(1, 0, 4, 8, 2)
    with pytest.raises(ValueError, match="floating dtype"):
        HostKVPool.create(1, 2, 4, 8, 2, torch.int8)
