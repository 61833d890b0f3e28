"""tools/residency_policies.py: reuse traces, policy simulation and Belady's optimum."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from residency_policies import Trace, belady_misses, make_reuse_trace, simulate_policy

import torch_kvoffload.sparse


def test_research_utilities_are_not_runtime_api() -> None:
    for name in ("Trace", "PolicyResult", "belady_misses", "make_reuse_trace", "simulate_policy"):
        assert not hasattr(torch_kvoffload.sparse, name), name


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
