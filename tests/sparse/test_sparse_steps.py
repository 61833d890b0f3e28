"""SparseDecodeOffload step semantics: validation before any change, failures part-way, residency rows
that belong to requests (any batch order), and counters that count what the copies moved.

Every runtime here is on the CPU explicitly. The reference is dense MLA attention
(:func:`support.references.dense_mla_attention`, through ``support/sparse_scenario.py``) over the same top-k positions of the test's own copy of every
request's KV.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.sparse_scenario import (
    DC,
    DR,
    LAYERS,
    MAX_LEN,
    TOP_K,
    Scenario,
    check_dense,
    config,
    counter_snapshot,
)

import torch_kvoffload.sparse.host_step as host_step_module
from torch_kvoffload.sparse import SparseDecodeOffload

# ------------------------------------------------------------------------------- rejected steps


def _with(args, **changes):
    """``attend`` arguments ``args`` with the named ones replaced."""
    names = ("layer", "q_nope", "q_pe", "scale", "indexer", "rows")
    return tuple({**dict(zip(names, args, strict=True)), **changes}.values())


def _with_rows(args, **fields):
    """``attend`` arguments ``args`` with the named fields of their ``DecodeRows`` replaced."""
    return _with(args, rows=replace(args[5], **fields))


def _bad_layer(args):
    return _with(args, layer=-1)


def _bad_q_pe(args):
    return _with(args, q_pe=args[2][..., :-1])


def _bad_dtype(args):
    return _with(args, q_nope=args[1].double(), q_pe=args[2].double())


def _narrow_table(args):
    return _with_rows(args, host_block_table=args[5].host_block_table[:, :3])


def _wrong_block(args):
    bt = args[5].host_block_table.clone()
    bt[1, 0] = 63  # a block of the pool, not this request's
    return _with_rows(args, host_block_table=bt)


def _block_out_of_range(args):
    bt = args[5].host_block_table.clone()
    bt[2, 1] = 64
    return _with_rows(args, host_block_table=bt)


def _past_reserved(args):
    idx, rows = args[4:]
    seq = idx.seq_lens_k.clone()
    seq[0] = MAX_LEN + 1
    wide = torch.cat([rows.host_block_table, torch.zeros(4, 2, dtype=torch.int32)], dim=1)
    return _with(args, indexer=replace(idx, seq_lens_k=seq), rows=replace(rows, host_block_table=wide))


def _bad_stable(args):
    return _with_rows(args, stable_len=args[5].stable_len[:2])


def _negative_id(args):
    return _with_rows(args, request_ids=torch.tensor([0, -1, 2, 3]))


def _no_k_cache(args):
    return _with(args, indexer=replace(args[4], k_cache=None))


REJECTIONS = [
    (_bad_layer, ValueError, "layer must be >= 0, got -1"),
    (_bad_q_pe, ValueError, r"'q_pe' must have shape \[4, 4, 8\]"),
    (_bad_dtype, ValueError, "'q_nope' must have dtype torch.float32"),
    (_narrow_table, ValueError, "host_block_table has 3 blocks per row"),
    (_wrong_block, ValueError, "but request 1's blocks in the host pool are"),
    (_block_out_of_range, IndexError, r"holds block 64 .* expected a value in \[0, 64\)"),
    (_past_reserved, ValueError, "attends to 97 positions but only 96 are reserved"),
    (_bad_stable, ValueError, r"rows.stable_len' must have shape \[4\]"),
    (_negative_id, ValueError, "request_ids' entries must be >= 0"),
    (_no_k_cache, ValueError, "needs indexer.k_cache"),
]


def _same_results(want: list, got: list) -> None:
    assert len(want) == len(got)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w.topk, g.topk) and w.rows == g.rows
        for a, b in zip(w.residency.as_tuple(), g.residency.as_tuple(), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(w.out, g.out) and torch.equal(w.lse, g.lse)


def _snapshot(rt: SparseDecodeOffload) -> list[torch.Tensor]:
    return [t.clone() for tb in rt.tables for t in tb.state] + [
        t.clone() for t in (*rt.hot_kv_c, *rt.hot_k_pe)
    ]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("spoil", "exc", "fragment"), REJECTIONS, ids=lambda v: getattr(v, "__name__", None))
def test_rejected_step_changes_nothing(fused: bool, spoil, exc, fragment: str) -> None:
    """good step, rejected step, good step == the two good steps alone (outputs, hits, counters)."""
    sc = Scenario(seed=1)
    order = [0, 1, 2, 3]
    clean, kc_clean = sc.runtime(config(fused=fused))
    spoiled, kc_spoiled = sc.runtime(config(fused=fused))
    with clean, spoiled:
        want = sc.step(clean, kc_clean, 0, order) + sc.step(clean, kc_clean, 1, order)
        got = sc.step(spoiled, kc_spoiled, 0, order)
        for layer in range(LAYERS):
            sc.append(spoiled, 1, layer, order)
            spoiled.sync()
            before, counts = _snapshot(spoiled), counter_snapshot(spoiled)
            with pytest.raises(exc, match=fragment):
                spoiled.attend(*spoil(sc.args(spoiled, kc_spoiled, 1, layer, order)))
            assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(spoiled), strict=True))
            assert counter_snapshot(spoiled) == counts
            got.append(spoiled.attend(*sc.args(spoiled, kc_spoiled, 1, layer, order)))
        _same_results(want, got)
        assert counter_snapshot(spoiled) == counter_snapshot(clean)
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(clean), _snapshot(spoiled), strict=True))


# ------------------------------------------------------------------------------- failure part-way


def test_step_failing_part_way_keeps_state_and_stays_correct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copy-SFA fails after it wrote the hot buffer: the state stays, minus the slots it was filling."""
    sc = Scenario(seed=2)
    order = [0, 1, 2, 3]
    rt, kc = sc.runtime(config(capacity=TOP_K))  # every miss evicts a resident
    real = host_step_module.scatter_copy_sparse_mla_attention
    seen: dict = {}

    def broken(*args) -> None:
        real(*args)  # the copies ran ...
        hot_kv, miss_slots, miss_count = args[5], args[8], args[9]
        seen["miss_slots"] = miss_slots.clone()
        for r in range(hot_kv.shape[0]):  # ... and left garbage in the slots it was filling
            hot_kv[r, miss_slots[r, : int(miss_count[r])].long()] = float("nan")
        raise RuntimeError("kernel failed")

    with rt:
        for s in range(2):
            check_dense(sc, sc.step(rt, kc, s, order), order, s)
        sc.append(rt, 2, 0, order)
        rt.sync()
        table = rt.tables[0]
        before, counts = [t.clone() for t in table.state], counter_snapshot(rt)
        monkeypatch.setattr(host_step_module, "scatter_copy_sparse_mla_attention", broken)
        with pytest.raises(RuntimeError, match="kernel failed"):
            rt.attend(*sc.args(rt, kc, 2, 0, order))
        monkeypatch.setattr(host_step_module, "scatter_copy_sparse_mla_attention", real)
        assert counter_snapshot(rt) == counts
        assert torch.equal(table.lru_order, before[1]) and torch.equal(table.row_request, before[2])
        expect = before[0].clone()
        for r, row in enumerate(seen["miss_slots"].tolist()):
            for slot in row:
                if slot >= 0:
                    expect[r, slot] = -1
        assert torch.equal(table.slot_to_token, expect)
        assert bool((expect != before[0]).any()), "the failed step had misses"
        # the same step again and the next one attend to the right rows (garbage never counts as a hit)
        res = [rt.attend(*sc.args(rt, kc, 2, 0, order))]
        sc.append(rt, 2, 1, order)
        res.append(rt.attend(*sc.args(rt, kc, 2, 1, order)))
        check_dense(sc, res, order, 2)
        check_dense(sc, sc.step(rt, kc, 3, order), order, 3)


