"""``RowAppender``: step 2 of a sparse decode step, new token rows into the host pool, and its fence.

Where the rows come from decides the path:

* rows in host memory (the CPU runtime): the copy into the pool runs on the host transfer stream with
  ``inline=True``, so when that stream is idle it runs at once on the calling thread (a few rows cost
  less than the hand-off to a worker thread the same layer would wait for); work already in flight
  keeps its order, the copy is then queued behind it;
* rows on an accelerator, host step: pinned staging on the D2H stream (ordered after the compute so far),
  then into the pool on a host worker once that copy's event completed;
* rows on an accelerator, device path: the Triton row copy writes them into the pinned pool directly on
  the runtime's D2H stream; the fence is published from a host worker once its event completed.

Fence: the writer publishes, per layer, the number of the last append whose rows are in the pool
(:meth:`~torch_kvoffload.sparse.host_pool.HostKVPool.publish`); a reader rank of a shared pool replays the
same appends (copying nothing) and :meth:`RowAppender.await_rows` waits until the writer published them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from torch_kvoffload import device as kv_device
from torch_kvoffload import transfer as kv_transfer
from torch_kvoffload.ops.fp8 import quantize_kv_fp8
from torch_kvoffload.sparse._checks import check_layer, check_tensor, host_ints
from torch_kvoffload.sparse.host_pool import HostKVPool
from torch_kvoffload.sparse.stats import StepCounters

logger = logging.getLogger(__name__)

__all__ = ["PlacedRows", "RowAppender"]


@dataclass(frozen=True)
class PlacedRows:
    """New token rows placed in the host pool once for the appends of every layer of a forward, from
    :meth:`~torch_kvoffload.sparse.SparseDecodeOffload.place_rows`.

    ``request_ids`` (``n`` ints) and ``dst int64 [n]``: row ``i`` goes to pool row ``dst[i]`` of each layer
    (blocks shared with a fork were copied on write when placed). Valid for the runtime that placed them
    (``pool``) while its block tables are unchanged (``tables_version``): a reserve, release, fork or
    truncate after placing makes :meth:`~torch_kvoffload.sparse.SparseDecodeOffload.append_placed` refuse
    them.
    """

    request_ids: list[int]
    dst: torch.Tensor
    tables_version: int
    pool: HostKVPool = field(repr=False, compare=False)

    @property
    def n(self) -> int:
        return len(self.request_ids)


class RowAppender:
    """Appends of new token rows of every layer into ``pool``, and the waits for them.

    ``writer``: whether this rank copies rows (TP rank 0); a reader only counts its appends and waits for
    the writer's fence (at most ``fence_timeout`` seconds). ``device_path``: the device step's appends
    (Triton row copy into the pinned pool). Counts ``bytes_d2h``, ``waits`` and ``wait_seconds`` into
    ``counters``. ``fp8``: the pool holds FP8 rows; the appended floating rows of widths ``dims = (Dc, Dr)``
    are quantized (``quantize_kv_fp8``) where they are, and move as bytes.
    """

    def __init__(
        self,
        pool: HostKVPool,
        counters: StepCounters,
        *,
        writer: bool,
        dtype: torch.dtype,
        device: torch.device,
        device_path: bool,
        fence_timeout: float,
        fp8: bool = False,
        dims: tuple[int, int] | None = None,
    ) -> None:
        self.pool, self.counters, self.writer = pool, counters, writer
        self.fp8 = fp8
        self.dims = dims if dims is not None else (pool.kv_lora_rank, pool.rope_dim)
        self.dtype, self.device, self.device_path = dtype, device, device_path
        self.fence_timeout = fence_timeout
        num_layers = pool.num_layers
        on_cpu = device.type == "cpu"
        self._d2h_stream = torch.Stream(device) if device_path and not on_cpu else None
        self.d2h = kv_transfer.TransferStream("sparse-d2h", device)
        # host-side copies (staging -> pool, CPU rows -> pool) and fence publication run on a host stream
        self.host = self.d2h if on_cpu else kv_transfer.TransferStream("sparse-host", torch.device("cpu"))
        self._pending: list[list[kv_transfer.TransferEvent]] = [[] for _ in range(num_layers)]
        # tensors a device-path append reads on the D2H stream: kept until compute waited on its event
        self._keep: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self._pending_publish: list[kv_transfer.TransferEvent] = []  # device path: fence + bytes_d2h
        self._seq = [0] * num_layers  # appends issued per layer (writer and readers alike)
        self._row_bytes = pool.row_bytes  # every append counts its bytes

    def append(
        self,
        layer: int,
        request_ids: Sequence[int] | torch.Tensor,
        positions: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
    ) -> kv_transfer.TransferEvent:
        """See :meth:`torch_kvoffload.sparse.SparseDecodeOffload.append`."""
        where = "SparseDecodeOffload.append"
        layer = check_layer(where, layer, self.pool.num_layers)
        positions = check_tensor(where, "positions", positions, dim=1, dtypes=(torch.int32, torch.int64))
        n = positions.shape[0]
        kv_c, k_pe = self._check_rows(where, n, kv_c, k_pe)
        ids = host_ints(where, "request_ids", request_ids, n)
        if n == 0:
            return kv_transfer.TransferEvent.completed()
        return self._write(layer, self._place(where, ids, positions), kv_c, k_pe)

    def place(self, request_ids: Sequence[int] | torch.Tensor, positions: torch.Tensor) -> PlacedRows:
        """See :meth:`torch_kvoffload.sparse.SparseDecodeOffload.place_rows`."""
        where = "SparseDecodeOffload.place_rows"
        positions = check_tensor(where, "positions", positions, dim=1, dtypes=(torch.int32, torch.int64))
        ids = host_ints(where, "request_ids", request_ids, positions.shape[0])
        if not ids:
            return PlacedRows(
                [], torch.empty(0, dtype=torch.int64), self.pool.block_tables.version, self.pool
            )
        return self._place(where, ids, positions)

    def append_placed(
        self, layer: int, placed: PlacedRows, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> kv_transfer.TransferEvent:
        """See :meth:`torch_kvoffload.sparse.SparseDecodeOffload.append_placed`."""
        where = "SparseDecodeOffload.append_placed"
        layer = check_layer(where, layer, self.pool.num_layers)
        if not isinstance(placed, PlacedRows):
            raise TypeError(
                f"{where}: 'placed' must be PlacedRows (place_rows()), got {type(placed).__name__}"
            )
        self._check_current(where, placed)
        kv_c, k_pe = self._check_rows(where, placed.n, kv_c, k_pe)
        return self._write(layer, placed, kv_c, k_pe)

    def append_validated(
        self, layer: int, placed: PlacedRows, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> kv_transfer.TransferEvent:
        """See :meth:`torch_kvoffload.sparse.SparseDecodeOffload.append_validated`."""
        self._check_current("SparseDecodeOffload.append_validated", placed)
        return self._write(layer, placed, kv_c, k_pe)

    def _check_current(self, where: str, placed: PlacedRows) -> None:
        """``placed`` was placed in this pool and no block table changed since."""
        if placed.pool is not self.pool:
            raise ValueError(f"{where}: the placed rows were placed by another runtime (another host pool)")
        if placed.tables_version != self.pool.block_tables.version:
            raise ValueError(
                f"{where}: the placed rows are stale (a request was reserved, released, forked or truncated "
                "since place_rows()); place them again"
            )

    def _check_rows(
        self, where: str, n: int, kv_c: object, k_pe: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_c [n, Dc]`` and ``k_pe [n, Dr]``: floating, on one device."""
        floating = (torch.float32, torch.bfloat16, torch.float16)
        Dc, Dr = self.dims
        kv_c = check_tensor(where, "kv_c", kv_c, shape=(n, Dc), dtypes=floating)
        k_pe = check_tensor(where, "k_pe", k_pe, shape=(n, Dr), dtypes=floating, devices=(kv_c.device,))
        return kv_c, k_pe

    def _place(self, where: str, ids: list[int], positions: torch.Tensor) -> PlacedRows:
        """The rows ``(ids[i], positions[i])`` placed: their pool rows, their blocks made writable first
        (:meth:`_pool_slots`, :meth:`_copy_on_write`)."""
        dst, copies = self._pool_slots(where, ids, positions.to("cpu", torch.int64))
        if copies and self.writer:
            self.counters.count_total("cow_copies", len(copies))
            self._copy_on_write(copies)
        return PlacedRows(ids, dst, self.pool.block_tables.version, self.pool)

    def _write(
        self, layer: int, placed: PlacedRows, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> kv_transfer.TransferEvent:
        """Copy checked rows ``kv_c [n, Dc]`` / ``k_pe [n, Dr]`` of ``layer`` to their placed pool rows."""
        if placed.n == 0:
            return kv_transfer.TransferEvent.completed()
        self._seq[layer] += 1
        if not self.writer:
            return kv_transfer.TransferEvent.completed()
        seq = self._seq[layer]
        host_kv, host_pe = self.pool.rows(layer)
        n, dst = placed.n, placed.dst
        if self.fp8:  # quantized where the rows are: the bytes of FP8 rows move, and an empty rotary part
            kv_src = kv_c if kv_c.dtype == torch.uint8 else quantize_kv_fp8(kv_c, k_pe)  # uint8: rows as kept
            pe_src = kv_src[:, :0]
        else:
            kv_src, pe_src = kv_c.to(self.dtype), k_pe.to(self.dtype)
        if self.device_path and kv_src.device == self.device:
            event = self._append_device(layer, seq, kv_src, pe_src, dst)
            if not event.succeeded():  # a launch run to completion here (the interpreter) leaves no wait
                self._pending[layer].append(event)
            return event

        def write(kv_rows: torch.Tensor, pe_rows: torch.Tensor) -> None:
            try:  # rows i of kv_rows / pe_rows to pool rows dst[i] (host to host: one index_copy_ each)
                host_kv.index_copy_(0, dst, kv_rows)
                host_pe.index_copy_(0, dst, pe_rows)
            except BaseException:
                self.pool.mark_failed(layer)  # readers must not take later appends for complete rows
                raise
            self.pool.publish(layer, seq)
            self.counters.count(layer, "bytes_d2h", n * self._row_bytes)

        if kv_src.device.type == "cpu":
            event = self.host.submit(
                write, kv_src, pe_src, after=[kv_transfer.record_compute_event()], inline=True
            )
        else:
            stage_kv = kv_device.empty_host((n, self.pool.kv_lora_rank), self.dtype)
            stage_pe = kv_device.empty_host((n, self.pool.rope_dim), self.dtype)

            def stage() -> None:
                stage_kv.copy_(kv_src, non_blocking=True)
                stage_pe.copy_(pe_src, non_blocking=True)

            def unstage(_keep_alive: tuple[torch.Tensor, torch.Tensor]) -> None:
                write(stage_kv, stage_pe)

            staged = self.d2h.submit(stage, after=[kv_transfer.record_compute_event()])
            # the host copy reads the staging only after the D2H copy's event (the worker waits on it);
            # the device sources stay referenced until then
            event = self.host.submit(unstage, (kv_src, pe_src), after=[staged])
        # an append done when it returned (inline on CPU) leaves nothing to wait for
        if not event.succeeded():
            self._pending[layer].append(event)
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
                if host_pe.shape[-1]:  # FP8 rows hold their rotary part
                    launch_copy_rows(pe_src.unsqueeze(1), host_pe, src, dst)
            except BaseException:
                self.pool.mark_failed(layer)
                raise
            event = kv_transfer.TransferEvent.completed()
            self._publish_later(layer, seq, n, event)
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
            if host_pe.shape[-1]:  # FP8 rows hold their rotary part
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
        self._keep[layer].extend((kv_src, pe_src, dst_dev, src_dev))
        self._publish_later(layer, seq, n, event)
        return event

    def _publish_later(self, layer: int, seq: int, n: int, event: kv_transfer.TransferEvent) -> None:
        """On the host worker, once ``event`` completed: publish the fence, count ``bytes_d2h``."""

        def finished() -> None:
            self.pool.publish(layer, seq)
            self.counters.count(layer, "bytes_d2h", n * self.pool.row_bytes)

        # keep the unfinished and the failed (sync() raises those); finished ones need nothing more
        self._pending_publish = [ev for ev in self._pending_publish if not ev.succeeded()]
        self._pending_publish.append(self.host.submit(finished, after=[event]))

    def _pool_slots(self, where: str, ids: list[int], pos: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Pool rows ``int64 [n]`` of ``(ids[i], pos[i])`` and the ``(old, new)`` blocks to copy first;
        a rank whose pool does not know a request gets ``-1``. Computed on Python ints: a decode step
        appends a few rows, where per-request tensor ops would cost more than the copy.

        Everything is checked first; then a block the row's request shares with another one (a fork's) is
        replaced in its table by a fresh block (copy-on-write, on every rank: the tables stay identical),
        whose rows the writer copies before this append's write."""
        positions = pos.tolist()
        bs = self.pool.block_size
        known: list[int] = []
        for rid in sorted(set(ids)):
            if self.pool.knows(rid):
                mine = [p for r, p in zip(ids, positions, strict=True) if r == rid]
                if min(mine) < 0 or max(mine) >= self.pool.reserved_tokens(rid):
                    try:  # the pool's own check names the range
                        self.pool.slots(rid, torch.tensor(mine, dtype=torch.int64))
                    except IndexError as exc:
                        raise IndexError(f"{where}: {exc}") from None
                known.append(rid)
            elif self.writer:
                raise ValueError(f"{where}: request {rid} has no host-pool blocks; reserve() it first")
        pairs = [(r, p) for r, p in zip(ids, positions, strict=True) if r in known]
        if len(set(pairs)) != len(pairs):
            raise ValueError(f"{where}: a (request, position) pair occurs twice in one append")
        copies: list[tuple[int, int]] = []
        for rid in known:
            written = sorted({p // bs for r, p in pairs if r == rid})
            copies += self.pool.make_writable(where, rid, written)
        tables = {rid: self.pool.blocks_of(rid) for rid in known}
        dst = [
            tables[r][p // bs] * bs + p % bs if r in tables else -1
            for r, p in zip(ids, positions, strict=True)
        ]
        return torch.tensor(dst, dtype=torch.int64), copies

    def _copy_on_write(self, copies: list[tuple[int, int]]) -> None:
        """Writer: copy the blocks ``copies`` (every layer) before the append that writes into the new ones.

        Earlier appends of any layer may still write into the old blocks: the copy runs on the host stream
        behind them (every host-side write runs there, in order, and this append's follows it); a device
        path append in flight on the D2H stream is waited for first."""
        if not copies:
            return
        if self.device_path:
            for layer in range(self.pool.num_layers):
                self._wait(layer)

        def copy() -> None:
            try:
                self.pool.copy_blocks(copies)
            except BaseException:
                for layer in range(self.pool.num_layers):  # every layer's rows of those blocks are lost
                    self.pool.mark_failed(layer)
                raise

        pending = [ev for evs in self._pending for ev in evs]
        event = self.host.submit(copy, after=pending, inline=True)
        if self.device_path:
            event.wait()  # the Triton write on the D2H stream is not ordered after the host stream
        for events in self._pending:  # each layer's next wait raises if the copy failed
            events.append(event)

    def _wait(self, layer: int, on_compute: bool = False) -> None:
        """Wait for ``layer``'s pending appends: on the host, or (``on_compute``) with a stream wait of
        the compute stream on each append's event, which blocks nothing on the host."""
        events = self._pending[layer]
        if not events:
            return
        start = time.perf_counter()
        for ev in events:
            if on_compute:
                ev.wait_on_compute()
            else:
                ev.wait()
        events.clear()
        self._keep[layer].clear()
        self.counters.count_wait(layer, time.perf_counter() - start)

    def await_rows(self, layer: int) -> None:
        """The rows appended for ``layer`` so far are in the pool: own copies done, or the writer's
        published (a reader of a shared pool)."""
        self._wait(layer, on_compute=self.device_path)
        self._await_fence(layer)

    def rows_on_host(self, layer: int) -> None:
        """The rows appended for ``layer`` so far can be read from the pool on the host: own copies
        finished (a host wait, also on the device path), or the writer's published."""
        self._wait(layer)
        self._await_fence(layer)

    def _await_fence(self, layer: int) -> None:
        """A reader of a shared pool: wait until the writer published every append of ``layer`` this
        rank replayed (at most ``fence_timeout`` seconds)."""
        if not self.writer and self.pool.name is not None and self._seq[layer]:
            waited = self.pool.wait_published(layer, self._seq[layer], self.fence_timeout)
            if waited:
                self.counters.count_wait(layer, waited)

    def sync(self) -> None:
        """Wait for every pending append, its fence and its counts (raises if one failed)."""
        for layer in range(self.pool.num_layers):
            self._wait(layer)
        published, self._pending_publish = self._pending_publish, []
        for ev in published:
            ev.wait()

    @property
    def streams(self) -> dict[str, kv_transfer.TransferStream]:
        """``{"d2h": ..., "host": ...}`` (one stream under both names on CPU)."""
        return {"d2h": self.d2h, "host": self.host}
