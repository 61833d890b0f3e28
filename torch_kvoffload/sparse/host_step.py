"""``HostStep``: steps 3–7 of one layer through the ops' dispatcher entry points (the CPU path, and any
device without the device step).

Steps 3–4 (select and manage) are the fused ``lightning_indexer_manage`` op by default; ``fused=False``
runs ``lightning_indexer`` + ``residency_update``, the int8 indexer path ``hadamard_quant_int8`` on the
query + ``quant_lightning_indexer`` + ``residency_update``, and the FP8 path ``hadamard_quant_fp8`` +
``fp8_lightning_indexer`` + ``residency_update``. Steps 5–7 (copy misses, remap, attend) are the
fused Copy-SFA op (``scatter_copy_sparse_mla_attention``) on a slice of the hot buffers when the step's
rows are one ascending run; otherwise (or unfused) ``copy_rows`` on the H2D transfer stream copies the
misses and ``sparse_mla_attention`` attends over the whole hot buffer (same results). FP8 rows
(``kv_dtype="fp8_e4m3"``): the same with ``fp8_scatter_copy_sparse_mla_attention``, or ``copy_rows`` of the
missed rows' bytes and ``fp8_sparse_mla_attention``, which dequantize the selected rows where they read them.
"""

from __future__ import annotations

import torch

from torch_kvoffload import transfer as kv_transfer
from torch_kvoffload._utils import Unchanged
from torch_kvoffload.ops import (
    copy_rows,
    lightning_indexer_manage,
    residency_update,
    scatter_copy_sparse_mla_attention,
    sparse_mla_attention,
)
from torch_kvoffload.ops.fp8_attention import fp8_sparse_mla_attention
from torch_kvoffload.ops.fp8_copy_attention import fp8_scatter_copy_sparse_mla_attention
from torch_kvoffload.ops.residency import ResidencyOutputs
from torch_kvoffload.sparse.config import SparseDecodeConfig
from torch_kvoffload.sparse.host_pool import HostKVPool
from torch_kvoffload.sparse.hot import HotBuffers
from torch_kvoffload.sparse.rows import RowPlan
from torch_kvoffload.sparse.step_inputs import IndexerInputs
from torch_kvoffload.sparse.step_outputs import PreparedStep, StepOutputs

__all__ = ["HostStep"]


