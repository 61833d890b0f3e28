"""End to end: a multi-layer synthetic MLA + lightning-indexer decode loop through SparseDecodeOffload.

Several requests of different lengths share the decode rows; requests finish and new ones take their rows;
speculative positions past the stable prefix are rolled back and rewritten with new content. At every step
and layer the offloaded output must equal dense attention over the full cache restricted to the same
top-k, the top-k must equal the unfused indexer's, the hot buffer must hold exactly the selected rows, the
bytes counted host->device must cover the hot rows whose content changed, and the residency invariants
must hold. Everything runs on the CPU (explicitly, so the tests mean the same on an accelerator machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from support.references import dense_mla_attention

from torch_kvoffload.ops import new_residency_outputs
from torch_kvoffload.sparse import (
    DecodeRows,
    HostKVPool,
    IndexerInputs,
    SparseDecodeConfig,
    SparseDecodeOffload,
)

LAYERS, DC, DR, H, HI, DI = 2, 32, 8, 4, 2, 16
BS, TOP_K, CAP, ROWS = 8, 12, 24, 4
SCALE = 1.0 / math.sqrt(DC + DR)


@dataclass
class Request:
    rid: int
    length: int
    stable: int
    target: int


class World:
    """The dense ground truth: every request's full KV and indexer keys, plus the device indexer cache."""

    def __init__(self, rt: SparseDecodeOffload, gen: torch.Generator, int8: bool, peers: tuple = ()) -> None:
        self.rt, self.g, self.int8 = rt, gen, int8
        self.peers = peers  # TP reader ranks replaying the writer's reservations
        nb = rt.pool.num_blocks
        self.kv = {}  # (rid, layer) -> [max_len, DC]
        self.pe = {}
        self.ik = {}
        self.k_cache = [torch.zeros(nb, BS, DI) for _ in range(LAYERS)]
        self.k_int8 = [torch.zeros(nb, BS, DI, dtype=torch.int8) for _ in range(LAYERS)]
        self.k_scale = [torch.zeros(nb, BS) for _ in range(LAYERS)]
        self.next_id = 0
        self.max_len = 90

    def admit(self) -> Request:
        rid = self.next_id
        self.next_id += 1
        prefill = int(torch.randint(10, 50, (1,), generator=self.g))
        target = prefill + int(torch.randint(3, 25, (1,), generator=self.g))
        for rt in (self.rt, *self.peers):
            rt.reserve(rid, self.max_len)
        for layer in range(LAYERS):
            self.kv[rid, layer] = torch.zeros(self.max_len, DC)
            self.pe[rid, layer] = torch.zeros(self.max_len, DR)
            self.ik[rid, layer] = torch.zeros(self.max_len, DI)
        pos = torch.arange(prefill)
        for layer in range(LAYERS):  # prefill KV arrives in the host pool / indexer cache directly
            self._write(rid, layer, pos, host=True)
        return Request(rid, prefill, prefill, target)

    def _write(self, rid: int, layer: int, pos: torch.Tensor, host: bool):
        n = pos.numel()
        kv, pe, ik = (torch.randn(n, d, generator=self.g) for d in (DC, DR, DI))
        self.kv[rid, layer][pos], self.pe[rid, layer][pos], self.ik[rid, layer][pos] = kv, pe, ik
        slots = self.rt.pool.slots(rid, pos)
        b, o = slots // BS, slots % BS
        if host:
            self.rt.pool.kv_c(layer)[b, o] = kv
            self.rt.pool.k_pe(layer)[b, o] = pe
        self.k_cache[layer][b, o] = ik
        if self.int8:
            qk, sc = SparseDecodeOffload.quantize_index_keys(ik)
            self.k_int8[layer][b, o], self.k_scale[layer][b, o] = qk, sc
        return kv, pe

    def decode_token(self, req: Request, layer: int):
        """The new token's K/V for ``layer`` at position ``req.length - 1`` (already advanced)."""
        pos = torch.tensor([req.length - 1])
        return self._write(req.rid, layer, pos, host=False)

    def release(self, req: Request) -> None:
        for rt in (self.rt, *self.peers):
            rt.release(req.rid)
        for layer in range(LAYERS):
            for d in (self.kv, self.pe, self.ik):
                del d[req.rid, layer]


CPU = torch.device("cpu")


def _runtime(cfg: SparseDecodeConfig, **kw) -> SparseDecodeOffload:
    return SparseDecodeOffload(
        cfg, num_layers=LAYERS, max_rows=ROWS, kv_lora_rank=DC, rope_dim=DR, device=CPU, **kw
    )


