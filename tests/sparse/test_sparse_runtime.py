"""torch_kvoffload.sparse: config, ResidencyTable, HostKVPool (incl. cross-process) and its fence, appends
on CPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest
import torch

from torch_kvoffload.ops import new_residency_outputs, residency_update
from torch_kvoffload.sparse import (
    DecodeRows,
    HostKVPool,
    IndexerInputs,
    ResidencyTable,
    SparseDecodeConfig,
    SparseDecodeOffload,
)
from torch_kvoffload.sparse.rows import RowMap

# ------------------------------------------------------------------------------------------ config


def test_config_defaults() -> None:
    cfg = SparseDecodeConfig(top_k=2048, host_pool_blocks=100)
    assert cfg.hot_capacity == 4096 and cfg.policy == "lru" and cfg.fused and cfg.kv_dtype == "bf16"
    assert SparseDecodeConfig(top_k=4, host_pool_blocks=1, kv_dtype="torch.float32").kv_dtype == "fp32"
    assert SparseDecodeConfig(top_k=4, host_pool_blocks=1, fused="False").fused is False


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(capacity=3), "capacity 3 is smaller than top_k 4"),
        (dict(kv_dtype="int8"), "main KV dtype 'int8' is not supported"),
        (dict(kv_dtype="fp8_e5m2"), "packed / quantised main caches"),
        (dict(kv_dtype="c8"), "main KV dtype 'c8'"),
        (dict(kv_dtype="fp16"), "run bf16, fp32 only"),
        (dict(kv_dtype=torch.float16), "run bf16, fp32 only"),
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


@pytest.mark.parametrize(
    ("value", "name", "dtype"),
    [("bf16", "bf16", torch.bfloat16), ("bfloat16", "bf16", torch.bfloat16), (torch.float32, "fp32", torch.float32),
     ("float", "fp32", torch.float32)],
)  # fmt: skip
def test_config_main_kv_dtypes_are_the_ones_the_sparse_ops_run(value, name: str, dtype: torch.dtype) -> None:
    cfg = SparseDecodeConfig(top_k=4, host_pool_blocks=8, kv_dtype=value)
    assert cfg.kv_dtype == name and cfg.torch_kv_dtype == dtype
    # the accepted dtype really runs through sparse MLA attention
    q, kv = torch.randn(2, 3, 8, dtype=dtype), torch.randn(5, 8, dtype=dtype)
    out, _ = torch.ops.kvoffload.sparse_mla_attention(
        q,
        q[..., :2].contiguous(),
        kv,
        kv[:, :2].contiguous(),
        torch.tensor([[0, 4], [1, -1]], dtype=torch.int32),
        0.5,
    )
    assert out.dtype == dtype


def test_fp16_is_rejected_by_the_sparse_ops_too() -> None:
    """The reason fp16 is refused at configuration: the sparse attention op rejects it."""
    q, kv = torch.randn(2, 3, 8).half(), torch.randn(5, 8).half()
    with pytest.raises(TypeError, match=r"q_nope.*float16"):
        torch.ops.kvoffload.sparse_mla_attention(
            q, q[..., :2].contiguous(), kv, kv[:, :2].contiguous(), torch.zeros(2, 1, dtype=torch.int32), 0.5
        )


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


@pytest.mark.parametrize(
    ("args", "exc", "fragment"),
    [((-1, 4), ValueError, "request_id must be >= 0"), ((1.5, 4), TypeError, "request_id must be an int"),
     ((True, 4), TypeError, "request_id must be an int, got bool"), ((1, -3), ValueError, "num_tokens must be >= 0"),
     ((1, 2.0), TypeError, "num_tokens must be an int"), ((1, "8"), TypeError, "num_tokens must be an int"),
     ((1, 100), RuntimeError, "needs 24 more blocks")],
)  # fmt: skip
def test_host_pool_allocate_rejects_bad_arguments_untouched(args, exc, fragment: str) -> None:
    with HostKVPool.create(1, 6, 4, 8, 2, torch.float32) as pool:
        pool.allocate(1, 3)
        before = (
            pool.free_blocks,
            pool.blocks_of(1),
            pool.knows(args[0]) if isinstance(args[0], int) else None,
        )
        with pytest.raises(exc, match=fragment):
            pool.allocate(*args)
        after = (
            pool.free_blocks,
            pool.blocks_of(1),
            pool.knows(args[0]) if isinstance(args[0], int) else None,
        )
        assert before == after
        assert pool.allocate(1, 8) == [0, 1] and pool.reserved_tokens(1) == 8


def test_host_pool_fence_publish_and_timeout() -> None:
    with HostKVPool.create(3, 2, 4, 8, 2, torch.float32, shared=True) as pool:
        other = HostKVPool.attach(pool.name)
        try:
            assert [other.published(layer) for layer in range(3)] == [0, 0, 0]
            pool.publish(1, 5)
            assert other.published(1) == 5 and other.published(0) == 0
            assert other.wait_published(1, 5, timeout=1.0) == 0.0
            with pytest.raises(TimeoutError, match=r"layer 2 append 1 was not published within 0.05 s"):
                other.wait_published(2, 1, timeout=0.05)
            with pytest.raises(ValueError, match="layer must be <= 2"):
                pool.publish(3, 1)
            pool.mark_failed(0)  # a failed append: readers get an error, not rows taken for complete
            pool.publish(0, 3)
            assert other.published(0) == -1
            with pytest.raises(RuntimeError, match="append of layer 0 failed"):
                other.wait_published(0, 1, timeout=5.0)
        finally:
            other.close()


def test_host_pool_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        HostKVPool.create(1, 0, 4, 8, 2)
    with pytest.raises(ValueError, match="floating dtype"):
        HostKVPool.create(1, 2, 4, 8, 2, torch.int8)


# ------------------------------------------------------------------------- rows and scratch state


def test_row_map_assigns_on_first_sight_and_frees_on_release() -> None:
    rows = RowMap(4)
    plan = rows.plan("step", [7, 3, 7])
    assert plan.rows == [0, 1, 2] and rows.alive == 0  # nothing recorded before commit
    rows.commit(plan)
    assert rows.rows_of(7) == [0, 2] and rows.rows_of(3) == [1] and rows.alive == 3
    again = rows.plan("step", [3, 7, 7])
    assert again.rows == [1, 0, 2] and not again.new and not again.contiguous()
    with pytest.raises(ValueError, match="needs 2 new residency rows but only 1 of max_rows=4"):
        rows.plan("step", [8, 9])
    assert rows.plan("step", [3, 7, 7]).rows == [1, 0, 2]  # the same step again (the next layer's)
    assert rows.release(7) == [0, 2] and rows.release(7) == []
    # after the release the same request ids are planned anew: 7's rows are free, it gets new ones
    assert rows.plan("step", [3, 7, 7]).new == {(7, 0): 0, (7, 1): 2}
    plan = rows.plan("step", [9, 3])
    assert plan.rows == [0, 1] and plan.contiguous()


def test_residency_table_scratch_commit_and_drop_slots() -> None:
    table = ResidencyTable(num_rows=3, capacity=4, top_k=2)
    ids, stable = torch.tensor([5, 6]), torch.tensor([100, 100])
    rows = torch.tensor([2, 0])
    scratch = table.gather(rows)
    out = new_residency_outputs(2, 2)
    residency_update(
        *scratch, torch.tensor([[1, 3], [0, -1]], dtype=torch.int32), ids, stable, None, "lru", out
    )
    assert table.slot_to_token.eq(-1).all(), "the op ran on the scratch copy"
    table.commit(rows, scratch)
    assert table.slot_to_token[2].tolist() == [1, 3, -1, -1] and table.slot_to_token[0].tolist() == [
        0,
        -1,
        -1,
        -1,
    ]
    assert table.row_request.tolist() == [6, -1, 5]
    table.drop_slots(rows, torch.tensor([[1, -1], [-1, -1]], dtype=torch.int32))
    assert table.slot_to_token[2].tolist() == [1, -1, -1, -1] and table.slot_to_token[0].tolist() == [
        0,
        -1,
        -1,
        -1,
    ]
    table.forget_rows(torch.tensor([0]))
    assert table.row_request.tolist() == [-1, -1, 5]
    with pytest.raises(ValueError, match="'rows' must be int64"):
        table.gather(torch.tensor([0], dtype=torch.int32))


# ------------------------------------------------------------------------------------ CPU appends

DC, DR, BS = 16, 4, 4


def _cpu_runtime(**cfg) -> SparseDecodeOffload:
    config = SparseDecodeConfig(top_k=2, host_pool_blocks=12, block_size=BS, kv_dtype="fp32", **cfg)
    return SparseDecodeOffload(
        config, num_layers=2, max_rows=3, kv_lora_rank=DC, rope_dim=DR, device=torch.device("cpu")
    )


def _place(want: dict, rt: SparseDecodeOffload, layer: int, rid: int, pos: int, kv, pe) -> None:
    """The reference pool: row ``pos`` of ``rid`` at block ``blocks[pos // BS]``, offset ``pos % BS``."""
    block = rt.pool.blocks_of(rid)[pos // BS]
    want["kv", layer][block, pos % BS] = kv
    want["pe", layer][block, pos % BS] = pe


def _pool_equals(want: dict, rt: SparseDecodeOffload) -> bool:
    return all(
        torch.equal(rt.pool.kv_c(layer), want["kv", layer])
        and torch.equal(rt.pool.k_pe(layer), want["pe", layer])
        for layer in range(2)
    )


def test_cpu_append_with_an_idle_stream_runs_inline_and_in_order_behind_work_in_flight() -> None:
    """On CPU an append whose stream is idle copies on the calling thread (finished on return, bit-exact);
    appends made while earlier work is in flight are queued behind it and land in the order made."""
    g = torch.Generator().manual_seed(0)
    with _cpu_runtime() as rt:
        for rid in (0, 1, 2):
            rt.reserve(rid, 8)
        host = rt.transfer_streams["host"]
        # a new pool's memory is uninitialised: zero it, so every row but the appended ones is known
        want = {}
        for layer in range(2):
            for part, t in (("kv", rt.pool.kv_c(layer)), ("pe", rt.pool.k_pe(layer))):
                t.zero_()
                want[part, layer] = torch.zeros_like(t)
        for pos in range(3):  # one new row x 3 requests x 2 layers per step
            for layer in range(2):
                kv, pe = torch.randn(3, DC, generator=g), torch.randn(3, DR, generator=g)
                inline = host.counters.get("inline")
                event = rt.append(layer, [0, 1, 2], torch.tensor([pos] * 3), kv, pe)
                assert event.query(), "an append with an idle stream is done when it returns"
                assert host.counters.get("inline") == inline + 1
                for i, rid in enumerate((0, 1, 2)):
                    _place(want, rt, layer, rid, pos, kv[i], pe[i])
        assert _pool_equals(want, rt)
        assert rt.counters.get("bytes_d2h") == 3 * 3 * 2 * rt.pool.row_bytes

        gate = threading.Event()
        blocker = host.submit(gate.wait)  # earlier work still in flight on the append stream
        inline = host.counters.get("inline")
        rows = [(torch.randn(1, DC, generator=g), torch.randn(1, DR, generator=g)) for _ in range(3)]
        events = [rt.append(0, [1], torch.tensor([5]), kv, pe) for kv, pe in rows]  # one position, 3 times
        events.append(rt.append(1, [2], torch.tensor([6]), *rows[0]))
        assert not any(ev.query() for ev in events) and host.counters.get("inline") == inline
        gate.set()
        blocker.wait()
        rt.sync()
        assert host.counters.get("inline") == inline
        _place(want, rt, 0, 1, 5, rows[-1][0][0], rows[-1][1][0])  # the last append made wins
        _place(want, rt, 1, 2, 6, rows[0][0][0], rows[0][1][0])
        assert _pool_equals(want, rt)
        # the stream is idle again: the next append runs inline
        rt.append(1, [0], torch.tensor([7]), *rows[1])
        assert host.counters.get("inline") == inline + 1


def test_rows_placed_once_append_to_every_layer_as_append_does_and_go_stale() -> None:
    """``place_rows`` once, ``append_placed`` (or ``append_validated``) per layer: the pool holds what
    per-layer ``append`` calls write (a fork's shared block copied on write at placing, for every layer); placed rows are refused
    once a request was reserved, released, forked or truncated, and bad rows are refused untouched."""
    g = torch.Generator().manual_seed(5)
    with _cpu_runtime() as placed_rt, _cpu_runtime() as plain_rt:
        for rt in (placed_rt, plain_rt):
            rt.reserve(0, 8)
            for layer in range(2):
                rt.pool.kv_c(layer).zero_()
                rt.pool.k_pe(layer).zero_()
            rt.append(0, [0] * 4, torch.arange(4), *(torch.ones(4, d) for d in (DC, DR)))
            rt.reserve(1, 8)
            rt.fork(0, 1, 4)  # request 1 shares request 0's first block (positions 0..3)
        ids, pos = [0, 1, 1], torch.tensor([4, 3, 5])  # request 1 rewrites position 3: copy on write
        placed = placed_rt.place_rows(ids, pos)
        assert placed.request_ids == ids and placed.n == 3
        pos[0] = 7  # the placement is its own: changing the positions tensor afterwards moves nothing
        for layer in range(2):
            kv, pe = torch.randn(3, DC, generator=g), torch.randn(3, DR, generator=g)
            # the checking append, then the one for rows validated by the caller: the same writes
            append = placed_rt.append_placed if layer == 0 else placed_rt.append_validated
            assert append(layer, placed, kv, pe).query()
            plain_rt.append(layer, ids, torch.tensor([4, 3, 5]), kv, pe)
        for layer in range(2):
            assert torch.equal(placed_rt.pool.kv_c(layer), plain_rt.pool.kv_c(layer))
            assert torch.equal(placed_rt.pool.k_pe(layer), plain_rt.pool.k_pe(layer))
        assert placed_rt.pool.blocks_of(1)[0] != placed_rt.pool.blocks_of(0)[0]  # copied on write
        assert placed_rt.pool.blocks_of(1) == plain_rt.pool.blocks_of(1)

        kv, pe = torch.randn(3, DC, generator=g), torch.randn(3, DR, generator=g)
        before = [placed_rt.pool.kv_c(layer).clone() for layer in range(2)]
        for bad, exc, needle in (
            (lambda: placed_rt.append_placed(0, (ids, pos), kv, pe), TypeError, "must be PlacedRows"),
            (lambda: placed_rt.append_placed(2, placed, kv, pe), ValueError, "layer must be <= 1"),
            (lambda: plain_rt.append_placed(0, placed, kv, pe), ValueError, "placed by another runtime"),
            (
                lambda: placed_rt.append_placed(0, placed, kv[:2], pe),
                ValueError,
                r"'kv_c' must have shape \[3",
            ),
            (lambda: placed_rt.place_rows([0, 9], pos[:2]), ValueError, "request 9 has no host-pool blocks"),
            (lambda: placed_rt.place_rows([0], pos), ValueError, "must hold 3 entries"),
        ):
            with pytest.raises(exc, match=needle):
                bad()
        with pytest.raises(ValueError, match="placed by another runtime"):
            plain_rt.append_validated(0, placed, kv, pe)
        placed_rt.reserve(2, 4)
        for append in (placed_rt.append_placed, placed_rt.append_validated):
            with pytest.raises(ValueError, match="stale"):
                append(0, placed, kv, pe)
        assert all(torch.equal(placed_rt.pool.kv_c(layer), b) for layer, b in enumerate(before))
        again = placed_rt.place_rows(ids, torch.tensor([4, 3, 5]))  # placed again: appended
        assert placed_rt.append_placed(1, again, kv, pe).query()
        assert placed_rt.place_rows([], torch.empty(0, dtype=torch.int64)).n == 0


def test_cpu_unfused_miss_copy_runs_inline() -> None:
    """The unfused step's miss copy (host pool -> hot buffers, both host memory on CPU) runs on the calling
    thread and fills the hot buffer with the pool's rows."""
    g = torch.Generator().manual_seed(1)
    with _cpu_runtime(fused=False) as rt:
        rt.reserve(0, 8)
        kv, pe = torch.randn(4, DC, generator=g), torch.randn(4, DR, generator=g)
        rt.append(0, [0] * 4, torch.arange(4), kv, pe)
        bt = rt.pool.block_table([0], max_blocks=2)
        h2d = rt.transfer_streams["h2d"]
        res = rt.attend(
            0, torch.randn(1, 2, DC, generator=g), torch.randn(1, 2, DR, generator=g), 0.25,
            IndexerInputs(q=torch.randn(1, 2, 8, generator=g), weights=torch.ones(1, 2), block_table=bt,
                          cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                          seq_lens_k=torch.tensor([4], dtype=torch.int32), k_cache=torch.randn(12, BS, 8, generator=g)),
            DecodeRows([0], torch.tensor([4]), bt),
        )  # fmt: skip
        assert h2d.counters.get("inline") == h2d.counters.get("submitted") == 1
        for token, slot in zip(res.topk[0].tolist(), res.residency.slots[0].tolist(), strict=True):
            assert torch.equal(rt.hot_kv_c[0][res.rows[0], slot], kv[token])
            assert torch.equal(rt.hot_k_pe[0][res.rows[0], slot], pe[token])


def _two_layer_step(rt: SparseDecodeOffload, rows_of, g: torch.Generator, n: int):
    """One decode step of request 0 over ``n`` positions in both layers; ``rows_of(indexer)`` gives the
    rows passed to ``attend``. Returns the two layers' results."""
    bt = rt.pool.block_table([0], max_blocks=2)
    cu, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    k_cache = torch.randn(12, BS, 8, generator=g)
    out = []
    rows = None
    for layer in range(2):
        idx = IndexerInputs(q=torch.randn(1, 2, 8, generator=g), weights=torch.ones(1, 2), block_table=bt,
                            cu_seqlens_q=cu, seq_lens_k=lens, k_cache=k_cache)  # fmt: skip
        rows = rows_of(idx, bt, rows)
        q_nope, q_pe = torch.randn(1, 2, DC, generator=g), torch.randn(1, 2, DR, generator=g)
        out.append(rt.attend(layer, q_nope, q_pe, 0.25, idx, rows))
    return out


def test_rows_checked_once_per_forward_give_the_per_layer_results_and_go_stale() -> None:
    """``check_rows`` once for both layers: the same outputs, top-k and counters as ``DecodeRows`` checked
    per layer; the checked rows are rejected after a reservation, an in-place change of their tensors or
    with other indexer lengths; ``check_rows`` rejects what ``attend`` rejects."""
    results = {}
    for mode in ("per_layer", "checked"):
        g = torch.Generator().manual_seed(3)
        with _cpu_runtime() as rt:
            rt.reserve(0, 8)
            kv, pe = torch.randn(8, DC, generator=g), torch.randn(8, DR, generator=g)
            for layer in range(2):
                rt.append(layer, [0] * 8, torch.arange(8), kv, pe)

            def rows_of(idx, bt, prev, rt=rt, mode=mode):
                decode = DecodeRows([0], torch.tensor([7]), bt)
                if mode == "per_layer":
                    return decode
                return prev if prev is not None else rt.check_rows(decode, idx.cu_seqlens_q, idx.seq_lens_k)

            steps = [_two_layer_step(rt, rows_of, g, n) for n in (6, 8)]
            counts = [rt.counters.snapshot(), *(c.snapshot() for c in rt.layer_counters)]
            for c in counts:
                c.pop("wait_seconds")  # timing, not a count
            results[mode] = (steps, counts[0], counts[1:])
    (want, want_tot, want_layers), (got, got_tot, got_layers) = results["per_layer"], results["checked"]
    for a_step, b_step in zip(want, got, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            assert torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse) and torch.equal(a.topk, b.topk)
    assert want_tot == got_tot and want_layers == got_layers and want_tot["hits"] > 0

    g = torch.Generator().manual_seed(4)
    with _cpu_runtime() as rt:
        rt.reserve(0, 8)
        rt.append(
            0, [0] * 8, torch.arange(8), torch.randn(8, DC, generator=g), torch.randn(8, DR, generator=g)
        )
        bt = rt.pool.block_table([0], max_blocks=2)
        cu, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([8], dtype=torch.int32)
        idx = IndexerInputs(q=torch.randn(1, 2, 8, generator=g), weights=torch.ones(1, 2), block_table=bt,
                            cu_seqlens_q=cu, seq_lens_k=lens, k_cache=torch.randn(12, BS, 8, generator=g))  # fmt: skip
        q = (torch.randn(1, 2, DC, generator=g), torch.randn(1, 2, DR, generator=g))
        with pytest.raises(ValueError, match="has 1 blocks per row"):
            rt.attend(0, *q, 0.25, idx, DecodeRows([0], torch.tensor([8]), bt[:, :1]))
        with pytest.raises(ValueError, match="has 1 blocks per row"):
            rt.check_rows(DecodeRows([0], torch.tensor([8]), bt[:, :1]), cu, lens)
        with pytest.raises(ValueError, match="stable_len entries must be >= 0"):
            rt.check_rows(DecodeRows([0], torch.tensor([-1]), bt), cu, lens)
        checked = rt.check_rows(DecodeRows([0], torch.tensor([8]), bt), cu, lens)
        # after a layer passed with these rows, a later layer's inputs are still checked: each fault alone
        rt.attend(0, *q, 0.25, idx, checked)
        for layer, q_nope, q_pe, scale, index, needle in (
            (1, q[0][..., :-1], q[1], 0.25, idx, r"'q_nope' must have shape"),
            (1, q[0].double(), q[1], 0.25, idx, r"'q_nope' must have dtype"),
            (1, q[0], q[1][:, :1], 0.25, idx, r"'q_pe' must have shape"),
            (2, *q, 0.25, idx, "layer must be <= 1"),
            (True, *q, 0.25, idx, "layer"),
            (1, *q, float("nan"), idx, "'scale' must be a finite float"),
            (
                1,
                *q,
                0.25,
                IndexerInputs(**{**idx.__dict__, "weights": torch.ones(1, 3)}),
                "'indexer.weights'",
            ),
            (1, *q, 0.25, IndexerInputs(**{**idx.__dict__, "k_cache": None}), "needs indexer.k_cache"),
            (1, *q, 0.25, idx.__dict__, "must be IndexerInputs"),
        ):
            with pytest.raises((ValueError, TypeError), match=needle):
                rt.attend(layer, q_nope, q_pe, scale, index, checked)
        rt.attend(1, *q, 0.25, idx, checked)  # and the good inputs pass again
        other = IndexerInputs(**{**idx.__dict__, "seq_lens_k": lens.clone()})
        with pytest.raises(ValueError, match=r"other indexer\.cu_seqlens_q / seq_lens_k"):
            rt.attend(0, *q, 0.25, other, checked)
        checked.stable_len.fill_(3)
        with pytest.raises(ValueError, match="stale"):
            rt.attend(0, *q, 0.25, idx, checked)
        checked = rt.check_rows(DecodeRows([0], torch.tensor([8]), bt), cu, lens)
        rt.reserve(1, 4)
        with pytest.raises(ValueError, match="stale"):
            rt.attend(0, *q, 0.25, idx, checked)
        assert rt.counters.get("hits") + rt.counters.get("misses") == 2 * 2  # the two good steps (top-k 2)


def test_step_counters_read_lazily_equal_each_steps_counts() -> None:
    """Hits, misses, evictions and H2D bytes read after several steps equal the sums of each step's
    counts recomputed from its results (top-k entries, miss counts, evictions)."""
    g = torch.Generator().manual_seed(5)
    with _cpu_runtime() as rt:
        rt.reserve(0, 8)
        rt.append(
            0, [0] * 8, torch.arange(8), torch.randn(8, DC, generator=g), torch.randn(8, DR, generator=g)
        )
        rt.append(
            1, [0] * 8, torch.arange(8), torch.randn(8, DC, generator=g), torch.randn(8, DR, generator=g)
        )
        want = {"hits": 0, "misses": 0, "evictions": 0}
        per_layer = [dict.fromkeys(want, 0) for _ in range(2)]
        for n in (3, 5, 8, 8, 8):
            for layer, r in enumerate(
                _two_layer_step(rt, lambda idx, bt, prev, n=n: DecodeRows([0], torch.tensor([n]), bt), g, n)
            ):
                valid = int((r.topk >= 0).sum())
                misses = int(r.residency.miss_count.sum())
                counts = {
                    "hits": valid - misses,
                    "misses": misses,
                    "evictions": int(r.residency.evictions.sum()),
                }
                for k, v in counts.items():
                    want[k] += v
                    per_layer[layer][k] += v
        got = rt.counters.snapshot()
        assert {k: got[k] for k in want} == want and want["hits"] > 0 and want["evictions"] > 0
        assert got["bytes_h2d"] == want["misses"] * rt.pool.row_bytes
        for layer, c in enumerate(rt.layer_counters):
            assert {k: c.get(k) for k in want} == per_layer[layer]
        assert rt.counters.snapshot() == got  # reading again adds nothing
