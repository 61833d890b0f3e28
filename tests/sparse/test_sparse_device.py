"""The sparse decode runtime's device step: no host synchronisation, per-layer buffers, CUDA graphs.

On a machine without CUDA the device step runs on CPU tensors under the Triton interpreter
(``step_path="device"``): the same launches, the same buffers. It is compared with the host step
(``step_path="host"``, the C++ / reference kernels) and with dense MLA attention over the chosen top-k
(:func:`references.dense_mla_attention` through ``test_sparse_steps``), and it is run under a guard that
fails on any call of the package that reads a tensor back to the host. The CUDA tests (skipped without a
GPU) run the real device step under ``torch.cuda.set_sync_debug_mode("error")`` and capture one layer's
``attend`` in a ``torch.cuda.CUDAGraph``.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import replace

import pytest
import torch
from support.sparse_scenario import LAYERS, MAX_LEN, Scenario, check_dense, config, counter_snapshot

from torch_kvoffload.ops.triton import interpreting, triton_available
from torch_kvoffload.sparse import IndexerInputs, SparseDecodeOffload

needs_interpreter = pytest.mark.skipif(
    not (triton_available() and interpreting()),
    reason="the device step on CPU tensors needs triton and TRITON_INTERPRET=1",
)
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA device and triton"
)

ORDERS = {"in_order": [0, 1, 2, 3], "shuffled": [2, 0, 3, 1]}  # rows a..a+T-1, and rows in another order


def _int8(args, rt: SparseDecodeOffload, k_cache: torch.Tensor):
    """``attend`` arguments with the int8 indexer cache in place of the floating one."""
    k_int8, k_scale = rt.quantize_index_keys(k_cache)
    idx = replace(args[4], k_cache=None, k_int8_cache=k_int8, k_scale_cache=k_scale)
    return (*args[:4], idx, args[5])


def _run(sc: Scenario, rt, k_cache, steps: int, order: list[int], int8: bool) -> list:
    results = []
    for s in range(steps):
        for layer in range(LAYERS):
            sc.append(rt, s, layer, sorted(order))
            args = sc.args(rt, k_cache, s, layer, order)
            if int8:
                args = _int8(args, rt, k_cache[layer])
            res = rt.attend(*args)
            # device-step results are views of reused buffers: keep copies
            results.append((s, layer, *(t.clone() for t in (res.out, res.lse, res.topk)),
                            [t.clone() for t in res.residency.as_tuple()]))  # fmt: skip
    return results


STEPS = 2  # the second step hits what the first loaded
CASES = {
    "lru": dict(),
    "score": dict(policy="score"),
    "int8": dict(indexer_dtype="int8"),
    "unfused": dict(fused=False),
    "small_capacity": dict(capacity=8),  # capacity == top_k: every miss evicts
}


# the Triton interpreter takes seconds per case: the inner loop (make test-fast) runs one case per order
# and the int8 indexer, make test all of them
_FAST = {("lru", "in_order"), ("int8", "shuffled")}


@needs_interpreter
@pytest.mark.parametrize(
    ("case", "order_name"),
    [
        pytest.param(c, o, id=f"{c}-{o}", marks=() if (c, o) in _FAST else pytest.mark.slow)
        for c in CASES
        for o in ORDERS
    ],
)
def test_device_step_equals_host_step_and_dense(case: str, order_name: str) -> None:
    order = ORDERS[order_name]
    cfg = config(**CASES[case])
    int8 = cfg.indexer_dtype == "int8"
    sc = Scenario(seed=11)
    host, kc_host = sc.runtime(cfg, step_path="host")
    dev, kc_dev = sc.runtime(cfg, step_path="device")
    assert not host.device_step and dev.device_step == cfg.fused
    with host, dev:
        want = _run(sc, host, kc_host, STEPS, order, int8)
        got = _run(sc, dev, kc_dev, STEPS, order, int8)
        for (s, layer, w_out, w_lse, w_topk, w_res), (_, _, out, lse, topk, res) in zip(
            want, got, strict=True
        ):
            assert torch.equal(topk, w_topk), (s, layer)
            for a, b in zip(res, w_res, strict=True):
                assert torch.equal(a, b), (s, layer)
            torch.testing.assert_close(out, w_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse, w_lse, rtol=1e-5, atol=1e-5)
        dev.sync()  # the fence and bytes_d2h of the device copies are settled on the host worker
        for s in range(STEPS):
            step = [r for r in got if r[0] == s]
            check_dense(sc, [_Res(r[2], r[4]) for r in step], order, s)
        assert counter_snapshot(dev) == counter_snapshot(host)
        assert counter_snapshot(dev)["misses"] > 0 and counter_snapshot(dev)["hits"] > 0
        for layer in range(LAYERS):  # the appended rows reached the pool through the device copy
            assert torch.equal(dev.pool.kv_c(layer), host.pool.kv_c(layer))
            assert torch.equal(dev.pool.k_pe(layer), host.pool.k_pe(layer))
            for a, b in zip(dev.tables[layer].state, host.tables[layer].state, strict=True):
                assert torch.equal(a, b)
            for name in ("bytes_h2d", "bytes_d2h"):
                assert dev.layer_counters[layer].get(name) == host.layer_counters[layer].get(name)
            assert dev.pool.published(layer) == host.pool.published(layer) == STEPS


class _Res:
    """The two fields ``_check_dense`` reads."""

    def __init__(self, out: torch.Tensor, topk: torch.Tensor) -> None:
        self.out, self.topk = out, topk


# ------------------------------------------------------------------------------- no host sync

_SYNCING = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


class _SyncGuard:
    """While active, a tensor read back to the host from code of the package raises ``AssertionError``.

    Patches the ``Tensor`` methods that read values (``item``, ``tolist``, ``cpu``, ``numpy``,
    ``nonzero``, ``bool()``, ``int()``, ``float()``, index use) and ``torch.nonzero``; calls from other
    code (the Triton interpreter reading its CPU arguments) and other threads (the host worker publishing
    the pool's fence) pass.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active: int | None = None  # the thread whose device step is guarded
        self.calls: list[str] = []
        for name in _SYNCING:
            self._wrap(monkeypatch, torch.Tensor, name)
        self._wrap(monkeypatch, torch, "nonzero")

    def _wrap(self, monkeypatch: pytest.MonkeyPatch, owner, name: str) -> None:
        real = getattr(owner, name)
        guard = self

        def checked(*args, **kwargs):
            if guard.active == threading.get_ident():
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if caller.startswith("torch_kvoffload"):
                    guard.calls.append(f"{name} from {caller}")
                    raise AssertionError(
                        f"host sync: Tensor.{name} called from {caller} during a device step"
                    )
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, checked)

    def around(self, monkeypatch: pytest.MonkeyPatch, obj, method: str) -> None:
        real = getattr(obj, method)

        def guarded(*args, **kwargs):
            self.active = threading.get_ident()
            try:
                return real(*args, **kwargs)
            finally:
                self.active = None

        monkeypatch.setattr(obj, method, guarded)