# ------------------------------------------------------------------------ rows belong to requests


@pytest.mark.parametrize("fused", [True, False])
def test_shuffled_and_compacted_batches_hit_exactly_as_in_order(fused: bool) -> None:
    sc = Scenario(seed=3)
    steady, kc_a = sc.runtime(config(fused=fused))
    shuffled, kc_b = sc.runtime(config(fused=fused))
    g = torch.Generator().manual_seed(5)
    live = [0, 1, 2, 3]
    with steady, shuffled:
        for s in range(7):
            if s == 4:  # request 1 finishes; the batch is compacted
                live = [0, 2, 3]
                steady.release(1)
                shuffled.release(1)
                assert shuffled.rows_of(1) == []
            order = [live[i] for i in torch.randperm(len(live), generator=g).tolist()]
            ra, rb = sc.step(steady, kc_a, s, live), sc.step(shuffled, kc_b, s, order)
            if s == 0:  # rows are assigned on first sight, in batch order, and kept
                first = {r: shuffled.rows_of(r) for r in live}
                assert sorted(first[r][0] for r in order) == [0, 1, 2, 3] and first[order[0]] == [0]
            check_dense(sc, rb, order, s)
            for a, b in zip(ra, rb, strict=True):
                for rid in live:
                    i, j = live.index(rid), order.index(rid)
                    assert torch.equal(a.topk[i], b.topk[j])
                    for x, y in zip(a.residency.as_tuple(), b.residency.as_tuple(), strict=True):
                        assert torch.equal(x[i], y[j]), f"step {s} request {rid}"
                    torch.testing.assert_close(a.out[i], b.out[j], rtol=1e-5, atol=1e-6)
                    assert b.rows[j] == shuffled.rows_of(rid)[0]
        assert counter_snapshot(steady) == counter_snapshot(shuffled)
        assert shuffled.counters.get("hits") > shuffled.counters.get("misses") > 0
        assert {r: shuffled.rows_of(r) for r in live} == {r: first[r] for r in live}


