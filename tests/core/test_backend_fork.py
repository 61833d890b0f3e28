"""``KVCore.fork`` / ``KVCore.truncate`` through the sparse-offload, resident-sparse and KVPP backends.

A forked request continues its source's rows in another slot (beam search), both then go on with their
own rows; a truncated request continues at an earlier position with new rows (assisted decoding's rejected
draft tokens). The reference keeps every request's rows itself and attends like DeepSeek-V3.2: the
lightning indexer's scores ``Σ_h w_h · relu(q_h · k)`` over the visible positions, their top-k, softmax
attention of the absorbed queries over the selected rows (fp32 random data: no exact top-k ties).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.core_driver import CoreDriver
from support.hf_models import build_model
from support.kvpp_helpers import spawn_gloo

from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.integrations.hf.inspect import inspect_model

SCALE = 0.125


@pytest.fixture(scope="module")
def spec():
    return inspect_model(build_model("deepseek_v32"))


def _ids(*counts: int) -> list[list[int]]:
    """``counts[b]`` tokens per request (all id 5: these backends never look tokens up)."""
    return [[5] * n for n in counts]


CONFIGS = {
    "offload": ({"sparse": {}}, 8),
    "offload-small-hot": ({"sparse": {"top_k": 4, "capacity": 6}}, 4),
    "resident": ({"sparse": {"offload": False}}, 8),
}


def _core(spec, cfg: dict, name: str) -> KVCore:
    return KVCore(spec, OffloadConfig.model_validate({**cfg, "block_size": 4}), name=name)


def _check_counts(core: KVCore, ref: CoreDriver) -> None:
    stats = core.backend_stats()
    if "hits" in stats:  # sparse offload: every valid top-k entry of a decode step is a hit or a miss
        assert stats["hits"] + stats["misses"] == ref.decode_entries
        assert stats["misses"] > 0 and stats["hits"] > 0


def _fork_scenario(core: KVCore, ref: CoreDriver) -> None:
    core.size(3, 28)
    a, b = core.admit(2)
    ref.forward([a, b], _ids(7, 5))
    ref.forward([a, b], _ids(1, 1))
    ref.forward([a, b], _ids(1, 1))
    c = ref.fork(a)
    assert (c.slot, c.length, c.tokens) == (2, a.length, a.tokens)
    for _ in range(3):  # a and c go on with different rows
        ref.forward([a, b, c], _ids(1, 1, 1))
    core.finish([a.id])
    d = ref.fork(c)  # into a's freed slot
    assert d.slot == a.slot and d.length == c.length
    for _ in range(3):
        ref.forward([c, b, d], _ids(1, 1, 1))
    ref.forward([d, c], _ids(1, 1))
    _check_counts(core, ref)


def _truncate_scenario(core: KVCore, ref: CoreDriver) -> None:
    core.size(3, 24)
    a, b = core.admit(2)
    ref.forward([a, b], _ids(6, 9))
    for _ in range(4):
        ref.forward([a, b], _ids(1, 1))
    for length in (a.length - 3, a.length - 1):  # drop 3 positions, decode there, drop 1 more
        ref.truncate(a, length)
        assert a.length == length
        for _ in range(3):
            ref.forward([a, b], _ids(1, 1))
    ref.truncate(b, b.length - 2)
    ref.forward([b, a], _ids(1, 1))
    (c,) = core.admit(1)  # a prefill next to truncated requests' decode rows
    ref.forward([c], _ids(4))
    _check_counts(core, ref)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fork_continues_the_source_rows_in_another_slot(spec, name):
    cfg, top_k = CONFIGS[name]
    core = _core(spec, cfg, f"fork-{name}")
    try:
        _fork_scenario(core, CoreDriver(core, scale=SCALE, top_k=top_k))
    finally:
        core.close()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_truncate_forgets_the_dropped_rows(spec, name):
    cfg, top_k = CONFIGS[name]
    core = _core(spec, cfg, f"truncate-{name}")
    try:
        _truncate_scenario(core, CoreDriver(core, scale=SCALE, top_k=top_k, seed=1))
    finally:
        core.close()


def test_fork_of_a_prefill_only_request_then_a_chunk(spec):
    """A fork right after the prefill, then a multi-token chunk of the fork (pool rows read back)."""
    cfg, top_k = CONFIGS["offload"]
    core = _core(spec, cfg, "fork-chunk")
    try:
        core.size(2, 24)
        (a,) = core.admit(1)
        ref = CoreDriver(core, scale=SCALE, top_k=top_k, seed=2)
        ref.forward([a], _ids(9))
        c = ref.fork(a)
        ref.forward([c], _ids(3))  # a chunk: earlier rows from the pool
        ref.forward([a, c], _ids(1, 1))
    finally:
        core.close()


def _pool(core: KVCore):
    (sparse,) = [b for b in core.backends.all if b.name == "sparse"]
    return sparse.runtime.pool


def _sharing(core: KVCore) -> tuple[int, int]:
    stats = core.backend_stats()
    return stats["fork_shared_blocks"], stats["cow_copies"]


@pytest.mark.parametrize("name", ["offload", "offload-small-hot"])
def test_forks_share_full_blocks_and_copy_them_on_write(spec, name):
    """Forks share the source's full host-pool blocks; both go on writing into blocks of their own; a
    truncated fork (and a truncated source) rewriting a shared block copies it first: every request's
    outputs still match the reference, the counters show the shared blocks and exactly those copies, and
    every block is free again at the end. Block size 4."""
    cfg, top_k = CONFIGS[name]
    core = _core(spec, cfg, f"cow-{name}")
    try:
        core.size(4, 28)
        pool = _pool(core)
        initial = pool.free_blocks
        ref = CoreDriver(core, scale=SCALE, top_k=top_k, seed=4)
        a, b = core.admit(2)
        ref.forward([a, b], _ids(8, 6))  # a: two full blocks, b: one and a half
        ref.forward([a, b], _ids(1, 1))  # a: position 8 opens its third block
        c = ref.fork(a)  # 9 positions: blocks 0, 1 shared, the partial block 2 copied
        assert _sharing(core) == (2, 0)
        assert pool.blocks_of(c.id)[:2] == pool.blocks_of(a.id)[:2]
        assert pool.blocks_of(c.id)[2] != pool.blocks_of(a.id)[2]
        for _ in range(3):  # both write into their partial block, then into their own next one
            ref.forward([a, b, c], _ids(1, 1, 1))
        assert _sharing(core) == (2, 0)
        d = ref.fork(a)  # a second fork of a: 12 positions, blocks 0..2 (0 and 1 now thrice)
        assert _sharing(core) == (5, 0)
        assert pool.block_tables.refs(pool.blocks_of(a.id)[0]) == 3
        ref.forward([d, a, c], _ids(1, 1, 1))
        assert _sharing(core) == (5, 0)
        ref.truncate(c, 5)  # back into shared block 1: its rewrite copies it (once)
        for _ in range(4):  # positions 5..8: block 1 (copied), then c's own block 2
            ref.forward([c, b, a], _ids(1, 1, 1))
        ref.forward([a, d], _ids(2, 2))  # chunks: every earlier row of the source read back from the pool
        assert _sharing(core) == (5, 1)
        assert pool.blocks_of(c.id)[1] != pool.blocks_of(a.id)[1] == pool.blocks_of(d.id)[1]
        core.finish([a.id])  # the source ends while its forks live
        ref.forward([d, c, b], _ids(1, 1, 1))
        ref.truncate(d, 2)  # into block 0, shared by c and d: copied once more
        ref.truncate(c, 3)  # c's rewrite of block 0 then finds it private: no copy
        for _ in range(3):
            ref.forward([c, d], _ids(1, 1))
        assert _sharing(core) == (5, 2)
        e = ref.fork(d)  # a fork of a fork: block 0 shared, position 4 copied
        assert d.length == 5 and _sharing(core) == (6, 2)
        ref.forward([e, d, c], _ids(2, 1, 1))  # a chunk of the fork over shared rows read back from the pool
        _check_counts(core, ref)
        core.finish([b.id, c.id, d.id, e.id])
        assert pool.free_blocks == initial
    finally:
        core.close()


def _kvpp_worker(rank: int, world: int) -> None:
    spec = inspect_model(build_model("deepseek_v32"))
    for name, scenario in (("fork", _fork_scenario), ("truncate", _truncate_scenario)):
        core = _core(spec, {"kvpp": {}}, f"kvpp-{name}")
        try:
            assert core.backends.kvpp is not None
            ref = CoreDriver(core, scale=SCALE, top_k=spec.index_topk, seed=3)  # the same rows on both ranks
            scenario(core, ref)
        finally:
            core.close()


@pytest.mark.slow
def test_kvpp_fork_and_truncate_on_two_ranks():
    """Each rank owns half the layers: a fork copies its owned bundles, the others arrive by broadcast; then
    the truncate scenario on a new core, in the same processes (a spawn each would double the start-up)."""
    spawn_gloo(_kvpp_worker, 2, timeout=300.0)


def test_host_pool_copy_rows_copies_every_layer_and_checks_the_reservation():
    from torch_kvoffload.sparse.host_pool import HostKVPool

    with HostKVPool.create(3, 8, 4, 6, 2, torch.float32) as pool:
        pool.allocate(0, 10)
        pool.allocate(1, 12)
        for layer in range(3):
            pool.kv_c(layer).copy_(torch.randn(8, 4, 6))
            pool.k_pe(layer).copy_(torch.randn(8, 4, 2))
        pos = torch.arange(10)
        after = pool.slots(1, torch.arange(10, 12))
        kept = [
            (pool.kv_c(i).reshape(-1, 6)[after].clone(), pool.k_pe(i).reshape(-1, 2)[after].clone())
            for i in range(3)
        ]
        pool.copy_rows(0, 1, 10)
        for layer in range(3):
            c, pe = pool.kv_c(layer).reshape(-1, 6), pool.k_pe(layer).reshape(-1, 2)
            assert torch.equal(c[pool.slots(1, pos)], c[pool.slots(0, pos)])
            assert torch.equal(pe[pool.slots(1, pos)], pe[pool.slots(0, pos)])
            assert torch.equal(c[after], kept[layer][0]) and torch.equal(pe[after], kept[layer][1])
        with pytest.raises(IndexError, match="request 0"):
            pool.copy_rows(0, 1, 13)


def test_residency_forget_from_empties_only_the_dropped_positions():
    from torch_kvoffload.sparse.residency import ResidencyTable

    table = ResidencyTable(num_rows=2, capacity=4, top_k=4)
    topk = torch.tensor([[0, 5, 2, 7], [1, 6, 3, 4]], dtype=torch.int32)
    table.update(topk, torch.tensor([1, 2]), torch.tensor([8, 8]))
    order = table.lru_order.clone()
    table.forget_from(torch.tensor([0]), 5)
    assert sorted(table.slot_to_token[0].tolist()) == [-1, -1, 0, 2]
    assert sorted(table.slot_to_token[1].tolist()) == [1, 3, 4, 6]
    assert torch.equal(table.lru_order, order)
    res = table.update(topk, torch.tensor([1, 2]), torch.tensor([8, 8]))
    assert res.miss_count.tolist() == [2, 0]
