"""The TP-shared host pool's cross-process fence: a reader rank never reads rows before the writer's copy.

The writer (this process) and a reader (a spawned process attached to the same ``/dev/shm`` pool) run
the same decode step. The reader replays the reservations and the append (without copying) and calls
``attend`` at once; the writer appends the step's new rows only after a delay. Every position is selected
(top-k = the whole visible length), so a reader that did not wait would attend to rows that are still
zero. Its outputs must equal the writer's exactly.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import pytest
import torch

from torch_kvoffload.sparse import (
    DecodeRows,
    HostKVPool,
    IndexerInputs,
    SparseDecodeConfig,
    SparseDecodeOffload,
)

DC, DR, H, HI, DI, BS = 16, 4, 2, 2, 8, 4
PREFILL = 7  # positions 0..6 arrive before the step; the step appends position 7
TOP_K = PREFILL + 1
DELAY = 1.0  # seconds the writer holds the new rows back


def _cfg() -> SparseDecodeConfig:
    return SparseDecodeConfig(
        top_k=TOP_K, capacity=2 * TOP_K, host_pool_blocks=8, block_size=BS, kv_dtype="fp32"
    )


def _inputs(seed: int):
    """Both ranks' identical step inputs (the indexer cache is rank-local, the same content on both)."""
    g = torch.Generator().manual_seed(seed)
    new_kv, new_pe = torch.randn(2, DC, generator=g), torch.randn(2, DR, generator=g)
    q_nope, q_pe = torch.randn(2, H, DC, generator=g), torch.randn(2, H, DR, generator=g)
    k_cache = torch.randn(8, BS, DI, generator=g)
    iq, w = torch.randn(2, HI, DI, generator=g), torch.rand(2, HI, generator=g)
    return new_kv, new_pe, q_nope, q_pe, k_cache, iq, w


def _step(rt: SparseDecodeOffload, seed: int, append: bool = True):
    new_kv, new_pe, q_nope, q_pe, k_cache, iq, w = _inputs(seed)
    if append:
        rt.append(0, [0, 1], torch.tensor([PREFILL, PREFILL]), new_kv, new_pe)
    bt = rt.pool.block_table([0, 1], max_blocks=2)
    seq = torch.full((2,), PREFILL + 1, dtype=torch.int32)
    idx = IndexerInputs(q=iq, weights=w, block_table=bt, cu_seqlens_q=torch.arange(3, dtype=torch.int32),
                        seq_lens_k=seq, k_cache=k_cache)  # fmt: skip
    return rt.attend(0, q_nope, q_pe, 0.5, idx, DecodeRows(torch.tensor([0, 1]), seq.long(), bt))


def _runtime(**kw) -> SparseDecodeOffload:
    return SparseDecodeOffload(_cfg(), num_layers=1, max_rows=2, kv_lora_rank=DC, rope_dim=DR,
                               device=torch.device("cpu"), **kw)  # fmt: skip


def _reader(name: str, seed: int, queue) -> None:
    try:
        pool = HostKVPool.attach(name)
        rt = _runtime(pool=pool, writer=False, fence_timeout=60.0)
        for rid in (0, 1):  # replay the writer's reservations: same blocks
            rt.reserve(rid, 2 * BS)
        queue.put("ready")
        start = time.perf_counter()
        res = _step(rt, seed)  # the append only counts; attend waits for the writer's
        waited = time.perf_counter() - start
        hot = rt.hot_kv_c[0][res.rows[0], res.residency.slots[0].long()].tolist()
        queue.put((res.out.tolist(), res.topk.tolist(), hot, waited, rt.counters.get("waits")))
        rt.close()
        pool.close()
    except BaseException as exc:  # reported to the test instead of a silent exit
        queue.put(f"reader failed: {exc!r}")


@pytest.mark.slow
def test_reader_waits_for_rows_the_writer_publishes_late() -> None:
    seed = 3
    writer = _runtime(shared=True)
    try:
        g = torch.Generator().manual_seed(1)
        for rid in (0, 1):
            writer.reserve(rid, 2 * BS)
            slots = writer.pool.slots(rid, torch.arange(PREFILL))
            writer.pool.kv_c(0).view(-1, DC)[slots] = torch.randn(PREFILL, DC, generator=g)
            writer.pool.k_pe(0).view(-1, DR)[slots] = torch.randn(PREFILL, DR, generator=g)
            new = writer.pool.slots(rid, torch.tensor([PREFILL]))
            writer.pool.kv_c(0).view(-1, DC)[new] = 0.0  # not written yet
            writer.pool.k_pe(0).view(-1, DR)[new] = 0.0
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_reader, args=(writer.pool.name, seed, queue))
        proc.start()
        try:
            assert queue.get(timeout=120) == "ready"
            time.sleep(DELAY)
            mine = _step(writer, seed)
            got = queue.get(timeout=120)
        finally:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        assert not isinstance(got, str), got
        out, topk, hot, waited, waits = got
        assert sorted(topk[0]) == list(range(TOP_K)), "every position, the new one included, is selected"
        assert torch.equal(torch.tensor(topk, dtype=torch.int32), mine.topk)
        assert torch.equal(torch.tensor(out), mine.out), "the reader attended to other rows than the writer"
        want_hot = writer.hot_kv_c[0][mine.rows[0], mine.residency.slots[0].long()]
        assert torch.equal(torch.tensor(hot), want_hot)
        assert waited >= 0.5 * DELAY and waits >= 1
        assert proc.exitcode == 0
    finally:
        writer.close()