@needs_interpreter
@pytest.mark.parametrize(
    "case",
    ["lru", pytest.param("score", marks=pytest.mark.slow), pytest.param("int8", marks=pytest.mark.slow)],
)
def test_device_step_reads_nothing_back(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """append's launch and attend after its host checks make no host sync, in order and shuffled."""
    cfg = config(**CASES[case])
    sc = Scenario(seed=12)
    rt, kc = sc.runtime(cfg, step_path="device")
    guard = _SyncGuard(monkeypatch)
    guard.around(monkeypatch, rt._appender, "_append_device")
    guard.around(monkeypatch, rt._step, "prepare")  # the device step up to its residency update ...
    guard.around(monkeypatch, rt, "_finish")  # ... then its copies, attention and commit
    int8 = cfg.indexer_dtype == "int8"
    with rt:
        for s, order in enumerate([ORDERS["in_order"], ORDERS["shuffled"]]):
            results = []
            for layer in range(LAYERS):
                sc.append(rt, s, layer, sorted(order))
                args = sc.args(rt, kc, s, layer, order)
                res = rt.attend(*(_int8(args, rt, kc[layer]) if int8 else args))
                results.append(_Res(res.out.clone(), res.topk.clone()))
            check_dense(sc, results, order, s)
        assert guard.calls == []
        assert counter_snapshot(rt)["misses"] > 0  # read after the steps: the tallies are folded here


@needs_interpreter
def test_sync_guard_catches_the_host_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard fails on a step that reads back (the unfused miss copy reads its miss list): it can fail."""
    sc = Scenario(seed=13)
    rt, kc = sc.runtime(config(fused=False), step_path="host")
    guard = _SyncGuard(monkeypatch)
    guard.around(monkeypatch, rt._host_step, "_copy_misses")
    with rt:
        sc.append(rt, 0, 0, [0, 1, 2, 3])
        with pytest.raises(AssertionError, match="host sync"):
            rt.attend(*sc.args(rt, kc, 0, 0, [0, 1, 2, 3]))
    assert guard.calls


@needs_interpreter
def test_device_step_reuses_its_buffers() -> None:
    """Two steps of a layer return views of the same per-layer buffers (nothing allocated per step)."""
    sc = Scenario(seed=14)
    rt, kc = sc.runtime(config(), step_path="device")
    with rt:
        ptrs = []
        for s in range(2):
            sc.append(rt, s, 0, [0, 1, 2, 3])
            res = rt.attend(*sc.args(rt, kc, s, 0, [0, 1, 2, 3]))
            ptrs.append([t.data_ptr() for t in (res.out, res.lse, res.topk, *res.residency.as_tuple())])
        assert ptrs[0] == ptrs[1]


def test_step_path_is_checked() -> None:
    with pytest.raises(ValueError, match=r"step_path must be one of \['auto', 'host', 'device'\], got 'gpu'"):
        Scenario(seed=0).runtime(config(), step_path="gpu")
    rt, _ = Scenario(seed=0).runtime(config())  # auto on the CPU: the host step
    with rt:
        assert not rt.device_step


# ------------------------------------------------------------------------------------- CUDA


def _to_cuda(args):
    layer, qn, qp, scale, idx, rows = args
    dev = torch.device("cuda")
    idx = IndexerInputs(
        q=idx.q.to(dev), weights=idx.weights.to(dev), block_table=idx.block_table.to(dev),
        cu_seqlens_q=idx.cu_seqlens_q.to(dev), seq_lens_k=idx.seq_lens_k.to(dev), k_cache=idx.k_cache.to(dev),
    )  # fmt: skip
    return layer, qn.to(dev), qp.to(dev), scale, idx, rows


def _cuda_pair(sc: Scenario, cfg):
    """A CUDA runtime with the scenario's prefill in its (pinned) pool and the CUDA indexer caches."""
    host, kc = sc.runtime(cfg, step_path="host")  # fills a CPU pool the way the scenario does
    dev_rt = SparseDecodeOffload(cfg, num_layers=LAYERS, max_rows=4, kv_lora_rank=host.pool.kv_lora_rank,
                                 rope_dim=host.pool.rope_dim, device=torch.device("cuda"))  # fmt: skip
    for rid in sc.lengths:
        dev_rt.reserve(rid, MAX_LEN)
    for layer in range(LAYERS):
        dev_rt.pool.kv_c(layer).copy_(host.pool.kv_c(layer))
        dev_rt.pool.k_pe(layer).copy_(host.pool.k_pe(layer))
    host.close()
    return dev_rt, [k.cuda() for k in kc]


def _cuda_rows(sc: Scenario, step: int, layer: int, rids: list[int]):
    """``append`` arguments of ``rids``' new rows at ``step``, the rows on the GPU."""
    pos = torch.tensor([sc.lengths[r] + step for r in rids])
    kv = torch.stack([sc.kv[r, layer][p] for r, p in zip(rids, pos.tolist(), strict=True)]).cuda()
    pe = torch.stack([sc.pe[r, layer][p] for r, p in zip(rids, pos.tolist(), strict=True)]).cuda()
    return layer, rids, pos, kv, pe


def _cuda_append(sc: Scenario, rt, step: int, layer: int, rids: list[int]) -> None:
    rt.append(*_cuda_rows(sc, step, layer, rids))


@needs_cuda
@pytest.mark.parametrize("order", list(ORDERS.values()), ids=list(ORDERS))
def test_cuda_device_step_under_sync_debug_error(order: list[int]) -> None:
    """append + attend with ``set_sync_debug_mode("error")``: any synchronising CUDA call raises."""
    sc = Scenario(seed=21)
    rt, kc = _cuda_pair(sc, config())
    assert rt.device_step
    with rt:
        for s in range(3):
            results = []
            for layer in range(LAYERS):
                rows = _cuda_rows(sc, s, layer, sorted(order))  # inputs prepared (moved) beforehand
                args = _to_cuda(sc.args(rt, kc, s, layer, order))
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    rt.append(*rows)
                    res = rt.attend(*args)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                results.append(_Res(res.out.cpu(), res.topk.cpu()))
            check_dense(sc, results, order, s)
        assert counter_snapshot(rt)["misses"] > 0


@needs_cuda
def test_cuda_graph_of_one_layer_attend_matches_eager() -> None:
    """Warm up, capture layer 0's attend, replay with new queries copied into the captured inputs; an
    eager twin runtime runs the same steps; outputs, residency state, hot buffers and counters agree."""
    sc = Scenario(seed=22)
    order = [0, 1, 2, 3]
    graph_rt, kc_g = _cuda_pair(sc, config())
    eager_rt, kc_e = _cuda_pair(sc, config())
    with graph_rt, eager_rt:
        for rt, kc in ((graph_rt, kc_g), (eager_rt, kc_e)):  # warm-up: step 0 of layer 0
            _cuda_append(sc, rt, 0, 0, order)
            rt.attend(*_to_cuda(sc.args(rt, kc, 0, 0, order)))
        torch.cuda.synchronize()
        static = _to_cuda(sc.args(graph_rt, kc_g, 0, 0, order))  # captured inputs (same rows and lengths)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = graph_rt.attend(*static)
        for s in (1, 2):  # new queries, same rows: the second replay is mostly hits
            new = sc.queries(s, 0)
            fresh = _to_cuda(sc.args(eager_rt, kc_e, 0, 0, order))
            q = [new[r] for r in order]
            fresh = (fresh[0], torch.stack([x[0] for x in q]).cuda(), torch.stack([x[1] for x in q]).cuda(),
                     fresh[3], replace(fresh[4], q=torch.stack([x[2] for x in q]).cuda(),
                                       weights=torch.stack([x[3] for x in q]).cuda()), fresh[5])  # fmt: skip
            static[1].copy_(fresh[1])
            static[2].copy_(fresh[2])
            static[4].q.copy_(fresh[4].q)
            static[4].weights.copy_(fresh[4].weights)
            graph.replay()
            want = eager_rt.attend(*fresh)
            torch.cuda.synchronize()
            assert torch.equal(captured.topk, want.topk)
            for a, b in zip(captured.residency.as_tuple(), want.residency.as_tuple(), strict=True):
                assert torch.equal(a, b)
            torch.testing.assert_close(captured.out, want.out)
            torch.testing.assert_close(captured.lse, want.lse)
        for a, b in zip(graph_rt.tables[0].state, eager_rt.tables[0].state, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(graph_rt.hot_kv_c[0], eager_rt.hot_kv_c[0])
        assert counter_snapshot(graph_rt) == counter_snapshot(eager_rt)


@needs_interpreter
@pytest.mark.parametrize(("T", "H", "K", "N"), [(1, 2, 8, 20), (3, 4, 70, 90)])
def test_unchecked_launches_match_references(T: int, H: int, K: int, N: int) -> None:
    """``launch_sparse_mla_attention`` against dense attention over the same rows (``-1`` padding, a row
    with no valid index), and ``launch_copy_rows`` against the copy written out by index."""
    from support.references import dense_mla_attention

    from torch_kvoffload.ops.triton.copy import launch_copy_rows
    from torch_kvoffload.ops.triton.sparse_attention import launch_sparse_mla_attention

    g = torch.Generator().manual_seed(T * 100 + K)
    Dc, Dr = 32, 8
    qn, qp = torch.randn(T, H, Dc, generator=g), torch.randn(T, H, Dr, generator=g)
    kv, pe = torch.randn(N, Dc, generator=g), torch.randn(N, Dr, generator=g)
    idx = torch.randint(0, N, (T, K), generator=g, dtype=torch.int32)
    idx[:, K // 2 :] = -1
    idx[0] = -1 if T > 1 else idx[0]  # with several tokens, one sees nothing
    out = torch.full((T, H, Dc), float("nan"))
    lse = torch.full((T, H), float("nan"))
    launch_sparse_mla_attention(qn, qp, kv, pe, idx, 0.125, out, lse)
    want_out, want_lse = dense_mla_attention(qn, qp, kv, pe, idx, 0.125)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)

    src = torch.randn(5, 4, Dc, generator=g)  # 20 rows of blocks of 4
    dst = torch.zeros(3, 8, Dc)  # 24 rows of blocks of 8
    s_slots = torch.randperm(20, generator=g)[: K % 20 + 1]
    d_slots = torch.randperm(24, generator=g)[: s_slots.numel()]
    launch_copy_rows(src, dst, s_slots, d_slots)
    want = torch.zeros(24, Dc)
    want[d_slots] = src.reshape(20, Dc)[s_slots]
    assert torch.equal(dst.reshape(24, Dc), want)