def _run_loop(cfg: SparseDecodeConfig, steps: int, seed: int, reader: SparseDecodeOffload | None = None,
              rt: SparseDecodeOffload | None = None, trace: list | None = None) -> dict:  # fmt: skip
    """Run the decode loop; ``trace`` (if given) receives every step's and layer's outputs."""
    g = torch.Generator().manual_seed(seed)
    own = rt is None
    rt = rt or _runtime(cfg)
    world = World(rt, g, cfg.indexer_dtype == "int8", peers=(reader,) if reader is not None else ())
    rows = [world.admit() for _ in range(ROWS)]
    stats = dict(resets=0, rewrites=0, hits=0, misses=0, evictions=0)
    changed_rows = 0
    try:
        for _step in range(steps):
            for i, req in enumerate(rows):
                if req.length >= req.target:  # finished: a new request takes the row
                    world.release(req)
                    rows[i] = req = world.admit()
                    stats["resets"] += 1
                spec = req.length - req.stable
                if spec > 0 and float(torch.rand(1, generator=g)) < 0.4:  # reject speculative tokens
                    req.length -= int(torch.randint(1, spec + 1, (1,), generator=g))
                    stats["rewrites"] += 1
                req.length += 1
            ids = torch.tensor([r.rid for r in rows])
            stable = torch.tensor([r.stable for r in rows])
            lengths = torch.tensor([r.length for r in rows], dtype=torch.int32)
            bt = rt.pool.block_table(ids.tolist(), max_blocks=math.ceil(world.max_len / BS))
            for layer in range(LAYERS):
                new = [world.decode_token(r, layer) for r in rows]
                for each in (rt, reader) if reader is not None else (rt,):
                    each.append(layer, ids.tolist(), lengths.long() - 1, torch.cat([n[0] for n in new]),
                                torch.cat([n[1] for n in new]))  # fmt: skip
                q_nope, q_pe = torch.randn(ROWS, H, DC, generator=g), torch.randn(ROWS, H, DR, generator=g)
                idx = IndexerInputs(
                    q=torch.randn(ROWS, HI, DI, generator=g), weights=torch.randn(ROWS, HI, generator=g),
                    block_table=bt, cu_seqlens_q=torch.arange(ROWS + 1, dtype=torch.int32), seq_lens_k=lengths,
                    k_cache=world.k_cache[layer], k_int8_cache=world.k_int8[layer], k_scale_cache=world.k_scale[layer],
                )  # fmt: skip
                table = rt.tables[layer]
                held_before = {r.rid: rt.rows_of(r.rid) for r in rows}
                stt_before = table.slot_to_token.clone()
                req_before = table.row_request.clone()
                hot_before = torch.cat([rt.hot_kv_c[layer], rt.hot_k_pe[layer]], dim=-1).clone()
                h2d_before = rt.counters.get("bytes_h2d")
                res = rt.attend(layer, q_nope, q_pe, SCALE, idx, DecodeRows(ids, stable, bt))
                if trace is not None:
                    trace.append(
                        (res.topk.clone(), *(t.clone() for t in res.residency.as_tuple()), res.out.clone())
                    )
                # top-k equals the unfused selection on the same inputs
                if cfg.indexer_dtype == "int8":
                    q8, qs = torch.ops.kvoffload.hadamard_quant_int8(idx.q)
                    expect_topk = torch.ops.kvoffload.quant_lightning_indexer(
                        q8, qs, idx.weights, idx.k_int8_cache, idx.k_scale_cache, bt, idx.cu_seqlens_q, lengths, TOP_K
                    )  # fmt: skip
                else:
                    expect_topk = torch.ops.kvoffload.lightning_indexer(
                        idx.q, idx.weights, idx.k_cache, bt, idx.cu_seqlens_q, lengths, TOP_K
                    )
                assert torch.equal(res.topk, expect_topk)
                # every hot row whose content changed was copied (rows reloaded unchanged are not visible)
                hot_after = torch.cat([rt.hot_kv_c[layer], rt.hot_k_pe[layer]], dim=-1)
                changed = int((hot_after != hot_before).any(dim=-1).sum())
                changed_rows += changed
                moved = rt.counters.get("bytes_h2d") - h2d_before
                selected = int((res.topk >= 0).sum())
                assert changed * rt.pool.row_bytes <= moved <= selected * rt.pool.row_bytes
                hot_kv, hot_pe = rt.hot_kv_c[layer], rt.hot_k_pe[layer]
                assert len(set(res.rows)) == ROWS
                for r, req in enumerate(rows):
                    row = res.rows[r]
                    assert rt.rows_of(req.rid) == [row], "one residency row per request"
                    stt = table.slot_to_token[row]
                    tokens = [t for t in stt.tolist() if t >= 0]
                    assert len(tokens) == len(set(tokens)), "a token holds two slots"
                    tk = res.topk[r]
                    sl = res.residency.slots[r]
                    valid = tk >= 0
                    pos = tk[valid].long()
                    assert torch.equal(stt[sl[valid].long()], tk[valid]), "slot does not hold its token"
                    # hot rows hold the current content of the selected positions (rewrites reloaded)
                    assert torch.equal(hot_kv[row, sl[valid].long()], world.kv[req.rid, layer][pos])
                    assert torch.equal(hot_pe[row, sl[valid].long()], world.pe[req.rid, layer][pos])
                    if held_before[req.rid]:
                        assert held_before[req.rid] == [row], "a request changed its residency row"
                    if int(req_before[row]) == req.rid:  # hits keep their slot
                        before = {t: s for s, t in enumerate(stt_before[row].tolist()) if 0 <= t < req.stable}
                        for k in valid.nonzero().flatten().tolist():
                            t = int(tk[k])
                            if t in before:
                                assert int(sl[k]) == before[t], "a hit moved"
                    kv, pe = world.kv[req.rid, layer], world.pe[req.rid, layer]
                    want, _ = dense_mla_attention(
                        q_nope[r : r + 1], q_pe[r : r + 1], kv, pe, pos[None], SCALE
                    )
                    want = want[0].double()
                    err = (res.out[r].double() - want).norm() / want.norm()
                    assert err <= 1e-5, f"row {r} relative error {err}"
                if reader is not None:  # a TP rank attached to the same pool computes the same output
                    other = reader.attend(layer, q_nope, q_pe, SCALE, idx, DecodeRows(ids, stable, bt))
                    assert torch.equal(other.out, res.out) and torch.equal(other.topk, res.topk)
            for req in rows:  # verification accepts a prefix of the speculative tokens
                if float(torch.rand(1, generator=g)) < 0.6:
                    req.stable = max(req.stable, req.length - int(torch.randint(0, 3, (1,), generator=g)))
                    req.stable = min(req.stable, req.length)
        c = rt.counters.snapshot()
        stats.update(hits=c["hits"], misses=c["misses"], evictions=c["evictions"], bytes_d2h=c["bytes_d2h"])
        per_layer = [lc.snapshot() for lc in rt.layer_counters]
        assert sum(p["misses"] for p in per_layer) == c["misses"]
        assert sum(p["bytes_h2d"] for p in per_layer) == c["bytes_h2d"] >= changed_rows * rt.pool.row_bytes
    finally:
        if own:
            rt.close()
    return stats