def test_reader_times_out_with_a_clear_error_and_nothing_changed() -> None:
    writer = _runtime(shared=True)
    pool = HostKVPool.attach(writer.pool.name)
    reader = _runtime(pool=pool, writer=False, fence_timeout=0.1)
    try:
        for rt in (writer, reader):
            for rid in (0, 1):
                rt.reserve(rid, 2 * BS)
        before = [t.clone() for t in reader.tables[0].state]
        with pytest.raises(TimeoutError, match=r"layer 0 append 1 was not published within 0.1 s .*up to 0"):
            _step(reader, seed=0)
        assert all(torch.equal(a, b) for a, b in zip(before, reader.tables[0].state, strict=True))
        mine = _step(writer, seed=0)  # the writer catches up: the reader's retry of the step goes through
        res = _step(reader, seed=0, append=False)
        assert torch.equal(res.out, mine.out) and torch.equal(res.topk, mine.topk)
        assert reader.counters.get("bytes_d2h") == 0 and writer.counters.get("bytes_d2h") > 0
    finally:
        reader.close()
        pool.close()
        writer.close()


# ------------------------------------------------------------------------------------ attach checks

POOL_DIMS = {"num_layers": 2, "num_blocks": 5, "block_size": 4, "kv_lora_rank": 8, "rope_dim": 2}


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 3), ("num_blocks", 6), ("block_size", 8), ("kv_lora_rank", 16), ("rope_dim", 4),
     ("dtype", torch.float32), ("dtype", torch.float16)],
)  # fmt: skip
def test_attach_with_other_dims_raises(field: str, value) -> None:
    """A rank attaching with the dims it expects gets a ValueError naming the field that differs."""
    with HostKVPool.create(**POOL_DIMS, dtype=torch.bfloat16, shared=True) as pool:
        expected = {**POOL_DIMS, "dtype": torch.bfloat16}
        pool.kv_c(1)[2, 3].fill_(5.0)
        with pytest.raises(ValueError, match=f"HostKVPool.attach: .*{field}.*"):
            HostKVPool.attach(pool.name, **{**expected, field: value})
        with HostKVPool.attach(pool.name, **expected) as same:  # the pool's own dims: attached
            assert same.kv_c(1).shape == (5, 4, 8) and float(same.kv_c(1)[2, 3, 0]) == 5.0
        with HostKVPool.attach(pool.name, dtype="bf16", num_blocks=5) as some:  # any subset
            assert some.num_layers == 2 and some.dtype == torch.bfloat16


def _rewrite_header(name: str, **changes) -> None:
    path = os.path.join("/dev/shm", name)
    with open(path, "r+b") as f:
        raw = f.read(2048)
        meta = json.loads(raw.rstrip(b"\0").decode())
        meta.update(changes)
        f.seek(0)
        f.write(json.dumps(meta).encode().ljust(2048, b"\0"))


@pytest.mark.parametrize(
    "changes",
    [{"num_blocks": 4}, {"num_blocks": 6}, {"num_layers": 1}, {"kv_lora_rank": 512}, {"rope_dim": 6},
     {"block_size": 2}, {"dtype": "torch.float32"}, {"dtype": "torch.float16", "rope_dim": 1}, {"total": 1 << 40},
     {"num_blocks": 0}, {"num_blocks": "5"}, {"num_layers": None}],
    ids=str,
)  # fmt: skip
def test_attach_to_a_header_that_disagrees_with_its_size_raises(changes: dict) -> None:
    """A header whose dims do not describe the file (another version, a torn or tampered file) is refused:
    the views would otherwise place layers / components at wrong offsets and read other rows silently."""
    with HostKVPool.create(**POOL_DIMS, dtype=torch.bfloat16, shared=True) as pool:
        _rewrite_header(pool.name, **changes)
        with pytest.raises(ValueError, match=r"HostKVPool.attach: "):
            HostKVPool.attach(pool.name)


def test_attach_to_a_truncated_file_raises() -> None:
    with HostKVPool.create(**POOL_DIMS, dtype=torch.bfloat16, shared=True) as pool:
        os.truncate(os.path.join("/dev/shm", pool.name), 4096)
        with pytest.raises(ValueError, match=r"HostKVPool.attach: .* 4096 bytes"):
            HostKVPool.attach(pool.name)
