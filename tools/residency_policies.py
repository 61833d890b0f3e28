"""Research utilities for residency policies: synthetic top-k traces, online policies and Belady's offline
optimum. Used by ``benchmarks/sparse_decode_bench.py`` and ``tests/sparse/test_sparse_policies.py`` (with
``tools/`` on the import path); not part of the installed package.

A *trace* is one decode row's sequence of top-k selections: ``steps`` lists of distinct logical
positions. Online policies (``"lru"``, ``"score"``) run through :class:`ResidencyTable` — the real op, one
step at a time. :func:`belady_misses` is the offline optimum for the same hot-buffer capacity: every
selected position must be resident at its step, and when a slot is needed the resident that is not
selected now and whose next selection lies farthest in the future (or never comes) is evicted. With all
of a step's selections pinned, farthest-next-use eviction is optimal for this set-request setting by the
usual exchange argument, so no policy can have fewer misses on the trace.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from torch_kvoffload.sparse.residency import ResidencyTable

__all__ = ["PolicyResult", "Trace", "belady_misses", "make_reuse_trace", "simulate_policy"]


@dataclass(frozen=True)
class Trace:
    """``topk[t]``: ``int32 [K]`` positions selected at step ``t`` (distinct, >= 0); ``scores[t]``:
    ``float32 [L_t]`` indexer scores of every position visible at step ``t`` (top-k = its K highest)."""

    topk: list[torch.Tensor]
    scores: list[torch.Tensor]

    @property
    def accesses(self) -> int:
        return sum(int(t.numel()) for t in self.topk)

    def measured_reuse(self) -> float:
        """Mean fraction of a step's selection that was selected at the previous step."""
        fr = [
            len(set(a.tolist()) & set(b.tolist())) / max(1, b.numel())
            for a, b in zip(self.topk, self.topk[1:], strict=False)
        ]
        return sum(fr) / max(1, len(fr))


def make_reuse_trace(
    steps: int, top_k: int, reuse: float, *, start_len: int | None = None, noise: float = 0.5, seed: int = 0
) -> Trace:
    """A trace whose consecutive selections share ``round(reuse * top_k)`` positions.

    Each position has a latent importance; step ``t``'s score is importance + ``noise`` x N(0, 1). The
    selection keeps the ``round(reuse * K)`` best-scoring positions of the previous selection and adds the
    best-scoring others; the selected positions' scores are then raised above all others so that the
    selection is exactly the top-k of the reported scores (what the indexer would return), while the
    unselected positions keep their informative scores (what the ``"score"`` policy uses). The sequence
    grows by one position per step, starting at ``start_len`` (default ``8 * top_k``).
    """
    if not 0.0 <= reuse <= 1.0:
        raise ValueError(f"make_reuse_trace: reuse must be in [0, 1], got {reuse}")
    g = torch.Generator().manual_seed(seed)
    length = start_len if start_len is not None else 8 * top_k
    if length < 2 * top_k:
        raise ValueError(f"make_reuse_trace: start_len {length} must be >= 2 * top_k")
    importance = torch.randn(length + steps, generator=g)
    keep = round(reuse * top_k)
    prev: torch.Tensor | None = None
    topk, scores = [], []
    for t in range(steps):
        L = length + t
        sc = importance[:L] + noise * torch.randn(L, generator=g)
        if prev is None:
            sel = torch.topk(sc, top_k).indices
        else:
            kept = prev[torch.topk(sc[prev], keep).indices] if keep else prev[:0]
            others = sc.clone()
            others[prev] = float("-inf")
            sel = torch.cat([kept, torch.topk(others, top_k - keep).indices])
        reported = sc.clone()
        reported[sel] = sc.max() + 1.0 + torch.rand(top_k, generator=g)
        topk.append(sel.to(torch.int32))
        scores.append(reported.float())
        prev = sel
    return Trace(topk, scores)


@dataclass(frozen=True)
class PolicyResult:
    hits: int
    misses: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def simulate_policy(trace: Trace, capacity: int, policy: str) -> PolicyResult:
    """Run ``policy`` (``"lru"`` / ``"score"``) over ``trace`` with :class:`ResidencyTable` (one row)."""
    K = int(trace.topk[0].numel())
    table = ResidencyTable(1, capacity, K, policy=policy)
    req = torch.zeros(1, dtype=torch.int64)
    stable = torch.full((1,), 2**62, dtype=torch.int64)
    for tk, sc in zip(trace.topk, trace.scores, strict=True):
        table.update(tk.view(1, K), req, stable, sc.view(1, -1) if policy == "score" else None)
    c = table.counters.snapshot()
    return PolicyResult(int(c["hits"]), int(c["misses"]), int(c["evictions"]))


def belady_misses(trace: Trace, capacity: int) -> PolicyResult:
    """Offline optimum (farthest next use, current selection pinned) for ``capacity`` slots."""
    seqs = [t.tolist() for t in trace.topk]
    if any(len(s) > capacity for s in seqs):
        raise ValueError("belady_misses: a step selects more positions than the capacity")
    never = len(seqs)
    # next_use[t][i]: next step after t selecting seqs[t][i]
    next_use: list[list[int]] = [[] for _ in seqs]
    upcoming: dict[int, int] = {}
    for t in range(len(seqs) - 1, -1, -1):
        next_use[t] = [upcoming.get(p, never) for p in seqs[t]]
        for p in seqs[t]:
            upcoming[p] = t
    resident: dict[int, int] = {}  # position -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, position), lazily invalidated
    hits = misses = evictions = 0
    for t, sel in enumerate(seqs):
        new = [p for p in sel if p not in resident]
        hits += len(sel) - len(new)
        misses += len(new)
        # refresh the selected residents' next use first: they are pinned by having next use > t,
        # while every stale heap entry of a non-selected resident has next use > t as well, so pin
        # explicitly by removing the selection from consideration during this step's evictions.
        pinned = set(sel)
        need = len(resident) + len(new) - capacity
        skipped: list[tuple[int, int]] = []
        while need > 0:
            neg, p = heapq.heappop(heap)
            if resident.get(p) != -neg:
                continue  # stale entry
            if p in pinned:
                skipped.append((neg, p))
                continue
            del resident[p]
            evictions += 1
            need -= 1
        for item in skipped:
            heapq.heappush(heap, item)
        for p, nxt in zip(sel, next_use[t], strict=True):
            resident[p] = nxt
            heapq.heappush(heap, (-nxt, p))
    return PolicyResult(hits, misses, evictions)
