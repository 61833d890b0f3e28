"""``DeviceStep``: steps 3–7 of one layer without a host synchronisation (``step_path="device"``, fused).

It calls the Triton launch entry points without their value checks: the runtime checked the structure of
every input on the host before the first write (and :meth:`DeviceStep._check_launches` runs the ops'
structural checks of these launches), its top-k comes from its own indexer and its miss lists from its
own residency kernel. It writes into per-layer buffers (row metadata, scratch state, top-k, residency
outputs, ``out``, ``lse``); the runtime adds the step's counts to per-layer device tallies. Nothing here
reads a device tensor back, so one layer's step can be captured in a CUDA graph once warmed up: row
metadata equal to the previous call's of the layer is not copied again.
"""

from __future__ import annotations

import torch

from torch_kvoffload.sparse.config import SparseDecodeConfig
from torch_kvoffload.sparse.host_pool import HostKVPool
from torch_kvoffload.sparse.hot import HotBuffers
from torch_kvoffload.sparse.rows import RowPlan
from torch_kvoffload.sparse.step_inputs import IndexerInputs
from torch_kvoffload.sparse.step_outputs import PreparedStep, StepOutputs

__all__ = ["DeviceStep"]


class DeviceStep:
    """The device step over ``pool`` and ``hot`` with outputs from ``outputs`` (see the module docstring).

    Per layer it keeps the row metadata buffers and the scratch state; :meth:`reset` drops them when the
    hot buffers are resized.
    """

    def __init__(
        self,
        config: SparseDecodeConfig,
        pool: HostKVPool,
        hot: HotBuffers,
        outputs: StepOutputs,
        device: torch.device,
    ) -> None:
        self.config, self.pool, self.hot, self.outputs, self.device = config, pool, hot, outputs, device
        self._on_cpu = device.type == "cpu"
        self._meta: dict[int, dict[str, torch.Tensor]] = {}
        self._meta_last: dict[int, tuple] = {}
        self._hadamard_norms: dict[int, float] = {}  # int8 / FP8 paths: head dim -> Hadamard norm

    def reset(self) -> None:
        """Forget the per-layer metadata and scratch buffers (their sizes follow the hot buffers')."""
        self._meta.clear()
        self._meta_last.clear()

    def host_constants(self, indexer: IndexerInputs) -> None:
        """Compute the host constants of the step's launches (the quantized indexers' Hadamard norm of the
        query's head dim) among the host checks, before the step, which then reads nothing back."""
        D = indexer.q.shape[-1]
        if (
            self.config.indexer_dtype in ("int8", "fp8_e4m3")
            and D not in self._hadamard_norms
            and D > 0
            and not D & (D - 1)
        ):
            from torch_kvoffload.ops.indexer import hadamard_norm

            self._hadamard_norms[D] = hadamard_norm(D)

    def prepare(
        self,
        layer: int,
        plan: RowPlan,
        ids: list[int],
        stable: torch.Tensor,
        host_bt: torch.Tensor,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        scale: float,
        indexer: IndexerInputs,
    ) -> PreparedStep:
        """Steps 3–4 of checked inputs into per-layer scratch state; steps 5–7 follow through the returned
        :class:`PreparedStep` (its ``copy_and_attend`` returns the rows copied as an int64 device scalar)."""
        T, H = q_nope.shape[:2]
        rows_t, ids_t, stable_t, bt = self._stage_rows(layer, plan.rows, ids, stable, host_bt)
        state = self._scratch_state(layer, T)
        out, lse, topk, res = self.outputs.get(layer, T, H, self.hot.top_k, q_nope.dtype)
        hot_kv, hot_pe, offset = self._hot_views(layer, plan, rows_t)
        q_int8 = self._check_launches(layer, q_nope, q_pe, indexer, state, ids_t, stable_t, bt, topk, res,
                                      hot_kv, hot_pe, out, lse)  # fmt: skip
        self.hot.tables[layer].gather(rows_t, out=state)
        self._manage(indexer, q_int8, state, ids_t, stable_t, topk, res)
        return PreparedStep(
            rows_t, state, out, lse, topk, res,
            lambda: self._copy_and_attend(layer, q_nope, q_pe, scale, bt, hot_kv, hot_pe, offset, res, out, lse),
        )  # fmt: skip

    def _stage_rows(self, layer: int, rows: list[int], ids: list[int], stable: torch.Tensor, host_bt):
        """``rows int64 [T]``, ``request ids int64 [T]``, ``stable_len int64 [T]`` and the host block table
        ``int32 [T, W]`` on the device, in per-layer buffers.

        Host values are copied (from pinned memory, asynchronously) only when they differ from the
        previous call's of this layer, so a call captured in a CUDA graph after a warm-up with the same
        rows reads the buffers as they are. Device-resident ``stable`` / ``host_bt`` are used as given.
        """
        T, dev = len(rows), self.device
        bufs = self._meta.setdefault(layer, {})
        if "meta" not in bufs:
            bufs["meta"] = torch.empty(3 * self.hot.max_rows, dtype=torch.int64, device=dev)
        meta = bufs["meta"]
        last = self._meta_last.get(layer)
        stable_host = stable.device.type == "cpu"
        same = (last is not None and last[0] == rows and last[1] == ids and
                (not stable_host or (last[2] is not None and torch.equal(last[2], stable))))  # fmt: skip
        if not same:
            host = torch.empty(3 * T, dtype=torch.int64, pin_memory=not self._on_cpu)
            host[:T] = torch.tensor(rows, dtype=torch.int64)
            host[T : 2 * T] = torch.tensor(ids, dtype=torch.int64)
            if stable_host:
                host[2 * T :] = stable
            meta[: 3 * T].copy_(host, non_blocking=True)
        if not stable_host:
            meta[2 * T : 3 * T].copy_(stable)
        rows_t, ids_t, stable_t = meta[:T], meta[T : 2 * T], meta[2 * T : 3 * T]
        bt_last = last[3] if last is not None else None
        if host_bt.device.type == "cpu":
            need = host_bt.numel()
            flat = bufs.get("bt")
            if flat is None or flat.numel() < need:
                flat = bufs["bt"] = torch.empty(max(need, 2 * (flat.numel() if flat is not None else 0), 1),
                                                dtype=torch.int32, device=dev)  # fmt: skip
                bt_last = None
            bt = flat[:need].view(host_bt.shape)
            if bt_last is None or bt_last.shape != host_bt.shape or not torch.equal(bt_last, host_bt):
                src = host_bt.contiguous()
                bt.copy_(src.pin_memory() if not self._on_cpu else src, non_blocking=True)
                bt_last = host_bt.clone()
        else:
            bt, bt_last = host_bt, None
        self._meta_last[layer] = (list(rows), list(ids), stable.clone() if stable_host else None, bt_last)
        return rows_t, ids_t, stable_t, bt

    def _scratch_state(self, layer: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-layer scratch ``(slot_to_token [T, C], lru_order [T, C], row_request [T])``."""
        bufs = self._meta.setdefault(layer, {})
        if "state" not in bufs:
            R, C, dev = self.hot.max_rows, self.hot.capacity, self.device
            bufs["stt"] = torch.empty(R, C, dtype=torch.int32, device=dev)
            bufs["lru"] = torch.empty(R, C, dtype=torch.int32, device=dev)
            bufs["req"] = torch.empty(R, dtype=torch.int64, device=dev)
            bufs["state"] = bufs["req"]  # marker
        return bufs["stt"][:T], bufs["lru"][:T], bufs["req"][:T]

    def _hot_views(self, layer: int, plan: RowPlan, rows_t: torch.Tensor):
        """The hot buffers as ``[T, C', D]`` views for Copy-SFA and the slot offset of each row.

        Rows ``a..a+T-1``: the slice, offset ``None``. Any other rows: the layer's whole hot buffer
        flattened to ``R * C`` slots and expanded over the ``T`` rows (row stride 0), offset
        ``int32 [T, 1] = rows * C`` to add to the row's slots.
        """
        hot_kv, hot_pe = self.hot.kv_c[layer], self.hot.k_pe[layer]
        T = len(plan.rows)
        if plan.contiguous():
            a = plan.rows[0]
            return hot_kv[a : a + T], hot_pe[a : a + T], None
        R, C = self.hot.max_rows, self.hot.capacity
        flat_kv = hot_kv.view(1, R * C, hot_kv.shape[-1]).expand(T, -1, -1)
        flat_pe = hot_pe.view(1, R * C, hot_pe.shape[-1]).expand(T, -1, -1)
        return flat_kv, flat_pe, (rows_t * C).to(torch.int32)[:, None]

    def _check_launches(self, layer, q_nope, q_pe, indexer, state, ids_t, stable_t, bt, topk, res,
                        hot_kv, hot_pe, out, lse):  # fmt: skip
        """The ops' structural checks of the step's launches (shapes, dtypes, devices; no values), before
        its first write. Returns the quantized query buffers: ``(q_int8, q_scale)`` of the int8 path,
        ``(q_rows,)`` (``uint8 [T, H, D + 4 * D / 128]``) of the FP8 path."""
        from torch_kvoffload.ops import indexer as idx_ops
        from torch_kvoffload.ops import residency as res_ops
        from torch_kvoffload.ops import sparse_attention as sa_ops

        q_int8 = None
        if self.config.indexer_dtype == "fp8_e4m3":
            from torch_kvoffload.ops import fp8_indexer as fp8_ops
            from torch_kvoffload.ops.fp8 import index_row_bytes

            fp8_ops.validate_hadamard_quant_fp8(indexer.q)  # structure only: no value is read
            T, Hi, D = indexer.q.shape
            q_int8 = (torch.empty(T, Hi, index_row_bytes(D), dtype=torch.uint8, device=self.device),)
            fp8_ops.validate_fp8_lightning_indexer_structure(
                *q_int8, indexer.weights, indexer.k_fp8_rows, indexer.block_table, indexer.cu_seqlens_q,
                indexer.seq_lens_k,
            )  # fmt: skip
            res_ops._residency_structure("residency_update", *state, topk, ids_t, stable_t, None,
                                         self.config.policy, *res.as_tuple(), topk_is_output=True)  # fmt: skip
        elif self.config.indexer_dtype == "int8":
            idx_ops._hadamard_structure("hadamard_quant_int8", indexer.q)
            q_int8 = (torch.empty(indexer.q.shape, dtype=torch.int8, device=self.device),
                      torch.empty(indexer.q.shape[:-1], dtype=torch.float32, device=self.device))  # fmt: skip
            idx_ops._quant_structure("quant_lightning_indexer", *q_int8, indexer.weights, indexer.k_int8_cache,
                                     indexer.k_scale_cache, indexer.block_table, indexer.cu_seqlens_q,
                                     indexer.seq_lens_k)  # fmt: skip
            res_ops._residency_structure("residency_update", *state, topk, ids_t, stable_t, None, "lru",
                                         *res.as_tuple(), topk_is_output=True)  # fmt: skip
        else:
            res_ops._lim_structure(indexer.q, indexer.weights, indexer.k_cache, indexer.block_table,
                                   indexer.cu_seqlens_q, indexer.seq_lens_k, *state, ids_t, stable_t,
                                   self.config.policy, topk, *res.as_tuple())  # fmt: skip
        if self.config.fp8_kv:
            from torch_kvoffload.ops.fp8_copy_attention import validate_fp8_copy_sfa_structure

            validate_fp8_copy_sfa_structure(q_nope, q_pe, self.pool.kv_c(layer), bt, hot_kv, res.miss_tokens,
                                            res.miss_slots, res.miss_count, res.slots, out, lse)  # fmt: skip
        else:
            sa_ops._copy_sfa_structure("scatter_copy_sparse_mla_attention", q_nope, q_pe, self.pool.kv_c(layer),
                                       self.pool.k_pe(layer), bt, hot_kv, hot_pe, res.miss_tokens, res.miss_slots,
                                       res.miss_count, res.slots, out, lse)  # fmt: skip
        return q_int8

    def _manage(self, indexer: IndexerInputs, q_int8, state, ids, stable, topk, res) -> None:
        """Steps 3–4 with the unchecked Triton launches (the quantized paths quantise the query first)."""
        from torch_kvoffload.ops.triton.indexer import launch_hadamard_quant_int8
        from torch_kvoffload.ops.triton.residency import launch_indexer_manage, launch_residency_rows

        idx = (indexer.block_table, indexer.cu_seqlens_q, indexer.seq_lens_k)
        if q_int8 is not None and len(q_int8) == 1:  # FP8 rows: scores from FP8 queries and keys
            from torch_kvoffload.ops.triton.fp8_indexer import (
                launch_fp8_indexer_topk,
                launch_hadamard_quant_fp8,
            )

            launch_hadamard_quant_fp8(indexer.q, q_int8[0], self._hadamard_norms[indexer.q.shape[-1]])
            launch_fp8_indexer_topk(q_int8[0], indexer.weights, indexer.k_fp8_rows, *idx, topk)
            launch_residency_rows(*state, topk, ids, stable, None, self.config.policy, *res.as_tuple())
        elif q_int8 is not None:
            launch_hadamard_quant_int8(indexer.q, *q_int8, self._hadamard_norms[indexer.q.shape[-1]])
            launch_indexer_manage(q_int8[0], indexer.weights, indexer.k_int8_cache, *idx, *state, ids, stable,
                                  "lru", topk, *res.as_tuple(), q_scale=q_int8[1],
                                  k_scale=indexer.k_scale_cache)  # fmt: skip
        else:
            launch_indexer_manage(indexer.q, indexer.weights, indexer.k_cache, *idx, *state, ids, stable,
                                  self.config.policy, topk, *res.as_tuple())  # fmt: skip

    def _copy_and_attend(self, layer, q_nope, q_pe, scale, bt, hot_kv, hot_pe, offset, res, out, lse):
        """Steps 5–7 with the unchecked Copy-SFA launch; returns the rows copied (an int64 device scalar)."""
        from torch_kvoffload.ops import unaliased_source
        from torch_kvoffload.ops.triton.sparse_attention import launch_scatter_copy_sparse_mla_attention

        miss_slots, slots = res.miss_slots, res.slots
        if offset is not None:
            miss_slots = torch.where(miss_slots >= 0, miss_slots + offset, -1)
            slots = torch.where(slots >= 0, slots + offset, -1)
        q_nope = unaliased_source(unaliased_source(q_nope, out), lse)
        q_pe = unaliased_source(unaliased_source(q_pe, out), lse)
        if self.config.fp8_kv:  # the rows' bytes, then the FP8 attention (the rotary part is inside)
            from torch_kvoffload.ops.triton.fp8_copy_attention import (
                launch_fp8_scatter_copy_sparse_mla_attention,
            )

            launch_fp8_scatter_copy_sparse_mla_attention(
                q_nope, q_pe, self.pool.kv_c(layer), bt, hot_kv, res.miss_tokens, miss_slots, res.miss_count,
                slots, scale, out, lse,
            )  # fmt: skip
            return res.miss_count.sum(dtype=torch.int64)
        launch_scatter_copy_sparse_mla_attention(
            q_nope, q_pe, self.pool.kv_c(layer), self.pool.k_pe(layer), bt, hot_kv, hot_pe, res.miss_tokens,
            miss_slots, res.miss_count, slots, scale, out, lse,
        )  # fmt: skip
        return res.miss_count.sum(dtype=torch.int64)