class HostStep:
    """The host step over ``pool`` and ``hot`` with outputs from ``outputs``; owns the H2D stream the
    unfused miss copies run on."""

    def __init__(
        self,
        config: SparseDecodeConfig,
        pool: HostKVPool,
        hot: HotBuffers,
        outputs: StepOutputs,
        device: torch.device,
    ) -> None:
        self.config, self.pool, self.hot, self.outputs, self.device = config, pool, hot, outputs, device
        self.h2d = kv_transfer.TransferStream("sparse-h2d", device)
        # the last step's (rows, request ids, stable_len as watched) and their device tensors: every layer of
        # a forward steps the same rows
        self._rows_key: tuple[list[int], list[int], Unchanged] | None = None
        self._rows_t: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

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
        """Steps 3–4 of checked inputs on scratch copies of the rows' residency state; steps 5–7 follow
        through the returned :class:`PreparedStep`."""
        T, H = q_nope.shape[:2]
        dev = self.device
        last = self._rows_key
        if last is not None and last[0] == plan.rows and last[1] == ids and last[2].holds(stable):
            assert self._rows_t is not None
            rows_t, ids_t, stable = self._rows_t
        else:
            key = (list(plan.rows), list(ids), Unchanged(stable))
            rows_t = torch.tensor(plan.rows, dtype=torch.int64).to(dev, non_blocking=True)
            ids_t = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
            stable = stable.to(dev, non_blocking=True)
            self._rows_key, self._rows_t = key, (rows_t, ids_t, stable)
        state = self.hot.tables[layer].gather(rows_t)
        out, lse, topk, res = self.outputs.get(layer, T, H, self.hot.top_k, q_nope.dtype)
        self._manage(indexer, state, ids_t, stable, topk, res)
        return PreparedStep(
            rows_t, state, out, lse, topk, res,
            lambda: self._copy_and_attend(layer, plan, rows_t, q_nope, q_pe, scale, host_bt, res, out, lse),
        )  # fmt: skip

    def _manage(self, indexer: IndexerInputs, state, ids, stable, topk, res: ResidencyOutputs) -> None:
        """Steps 3–4 on the scratch ``state``: fill ``topk`` and ``res``."""
        policy, top_k = self.config.policy, self.hot.top_k
        if self.config.indexer_dtype == "int8":
            q_int8, q_scale = torch.ops.kvoffload.hadamard_quant_int8(indexer.q)
            topk.copy_(torch.ops.kvoffload.quant_lightning_indexer(
                q_int8, q_scale, indexer.weights, indexer.k_int8_cache, indexer.k_scale_cache, indexer.block_table,
                indexer.cu_seqlens_q, indexer.seq_lens_k, top_k,
            ))  # fmt: skip
            residency_update(*state, topk, ids, stable, None, policy, res)
        elif self.config.indexer_dtype == "fp8_e4m3":
            q_rows = torch.ops.kvoffload.hadamard_quant_fp8(indexer.q)
            topk.copy_(torch.ops.kvoffload.fp8_lightning_indexer(
                q_rows, indexer.weights, indexer.k_fp8_rows, indexer.block_table, indexer.cu_seqlens_q,
                indexer.seq_lens_k, top_k,
            ))  # fmt: skip
            residency_update(*state, topk, ids, stable, None, policy, res)
        elif self.config.fused:
            lightning_indexer_manage(
                indexer.q, indexer.weights, indexer.k_cache, indexer.block_table, indexer.cu_seqlens_q,
                indexer.seq_lens_k, *state, ids, stable, policy, topk, res,
            )  # fmt: skip
        else:
            args = (indexer.q, indexer.weights, indexer.k_cache, indexer.block_table, indexer.cu_seqlens_q,
                    indexer.seq_lens_k)  # fmt: skip
            topk.copy_(torch.ops.kvoffload.lightning_indexer(*args, top_k))
            scores = torch.ops.kvoffload.lightning_indexer_scores(*args) if policy == "score" else None
            residency_update(*state, topk, ids, stable, scores, policy, res)

    def _copy_and_attend(self, layer, plan: RowPlan, rows_t, q_nope, q_pe, scale, host_bt, res, out, lse):
        """Steps 5–7 into ``out`` / ``lse``; returns the rows copied host→device (an int, or a tensor of
        per-row counts to sum)."""
        host_kv, host_pe = self.pool.kv_c(layer), self.pool.k_pe(layer)
        hot_kv, hot_pe = self.hot.kv_c[layer], self.hot.k_pe[layer]
        T, C = q_nope.shape[0], self.hot.capacity
        fp8 = self.config.fp8_kv  # the rows' bytes move; attention dequantizes the rows it selects
        if self.config.fused and plan.contiguous():
            a, bt = plan.rows[0], host_bt.to(self.device, non_blocking=True)
            if fp8:
                fp8_scatter_copy_sparse_mla_attention(
                    q_nope, q_pe, host_kv, bt, hot_kv[a : a + T], res.miss_tokens, res.miss_slots, res.miss_count,
                    res.slots, scale, out, lse,
                )  # fmt: skip
            else:
                scatter_copy_sparse_mla_attention(
                    q_nope, q_pe, host_kv, host_pe, bt, hot_kv[a : a + T], hot_pe[a : a + T], res.miss_tokens,
                    res.miss_slots, res.miss_count, res.slots, scale, out, lse,
                )  # fmt: skip
            # Copy-SFA copies the first miss_count[r] entries of each row's miss list (summed when counted)
            return res.miss_count
        copied = self._copy_misses(host_kv, host_pe, hot_kv, hot_pe, host_bt, res, rows_t)
        indices = torch.where(res.slots >= 0, res.slots + (rows_t[:, None] * C).to(torch.int32), -1)
        flat_kv = hot_kv.view(-1, hot_kv.shape[-1])
        if fp8:
            o, s = fp8_sparse_mla_attention(q_nope, q_pe, flat_kv, indices, scale)
        else:
            o, s = sparse_mla_attention(
                q_nope, q_pe, flat_kv, hot_pe.view(-1, hot_pe.shape[-1]), indices, scale
            )
        out.copy_(o)
        lse.copy_(s)
        return copied

    def _copy_misses(
        self, host_kv, host_pe, hot_kv, hot_pe, block_table, res: ResidencyOutputs, rows_t
    ) -> int:
        """Unfused step 5: gather the missed rows host→hot buffer on the H2D transfer stream.

        The gather indices (host pool row, hot-buffer row) are computed where the miss list lives; the
        host pool is indexed on the host, so on an accelerator the valid pairs are read back once here
        (the fused default has no such read). On CPU the hot buffers are host memory too: the copy runs
        on the calling thread when the stream is idle (``inline``), as the step waits for it at once.
        """
        C, bs = self.hot.capacity, self.pool.block_size
        mt, ms = res.miss_tokens.long(), res.miss_slots.long()
        valid = mt >= 0
        tok = mt.clamp(min=0)
        bt = block_table.to(mt.device, torch.int64)
        src = bt.gather(1, tok // bs) * bs + tok % bs
        dst = rows_t[:, None] * C + ms
        src, dst = src[valid].cpu(), dst[valid].cpu()
        if src.numel() == 0:
            return 0

        def h2d() -> None:
            copy_rows(host_kv, hot_kv, src, dst)
            if host_pe.shape[-1]:  # FP8 rows hold their rotary part
                copy_rows(host_pe, hot_pe, src, dst)

        event = self.h2d.submit(h2d, after=[kv_transfer.record_compute_event()], inline=True)
        event.wait_on_compute()
        return int(src.numel())