CASES = [
    dict(fused=True, policy="lru", indexer_dtype="bf16"),
    dict(fused=True, policy="score", indexer_dtype="bf16"),
    dict(fused=False, policy="lru", indexer_dtype="bf16"),
    dict(fused=False, policy="score", indexer_dtype="bf16"),
    dict(fused=True, policy="lru", indexer_dtype="int8"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_offloaded_decode_equals_dense(case: dict) -> None:
    cfg = SparseDecodeConfig(
        top_k=TOP_K, capacity=CAP, host_pool_blocks=64, block_size=BS, kv_dtype="fp32", **case
    )
    stats = _run_loop(cfg, steps=20, seed=7)
    # the loop really exercised what it claims to
    assert stats["resets"] >= 2 and stats["rewrites"] >= 5
    assert stats["hits"] > 0 and stats["misses"] > 0 and stats["evictions"] > 0
    assert stats["bytes_d2h"] == 20 * LAYERS * ROWS * (DC + DR) * 4


def test_fused_and_unfused_paths_agree_step_by_step() -> None:
    """Same seed: fused (LIM + Copy-SFA) and unfused runs see identical residency decisions."""
    base = dict(
        top_k=TOP_K, capacity=CAP, host_pool_blocks=64, block_size=BS, kv_dtype="fp32", policy="score"
    )
    trace_a: list = []
    trace_b: list = []
    a = _run_loop(SparseDecodeConfig(fused=True, **base), steps=10, seed=3, trace=trace_a)
    b = _run_loop(SparseDecodeConfig(fused=False, **base), steps=10, seed=3, trace=trace_b)
    assert a == b
    assert len(trace_a) == len(trace_b) == 10 * LAYERS
    for step, (x, y) in enumerate(zip(trace_a, trace_b, strict=True)):
        *decisions_a, out_a = x
        *decisions_b, out_b = y
        for u, v in zip(decisions_a, decisions_b, strict=True):  # top-k and every residency output
            assert torch.equal(u, v), f"step {step // LAYERS} layer {step % LAYERS}"
        torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-6)


def test_tp_reader_attached_to_shared_pool() -> None:
    cfg = SparseDecodeConfig(top_k=TOP_K, capacity=CAP, host_pool_blocks=64, block_size=BS, kv_dtype="fp32")
    writer = _runtime(cfg, shared=True)
    pool = HostKVPool.attach(writer.pool.name)
    reader = _runtime(cfg, pool=pool, writer=False)
    try:
        _run_loop(cfg, steps=6, seed=5, reader=reader, rt=writer)
        assert reader.counters.get("bytes_d2h") == 0  # only TP rank 0 writes the pool
    finally:
        reader.close()
        pool.close()
        writer.close()


def test_lightning_indexer_manage_equals_sequence() -> None:
    """The fused manage op equals lightning_indexer followed by residency_update (both policies, 3 steps)."""
    g = torch.Generator().manual_seed(11)
    T, nb, K, C = 5, 20, 16, 24
    k_cache = torch.randn(nb, BS, DI, generator=g)
    bt = torch.randperm(nb, generator=g)[: T * 4].view(T, 4).to(torch.int32)
    cu = torch.arange(T + 1, dtype=torch.int32)
    for policy in ("lru", "score"):
        fused = [torch.full((T, C), -1, dtype=torch.int32), torch.arange(C, dtype=torch.int32).repeat(T, 1),
                 torch.full((T,), -1, dtype=torch.int64)]  # fmt: skip
        seq = [t.clone() for t in fused]
        lens = torch.tensor([3, 10, 20, 31, 32], dtype=torch.int32)
        for step in range(3):
            q, w = torch.randn(T, HI, DI, generator=g), torch.randn(T, HI, generator=g)
            ids = torch.tensor([0, 1, 2, 3, 4 + step])
            stable = lens.long() - 1
            topk = torch.empty(T, K, dtype=torch.int32)
            out_f = new_residency_outputs(T, K)
            torch.ops.kvoffload.lightning_indexer_manage(q, w, k_cache, bt, cu, lens, *fused, ids, stable, policy,
                                                         topk, *out_f.as_tuple())  # fmt: skip
            want_topk = torch.ops.kvoffload.lightning_indexer(q, w, k_cache, bt, cu, lens, K)
            scores = torch.ops.kvoffload.lightning_indexer_scores(q, w, k_cache, bt, cu, lens)
            out_s = new_residency_outputs(T, K)
            torch.ops.kvoffload.residency_update(
                *seq, want_topk, ids, stable, scores, policy, *out_s.as_tuple()
            )
            assert torch.equal(topk, want_topk)
            for x, y in zip(fused + list(out_f.as_tuple()), seq + list(out_s.as_tuple()), strict=True):
                assert torch.equal(x, y)
            lens = torch.clamp(lens + 1, max=32)


def test_memory_figures() -> None:
    cfg = SparseDecodeConfig(top_k=TOP_K, capacity=CAP, host_pool_blocks=64, block_size=BS, kv_dtype="fp32")
    with _runtime(cfg) as rt:
        assert rt.device_bytes() == LAYERS * ROWS * CAP * (DC + DR) * 4
        assert rt.dense_device_bytes(1000) == LAYERS * 1000 * (DC + DR) * 4


def test_released_request_id_reused_in_same_row_reloads() -> None:
    """release() detaches the request from its rows: a later request with the same id starts cold."""
    cfg = SparseDecodeConfig(top_k=4, capacity=8, host_pool_blocks=8, block_size=4, kv_dtype="fp32")
    with SparseDecodeOffload(cfg, num_layers=1, max_rows=1, kv_lora_rank=DC, rope_dim=DR, device=CPU) as rt:
        k_cache = torch.randn(8, 4, DI)
        outs = []
        for _life in range(2):
            rt.reserve(0, 6)
            kv = torch.randn(6, DC)
            rt.append(0, [0] * 6, torch.arange(6), kv, torch.randn(6, DR))
            bt = rt.pool.block_table([0], max_blocks=2)
            idx = IndexerInputs(q=torch.randn(1, HI, DI), weights=torch.ones(1, HI), block_table=bt,
                                cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                                seq_lens_k=torch.tensor([6], dtype=torch.int32), k_cache=k_cache)  # fmt: skip
            res = rt.attend(0, torch.randn(1, H, DC), torch.randn(1, H, DR), SCALE, idx,
                            DecodeRows(torch.tensor([0]), torch.tensor([6]), bt))  # fmt: skip
            valid = res.topk[0] >= 0
            hot = rt.hot_kv_c[0][res.rows[0], res.residency.slots[0][valid].long()]
            assert torch.equal(hot, kv[res.topk[0][valid].long()])
            outs.append(int(res.residency.miss_count[0]))
            rt.release(0)
        assert outs == [4, 4]  # the second life misses everything again
