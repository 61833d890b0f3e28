"""``SparseDecodeOffload``: the sparse decode offload runtime (DESIGN §7).

Memory: the complete main KV (latent ``kv_c`` + rotary ``k_pe``) of every request lives in a
:class:`HostKVPool`; the device holds the indexer cache (owned by the caller, rank-local) and, per layer,
hot buffers ``hot_kv_c [R, C, Dc]`` / ``hot_k_pe [R, C, Dr]`` of ``C = capacity`` rows per residency row
(``R = max_rows``). With ``kv_dtype="fp8_e4m3"`` the pool and the hot buffers hold DeepSeek's FP8 rows
instead (``uint8 [.., W]``, ``W = Dc + 4 * Dc / 128 + 2 * Dr``, and an empty ``k_pe``): appended rows are
quantized on their way to the pool, misses move as bytes, attention dequantizes the rows it reads.

Per decode step and layer:

1. the caller computes the new token's K/V (no full device cache is written);
2. :meth:`SparseDecodeOffload.append` copies the new rows into the pool (:mod:`.append`; :meth:`attend` of
   the same layer waits for them);
3. :meth:`SparseDecodeOffload.attend` selects the top-k positions with the lightning indexer,
4. updates the layer's residency (hits, slots for misses, evictions),
5. copies only the missed rows host→hot buffer,
6. remaps top-k to hot slots and
7. runs sparse MLA attention over the resident rows.

Steps 3–7 run in the host step (:mod:`.host_step`, the ops through the dispatcher) or the host-sync-free
device step (:mod:`.device_step`, Triton launches, capturable in a CUDA graph); :mod:`.step_path` picks.

Residency rows belong to requests: decode row ``t`` of a step is matched to a row by ``(request id,
ordinal among that request's rows in the step)`` (:class:`~torch_kvoffload.sparse.rows.RowMap`), so the
batch may come in any order. A step whose rows are one ascending run ``a..a+T-1`` runs Copy-SFA on that
slice of the hot buffers; any other order copies the misses with ``copy_rows`` and attends over the whole
hot buffer (same results).

A step runs on scratch copies of its rows' residency state and commits them when it succeeded (this
module): a rejected step changes nothing, and a step that fails after its copies may have started only
empties the slots it was filling.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from torch_kvoffload import device as kv_device
from torch_kvoffload import transfer as kv_transfer
from torch_kvoffload._utils import check_int
from torch_kvoffload.counters import Counters
from torch_kvoffload.sparse._checks import check_layer
from torch_kvoffload.sparse.append import PlacedRows, RowAppender
from torch_kvoffload.sparse.config import SparseDecodeConfig
from torch_kvoffload.sparse.device_step import DeviceStep
from torch_kvoffload.sparse.host_pool import HostKVPool
from torch_kvoffload.sparse.host_step import HostStep
from torch_kvoffload.sparse.hot import HotBuffers
from torch_kvoffload.sparse.residency import ResidencyTable
from torch_kvoffload.sparse.rows import RowMap, RowPlan
from torch_kvoffload.sparse.stats import COUNTER_NAMES, StepCounters
from torch_kvoffload.sparse.step_inputs import (
    CheckedRows,
    DecodeRows,
    IndexerInputs,
    check_rows,
    check_step,
    check_step_checked,
)
from torch_kvoffload.sparse.step_outputs import PreparedStep, StepOutputs, StepResult
from torch_kvoffload.sparse.step_path import check_device_capacity, resolve_step_path

logger = logging.getLogger(__name__)

__all__ = [
    "COUNTER_NAMES",
    "CheckedRows",
    "DecodeRows",
    "IndexerInputs",
    "PlacedRows",
    "SparseDecodeOffload",
    "StepResult",
]


class SparseDecodeOffload:
    """Sparse decode offload for ``num_layers`` layers and up to ``max_rows`` residency rows alive.

    Parameters
    ----------
    config : SparseDecodeConfig
    num_layers, max_rows : int
        ``max_rows`` bounds the decode rows that hold hot buffers at once (requests x query tokens per
        step, until :meth:`release`).
    kv_lora_rank, rope_dim : int
        ``Dc`` and ``Dr`` of the main KV.
    pool : HostKVPool, optional
        An existing pool (e.g. attached by a TP rank > 0); by default one of ``config.host_pool_blocks``
        blocks is created (``shared=True`` makes it attachable by name).
    writer : bool
        Whether this rank writes appended rows into the pool (TP rank 0). A reader calls
        :meth:`append` like the writer (same requests, same order) without copying anything; its
        :meth:`attend` then waits until the writer published that append (shared pools).
    device : torch.device, optional
        The compute device (default: the accelerator, else CPU).
    fence_timeout : float
        Seconds a reader waits for the writer's append before :meth:`attend` raises ``TimeoutError``.
    step_path : str
        ``"host"``: the ops through the dispatcher (the CPU path, and any device without the device
        step). ``"device"``: the host-sync-free device step (:mod:`torch_kvoffload.sparse.device_step`);
        it needs triton, and CUDA with a pinned pool, or CPU tensors under the Triton interpreter
        (``TRITON_INTERPRET=1``, how the tests run it without an accelerator). ``"auto"`` (default):
        ``"device"`` on CUDA when triton imports and the pool is pinned, else ``"host"``.
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
        fence_timeout: float = 60.0,
        step_path: str = "auto",
    ) -> None:
        where = "SparseDecodeOffload"
        if not isinstance(config, SparseDecodeConfig):
            raise TypeError(f"{where}: config must be a SparseDecodeConfig, got {type(config).__name__}")
        for arg, v in (("num_layers", num_layers), ("max_rows", max_rows), ("kv_lora_rank", kv_lora_rank),
                       ("rope_dim", rope_dim)):  # fmt: skip
            check_int(where, arg, v, minimum=1)
        if not fence_timeout > 0:
            raise ValueError(f"{where}: fence_timeout must be > 0 seconds, got {fence_timeout!r}")
        self.config = config
        self.num_layers, self.max_rows = num_layers, max_rows
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.dtype = config.torch_kv_dtype  # what the pool and hot buffers store (uint8 for FP8 rows)
        # the queries' dtype: the KV's, or for FP8 rows any the FP8 attention reads
        self.query_dtypes = (torch.float32, torch.bfloat16) if config.fp8_kv else (self.dtype,)
        self.device = torch.device(device) if device is not None else kv_device.default_device()
        self.fence_timeout = float(fence_timeout)
        row_c, row_pe = config.row_dims(kv_lora_rank, rope_dim)  # the stored rows' widths
        if pool is None:
            pool = HostKVPool.create(num_layers, config.host_pool_blocks, config.block_size, row_c, row_pe,
                                     self.dtype, shared=shared)  # fmt: skip
            self._owns_pool = True
        else:
            self._owns_pool = False
        self._check_pool(pool, row_c, row_pe)
        self.pool = pool
        self.writer = writer
        self._hot = HotBuffers(
            num_layers=num_layers, max_rows=max_rows, capacity=config.hot_capacity, top_k=config.top_k,
            kv_lora_rank=row_c, rope_dim=row_pe, dtype=self.dtype, device=self.device, policy=config.policy,
        )  # fmt: skip
        self._device_path = resolve_step_path(where, step_path, self.device, pool, self.capacity)
        self._device_step = self._device_path and config.fused
        fresh = self.device.type == "cpu" and not self._device_path  # new output tensors every step
        self._counters = StepCounters(num_layers, pool.row_bytes, self.device, deferred=fresh)
        self._appender = RowAppender(
            pool, self._counters, writer=writer, dtype=self.dtype, device=self.device,
            fp8=config.fp8_kv, dims=(kv_lora_rank, rope_dim),
            device_path=self._device_path, fence_timeout=self.fence_timeout,
        )  # fmt: skip
        outputs = StepOutputs(max_rows, kv_lora_rank, self.device, fresh=fresh)
        self._outputs = outputs
        self._host_step = HostStep(config, pool, self._hot, outputs, self.device)
        self._step = DeviceStep(config, pool, self._hot, outputs, self.device) if self._device_step else None
        self._epoch = 0  # bumped when requests are reserved / released or the hot buffers resized
        self._closed = False

    def _check_pool(self, pool: HostKVPool, kv_lora_rank: int, rope_dim: int) -> None:
        if not isinstance(pool, HostKVPool):
            raise TypeError(f"SparseDecodeOffload: pool must be a HostKVPool, got {type(pool).__name__}")
        got = (pool.num_layers, pool.kv_lora_rank, pool.rope_dim, pool.dtype, pool.block_size)
        want = (self.num_layers, kv_lora_rank, rope_dim, self.dtype, self.config.block_size)
        if got != want:
            raise ValueError(
                f"SparseDecodeOffload: host pool (layers, Dc, Dr, dtype, block_size) = {got} does not match "
                f"the configuration {want}"
            )

    # ------------------------------------------------------------------------------------- state
    @property
    def top_k(self) -> int:
        """Rows selected per decode row and step (``config.top_k`` until :meth:`resize_hot`)."""
        return self._hot.top_k

    @property
    def capacity(self) -> int:
        """Hot-buffer rows per residency row (``config.hot_capacity`` until :meth:`resize_hot`)."""
        return self._hot.capacity

    @property
    def hot_kv_c(self) -> list[torch.Tensor]:
        """Per layer ``[max_rows, capacity, Dc]`` hot buffer of the latent rows (FP8 rows: ``uint8 [.., W]``)."""
        return self._hot.kv_c

    @property
    def hot_k_pe(self) -> list[torch.Tensor]:
        """Per layer ``[max_rows, capacity, Dr]`` hot buffer of the rotary rows."""
        return self._hot.k_pe

    @property
    def tables(self) -> list[ResidencyTable]:
        """Per layer the residency of the hot buffers' slots."""
        return self._hot.tables

    @property
    def rows(self) -> RowMap:
        """Which request holds which residency rows (shared by every layer)."""
        return self._hot.rows

    @property
    def epoch(self) -> int:
        """Changes whenever :class:`CheckedRows` made before go stale: a request reserved, released,
        forked or truncated, the hot buffers resized, or a block table changed by a copy-on-write."""
        return self._epoch + self.pool.block_tables.version

    @property
    def device_step(self) -> bool:
        """Whether :meth:`attend` runs the host-sync-free device step (fused, ``step_path`` device)."""
        return self._device_step

    @property
    def counters(self) -> Counters:
        """Totals over every layer (device tallies are read back here, not during a step)."""
        self._counters.fold()
        return self._counters.total

    @property
    def layer_counters(self) -> list[Counters]:
        """Per-layer counters (device tallies are read back here, not during a step)."""
        self._counters.fold()
        return self._counters.layers

    @property
    def transfer_streams(self) -> dict[str, kv_transfer.TransferStream]:
        """The runtime's transfer streams by role, for their counters (``submitted``, ``inline``, ...):
        ``"d2h"`` (appends from the device), ``"host"`` (host-side copies into the pool and fence
        publication; the ``"d2h"`` stream itself on CPU) and ``"h2d"`` (unfused miss copies)."""
        return {**self._appender.streams, "h2d": self._host_step.h2d}

    # ------------------------------------------------------------------------------ memory figures
    def device_bytes(self) -> int:
        """Bytes of main KV this runtime keeps on the device: the hot buffers of every layer."""
        return self._hot.nbytes()

    def dense_device_bytes(self, total_tokens: int) -> int:
        """Bytes a dense device main-KV cache would need for ``total_tokens`` cached tokens."""
        total_tokens = check_int(
            "SparseDecodeOffload.dense_device_bytes", "total_tokens", total_tokens, minimum=0
        )
        return self.num_layers * total_tokens * self.pool.row_bytes

    # --------------------------------------------------------------------------------- requests
    def reserve(self, request_id: int, num_tokens: int) -> None:
        """Make host-pool room for positions ``0..num_tokens-1`` of ``request_id`` (ints ``>= 0``).

        A reader rank replays the writer's reservations so that its pool object knows the block tables.
        """
        self._epoch += 1
        self.pool.allocate(request_id, num_tokens)

    def release(self, request_id: int) -> None:
        """Free a finished request's host blocks and its residency rows in every layer.

        The rows are reset when a request takes them next, even if it reuses the id.
        """
        request_id = check_int("SparseDecodeOffload.release", "request_id", request_id, minimum=0)
        self.sync()
        self._epoch += 1
        self.pool.free(request_id)
        self._hot.release(request_id)

    def fork(self, src_id: int, dst_id: int, num_tokens: int) -> None:
        """``dst_id`` (reserved, no rows yet) continues ``src_id``: positions ``0..num_tokens-1`` of every
        layer. Its host-pool table shares ``src_id``'s full blocks there, copy-on-write (a later write of
        either into a shared block copies that block first, :mod:`.block_tables`); the rows of the partial
        last block are copied (by the writer; a reader replays the table change and copies nothing).
        ``dst_id`` holds no residency rows: its first step loads what it selects from the pool. Counts
        ``fork_shared_blocks``."""
        where = "SparseDecodeOffload.fork"
        src_id = check_int(where, "src_id", src_id, minimum=0)
        dst_id = check_int(where, "dst_id", dst_id, minimum=0)
        num_tokens = check_int(where, "num_tokens", num_tokens, minimum=0)
        if src_id == dst_id:
            raise ValueError(f"{where}: src_id and dst_id must differ, got {src_id} for both")
        if self.rows.rows_of(dst_id):
            raise ValueError(f"{where}: request {dst_id} already holds residency rows; fork into a new one")
        self.sync()  # the appends of earlier forwards are in the pool
        self._epoch += 1
        shared = self.pool.fork(src_id, dst_id, num_tokens, copy=self.writer)
        self._counters.count_total("fork_shared_blocks", shared)

    def truncate(self, request_id: int, length: int) -> None:
        """``request_id`` drops its positions ``>= length``: every layer forgets them in the hot buffers
        (the pool rows are replaced by later appends at those positions)."""
        where = "SparseDecodeOffload.truncate"
        request_id = check_int(where, "request_id", request_id, minimum=0)
        length = check_int(where, "length", length, minimum=0)
        self.sync()
        self._epoch += 1
        self._hot.truncate(request_id, length)

    def rows_of(self, request_id: int) -> list[int]:
        """The residency (hot-buffer) rows ``request_id`` holds, by its rows' order within a step."""
        return self.rows.rows_of(request_id)

    @property
    def rows_alive(self) -> int:
        """Residency rows held by requests now (0 once every request was released)."""
        return self.rows.alive

    def resize_hot(self, capacity: int, top_k: int) -> None:
        """Reallocate the hot buffers with ``capacity`` rows per residency row and select ``top_k`` rows
        per step from now on (``1 <= top_k <= capacity``).

        For a caller whose requests outgrew the sizes it reserved: a top-k at least the longest context
        selects every row, as the configured top-k would. Every residency row is forgotten (the next step
        of each request reloads what it selects from the host pool); the host pool is kept.
        """
        where = "SparseDecodeOffload.resize_hot"
        check_int(where, "top_k", top_k, minimum=1)
        check_int(where, "capacity", capacity, minimum=top_k)
        if self._device_path:
            check_device_capacity(where, capacity)
        self.sync()
        self._epoch += 1
        self._hot.resize(capacity, top_k)
        # per-layer outputs and scratch state are shaped by top_k / capacity
        self._outputs.clear()
        if self._step is not None:
            self._step.reset()

    def resize_rows(self, max_rows: int) -> None:
        """Hot buffers for ``max_rows`` decode rows (``>= 0``) from now on; every residency row is forgotten."""
        check_int("SparseDecodeOffload.resize_rows", "max_rows", max_rows, minimum=0)
        self.sync()
        self._epoch += 1
        self.max_rows = self._hot.max_rows = self._outputs.max_rows = max_rows
        self._hot.resize(self._hot.capacity, self._hot.top_k)
        self._outputs.clear()
        if self._step is not None:
            self._step.reset()

    # ----------------------------------------------------------------------------------- append
    def append(
        self,
        layer: int,
        request_ids: Sequence[int] | torch.Tensor,
        positions: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
    ) -> kv_transfer.TransferEvent:
        """Copy new token rows of ``layer`` into the host pool (step 2).

        ``request_ids[i]`` / ``positions[i]`` (integer ``[n]``, CPU) address row ``i`` of ``kv_c [n, Dc]``
        and ``k_pe [n, Dr]`` (floating, cast to the pool dtype); positions must be reserved and distinct.
        A position written again replaces its row (speculative tokens). Rows in host memory are copied at
        once on the calling thread when no earlier append is still in flight (else queued behind it, in
        order). On an accelerator the rows go to pinned staging on the D2H stream (ordered after the
        compute so far), then into the pool on a host worker once that copy's event completed; with the
        device step the Triton row copy writes them into the pinned pool directly on the D2H stream, and
        :meth:`attend` waits with a stream wait. ``kv_c`` / ``k_pe`` must not be modified until the
        returned event completed; :meth:`attend` of this layer waits for it. Everything is checked before
        anything is queued.
        """
        return self._appender.append(layer, request_ids, positions, kv_c, k_pe)

    def place_rows(self, request_ids: Sequence[int] | torch.Tensor, positions: torch.Tensor) -> PlacedRows:
        """Check and place the rows ``(request_ids[i], positions[i])`` (as :meth:`append` does) once, for
        :meth:`append_placed` of every layer: a forward appends the same rows to each. Blocks a row's
        request shares with a fork are copied on write now, for every layer."""
        return self._appender.place(request_ids, positions)

    def append_placed(
        self, layer: int, placed: PlacedRows, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> kv_transfer.TransferEvent:
        """:meth:`append` of rows placed by :meth:`place_rows`; ``kv_c [n, Dc]`` / ``k_pe [n, Dr]`` hold
        them in that order. ``ValueError`` when a request was reserved, released, forked or truncated
        since they were placed."""
        return self._appender.append_placed(layer, placed, kv_c, k_pe)

    def append_validated(
        self, layer: int, placed: PlacedRows, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> kv_transfer.TransferEvent:
        """:meth:`append_placed` for a caller that validated ``layer`` and the rows' shapes, dtypes and
        device where they entered it (the KV core's cache write): only that ``placed`` is current (this
        runtime's, no table change since) is checked here, once per layer of a decode forward."""
        return self._appender.append_validated(layer, placed, kv_c, k_pe)

    def sync(self) -> None:
        """Wait for every pending append, its fence and its counts (raises if one failed)."""
        self._appender.sync()

    def wait_rows(self, layer: int) -> None:
        """Block until every row appended to ``layer`` so far can be read from :attr:`pool` on the host:
        this runtime's own copies finished and, on a reader of a shared pool, the writer published them
        (``TimeoutError`` after ``fence_timeout`` seconds, ``RuntimeError`` if the writer's append
        failed). For a caller reading pool rows itself (a chunked prefill's earlier rows)."""
        self._appender.rows_on_host(check_layer("SparseDecodeOffload.wait_rows", layer, self.num_layers))

    # ----------------------------------------------------------------------------------- attend
    def check_rows(
        self, rows: DecodeRows, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor
    ) -> CheckedRows:
        """Check ``rows`` and the indexer's ``cu_seqlens_q int32 [B + 1]`` / ``seq_lens_k int32 [B]`` once
        for the steps of every layer of a forward (what :meth:`attend` checks of them per layer).

        The returned :class:`CheckedRows` stand for ``rows`` in :meth:`attend` calls whose indexer inputs
        hold these same two tensors, unmodified, until the next :meth:`reserve`, :meth:`release`,
        :meth:`fork`, :meth:`truncate`, :meth:`resize_hot` or an :meth:`append` that copied a shared block
        on write (after which :meth:`attend` rejects them: :attr:`epoch` changed).
        """
        return check_rows(
            "SparseDecodeOffload.check_rows", rows, cu_seqlens_q, seq_lens_k, pool=self.pool,
            max_rows=self.max_rows, device=self.device, epoch=self.epoch,
        )  # fmt: skip

    def attend(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        scale: float,
        indexer: IndexerInputs,
        rows: DecodeRows | CheckedRows,
    ) -> StepResult:
        """Steps 3–7 for ``layer``: select, manage, copy misses, sparse attention over the hot rows.

        ``q_nope [T, H, Dc]``, ``q_pe [T, H, Dr]`` (absorbed queries, the KV dtype or for FP8 rows fp32 /
        bf16, on the compute
        device); ``indexer`` and ``rows`` describe the same ``T`` decode rows. Every argument is checked
        before anything changes; see :func:`torch_kvoffload.sparse.step_inputs.check_block_coverage` for
        the block-table checks. ``rows`` from :meth:`check_rows` skip the checks made there (the same
        rows for every layer of a forward).
        """
        where = "SparseDecodeOffload.attend"
        kw = dict(pool=self.pool, max_rows=self.max_rows, dims=(self.kv_lora_rank, self.rope_dim),
                  dtypes=self.query_dtypes, device=self.device, indexer_dtype=self.config.indexer_dtype)  # fmt: skip
        if isinstance(rows, CheckedRows):
            ids, stable, host_bt = check_step_checked(
                where, layer, q_nope, q_pe, scale, indexer, rows, **kw, epoch=self.epoch
            )
        else:
            ids, stable, host_bt = check_step(where, layer, q_nope, q_pe, scale, indexer, rows, **kw)
        if self._step is not None:
            self._step.host_constants(indexer)
        plan = self.rows.plan(where, ids)
        step = self._step if self._step is not None else self._host_step
        prepared = step.prepare(layer, plan, ids, stable, host_bt, q_nope, q_pe, scale, indexer)
        return self._finish(layer, plan, prepared)

    def _finish(self, layer: int, plan: RowPlan, step: PreparedStep) -> StepResult:
        """Steps 5–7 and the commit, after the residency update wrote ``step.state`` and ``step.res``.

        Waits for the rows appended to ``layer``, then runs ``step.copy_and_attend()``. If that fails, the
        slots given to this step's misses are emptied (their copies may have started) and nothing is
        committed.
        """
        table = self.tables[layer]
        res = step.res
        copying = False
        try:
            self._appender.await_rows(layer)
            copying = True
            copied = step.copy_and_attend()
        except BaseException:
            if copying:
                table.drop_slots(step.rows_t, res.miss_slots)
            raise
        table.commit(step.rows_t, step.state)
        self.rows.commit(plan)
        self._counters.record(layer, step.topk, res, copied)
        return StepResult(step.out, step.lse, step.topk, res, plan.rows)

    @staticmethod
    def quantize_index_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Int8 indexer keys for the caller's cache: ``(int8 [..., D], fp32 scale [...])``."""
        return torch.ops.kvoffload.hadamard_quant_int8(k)

    # ---------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Finish pending transfers, stop the transfer streams, release an owned pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.sync()
        finally:
            for stream in {id(s): s for s in self.transfer_streams.values()}.values():
                stream.close()
            if self._owns_pool:
                self.pool.close()

    def __enter__(self) -> SparseDecodeOffload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
