"""KVPP across processes (spawn, gloo on loopback): outputs equal the single-process run without KVPP.

Each run spawns the ranks of one layout, serves a script of prefill / decode / chunked-prefill steps of a
small MLA stack (fp32) whose layers are owned across the group, and compares every rank's hidden states
with a single-process run where every layer keeps its own cache.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from torch_kvoffload.kvpp.launch import spawn_local
from torch_kvoffload.kvpp.ownership import assign_owners
from torch_kvoffload.kvpp.plan import KVPPPlan, align_up
from torch_kvoffload.kvpp.toy_mla import (
    DEFAULT_SCRIPT,
    ToyMLAConfig,
    blocks_needed,
    kvpp_jobs_worker,
    kvpp_worker,
    make_batches,
    reference_outputs,
)


def _reference(cfg: ToyMLAConfig, boundaries: tuple[int, ...]):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded: same kernels, same bits
    try:
        return reference_outputs(cfg, boundaries=boundaries)
    finally:
        torch.set_num_threads(threads)


def _run(tmp_path, cfg: ToyMLAConfig, world: int, tp: int, pp: int, options: dict) -> list[dict]:
    out = str(tmp_path / "rank{rank}.pt")
    spawn_local(kvpp_worker, world, asdict(cfg), tp, pp, out, options, timeout=150, pg_timeout=60)
    return [torch.load(out.format(rank=r), weights_only=False) for r in range(world)]


def _check_run(results: list[dict], cfg: ToyMLAConfig, tp: int, pp: int) -> None:
    boundaries = tuple(cfg.stage_layers(pp, s)[-1] for s in range(pp))
    ref = _reference(cfg, boundaries)
    history = [b.has_history for b in make_batches(cfg)]
    assert history[0] is False and all(history[1:])
    bundle = cfg.bundle().bytes_per_block
    num_blocks = blocks_needed(cfg)
    for res in results:
        stage = res["stage"]
        layers = cfg.stage_layers(pp, stage)
        assert res["layers"] == layers
        assert res["group_ranks"] == list(range(stage * tp, stage * tp + tp))
        # every rank's hidden states equal the run without KVPP, bit for bit, at every step
        last = (layers + res["drafts"])[-1]
        for step, (got, want) in enumerate(zip(res["outputs"], ref, strict=True)):
            assert torch.equal(got[last], want[last]), f"rank {res['rank']} step {step} layer {last}"
        # persistent bytes: the owned bundles (+ local drafts), by the formula
        owners = assign_owners(layers, tp)
        plan = KVPPPlan(dict.fromkeys(layers, bundle), owners, res["local_rank"], bundle * len(res["drafts"]))
        owned = [layer for layer in layers if owners[layer] == res["local_rank"]]
        assert res["owned"] == owned
        assert res["persistent_bytes"] == (len(owned) + len(res["drafts"])) * bundle * num_blocks
        assert res["plan_bytes_per_block"] == (len(owned) + len(res["drafts"]) + 2) * bundle
        expected_scratch = 2 * align_up(bundle * num_blocks) if len(owned) < len(layers) else 0
        assert res["scratch_bytes"] == expected_scratch
        assert res["allocated_bytes"] == plan.allocation_bytes(num_blocks) - (
            0 if expected_scratch else 2 * align_up(bundle * num_blocks)
        )
        # the first forward (no history) broadcast nothing; every later one each target layer once
        assert res["broadcasts_per_step"] == [len(layers) * i for i in range(len(DEFAULT_SCRIPT))]
        assert res["counters"]["bytes_broadcast"] == res["counters"]["broadcasts"] * bundle * num_blocks
        assert res["counters"]["waits"] == res["counters"]["broadcasts"]


def test_world2_tp2_with_draft_failure_and_mismatch(tmp_path) -> None:
    cfg = ToyMLAConfig(num_layers=5, num_draft_layers=1)
    results = _run(tmp_path, cfg, 2, 2, 1, {"fail_target": 2, "mismatch_check": True})
    _check_run(results, cfg, 2, 1)
    for res in results:
        assert res["owned"] == ([0, 1, 2] if res["rank"] == 0 else [3, 4])
        assert "disagree on num_blocks" in res["mismatch"]
        f = res["failure"]
        assert f["raised_at"] == 2 and "injected failure of layer 2" in f["message"]
        assert f["submitted"] == [0, 1, 2] and f["submitted_after"] == [0, 1, 2]
        assert "earlier broadcast failed" in f["later_error"]


@pytest.mark.slow
def test_world4_tp4_and_tp2_pp2(tmp_path) -> None:
    """Two layouts of four ranks in one set of processes: TP 4, then TP 2 x PP 2 (with a draft layer)."""
    tp4 = ToyMLAConfig(num_layers=6)
    tp2pp2 = ToyMLAConfig(num_layers=6, num_draft_layers=1, seed=1)
    a, b = str(tmp_path / "tp4-{rank}.pt"), str(tmp_path / "tp2pp2-{rank}.pt")
    jobs = [(asdict(tp4), 4, 1, a, {}), (asdict(tp2pp2), 2, 2, b, {})]
    spawn_local(kvpp_jobs_worker, 4, jobs, timeout=200, pg_timeout=60)
    results = [torch.load(a.format(rank=r), weights_only=False) for r in range(4)]
    _check_run(results, tp4, 4, 1)
    assert [r["owned"] for r in results] == [[0, 1], [2, 3], [4], [5]]
    results = [torch.load(b.format(rank=r), weights_only=False) for r in range(4)]
    _check_run(results, tp2pp2, 2, 2)
    assert [r["owned"] for r in results] == [[0, 1], [2], [3, 4], [5]]
    assert [r["drafts"] for r in results] == [[], [], [6], [6]]