def test_max_rows_bounds_the_rows_alive() -> None:
    sc = Scenario(seed=4)
    rt, kc = sc.runtime(config(), max_rows=3)
    with rt:
        sc.append(rt, 0, 0, [0, 1, 2, 3])
        with pytest.raises(ValueError, match=r"4 decode rows, expected 1\.\.max_rows=3"):
            rt.attend(*sc.args(rt, kc, 0, 0, [0, 1, 2, 3]))
        res = rt.attend(*sc.args(rt, kc, 0, 0, [2, 0, 1]))
        assert res.rows == [0, 1, 2]  # first sight: the lowest free row, in batch order
        before = _snapshot(rt)
        with pytest.raises(
            ValueError, match=r"needs 1 new residency rows but only 0 of max_rows=3 are free \(3 held"
        ):
            rt.attend(*sc.args(rt, kc, 0, 0, [3]))
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(rt), strict=True))
        rt.release(0)
        res = rt.attend(*sc.args(rt, kc, 0, 0, [3, 2, 1]))
        assert res.rows == [1, 0, 2]  # request 3 takes the row request 0 left; the others keep theirs
        assert int(res.residency.miss_count[0]) == int((res.topk[0] >= 0).sum())  # a fresh row misses all
        # a request with two query tokens holds two rows, matched by their order in the step
        rt.release(1)
        rt.release(2)
        res = rt.attend(*sc.args(rt, kc, 0, 0, [3, 3]))
        assert res.rows == [1, 0] and rt.rows_of(3) == [1, 0]


# ----------------------------------------------------------------------------- counters are moves


def _changed_rows(before: torch.Tensor, after: torch.Tensor) -> int:
    return int((before != after).flatten(0, -2).any(dim=-1).sum())


