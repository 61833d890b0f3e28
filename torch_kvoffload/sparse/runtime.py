"""``SparseDecodeOffload``: the sparse decode offload runtime (DESIGN §7).

Memory: the complete main KV (latent ``kv_c`` + rotary ``k_pe``) of every request lives in a
:class:`HostKVPool`; the device holds the indexer cache (owned by the caller, rank-local) and, per layer,
hot buffers ``hot_kv_c [R, C, Dc]`` / ``hot_k_pe [R, C, Dr]`` of ``C = capacity`` rows per decode row.

Per decode step and layer:

1. the caller computes the new token's K/V (no full device cache is written);
2. :meth:`SparseDecodeOffload.append` copies the new rows device→host into the pool (``copy_rows`` on the
   D2H transfer stream, asynchronous; :meth:`attend` of the same layer waits for it);
3. :meth:`SparseDecodeOffload.attend` selects the top-k positions with the lightning indexer,
4. updates the layer's residency (hits, slots for misses, evictions),
5. copies only the missed rows host→hot buffer,
6. remaps top-k to hot slots and
7. runs sparse MLA attention over the resident rows.

Steps 3–4 are the fused ``lightning_indexer_manage`` op and 5–7 the fused Copy-SFA op
(``scatter_copy_sparse_mla_attention``) by default; ``fused=False`` runs ``lightning_indexer`` +
``residency_update`` + ``copy_rows`` (on the H2D transfer stream) + ``sparse_mla_attention``; the int8
indexer path runs ``hadamard_quant_int8`` on the query + ``quant_lightning_indexer`` + ``residency_update``.
Residency rows are decode rows: one per query token (``R = T``), rows ``0..T-1`` of the hot buffers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torch_kvoffload import device as kv_device
from torch_kvoffload.counters import Counters
from torch_kvoffload.ops import copy_rows
from torch_kvoffload.ops.residency import ResidencyOutputs, new_residency_outputs, new_residency_state
from torch_kvoffload.sparse.config import SparseDecodeConfig
from torch_kvoffload.sparse.host_pool import HostKVPool

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "DecodeRows", "IndexerInputs", "SparseDecodeOffload", "StepResult"]

COUNTER_NAMES = ("hits", "misses", "evictions", "bytes_h2d", "bytes_d2h", "waits", "wait_seconds")

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class IndexerInputs:
    """The lightning indexer's inputs for one layer and step (all on the compute device).

    ``q [T, H, D]`` and ``weights [T, H]``; ``k_cache [num_blocks, block_size, D]`` (floating path) or
    ``k_int8_cache`` int8 ``[num_blocks, block_size, D]`` + ``k_scale_cache`` fp32 ``[num_blocks,
    block_size]`` (int8 path); ``block_table int32 [B, max_blocks]`` of the indexer cache;
    ``cu_seqlens_q int32 [B + 1]``; ``seq_lens_k int32 [B]``.
    """

    q: torch.Tensor
    weights: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    k_cache: torch.Tensor | None = None
    k_int8_cache: torch.Tensor | None = None
    k_scale_cache: torch.Tensor | None = None


@dataclass
class DecodeRows:
    """The decode rows of one step: ``T`` query tokens, one residency row each.

    ``request_ids int64 [T]`` (the request each row belongs to); ``stable_len int64 [T]`` (the verified
    prefix of that request: hot rows at or beyond it are reloaded); ``host_block_table int32 [T,
    max_blocks]`` (the row's request's blocks in the host pool, e.g. ``pool.block_table(ids)``).
    """

    request_ids: torch.Tensor
    stable_len: torch.Tensor
    host_block_table: torch.Tensor


@dataclass
class StepResult:
    """``out [T, H, Dc]`` (latent space), ``lse fp32 [T, H]``, ``topk int32 [T, K]`` and the residency
    outputs of the step."""

    out: torch.Tensor
    lse: torch.Tensor
    topk: torch.Tensor
    residency: ResidencyOutputs


class SparseDecodeOffload:
    """Sparse decode offload for ``num_layers`` layers and up to ``max_rows`` decode rows.

    Parameters
    ----------
    config : SparseDecodeConfig
    num_layers, max_rows : int
    kv_lora_rank, rope_dim : int
        ``Dc`` and ``Dr`` of the main KV.
    pool : HostKVPool, optional
        An existing pool (e.g. attached by a TP rank > 0); by default one of ``config.host_pool_blocks``
        blocks is created (``shared=True`` makes it attachable by name).
    writer : bool
        Whether this rank writes appended rows into the pool (TP rank 0); others only read.
    device : torch.device, optional
        The compute device (default: the accelerator, else CPU).
    """

    def __init__(
        self,
        config: SparseDecodeConfig,
        *,
        num_layers: int,
        max_rows: int,
        kv_lora_rank: int,
        rope_dim: int,
        pool: HostKVPool | None = None,
        shared: bool = False,
        writer: bool = True,
        device: torch.device | None = None,
    ) -> None:
        if num_layers <= 0 or max_rows <= 0:
            raise ValueError(
                f"SparseDecodeOffload: num_layers and max_rows must be positive, got {num_layers}, {max_rows}"
            )
        self.config = config
        self.num_layers, self.max_rows = num_layers, max_rows
        self.top_k, self.capacity = config.top_k, config.hot_capacity
        self.dtype = _TORCH_DTYPES[config.kv_dtype]
        self.device = device if device is not None else kv_device.default_device()
        if pool is None:
            pool = HostKVPool.create(num_layers, config.host_pool_blocks, config.block_size, kv_lora_rank,
                                     rope_dim, self.dtype, shared=shared)  # fmt: skip
            self._owns_pool = True
        else:
            self._owns_pool = False
        self._check_pool(pool, kv_lora_rank, rope_dim)
        self.pool = pool
        self.writer = writer
        R, C = max_rows, self.capacity
        self.hot_kv_c = [
            torch.zeros(R, C, kv_lora_rank, dtype=self.dtype, device=self.device) for _ in range(num_layers)
        ]
        self.hot_k_pe = [
            torch.zeros(R, C, rope_dim, dtype=self.dtype, device=self.device) for _ in range(num_layers)
        ]
        self.state = [new_residency_state(R, C, self.device) for _ in range(num_layers)]
        self.layer_counters = [Counters(COUNTER_NAMES) for _ in range(num_layers)]
        self.counters = Counters(COUNTER_NAMES)
        self._d2h = kv_device.TransferStream("sparse-d2h", self.device)
        self._h2d = kv_device.TransferStream("sparse-h2d", self.device)
        self._pending_append: list[list[kv_device.TransferEvent]] = [[] for _ in range(num_layers)]

    def _check_pool(self, pool: HostKVPool, kv_lora_rank: int, rope_dim: int) -> None:
        got = (pool.num_layers, pool.kv_lora_rank, pool.rope_dim, pool.dtype, pool.block_size)
        want = (self.num_layers, kv_lora_rank, rope_dim, self.dtype, self.config.block_size)
        if got != want:
            raise ValueError(
                f"SparseDecodeOffload: host pool (layers, Dc, Dr, dtype, block_size) = {got} does not match "
                f"the configuration {want}"
            )

    # ------------------------------------------------------------------------------ memory figures
    def device_bytes(self) -> int:
        """Bytes of main KV this runtime keeps on the device: the hot buffers of every layer."""
        return sum(t.numel() * t.element_size() for t in (*self.hot_kv_c, *self.hot_k_pe))

    def dense_device_bytes(self, total_tokens: int) -> int:
        """Bytes a dense device main-KV cache would need for ``total_tokens`` cached tokens."""
        return self.num_layers * total_tokens * self.pool.row_bytes

    # --------------------------------------------------------------------------------- requests
    def reserve(self, request_id: int, num_tokens: int) -> None:
        """Make host-pool room for positions ``0..num_tokens-1`` of ``request_id``."""
        self.pool.allocate(request_id, num_tokens)

    def release(self, request_id: int) -> None:
        """Free a finished request's host blocks and detach it from its rows in every layer.

        The rows are reset at their next update even if a later request reuses the id.
        """
        self.sync()
        self.pool.free(request_id)
        for _, _, row_request in self.state:
            row_request.masked_fill_(row_request == request_id, -1)

    # ----------------------------------------------------------------------------------- append
    def append(
        self,
        layer: int,
        request_ids: Sequence[int],
        positions: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
    ) -> kv_device.TransferEvent:
        """Copy new token rows of ``layer`` device→host (step 2), asynchronously.

        ``request_ids[i]`` / ``positions[i]`` (int64 ``[n]``) address row ``i`` of ``kv_c [n, Dc]`` and
        ``k_pe [n, Dr]``; positions must be reserved. A position written again replaces its row
        (speculative tokens). The source tensors must not be modified until the returned event completes;
        :meth:`attend` of this layer waits for it.
        """
        n = positions.numel()
        if kv_c.shape != (n, self.pool.kv_lora_rank) or k_pe.shape != (n, self.pool.rope_dim):
            raise ValueError(
                f"SparseDecodeOffload.append: kv_c / k_pe must be [{n}, {self.pool.kv_lora_rank}] / "
                f"[{n}, {self.pool.rope_dim}], got {list(kv_c.shape)} / {list(k_pe.shape)}"
            )
        if len(request_ids) != n:
            raise ValueError(f"SparseDecodeOffload.append: {len(request_ids)} request ids for {n} rows")
        if not self.writer or n == 0:
            return kv_device.TransferEvent.completed()
        pos = positions.to("cpu", torch.int64)
        dst = torch.empty(n, dtype=torch.int64)
        ids = torch.as_tensor(list(request_ids), dtype=torch.int64)
        for rid in torch.unique(ids).tolist():
            m = ids == rid
            dst[m] = self.pool.slots(int(rid), pos[m])
        src = torch.arange(n, dtype=torch.int64)
        kv_src, pe_src = kv_c.to(self.dtype).unsqueeze(1), k_pe.to(self.dtype).unsqueeze(1)
        host_kv, host_pe = self.pool.kv_c(layer), self.pool.k_pe(layer)

        def d2h() -> None:
            copy_rows(kv_src.to(host_kv.device, non_blocking=True), host_kv, src, dst)
            copy_rows(pe_src.to(host_pe.device, non_blocking=True), host_pe, src, dst)

        event = self._d2h.submit(d2h, after=[kv_device.record_compute_event()])
        self._pending_append[layer].append(event)
        nbytes = n * self.pool.row_bytes
        self.layer_counters[layer].add("bytes_d2h", nbytes)
        self.counters.add("bytes_d2h", nbytes)
        return event

    def _wait(self, events: list[kv_device.TransferEvent], layer: int) -> None:
        if not events:
            return
        start = time.perf_counter()
        for ev in events:
            ev.wait()
        waited = time.perf_counter() - start
        events.clear()
        for c in (self.layer_counters[layer], self.counters):
            c.add("waits")
            c.add("wait_seconds", waited)

    def sync(self) -> None:
        """Wait for every pending append (raises if one failed)."""
        for layer in range(self.num_layers):
            self._wait(self._pending_append[layer], layer)

    # ----------------------------------------------------------------------------------- attend
    def attend(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        scale: float,
        indexer: IndexerInputs,
        rows: DecodeRows,
    ) -> StepResult:
        """Steps 3–7 for ``layer``: select, manage, copy misses, sparse attention over the hot rows.

        ``q_nope [T, H, Dc]``, ``q_pe [T, H, Dr]`` (absorbed queries), ``T <= max_rows``.
        """
        T = q_nope.shape[0]
        if self.max_rows < T:
            raise ValueError(f"SparseDecodeOffload.attend: {T} decode rows exceed max_rows {self.max_rows}")
        for arg, t in (("request_ids", rows.request_ids), ("stable_len", rows.stable_len)):
            if t.shape != (T,):
                raise ValueError(
                    f"SparseDecodeOffload.attend: rows.{arg} must have shape [{T}], got {list(t.shape)}"
                )
        stt, lru, req = (s[:T] for s in self.state[layer])
        hot_kv, hot_pe = self.hot_kv_c[layer][:T], self.hot_k_pe[layer][:T]
        dev = self.device
        ids, stable = rows.request_ids.to(dev), rows.stable_len.to(dev)
        res = new_residency_outputs(T, self.top_k, dev)
        policy = self.config.policy
        if self.config.indexer_dtype == "int8":
            topk = self._select_int8(indexer)
            torch.ops.kvoffload.residency_update(
                stt, lru, req, topk, ids, stable, None, policy, *res.as_tuple()
            )
        elif self.config.fused:
            topk = torch.empty(T, self.top_k, dtype=torch.int32, device=dev)
            torch.ops.kvoffload.lightning_indexer_manage(
                indexer.q, indexer.weights, self._float_k(indexer), indexer.block_table, indexer.cu_seqlens_q,
                indexer.seq_lens_k, stt, lru, req, ids, stable, policy, topk, *res.as_tuple(),
            )  # fmt: skip
        else:
            k_cache = self._float_k(indexer)
            args = (
                indexer.q,
                indexer.weights,
                k_cache,
                indexer.block_table,
                indexer.cu_seqlens_q,
                indexer.seq_lens_k,
            )
            topk = torch.ops.kvoffload.lightning_indexer(*args, self.top_k)
            scores = torch.ops.kvoffload.lightning_indexer_scores(*args) if policy == "score" else None
            torch.ops.kvoffload.residency_update(
                stt, lru, req, topk, ids, stable, scores, policy, *res.as_tuple()
            )
        self._record(layer, topk, res)
        # the rows appended for this layer must be in the pool before misses are read from it
        self._wait(self._pending_append[layer], layer)
        host_kv, host_pe = self.pool.kv_c(layer), self.pool.k_pe(layer)
        block_table = rows.host_block_table.to(dev)
        H = q_nope.shape[1]
        if self.config.fused:
            out = torch.empty(T, H, hot_kv.shape[-1], dtype=q_nope.dtype, device=dev)
            lse = torch.empty(T, H, dtype=torch.float32, device=dev)
            torch.ops.kvoffload.scatter_copy_sparse_mla_attention(
                q_nope, q_pe, host_kv, host_pe, block_table, hot_kv, hot_pe, res.miss_tokens, res.miss_slots,
                res.miss_count, res.slots, scale, out, lse,
            )  # fmt: skip
        else:
            self._copy_misses(host_kv, host_pe, hot_kv, hot_pe, rows.host_block_table, res)
            C = self.capacity
            base = torch.arange(T, dtype=torch.int32, device=dev)[:, None] * C
            indices = torch.where(res.slots >= 0, res.slots + base, -1)
            out, lse = torch.ops.kvoffload.sparse_mla_attention(
                q_nope, q_pe, hot_kv.reshape(T * C, -1), hot_pe.reshape(T * C, -1), indices, scale
            )
        return StepResult(out, lse, topk, res)

    def _float_k(self, indexer: IndexerInputs) -> torch.Tensor:
        if indexer.k_cache is None:
            raise ValueError("SparseDecodeOffload.attend: the floating indexer path needs indexer.k_cache")
        return indexer.k_cache

    def _select_int8(self, indexer: IndexerInputs) -> torch.Tensor:
        if indexer.k_int8_cache is None or indexer.k_scale_cache is None:
            raise ValueError(
                "SparseDecodeOffload.attend: the int8 indexer path needs indexer.k_int8_cache and k_scale_cache"
            )
        q_int8, q_scale = torch.ops.kvoffload.hadamard_quant_int8(indexer.q)
        return torch.ops.kvoffload.quant_lightning_indexer(
            q_int8, q_scale, indexer.weights, indexer.k_int8_cache, indexer.k_scale_cache, indexer.block_table,
            indexer.cu_seqlens_q, indexer.seq_lens_k, self.top_k,
        )  # fmt: skip

    @staticmethod
    def quantize_index_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Int8 indexer keys for the caller's cache: ``(int8 [..., D], fp32 scale [...])``."""
        return torch.ops.kvoffload.hadamard_quant_int8(k)

    def _copy_misses(self, host_kv, host_pe, hot_kv, hot_pe, block_table, res: ResidencyOutputs) -> None:
        """Unfused step 5: gather the missed rows host→hot buffer on the H2D transfer stream."""
        T, C = hot_kv.shape[0], hot_kv.shape[1]
        bs = self.pool.block_size
        mt = res.miss_tokens.to("cpu", torch.int64)
        ms = res.miss_slots.to("cpu", torch.int64)
        valid = mt >= 0
        if not bool(valid.any()):
            return
        row = torch.arange(T)[:, None].expand_as(mt)[valid]
        tok = mt[valid]
        bt = block_table.to("cpu", torch.int64)
        src = bt[row, tok // bs] * bs + tok % bs
        dst = row * C + ms[valid]

        def h2d() -> None:
            copy_rows(host_kv, hot_kv, src, dst)
            copy_rows(host_pe, hot_pe, src, dst)

        event = self._h2d.submit(h2d, after=[kv_device.record_compute_event()])
        event.wait_on_compute()

    def _record(self, layer: int, topk: torch.Tensor, res: ResidencyOutputs) -> None:
        misses = int(res.miss_count.sum())
        hits = int((topk >= 0).sum()) - misses
        ev = int(res.evictions.sum())
        for c in (self.layer_counters[layer], self.counters):
            c.add("hits", hits)
            c.add("misses", misses)
            c.add("evictions", ev)
            c.add("bytes_h2d", misses * self.pool.row_bytes)

    # ---------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Finish pending transfers, stop the transfer streams, release an owned pool. Idempotent."""
        try:
            self.sync()
        finally:
            self._d2h.close()
            self._h2d.close()
            if self._owns_pool:
                self.pool.close()

    def __enter__(self) -> SparseDecodeOffload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
