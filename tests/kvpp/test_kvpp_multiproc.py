"""KVPP across processes (spawn, gloo on loopback), each run bounded in time.

Every rank serves the same script of prefill / decode / chunked-prefill steps through a KVPP runtime,
first broadcasting only the forward's block runs, then whole bundle spans. The test checks, against
things written out here (the block runs of the script, the per-block bytes of each component, a run
without KVPP):

* bytes broadcast per forward = layers x blocks in the runs x per-block bytes of all components;
* after every wait a peer's scratch holds exactly the owner's blocks for those runs (checked in the
  worker, reported here) and nothing is written outside them;
* outputs are bit-identical to whole-span broadcast and to the run without KVPP, and the owners' caches
  end equal to the reference caches.
"""

from __future__ import annotations

import pytest
import torch
from support.kvpp_helpers import consecutive_runs, spawn_gloo
from support.kvpp_workers import (
    BLOCK_SIZE,
    DIMS,
    NUM_BLOCKS,
    SCRIPT,
    agreement_worker,
    has_history,
    kvpp_worker,
    reference,
)

FP32 = 4
COMPONENT_BYTES_PER_BLOCK = [BLOCK_SIZE * d * FP32 for d in DIMS.values()]  # c_kv, k_pe, index_k
BUNDLE_BYTES_PER_BLOCK = sum(COMPONENT_BYTES_PER_BLOCK)


def _runs(step) -> list[tuple[int, int]]:
    """Consecutive runs of the union of the step's block tables, written out independently."""
    return consecutive_runs({b for r in step for b in r.blocks})


def _run(tmp_path, world: int, tp: int, pp: int, num_layers: int, extra: bool) -> list[dict]:
    out = str(tmp_path / "rank{rank}.pt")
    spawn_gloo(kvpp_worker, world, tp, pp, num_layers, out, extra, timeout=150)
    return [torch.load(out.format(rank=r), weights_only=False) for r in range(world)]


def _check(results: list[dict], tp: int, num_layers: int) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded: same kernels, same bits
    try:
        refs = {}
        for res in results:
            key = tuple(res["layers"] + res["drafts"])
            if key not in refs:
                refs[key] = reference(list(key))
    finally:
        torch.set_num_threads(threads)
    for res in results:
        layers, drafts = res["layers"], res["drafts"]
        ref_out, _, ref_caches = refs[tuple(layers + drafts)]
        n = len(layers)
        # contiguous balanced ownership within the group
        base, rem = divmod(n, tp)
        counts = [base + int(r < rem) for r in range(tp)]
        start = layers[0] + sum(counts[: res["local_rank"]])
        assert res["owned"] == list(range(start, start + counts[res["local_rank"]]))
        assert (
            res["persistent_bytes"] == (len(res["owned"]) + len(drafts)) * BUNDLE_BYTES_PER_BLOCK * NUM_BLOCKS
        )
        for mode in ("runs", "whole"):
            got = res[mode]
            assert got["problems"] == [], got["problems"][:5]
            for step_index, (a, b) in enumerate(zip(got["outputs"], ref_out, strict=True)):
                assert torch.equal(a, b), f"rank {res['rank']} {mode} step {step_index}"
            for layer, comps in {**got["owned_caches"], **got["draft_caches"]}.items():
                for name, value in comps.items():
                    assert torch.equal(value, ref_caches[layer][name]), (res["rank"], mode, layer, name)
            for step_index, (step, counts_) in enumerate(zip(SCRIPT, got["per_forward"], strict=True)):
                if not has_history(step):
                    expected_bytes, expected_spans = 0, 0
                elif mode == "runs":
                    runs = _runs(step)
                    assert got["runs"][step_index] == runs
                    expected_bytes = n * sum(t - s for s, t in runs) * BUNDLE_BYTES_PER_BLOCK
                    expected_spans = n * len(runs) * len(COMPONENT_BYTES_PER_BLOCK)
                else:
                    expected_bytes, expected_spans = n * NUM_BLOCKS * BUNDLE_BYTES_PER_BLOCK, n
                assert counts_["bytes_broadcast"] == expected_bytes, (res["rank"], mode, step_index)
                assert counts_["broadcast_spans"] == expected_spans, (res["rank"], mode, step_index)
                assert counts_["broadcasts"] == (n if has_history(step) else 0)
                assert counts_["waits"] == counts_["broadcasts"]
        # the runs are a small part of the pool here: traffic follows the tokens
        runs_bytes = sum(f["bytes_broadcast"] for f in res["runs"]["per_forward"])
        whole_bytes = sum(f["bytes_broadcast"] for f in res["whole"]["per_forward"])
        assert 0 < runs_bytes < whole_bytes / 2