@pytest.mark.parametrize("mode", ["fused", "unfused", "fused-shuffled"])
def test_bytes_moved_equal_rows_the_copies_wrote(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No speculation, fresh random rows: every copied row changes content, so the rows that changed
    are the rows the copies wrote (and, unfused, the rows a spy on copy_rows saw)."""
    sc = Scenario(seed=6)
    rt, kc = sc.runtime(config(fused=mode != "unfused"))
    spied = {"h2d": 0}
    real_copy = host_step_module.copy_rows

    def spy(src, dst, src_slots, dst_slots) -> None:
        if any(dst is t for t in (*rt.hot_kv_c, *rt.hot_k_pe)):
            spied["h2d"] += dst_slots.numel()
        real_copy(src, dst, src_slots, dst_slots)

    monkeypatch.setattr(host_step_module, "copy_rows", spy)
    row_bytes = (DC + DR) * 4  # fp32 latent + rope
    g = torch.Generator().manual_seed(0)
    with rt:
        for s in range(5):
            order = [0, 1, 2, 3]
            if mode == "fused-shuffled":
                order = [order[i] for i in torch.randperm(4, generator=g).tolist()]
            for layer in range(LAYERS):
                pool_before = torch.cat([rt.pool.kv_c(layer), rt.pool.k_pe(layer)], dim=-1).clone()
                d2h = rt.counters.get("bytes_d2h")
                sc.append(rt, s, layer, sorted(order))
                rt.sync()
                pool_after = torch.cat([rt.pool.kv_c(layer), rt.pool.k_pe(layer)], dim=-1)
                assert _changed_rows(pool_before, pool_after) == 4
                assert rt.counters.get("bytes_d2h") - d2h == 4 * row_bytes
                hot_before = torch.cat([rt.hot_kv_c[layer], rt.hot_k_pe[layer]], dim=-1).clone()
                h2d, spy_before = rt.counters.get("bytes_h2d"), spied["h2d"]
                res = rt.attend(*sc.args(rt, kc, s, layer, order))
                hot_after = torch.cat([rt.hot_kv_c[layer], rt.hot_k_pe[layer]], dim=-1)
                changed = _changed_rows(hot_before, hot_after)
                assert rt.counters.get("bytes_h2d") - h2d == changed * row_bytes
                copy_sfa = mode != "unfused" and res.rows == list(range(res.rows[0], res.rows[0] + 4))
                if not copy_sfa:  # copies went through copy_rows
                    assert (spied["h2d"] - spy_before) == 2 * changed  # kv_c and k_pe rows
                assert changed > 0 or s > 0
                assert res.out.isfinite().all()
        assert rt.counters.get("bytes_h2d") < 5 * LAYERS * 4 * TOP_K * row_bytes  # hits moved nothing


# ------------------------------------------------------------------------------- append / reserve


@pytest.mark.parametrize(
    ("call", "exc", "fragment"),
    [
        (lambda rt, p, kv, pe: rt.append(-1, [0, 1], p, kv, pe), ValueError, "layer must be >= 0, got -1"),
        (lambda rt, p, kv, pe: rt.append(LAYERS, [0, 1], p, kv, pe), ValueError, f"layer must be <= {LAYERS - 1}"),
        (lambda rt, p, kv, pe: rt.append(0, [0, 7], p, kv, pe), ValueError, "request 7 has no host-pool blocks"),
        (lambda rt, p, kv, pe: rt.append(0, [0, 1], p + MAX_LEN, kv, pe), IndexError, "must lie in"),
        (lambda rt, p, kv, pe: rt.append(0, [0, 0], p * 0, kv, pe), ValueError, "occurs twice"),
        (lambda rt, p, kv, pe: rt.append(0, [0, 1], p, kv[:, :-1], pe), ValueError, r"'kv_c' must have shape \[2, 32\]"),
        (lambda rt, p, kv, pe: rt.append(0, [0], p, kv, pe), ValueError, "must hold 2 entries"),
        (lambda rt, p, kv, pe: rt.append(0, [0, 1], p.float(), kv, pe), ValueError, "'positions' must have dtype"),
        (lambda rt, p, kv, pe: rt.append(0, [0, 1], p, kv.int(), pe), ValueError, "'kv_c' must have dtype"),
        (lambda rt, p, kv, pe: rt.reserve(-1, 8), ValueError, "request_id must be >= 0"),
        (lambda rt, p, kv, pe: rt.reserve(0, 2.5), TypeError, "num_tokens must be an int"),
        (lambda rt, p, kv, pe: rt.release(-2), ValueError, "request_id must be >= 0"),
    ],
)  # fmt: skip
def test_bad_append_reserve_release_change_nothing(call, exc, fragment: str) -> None:
    sc = Scenario(seed=7)
    rt, _ = sc.runtime(config())
    with rt:
        pool = [t.clone() for ly in range(LAYERS) for t in (rt.pool.kv_c(ly), rt.pool.k_pe(ly))]
        free, counts = rt.pool.free_blocks, counter_snapshot(rt)
        with pytest.raises(exc, match=fragment):
            call(rt, torch.tensor([50, 30]), torch.randn(2, DC), torch.randn(2, DR))
        rt.sync()
        after = [t for ly in range(LAYERS) for t in (rt.pool.kv_c(ly), rt.pool.k_pe(ly))]
        assert all(torch.equal(a, b) for a, b in zip(pool, after, strict=True))
        assert rt.pool.free_blocks == free and counter_snapshot(rt) == counts
