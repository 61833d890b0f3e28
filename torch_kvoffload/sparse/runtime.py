"""``SparseDecodeOffload``: the sparse decode offload runtime (DESIGN §7).

Memory: the complete main KV (latent ``kv_c`` + rotary ``k_pe``) of every request lives in a
:class:`HostKVPool`; the device holds the indexer cache (owned by the caller, rank-local) and, per layer,
hot buffers ``hot_kv_c [R, C, Dc]`` / ``hot_k_pe [R, C, Dr]`` of ``C = capacity`` rows per residency row
(``R = max_rows``).

Per decode step and layer:

1. the caller computes the new token's K/V (no full device cache is written);
2. :meth:`SparseDecodeOffload.append` copies the new rows device→host into the pool (asynchronous;
   :meth:`attend` of the same layer waits for it);
3. :meth:`SparseDecodeOffload.attend` selects the top-k positions with the lightning indexer,
4. updates the layer's residency (hits, slots for misses, evictions),
5. copies only the missed rows host→hot buffer,
6. remaps top-k to hot slots and
7. runs sparse MLA attention over the resident rows.

Steps 3–4 are the fused ``lightning_indexer_manage`` op and 5–7 the fused Copy-SFA op
(``scatter_copy_sparse_mla_attention``) by default; ``fused=False`` runs ``lightning_indexer`` +
``residency_update`` + ``copy_rows`` (on the H2D transfer stream) + ``sparse_mla_attention``; the int8
indexer path runs ``hadamard_quant_int8`` on the query + ``quant_lightning_indexer`` + ``residency_update``.

Residency rows belong to requests: decode row ``t`` of a step is matched to a row by ``(request id,
ordinal among that request's rows in the step)`` (:class:`~torch_kvoffload.sparse.rows.RowMap`), so the
batch may come in any order. A step whose rows are one ascending run ``a..a+T-1`` runs Copy-SFA on that
slice of the hot buffers; any other order copies the misses with ``copy_rows`` and attends over the whole
hot buffer (same results).

A step runs on scratch copies of its rows' residency state and commits them when it succeeded: a rejected
step changes nothing, and a step that fails after its copies may have started only empties the slots it
was filling.

Device step (``step_path="device"``; the default on CUDA with triton and a pinned pool): :meth:`append`
launches the Triton row copy from the device rows straight into the pinned pool on the runtime's D2H
stream (ordered after the compute so far; no staging, no host copy), and :meth:`attend` makes the compute
stream wait on that copy's event before the miss copy reads the pool. The fused step then calls the
Triton launch entry points without their value checks (the runtime checked the structure of every
input on the host before the first write; its top-k comes from its own indexer and its miss lists from
its own residency kernel), writes into per-layer buffers (scratch state, top-k, residency outputs,
``out``, ``lse``, row metadata) and adds its counts to per-layer device tallies read only when
:attr:`counters` / :attr:`layer_counters` are read. Nothing in that step reads a device tensor back, so
one layer's :meth:`attend` can be captured in a CUDA graph. ``fused=False`` keeps the unfused step (it
reads the miss list back once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torch_kvoffload import device as kv_device
from torch_kvoffload import transfer as kv_transfer
from torch_kvoffload._utils import check_int
from torch_kvoffload.counters import Counters
from torch_kvoffload.ops import (
    copy_rows,
    lightning_indexer_manage,
    residency_update,
    scatter_copy_sparse_mla_attention,
    sparse_mla_attention,
)
from torch_kvoffload.ops.residency import ResidencyOutputs, new_residency_outputs
from torch_kvoffload.ops.triton import interpreting, triton_available
from torch_kvoffload.sparse import _checks
from torch_kvoffload.sparse.config import SparseDecodeConfig
from torch_kvoffload.sparse.host_pool import HostKVPool
from torch_kvoffload.sparse.residency import ResidencyTable, step_counts
from torch_kvoffload.sparse.rows import RowMap, RowPlan

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "DecodeRows", "IndexerInputs", "SparseDecodeOffload", "StepResult"]

COUNTER_NAMES = ("hits", "misses", "evictions", "bytes_h2d", "bytes_d2h", "waits", "wait_seconds")
#: What the device step's per-layer tallies count (``rows_h2d`` becomes ``bytes_h2d`` when read).
_TALLY_NAMES = ("hits", "misses", "evictions", "rows_h2d")
STEP_PATHS = ("auto", "host", "device")


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
    """The decode rows of one step: ``T`` query tokens, in any order.

    ``request_ids int64 [T]`` (or a list of ints): the request each row belongs to; a request's rows
    keep their residency rows (hot buffers) by their order among that request's rows. ``stable_len
    int64 [T]``: the verified prefix of that request (hot rows at or beyond it are reloaded).
    ``host_block_table int32 [T, max_blocks]``: the row's request's blocks in the host pool, e.g.
    ``pool.block_table(ids)``. Scheduler metadata: CPU tensors (the runtime moves what the device needs).
    """

    request_ids: torch.Tensor | Sequence[int]
    stable_len: torch.Tensor
    host_block_table: torch.Tensor


@dataclass
class StepResult:
    """``out [T, H, Dc]`` (latent space), ``lse fp32 [T, H]``, ``topk int32 [T, K]``, the residency
    outputs of the step and ``rows``, the residency row (hot-buffer row) of each decode row.

    On an accelerator (and with the device step) the tensors are views of per-layer buffers reused by
    the next :meth:`attend` of the same layer (so a step allocates no outputs); on CPU they are fresh
    tensors.
    """

    out: torch.Tensor
    lse: torch.Tensor
    topk: torch.Tensor
    residency: ResidencyOutputs
    rows: list[int]


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
        step). ``"device"``: the host-sync-free device step (see the module docstring); it needs triton,
        and CUDA with a pinned pool, or CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``,
        how the tests run it without an accelerator). ``"auto"`` (default): ``"device"`` on CUDA when
        triton imports and the pool is pinned, else ``"host"``.
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
        self.top_k, self.capacity = config.top_k, config.hot_capacity
        self.dtype = config.torch_kv_dtype
        self.device = torch.device(device) if device is not None else kv_device.default_device()
        self.fence_timeout = float(fence_timeout)
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
        self.tables = [
            ResidencyTable(R, C, self.top_k, config.policy, self.device) for _ in range(num_layers)
        ]
        self.rows = RowMap(max_rows)
        self._layer_counters = [Counters(COUNTER_NAMES) for _ in range(num_layers)]
        self._counters = Counters(COUNTER_NAMES)
        self._on_cpu = self.device.type == "cpu"
        self._device_path = self._resolve_step_path(step_path)
        self._device_step = self._device_path and config.fused
        # device step: per-layer tallies (int64 [4], _TALLY_NAMES), row metadata and scratch buffers
        self._tally = (
            [torch.zeros(len(_TALLY_NAMES), dtype=torch.int64, device=self.device) for _ in range(num_layers)]
            if self._device_path
            else []
        )
        self._tally_lock = threading.Lock()
        self._meta: dict[int, dict[str, torch.Tensor]] = {}
        self._meta_last: dict[int, tuple] = {}
        self._hadamard_norms: dict[int, float] = {}  # int8 device step: head dim -> Hadamard norm
        self._d2h_stream = torch.Stream(self.device) if self._device_path and not self._on_cpu else None
        self._d2h = kv_transfer.TransferStream("sparse-d2h", self.device)
        self._h2d = kv_transfer.TransferStream("sparse-h2d", self.device)
        # host-side copies (staging -> pool) run on a host worker, after the device copy's event
        self._host = (
            self._d2h if self._on_cpu else kv_transfer.TransferStream("sparse-host", torch.device("cpu"))
        )
        self._pending_append: list[list[kv_transfer.TransferEvent]] = [[] for _ in range(num_layers)]
        # tensors a device-path append reads on the D2H stream: kept until compute waited on its event
        self._append_keep: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._pending_publish: list[kv_transfer.TransferEvent] = []  # device path: fence + bytes_d2h
        self._append_seq = [0] * num_layers  # appends issued per layer (writer and readers alike)
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (layer, heads) -> outputs
        self._closed = False

    def _resolve_step_path(self, step_path: object) -> bool:
        """Whether the device step runs (``step_path`` of the constructor)."""
        where = "SparseDecodeOffload"
        if step_path not in STEP_PATHS:
            raise ValueError(f"{where}: step_path must be one of {list(STEP_PATHS)}, got {step_path!r}")
        if step_path == "host":
            return False
        pinned = self.pool.kv_c(0).is_pinned() and self.pool.k_pe(0).is_pinned()
        if step_path == "auto":
            return self.device.type == "cuda" and pinned and triton_available()
        if not triton_available():
            raise RuntimeError(f"{where}: step_path='device' runs Triton kernels; install triton")
        if self.device.type == "cpu":
            if not interpreting():
                raise ValueError(
                    f"{where}: step_path='device' on CPU tensors runs only under the Triton interpreter "
                    "(set TRITON_INTERPRET=1 before triton is imported)"
                )
        elif self.device.type != "cuda":
            raise ValueError(
                f"{where}: step_path='device' needs a CUDA device (its kernels read the pinned pool in place), "
                f"got {self.device}"
            )
        elif not pinned:
            raise ValueError(f"{where}: step_path='device' needs a pinned host pool (this one is pageable)")
        from torch_kvoffload.ops.triton.residency import MAX_CAPACITY

        if self.capacity > MAX_CAPACITY:
            raise ValueError(f"{where}: step_path='device' takes a capacity of at most {MAX_CAPACITY} slots")
        return True

    @property
    def device_step(self) -> bool:
        """Whether :meth:`attend` runs the host-sync-free device step (fused, ``step_path`` device)."""
        return self._device_step

    @property
    def counters(self) -> Counters:
        """Totals over every layer (device tallies are read back here, not during a step)."""
        self._fold_tallies()
        return self._counters

    @property
    def layer_counters(self) -> list[Counters]:
        """Per-layer counters (device tallies are read back here, not during a step)."""
        self._fold_tallies()
        return self._layer_counters

    def _fold_tallies(self) -> None:
        """Move the device tallies into the counters (a device synchronisation: only when read)."""
        if not self._tally:
            return
        with self._tally_lock:
            for layer, tally in enumerate(self._tally):
                values = tally.tolist()
                if not any(values):
                    continue
                tally.zero_()
                for name, v in zip(_TALLY_NAMES, values, strict=True):
                    if name == "rows_h2d":
                        name, v = "bytes_h2d", v * self.pool.row_bytes
                    self._count(layer, name, v)

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

    # ------------------------------------------------------------------------------ memory figures
    def device_bytes(self) -> int:
        """Bytes of main KV this runtime keeps on the device: the hot buffers of every layer."""
        return sum(t.numel() * t.element_size() for t in (*self.hot_kv_c, *self.hot_k_pe))

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
        self.pool.allocate(request_id, num_tokens)

    def release(self, request_id: int) -> None:
        """Free a finished request's host blocks and its residency rows in every layer.

        The rows are reset when a request takes them next, even if it reuses the id.
        """
        request_id = check_int("SparseDecodeOffload.release", "request_id", request_id, minimum=0)
        self.sync()
        self.pool.free(request_id)
        rows = self.rows.release(request_id)
        if rows:
            rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
            for table in self.tables:
                table.forget_rows(rows_t)

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
            from torch_kvoffload.ops.triton.residency import MAX_CAPACITY

            if capacity > MAX_CAPACITY:
                raise ValueError(
                    f"{where}: step_path='device' takes a capacity of at most {MAX_CAPACITY} slots"
                )
        self.sync()
        R, dt, dev = self.max_rows, self.dtype, self.device
        Dc, Dr = self.pool.kv_lora_rank, self.pool.rope_dim
        self.top_k, self.capacity = top_k, capacity
        self.hot_kv_c = [torch.zeros(R, capacity, Dc, dtype=dt, device=dev) for _ in range(self.num_layers)]
        self.hot_k_pe = [torch.zeros(R, capacity, Dr, dtype=dt, device=dev) for _ in range(self.num_layers)]
        self.tables = [
            ResidencyTable(R, capacity, top_k, self.config.policy, dev) for _ in range(self.num_layers)
        ]
        self.rows = RowMap(R)
        # per-layer outputs and scratch state are shaped by top_k / capacity
        self._buffers.clear()
        self._meta.clear()
        self._meta_last.clear()

    # ----------------------------------------------------------------------------------- append
    def append(
        self,
        layer: int,
        request_ids: Sequence[int] | torch.Tensor,
        positions: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
    ) -> kv_transfer.TransferEvent:
        """Copy new token rows of ``layer`` device→host (step 2), asynchronously.

        ``request_ids[i]`` / ``positions[i]`` (integer ``[n]``, CPU) address row ``i`` of ``kv_c [n, Dc]``
        and ``k_pe [n, Dr]`` (floating, cast to the pool dtype); positions must be reserved and distinct.
        A position written again replaces its row (speculative tokens). On an accelerator the rows go to
        pinned staging on the D2H stream (ordered after the compute so far), then into the pool on a host
        worker once that copy's event completed; with the device step the Triton row copy writes them
        into the pinned pool directly on the D2H stream, and :meth:`attend` waits with a stream wait.
        ``kv_c`` / ``k_pe`` must not be modified until the returned event completed; :meth:`attend` of this
        layer waits for it. Everything is checked before anything is queued.
        """
        where = "SparseDecodeOffload.append"
        layer = _checks.check_layer(where, layer, self.num_layers)
        positions = _checks.check_tensor(
            where, "positions", positions, dim=1, dtypes=(torch.int32, torch.int64)
        )
        n = positions.shape[0]
        Dc, Dr = self.pool.kv_lora_rank, self.pool.rope_dim
        floating = (torch.float32, torch.bfloat16, torch.float16)
        kv_c = _checks.check_tensor(where, "kv_c", kv_c, shape=(n, Dc), dtypes=floating)
        k_pe = _checks.check_tensor(where, "k_pe", k_pe, shape=(n, Dr), dtypes=floating,
                                    devices=(kv_c.device,))  # fmt: skip
        ids = _checks.host_ints(where, "request_ids", request_ids, n)
        if n == 0:
            return kv_transfer.TransferEvent.completed()
        pos = positions.to("cpu", torch.int64)
        dst = self._pool_slots(where, ids, pos)
        self._append_seq[layer] += 1
        if not self.writer:
            return kv_transfer.TransferEvent.completed()
        seq = self._append_seq[layer]
        host_kv, host_pe = self.pool.kv_c(layer), self.pool.k_pe(layer)
        src = torch.arange(n, dtype=torch.int64)
        kv_src, pe_src = kv_c.to(self.dtype), k_pe.to(self.dtype)
        if self._device_path and kv_src.device == self.device:
            event = self._append_device(layer, seq, kv_src, pe_src, dst)
            self._pending_append[layer].append(event)
            return event

        def write(kv_rows: torch.Tensor, pe_rows: torch.Tensor) -> None:
            try:
                copy_rows(kv_rows.unsqueeze(1), host_kv, src, dst)
                copy_rows(pe_rows.unsqueeze(1), host_pe, src, dst)
            except BaseException:
                self.pool.mark_failed(layer)  # readers must not take later appends for complete rows
                raise
            self.pool.publish(layer, seq)
            self._count(layer, "bytes_d2h", dst.numel() * self.pool.row_bytes)

        if kv_src.device.type == "cpu":
            event = self._host.submit(write, kv_src, pe_src, after=[kv_transfer.record_compute_event()])
        else:
            stage_kv = kv_device.empty_host((n, Dc), self.dtype)
            stage_pe = kv_device.empty_host((n, Dr), self.dtype)

            def stage() -> None:
                stage_kv.copy_(kv_src, non_blocking=True)
                stage_pe.copy_(pe_src, non_blocking=True)

            def unstage(_keep_alive: tuple[torch.Tensor, torch.Tensor]) -> None:
                write(stage_kv, stage_pe)

            staged = self._d2h.submit(stage, after=[kv_transfer.record_compute_event()])
            # the host copy reads the staging only after the D2H copy's event (the worker waits on it);
            # the device sources stay referenced until then
            event = self._host.submit(unstage, (kv_src, pe_src), after=[staged])
        self._pending_append[layer].append(event)
        return event

    def _append_device(
        self, layer: int, seq: int, kv_src: torch.Tensor, pe_src: torch.Tensor, dst: torch.Tensor
    ) -> kv_transfer.TransferEvent:
        """Device-path append of checked rows ``kv_src [n, Dc]`` / ``pe_src [n, Dr]`` (pool dtype, on the
        compute device) to pool rows ``dst int64 [n]`` (CPU): the Triton row copy on the D2H stream.

        The pool's fence is published by the host worker once the copy's event completed (readers of a
        shared pool read only published rows); the compute thread never waits.
        """
        from torch_kvoffload.ops.triton.copy import launch_copy_rows

        host_kv, host_pe = self.pool.kv_c(layer), self.pool.k_pe(layer)
        n = dst.numel()
        if self._d2h_stream is None:  # CPU tensors under the interpreter: the launch runs to completion here
            src = torch.arange(n, dtype=torch.int64)
            try:
                launch_copy_rows(kv_src.unsqueeze(1), host_kv, src, dst)
                launch_copy_rows(pe_src.unsqueeze(1), host_pe, src, dst)
            except BaseException:
                self.pool.mark_failed(layer)
                raise
            event = kv_transfer.TransferEvent.completed()
            self._finish_append_later(layer, seq, n, event)
            return event
        stream = self._d2h_stream
        compute = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(stream)
        try:
            stream.wait_stream(compute)
            # allocated while the D2H stream is current: their memory is reused only after this stream's work
            dst_dev = dst.pin_memory().to(self.device, non_blocking=True)
            src_dev = torch.arange(n, dtype=torch.int64, device=self.device)
            launch_copy_rows(kv_src.unsqueeze(1), host_kv, src_dev, dst_dev)
            launch_copy_rows(pe_src.unsqueeze(1), host_pe, src_dev, dst_dev)
            done = torch.Event(self.device)
            done.record(stream)
        except BaseException:
            self.pool.mark_failed(layer)
            raise
        finally:
            torch.accelerator.set_stream(compute)
        event = kv_transfer.TransferEvent.issued(done)
        # the compute stream's allocator may reuse the sources once compute waited on ``event``
        self._append_keep[layer].extend((kv_src, pe_src, dst_dev, src_dev))
        self._finish_append_later(layer, seq, n, event)
        return event

    def _finish_append_later(self, layer: int, seq: int, n: int, event: kv_transfer.TransferEvent) -> None:
        """On the host worker, once ``event`` completed: publish the fence, count ``bytes_d2h``."""

        def finished() -> None:
            self.pool.publish(layer, seq)
            self._count(layer, "bytes_d2h", n * self.pool.row_bytes)

        # keep the unfinished and the failed (sync() raises those); finished ones need nothing more
        self._pending_publish = [ev for ev in self._pending_publish if not ev.succeeded()]
        self._pending_publish.append(self._host.submit(finished, after=[event]))

    def _pool_slots(self, where: str, ids: list[int], pos: torch.Tensor) -> torch.Tensor:
        """Pool rows of ``(ids[i], pos[i])``; a rank whose pool does not know a request gets ``-1``."""
        dst = torch.full((pos.numel(),), -1, dtype=torch.int64)
        ids_t = torch.tensor(ids, dtype=torch.int64)
        for rid in sorted(set(ids)):
            m = ids_t == rid
            if self.pool.knows(rid):
                try:
                    dst[m] = self.pool.slots(rid, pos[m])
                except IndexError as exc:
                    raise IndexError(f"{where}: {exc}") from None
            elif self.writer:
                raise ValueError(f"{where}: request {rid} has no host-pool blocks; reserve() it first")
        known = dst[dst >= 0]
        if known.unique().numel() != known.numel():
            raise ValueError(f"{where}: a (request, position) pair occurs twice in one append")
        return dst

    def _count(self, layer: int, name: str, amount: float | torch.Tensor) -> None:
        self._layer_counters[layer].add(name, amount)
        self._counters.add(name, amount)

    def _wait(self, events: list[kv_transfer.TransferEvent], layer: int, on_compute: bool = False) -> None:
        """Wait for ``layer``'s pending appends: on the host, or (``on_compute``) with a stream wait of
        the compute stream on each append's event, which blocks nothing on the host."""
        if not events:
            return
        start = time.perf_counter()
        for ev in events:
            if on_compute:
                ev.wait_on_compute()
            else:
                ev.wait()
        events.clear()
        self._append_keep[layer].clear()
        self._count_wait(layer, time.perf_counter() - start)

    def _count_wait(self, layer: int, seconds: float) -> None:
        self._count(layer, "waits", 1)
        self._count(layer, "wait_seconds", seconds)

    def _await_rows(self, layer: int) -> None:
        """The rows appended for ``layer`` so far are in the pool: own copies done, or the writer's
        published (a reader of a shared pool)."""
        self._wait(self._pending_append[layer], layer, on_compute=self._device_path)
        if not self.writer and self.pool.name is not None and self._append_seq[layer]:
            waited = self.pool.wait_published(layer, self._append_seq[layer], self.fence_timeout)
            if waited:
                self._count_wait(layer, waited)

    def sync(self) -> None:
        """Wait for every pending append, its fence and its counts (raises if one failed)."""
        for layer in range(self.num_layers):
            self._wait(self._pending_append[layer], layer)
        published, self._pending_publish = self._pending_publish, []
        for ev in published:
            ev.wait()

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

        ``q_nope [T, H, Dc]``, ``q_pe [T, H, Dr]`` (absorbed queries, the KV dtype, on the compute
        device); ``indexer`` and ``rows`` describe the same ``T`` decode rows. Every argument is checked
        before anything changes; see :func:`torch_kvoffload.sparse._checks.check_block_coverage` for
        the block-table checks.
        """
        plan, ids, stable, host_bt = self._check_attend(layer, q_nope, q_pe, scale, indexer, rows)
        if self._device_step:
            return self._attend_device(layer, plan, ids, stable, host_bt, q_nope, q_pe, scale, indexer)
        T, H = q_nope.shape[:2]
        dev = self.device
        table = self.tables[layer]
        rows_t = torch.tensor(plan.rows, dtype=torch.int64).to(dev, non_blocking=True)
        ids_t = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        stable = stable.to(dev, non_blocking=True)
        state = table.gather(rows_t)
        out, lse, topk, res = self._outputs(layer, T, H, q_nope.dtype)
        self._manage(indexer, state, ids_t, stable, topk, res)
        return self._finish_attend(
            layer, plan, rows_t, state, out, lse, topk, res,
            lambda: self._copy_and_attend(layer, plan, rows_t, q_nope, q_pe, scale, host_bt, res, out, lse),
        )  # fmt: skip

    def _finish_attend(self, layer, plan: RowPlan, rows_t, state, out, lse, topk, res, copy_and_attend):
        """Steps 5–7 and the commit, after the residency update wrote ``state`` and ``res``.

        Waits for the rows appended to ``layer``, then runs ``copy_and_attend()`` (returns the rows copied:
        an int, or an int64 device scalar). If that fails, the slots given to this step's misses are
        emptied (their copies may have started) and nothing is committed.
        """
        table = self.tables[layer]
        copying = False
        try:
            self._await_rows(layer)
            copying = True
            copied = copy_and_attend()
        except BaseException:
            if copying:
                table.drop_slots(rows_t, res.miss_slots)
            raise
        table.commit(rows_t, state)
        self.rows.commit(plan)
        self._record(layer, topk, res, copied)
        return StepResult(out, lse, topk, res, plan.rows)

    def _check_attend(self, layer, q_nope, q_pe, scale, indexer, rows):
        where = "SparseDecodeOffload.attend"
        layer = _checks.check_layer(where, layer, self.num_layers)
        dev = (self.device,)
        Dc, Dr = self.pool.kv_lora_rank, self.pool.rope_dim
        q_nope = _checks.check_tensor(where, "q_nope", q_nope, shape=(None, None, Dc), dtypes=(self.dtype,),
                                      devices=dev)  # fmt: skip
        T, H = q_nope.shape[:2]
        if not 1 <= T <= self.max_rows:
            raise ValueError(f"{where}: {T} decode rows, expected 1..max_rows={self.max_rows}")
        _checks.check_tensor(where, "q_pe", q_pe, shape=(T, H, Dr), dtypes=(self.dtype,), devices=dev)
        _checks.check_scale(where, scale)
        if not isinstance(rows, DecodeRows):
            raise TypeError(f"{where}: 'rows' must be a DecodeRows, got {type(rows).__name__}")
        if not isinstance(indexer, IndexerInputs):
            raise TypeError(f"{where}: 'indexer' must be IndexerInputs, got {type(indexer).__name__}")
        ids = _checks.host_ints(where, "rows.request_ids", rows.request_ids, T)
        stable = _checks.check_tensor(where, "rows.stable_len", rows.stable_len, shape=(T,), dtypes=(torch.int64,),
                                      devices=(torch.device("cpu"), self.device))  # fmt: skip
        if stable.device.type == "cpu" and bool((stable < 0).any()):
            raise ValueError(f"{where}: rows.stable_len entries must be >= 0, got {stable.tolist()}")
        host_bt = _checks.check_tensor(where, "rows.host_block_table", rows.host_block_table, dim=2,
                                       dtypes=(torch.int32,), devices=(torch.device("cpu"), self.device))  # fmt: skip
        if host_bt.shape[0] != T:
            raise ValueError(f"{where}: rows.host_block_table must have {T} rows, got {list(host_bt.shape)}")
        _checks.check_tensor(where, "indexer.q", indexer.q, dim=3, devices=dev)
        if indexer.q.shape[0] != T:
            raise ValueError(
                f"{where}: indexer.q must have {T} rows (T of q_nope), got {list(indexer.q.shape)}"
            )
        _checks.check_tensor(
            where, "indexer.weights", indexer.weights, shape=(T, indexer.q.shape[1]), devices=dev
        )
        cu = _checks.check_tensor(where, "indexer.cu_seqlens_q", indexer.cu_seqlens_q, dim=1, dtypes=(torch.int32,),
                                  devices=dev)  # fmt: skip
        lens = _checks.check_tensor(where, "indexer.seq_lens_k", indexer.seq_lens_k,
                                    shape=(cu.shape[0] - 1,), dtypes=(torch.int32,), devices=dev)  # fmt: skip
        _checks.check_tensor(where, "indexer.block_table", indexer.block_table, shape=(cu.shape[0] - 1, None),
                             dtypes=(torch.int32,), devices=dev)  # fmt: skip
        if self.config.indexer_dtype == "int8":
            if indexer.k_int8_cache is None or indexer.k_scale_cache is None:
                raise ValueError(
                    f"{where}: the int8 indexer path needs indexer.k_int8_cache and k_scale_cache"
                )
            _checks.check_tensor(where, "indexer.k_int8_cache", indexer.k_int8_cache, dim=3,
                                 dtypes=(torch.int8,), devices=dev)  # fmt: skip
            _checks.check_tensor(where, "indexer.k_scale_cache", indexer.k_scale_cache, dim=2,
                                 dtypes=(torch.float32,), devices=dev)  # fmt: skip
            D = indexer.q.shape[-1]
            if self._device_step and D not in self._hadamard_norms and D > 0 and not D & (D - 1):
                from torch_kvoffload.ops.indexer import hadamard_norm

                self._hadamard_norms[D] = hadamard_norm(D)  # a host constant of the device step's launch
        else:
            if indexer.k_cache is None:
                raise ValueError(f"{where}: the floating indexer path needs indexer.k_cache")
            _checks.check_tensor(where, "indexer.k_cache", indexer.k_cache, dim=3, devices=dev)
        _checks.check_block_coverage(where, self.pool, ids, host_bt, cu, lens)
        plan = self.rows.plan(where, ids)
        return plan, ids, stable, host_bt

    def _outputs(self, layer: int, T: int, H: int, dtype: torch.dtype):
        """``out, lse, topk, residency outputs`` for ``T`` rows: fresh on the CPU path, reused buffers on a
        device or with the device step."""
        K, Dc, dev = self.top_k, self.pool.kv_lora_rank, self.device
        if self._on_cpu and not self._device_path:
            out = torch.empty(T, H, Dc, dtype=dtype)
            lse = torch.empty(T, H, dtype=torch.float32)
            return out, lse, torch.empty(T, K, dtype=torch.int32), new_residency_outputs(T, K)
        key = (layer, H)
        if key not in self._buffers:
            R = self.max_rows
            res = new_residency_outputs(R, K, dev)
            self._buffers[key] = (torch.empty(R, H, Dc, dtype=dtype, device=dev),
                                  torch.empty(R, H, dtype=torch.float32, device=dev),
                                  torch.empty(R, K, dtype=torch.int32, device=dev), *res.as_tuple())  # fmt: skip
        out, lse, topk, *res_bufs = self._buffers[key]
        return out[:T], lse[:T], topk[:T], ResidencyOutputs(*(t[:T] for t in res_bufs))

    def _manage(self, indexer: IndexerInputs, state, ids, stable, topk, res: ResidencyOutputs) -> None:
        """Steps 3–4 on the scratch ``state``: fill ``topk`` and ``res``."""
        policy = self.config.policy
        if self.config.indexer_dtype == "int8":
            q_int8, q_scale = torch.ops.kvoffload.hadamard_quant_int8(indexer.q)
            topk.copy_(torch.ops.kvoffload.quant_lightning_indexer(
                q_int8, q_scale, indexer.weights, indexer.k_int8_cache, indexer.k_scale_cache, indexer.block_table,
                indexer.cu_seqlens_q, indexer.seq_lens_k, self.top_k,
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
            topk.copy_(torch.ops.kvoffload.lightning_indexer(*args, self.top_k))
            scores = torch.ops.kvoffload.lightning_indexer_scores(*args) if policy == "score" else None
            residency_update(*state, topk, ids, stable, scores, policy, res)

    def _copy_and_attend(self, layer, plan: RowPlan, rows_t, q_nope, q_pe, scale, host_bt, res, out, lse):
        """Steps 5–7 into ``out`` / ``lse``; returns the rows copied host→device (int or device tensor)."""
        host_kv, host_pe = self.pool.kv_c(layer), self.pool.k_pe(layer)
        hot_kv, hot_pe = self.hot_kv_c[layer], self.hot_k_pe[layer]
        T, C = q_nope.shape[0], self.capacity
        if self.config.fused and plan.contiguous():
            a = plan.rows[0]
            scatter_copy_sparse_mla_attention(
                q_nope, q_pe, host_kv, host_pe, host_bt.to(self.device, non_blocking=True), hot_kv[a : a + T],
                hot_pe[a : a + T], res.miss_tokens, res.miss_slots, res.miss_count, res.slots, scale, out, lse,
            )  # fmt: skip
            # Copy-SFA copies the first miss_count[r] entries of each row's miss list
            return res.miss_count.sum(dtype=torch.int64)
        copied = self._copy_misses(host_kv, host_pe, hot_kv, hot_pe, host_bt, res, rows_t)
        indices = torch.where(res.slots >= 0, res.slots + (rows_t[:, None] * C).to(torch.int32), -1)
        o, s = sparse_mla_attention(
            q_nope, q_pe, hot_kv.view(-1, hot_kv.shape[-1]), hot_pe.view(-1, hot_pe.shape[-1]), indices, scale
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
        (the fused default has no such read).
        """
        C, bs = self.capacity, self.pool.block_size
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
            copy_rows(host_pe, hot_pe, src, dst)

        event = self._h2d.submit(h2d, after=[kv_transfer.record_compute_event()])
        event.wait_on_compute()
        return int(src.numel())

    def _record(
        self, layer: int, topk: torch.Tensor, res: ResidencyOutputs, copied: int | torch.Tensor
    ) -> None:
        if self._device_path:  # device tallies, in place (a CUDA graph replay adds to them too)
            counts = step_counts(topk, res)
            tally = self._tally[layer]
            if isinstance(copied, torch.Tensor):
                tally.add_(torch.stack([counts["hits"], counts["misses"], counts["evictions"], copied]))
            else:
                tally[:3].add_(torch.stack([counts["hits"], counts["misses"], counts["evictions"]]))
                tally[3].add_(copied)
            return
        for name, amount in (*step_counts(topk, res).items(), ("bytes_h2d", copied * self.pool.row_bytes)):
            self._count(layer, name, amount)

    # ------------------------------------------------------------------------------- device step
    def _attend_device(self, layer, plan: RowPlan, ids, stable, host_bt, q_nope, q_pe, scale, indexer):
        """Steps 3–7 without a host synchronisation (fused; see the module docstring).

        Every device tensor it writes is a per-layer buffer, so the same call can be captured in a CUDA
        graph once warmed up (row metadata equal to the previous call's is not copied again).
        """
        T, H = q_nope.shape[:2]
        table = self.tables[layer]
        rows_t, ids_t, stable_t, bt = self._stage_rows(layer, plan.rows, ids, stable, host_bt)
        state = self._scratch_state(layer, T)
        out, lse, topk, res = self._outputs(layer, T, H, q_nope.dtype)
        hot_kv, hot_pe, offset = self._hot_views(layer, plan, rows_t)
        q_int8 = self._check_device_step(layer, q_nope, q_pe, indexer, state, ids_t, stable_t, bt, topk, res,
                                         hot_kv, hot_pe, out, lse)  # fmt: skip
        table.gather(rows_t, out=state)
        self._manage_device(indexer, q_int8, state, ids_t, stable_t, topk, res)
        return self._finish_attend(
            layer, plan, rows_t, state, out, lse, topk, res,
            lambda: self._copy_and_attend_device(layer, q_nope, q_pe, scale, bt, hot_kv, hot_pe, offset, res,
                                                 out, lse),
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
            bufs["meta"] = torch.empty(3 * self.max_rows, dtype=torch.int64, device=dev)
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
            R, C, dev = self.max_rows, self.capacity, self.device
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
        hot_kv, hot_pe = self.hot_kv_c[layer], self.hot_k_pe[layer]
        T = len(plan.rows)
        if plan.contiguous():
            a = plan.rows[0]
            return hot_kv[a : a + T], hot_pe[a : a + T], None
        R, C = self.max_rows, self.capacity
        flat_kv = hot_kv.view(1, R * C, hot_kv.shape[-1]).expand(T, -1, -1)
        flat_pe = hot_pe.view(1, R * C, hot_pe.shape[-1]).expand(T, -1, -1)
        return flat_kv, flat_pe, (rows_t * C).to(torch.int32)[:, None]

    def _check_device_step(self, layer, q_nope, q_pe, indexer, state, ids_t, stable_t, bt, topk, res,
                           hot_kv, hot_pe, out, lse):  # fmt: skip
        """The ops' structural checks of the device step's launches (shapes, dtypes, devices; no values),
        before its first write. Returns the int8 query buffers ``(q_int8, q_scale)`` of the int8 path."""
        from torch_kvoffload.ops import indexer as idx_ops
        from torch_kvoffload.ops import residency as res_ops
        from torch_kvoffload.ops import sparse_attention as sa_ops

        q_int8 = None
        if self.config.indexer_dtype == "int8":
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
        sa_ops._copy_sfa_structure("scatter_copy_sparse_mla_attention", q_nope, q_pe, self.pool.kv_c(layer),
                                   self.pool.k_pe(layer), bt, hot_kv, hot_pe, res.miss_tokens, res.miss_slots,
                                   res.miss_count, res.slots, out, lse)  # fmt: skip
        return q_int8

    def _manage_device(self, indexer: IndexerInputs, q_int8, state, ids, stable, topk, res) -> None:
        """Steps 3–4 with the unchecked Triton launches (the int8 path quantises the query first)."""
        from torch_kvoffload.ops.triton.indexer import launch_hadamard_quant_int8
        from torch_kvoffload.ops.triton.residency import launch_indexer_manage

        idx = (indexer.block_table, indexer.cu_seqlens_q, indexer.seq_lens_k)
        if q_int8 is not None:
            launch_hadamard_quant_int8(indexer.q, *q_int8, self._hadamard_norms[indexer.q.shape[-1]])
            launch_indexer_manage(q_int8[0], indexer.weights, indexer.k_int8_cache, *idx, *state, ids, stable,
                                  "lru", topk, *res.as_tuple(), q_scale=q_int8[1],
                                  k_scale=indexer.k_scale_cache)  # fmt: skip
        else:
            launch_indexer_manage(indexer.q, indexer.weights, indexer.k_cache, *idx, *state, ids, stable,
                                  self.config.policy, topk, *res.as_tuple())  # fmt: skip

    def _copy_and_attend_device(self, layer, q_nope, q_pe, scale, bt, hot_kv, hot_pe, offset, res, out, lse):
        """Steps 5–7 with the unchecked Copy-SFA launch; returns the rows copied (an int64 device scalar)."""
        from torch_kvoffload.ops._checks import unaliased_source
        from torch_kvoffload.ops.triton.sparse_attention import launch_scatter_copy_sparse_mla_attention

        miss_slots, slots = res.miss_slots, res.slots
        if offset is not None:
            miss_slots = torch.where(miss_slots >= 0, miss_slots + offset, -1)
            slots = torch.where(slots >= 0, slots + offset, -1)
        q_nope = unaliased_source(unaliased_source(q_nope, out), lse)
        q_pe = unaliased_source(unaliased_source(q_pe, out), lse)
        launch_scatter_copy_sparse_mla_attention(
            q_nope, q_pe, self.pool.kv_c(layer), self.pool.k_pe(layer), bt, hot_kv, hot_pe, res.miss_tokens,
            miss_slots, res.miss_count, slots, scale, out, lse,
        )  # fmt: skip
        return res.miss_count.sum(dtype=torch.int64)

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
            for stream in {id(s): s for s in (self._d2h, self._h2d, self._host)}.values():
                stream.close()
            if self._owns_pool:
                self.pool.close()

    def __enter__(self) -> SparseDecodeOffload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