@pytest.mark.slow
def test_two_ranks_broadcast_the_block_runs_and_match_whole_spans(tmp_path) -> None:
    results = _run(tmp_path, 2, 2, 1, 5, extra=True)
    _check(results, 2, 5)
    for res in results:
        assert res["owned"] == ([0, 1, 2] if res["rank"] == 0 else [3, 4])
        assert res["drafts"] == [5]
        assert "disagree on num_blocks" in res["mismatch"]
        f = res["failure"]
        assert f["raised_at"] == 2 and "injected failure of layer 2" in f["message"]
        assert f["submitted"] == [0, 1, 2] and f["submitted_after"] == [0, 1, 2]
        assert "earlier broadcast failed" in f["later_error"]


@pytest.mark.slow
def test_four_ranks_tp2_pp2(tmp_path) -> None:
    """Four ranks as TP 2 x PP 2: one KVPP group per stage, never crossing stages."""
    results = _run(tmp_path, 4, 2, 2, 7, extra=False)
    _check(results, 2, 7)
    assert [r["group_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["owned"] for r in results] == [[0, 1], [2, 3], [4, 5], [6]]
    assert [r["drafts"] for r in results] == [[], [], [7], [7]]


# wait_timeout_s of the runtime whose ranks disagree or fail: their errors must arrive well before it
AGREE_TIMEOUT_S = 30.0
# wait_timeout_s of the runtime whose peer never joins a forward: the waiting rank gives up after it
SHORT_TIMEOUT_S = 2.0
# process start-up, imports and the good forwards on a loaded machine
STARTUP_S = 90.0


@pytest.mark.slow
def test_ranks_that_disagree_or_fail_raise_on_every_rank_and_recover(tmp_path) -> None:
    """Before a forward's broadcasts the ranks compare their block tables (and history flag) and whether
    each could schedule it: different tables, or one rank's bad input, raise a clear error on every rank
    (naming the ranks) through that exchange, well within ``wait_timeout_s`` and without issuing a
    broadcast, so the group stays usable and the next good forward works. A peer that never joins raises
    ``TimeoutError`` on the waiting rank after ``wait_timeout_s``."""
    out = str(tmp_path / "agree{rank}.pt")
    spawn_gloo(
        agreement_worker, 2, out, AGREE_TIMEOUT_S, SHORT_TIMEOUT_S, timeout=STARTUP_S + AGREE_TIMEOUT_S * 4
    )
    r0, r1 = (torch.load(out.format(rank=r), weights_only=False) for r in range(2))
    for res in (r0, r1):
        for key in ("first", "after_tables_differ", "after_history_differs", "after_bad_input"):
            assert res[key] == [], (res["rank"], key, res[key])
        for key in ("tables_differ", "history_differs"):
            got = res[key]
            assert got["type"] == "RuntimeError", (res["rank"], key, got)
            assert "ranks disagree on the forward's block tables" in got["message"], got
            assert "rank 0" in got["message"] and "rank 1" in got["message"], got
            assert got["seconds"] < AGREE_TIMEOUT_S, (res["rank"], key, got)
        assert res["counters"]["forwards_refused"] == 3
    got = r1["bad_input"]
    assert got["type"] == "ValueError" and "block_tables[0] entry must be <= 39, got 40" in got["message"], (
        got
    )
    got = r0["bad_input"]
    assert got["type"] == "RuntimeError" and "rank 1 could not schedule" in got["message"], got
    assert got["seconds"] < AGREE_TIMEOUT_S, got
    # the absent peer: a timeout bounded by the configuration, then the scheduler refuses to go on
    got = r0["absent_peer"]
    assert got["type"] == "TimeoutError" and "within 2.0 s" in got["message"], got
    assert SHORT_TIMEOUT_S <= got["seconds"] <= 2 * SHORT_TIMEOUT_S, got
    assert r0["after_absent_peer"]["type"] == "TransferError", r0["after_absent_peer"]
    assert r1["late_peer"]["type"] == "ValueError", r1["late_peer"]
    # a peer gone in the middle of a forward: the wait and the transfer thread's collective give up after
    # the configured timeout, the scheduler is failed, and closing it returns
    got = r0["peer_gone_midway"]
    assert got["type"] in ("TimeoutError", "TransferError"), got
    assert got["seconds"] <= 2 * SHORT_TIMEOUT_S, got
    got = r0["complete_after_peer_gone"]
    assert got["type"] in (None, "TransferError") and got["seconds"] <= 2 * SHORT_TIMEOUT_S, got
    assert r0["after_peer_gone"]["type"] == "TransferError", r0["after_peer_gone"]
    for res in (r0, r1):
        got = res["close_after_peer_gone"]
        assert got["type"] is None and got["seconds"] <= 2 * SHORT_TIMEOUT_S, (res["rank"], got)
