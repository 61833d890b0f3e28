"""A sparse decode scenario shared by the step tests: a few requests' full KV and indexer keys (the ground
truth) in a :class:`SparseDecodeOffload` on the CPU, per-step inputs keyed by request, and the dense MLA
reference check (:func:`support.references.dense_mla_attention` over the same top-k positions)."""

from __future__ import annotations

import math

import torch

from support.references import dense_mla_attention
from torch_kvoffload.sparse import DecodeRows, IndexerInputs, SparseDecodeConfig, SparseDecodeOffload

CPU = torch.device("cpu")
LAYERS, DC, DR, H, HI, DI = 2, 32, 8, 4, 2, 16
BS, TOP_K, CAP = 8, 8, 16
LENGTHS = {0: 40, 1: 25, 2: 60, 3: 33}  # request id -> prefill length
MAX_LEN = 96
SCALE = 1.0 / math.sqrt(DC + DR)


def config(**kw) -> SparseDecodeConfig:
    """The scenario's sparse decode config with ``kw`` changed."""
    base = dict(top_k=TOP_K, capacity=CAP, host_pool_blocks=64, block_size=BS, kv_dtype="fp32")
    return SparseDecodeConfig(**{**base, **kw})


class Scenario:
    """Every request's full KV / indexer keys (the ground truth) and per-step inputs keyed by request."""

    def __init__(self, seed: int, lengths: dict[int, int] = LENGTHS) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seed, self.lengths = seed, dict(lengths)
        self.kv = {(r, ly): torch.randn(MAX_LEN, DC, generator=g) for r in lengths for ly in range(LAYERS)}
        self.pe = {(r, ly): torch.randn(MAX_LEN, DR, generator=g) for r in lengths for ly in range(LAYERS)}
        self.ik = {(r, ly): torch.randn(MAX_LEN, DI, generator=g) for r in lengths for ly in range(LAYERS)}
        self.q_base = {(r, ly): torch.randn(HI, DI, generator=g) for r in lengths for ly in range(LAYERS)}

    def runtime(self, cfg: SparseDecodeConfig, **kw) -> tuple[SparseDecodeOffload, list[torch.Tensor]]:
        """A runtime holding every request's prefill in its pool, and the indexer caches per layer."""
        rt = SparseDecodeOffload(cfg, num_layers=LAYERS, max_rows=kw.pop("max_rows", 4), kv_lora_rank=DC,
                                 rope_dim=DR, device=CPU, **kw)  # fmt: skip
        k_cache = [torch.zeros(rt.pool.num_blocks, BS, DI) for _ in range(LAYERS)]
        for ly in range(LAYERS):  # the pool starts uninitialised; unwritten rows must compare equal
            rt.pool.kv_c(ly).zero_()
            rt.pool.k_pe(ly).zero_()
        for rid, n in self.lengths.items():
            rt.reserve(rid, MAX_LEN)
            slots = rt.pool.slots(rid, torch.arange(MAX_LEN))
            b, o = slots // BS, slots % BS
            for ly in range(LAYERS):
                rt.pool.kv_c(ly)[b[:n], o[:n]] = self.kv[rid, ly][:n]
                rt.pool.k_pe(ly)[b[:n], o[:n]] = self.pe[rid, ly][:n]
                k_cache[ly][b, o] = self.ik[rid, ly]
        return rt, k_cache

    def queries(self, step: int, layer: int) -> dict[int, tuple[torch.Tensor, ...]]:
        g = torch.Generator().manual_seed(self.seed * 1000 + step * 10 + layer)
        out = {}
        for rid in sorted(self.lengths):
            qn, qp = torch.randn(H, DC, generator=g), torch.randn(H, DR, generator=g)
            iq = self.q_base[rid, layer] + 0.3 * torch.randn(HI, DI, generator=g)
            out[rid] = (qn, qp, iq, torch.rand(HI, generator=g) + 0.5)
        return out

    def append(self, rt: SparseDecodeOffload, step: int, layer: int, rids: list[int]) -> None:
        pos = torch.tensor([self.lengths[r] + step for r in rids])
        kv = torch.stack([self.kv[r, layer][p] for r, p in zip(rids, pos.tolist(), strict=True)])
        pe = torch.stack([self.pe[r, layer][p] for r, p in zip(rids, pos.tolist(), strict=True)])
        rt.append(layer, rids, pos, kv, pe)

    def args(self, rt, k_cache, step: int, layer: int, order: list[int]):
        """``attend`` arguments for decode rows ``order`` (request ids) at ``step``."""
        q = self.queries(step, layer)
        T = len(order)
        seq = torch.tensor([self.lengths[r] + step + 1 for r in order], dtype=torch.int32)
        bt = rt.pool.block_table(order, max_blocks=MAX_LEN // BS)
        idx = IndexerInputs(
            q=torch.stack([q[r][2] for r in order]), weights=torch.stack([q[r][3] for r in order]), block_table=bt,
            cu_seqlens_q=torch.arange(T + 1, dtype=torch.int32), seq_lens_k=seq, k_cache=k_cache[layer],
        )  # fmt: skip
        rows = DecodeRows(torch.tensor(order), seq.long(), bt)
        return (
            layer,
            torch.stack([q[r][0] for r in order]),
            torch.stack([q[r][1] for r in order]),
            SCALE,
            idx,
            rows,
        )

    def step(self, rt, k_cache, step: int, order: list[int]) -> list:
        results = []
        for layer in range(LAYERS):
            self.append(rt, step, layer, sorted(order))
            results.append(rt.attend(*self.args(rt, k_cache, step, layer, order)))
        return results


def check_dense(sc: Scenario, results, order: list[int], step: int) -> None:
    """Each row's output equals dense MLA attention over its top-k positions of the ground truth."""
    for layer, res in enumerate(results):
        q = sc.queries(step, layer)
        for t, rid in enumerate(order):
            qn, qp = q[rid][0][None], q[rid][1][None]
            want, _ = dense_mla_attention(
                qn, qp, sc.kv[rid, layer], sc.pe[rid, layer], res.topk[t][None], SCALE
            )
            torch.testing.assert_close(res.out[t].double(), want[0].double(), rtol=1e-5, atol=1e-5)


def counter_snapshot(rt: SparseDecodeOffload) -> dict:
    """The runtime's counters without the (timing-dependent) wait seconds."""
    snap = rt.counters.snapshot()
    snap.pop("wait_seconds")
    return snap
