"""``SparseOffloadBackend``: sparse decode offload as a KV backend (DESIGN §7).

Every new row goes to the host pool (:meth:`SparseDecodeOffload.append`; with ``kv_dtype="fp8_e4m3"`` as
DeepSeek's FP8 row, which the hot buffers keep too and attention dequantizes where it reads); the indexer
keys go to the device :class:`~torch_kvoffload.sparse.indexer_cache.IndexerCache`. A decode step (one new token per request)
runs the fused indexer + residency + Copy-SFA path (:meth:`SparseDecodeOffload.attend`); a multi-token
forward without the layerwise pipeline attends over its own rows plus, for a chunked prefill, the
requests' earlier rows read from the host pool for that layer only, on the runtime's ``h2d`` transfer
stream (``prefill_host_bytes_h2d``).

Sizes: the host pool holds ``slots * M`` blocks, one range of ``M`` blocks reserved per request at
admission and released when it ends; it keeps the size of a sequence's first forward (growing past a
request's reservation is refused by :meth:`can_grow`). The hot buffers hold ``min(capacity, tokens)``
rows with a top-k of ``min(top_k, tokens)`` (a top-k covering a request's whole context selects what the
configured one would: every row).

Tensor parallelism (``spec.tp``, transformers' ``tp_plan``): MLA's latent KV is replicated over the TP
group, so its ranks share one host pool instead of one each. TP rank 0 creates it in shared memory
(``/dev/shm``) and writes every new row; its name reaches the other ranks over the TP group, which attach
it and run as readers (``writer=False``: an append copies nothing, a step waits for the writer's fence, at
most :data:`FENCE_TIMEOUT_S`). Every rank keeps its own device data: hot buffers, residency, indexer cache
(the indexer is replicated under the HF TP plan). The ranks size, admit, fork and release in lock step
(they run the same ``generate``), so their block tables agree without being exchanged. After the
attach every rank learns whether every other rank got its pool (a collective of the TP group, bounded
by the group's timeout): a failure on one rank raises on all of them instead of hanging the writer. The
TP ranks must share a host (``/dev/shm``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.kv.backend import IndexerView, KeyRows, KVBackend, NewRows, Queries, SelectedRows
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.fp8_rows import (
    FP8_KV,
    check_indexer_format,
    check_kv_format,
    latent_fp8_rows,
)
from torch_kvoffload.kv.group_outcomes import exchange_outcomes
from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import ModelSpec, TensorParallel
from torch_kvoffload.kv.totals import RuntimeTotals
from torch_kvoffload.ops.fp8_attention import dequantize_rows
from torch_kvoffload.sparse.config import (
    SparseDecodeConfig,
    SparseOptions,
    resolve_sparse_config,
)
from torch_kvoffload.sparse.host_pool import HostKVPool
from torch_kvoffload.sparse.indexer_cache import IndexerCache
from torch_kvoffload.sparse.runtime import DecodeRows, IndexerInputs, SparseDecodeOffload, StepResult

__all__ = ["FENCE_TIMEOUT_S", "SparseOffloadBackend"]

#: Seconds a reader rank of a TP-shared host pool waits for the writer's rows before a step raises
#: ``TimeoutError`` (the writing rank fell behind, failed or is gone).
FENCE_TIMEOUT_S = 60.0

# the runtime's counters stats() reports, summed over every runtime the backend built
_TOTALS = ("bytes_h2d", "bytes_d2h", "hits", "misses", "evictions", "fork_shared_blocks", "cow_copies")


class SparseOffloadBackend(KVBackend):
    """Sparse decode offload of ``spec``'s KV under ``options``, paged in blocks of ``block_size`` tokens
    (see the module docstring)."""

    name = "sparse"
    #: counters :meth:`stats` adds beyond the runtime's and the host pool's (none here; hybrid sparse has some)
    STATS: tuple[str, ...] = ()

    def __init__(self, spec: ModelSpec, options: SparseOptions, *, block_size: int) -> None:
        assert options.offload
        self.spec, self.options, self.block_size = spec, options, block_size
        self.runtime: SparseDecodeOffload | None = None
        self._attached: HostKVPool | None = None  # a TP reader's mapping of TP rank 0's pool
        check_indexer_format(options.indexer_dtype or "bf16", spec)
        check_kv_format(options.kv_dtype, spec)
        self.fp8 = options.kv_dtype == FP8_KV  # the host pool and hot buffers keep FP8 rows
        self.index = IndexerCache(spec, options.indexer_dtype or "bf16")
        self._layout: KVLayout | None = None
        self._configured = (0, 0)  # (top_k, hot capacity) of the configuration, before clipping to a layout
        self._reserved: list[int] = []  # request ids holding host-pool blocks
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this forward's rows per layer
        # per forward, in the plan's memo: its new rows placed in the pool, and a decode forward's rows
        # (request ids, lengths, host block table) checked once for every layer
        # the last decode step's (layer, plan, result): the rows it read, for attended()
        self._last_step: tuple[int, ForwardPlan, StepResult] | None = None
        self.counters = Counters(("prefill_host_bytes_h2d",))
        self._totals = RuntimeTotals(_TOTALS)

    # -------------------------------------------------------------------------------- sizing
    @property
    def built(self) -> bool:
        return self.runtime is not None

    @staticmethod
    def _hot_sizes(layout: KVLayout, top_k: int, capacity: int) -> tuple[int, int]:
        k = min(top_k, layout.tokens)
        return k, max(k, min(capacity, layout.tokens))

    def can_grow(self, layout: KVLayout, live: Sequence[Request]) -> bool:
        rt = self.runtime
        return rt is None or all(layout.tokens <= rt.pool.reserved_tokens(r.id) for r in live)

    def resize(self, layout: KVLayout, live: Sequence[Request]) -> None:
        self._layout = layout
        if live and self.runtime is not None:
            self.index.allocate(layout, live)
            # the configured sizes, not the runtime's: those were clipped to the layout it was built for
            k, cap = self._hot_sizes(layout, *self._configured)
            if (k, cap) != (self.runtime.top_k, self.runtime.capacity):
                self.runtime.resize_hot(cap, k)
            return
        self.free()
        spec = self.spec
        scfg = resolve_sparse_config(
            self.options, spec, block_size=self.block_size, host_pool_blocks=layout.num_blocks
        )
        self._configured = (scfg.top_k, scfg.hot_capacity)
        k, cap = self._hot_sizes(layout, scfg.top_k, scfg.hot_capacity)
        scfg = scfg.model_copy(update={"top_k": k, "capacity": cap})
        kw = dict(num_layers=spec.num_layers, max_rows=self.hot_rows(layout), kv_lora_rank=spec.kv_lora_rank,
                  rope_dim=spec.rope_dim, device=spec.device)  # fmt: skip
        tp = spec.tp
        if tp is None or tp.size == 1:
            self.runtime = SparseDecodeOffload(scfg, **kw)
            self.index.allocate(layout)
        else:  # the indexer cache too, before every rank hears whether every rank is ready
            self.runtime, self._attached = _shared_runtime(
                tp, scfg, kw, then=lambda: self.index.allocate(layout)
            )

    def hot_rows(self, layout: KVLayout) -> int:
        """Decode rows the hot buffers are built for: one per request slot."""
        return layout.slots

    def free(self) -> None:
        rt, self.runtime = self.runtime, None
        attached, self._attached = self._attached, None
        self._reserved = []
        self.index.free()
        try:
            if rt is not None:
                self._totals.retire(rt)  # a rebuilt runtime's counters keep counting in stats
        finally:
            if attached is not None:  # after the runtime's last read of it; the owner removes the file
                attached.close()

    @property
    def writer(self) -> bool:
        """Whether this rank writes the host pool's rows: without tensor parallelism, or TP rank 0 of a
        shared pool (the other TP ranks read the rows it writes)."""
        return self.spec.tp is None or self.spec.tp.rank == 0

    # ------------------------------------------------------------------------------ requests
    def admit(self, layout: KVLayout, requests: Sequence[Request]) -> None:
        assert self.runtime is not None
        for r in requests:
            self.runtime.reserve(r.id, layout.blocks_per_request * layout.block_size)
            self._reserved.append(r.id)

    def release(self, request_ids: Sequence[int]) -> None:
        rt = self.runtime
        gone = [rid for rid in request_ids if rid in self._reserved]
        self._reserved = [rid for rid in self._reserved if rid not in gone]
        if rt is not None:
            for rid in gone:
                rt.release(rid)

    def fork(self, layout: KVLayout, src: Request, dst: Request, length: int) -> None:
        """``dst`` continues ``src``'s rows: its host-pool table shares ``src``'s full blocks (copy-on-write:
        an append or a truncated beam's rewrite into a shared block copies it first) and gets a copy of
        the partial last one; the indexer-cache pages are copied. ``dst`` holds no hot-buffer rows (its
        first decode step loads what it selects)."""
        rt = self.runtime
        assert rt is not None
        rt.fork(src.id, dst.id, length)
        self.index.copy_rows(src.slot, dst.slot, length)

    def truncate(self, request: Request, length: int) -> None:
        """Forget ``request``'s hot-buffer rows of positions ``>= length`` in every layer; its pool rows
        there are replaced by the next appends, and the indexer reads at most ``seq_lens_k`` rows."""
        assert self.runtime is not None
        self.runtime.truncate(request.id, length)

    # ------------------------------------------------------------------------------ forwards
    def begin_forward(self, fwd: ForwardPlan) -> None:
        self._rows = {}
        self._last_step = None

    def end_forward(self, fwd: ForwardPlan) -> None:
        self._rows = {}
        self._last_step = None

    # ------------------------------------------------------------------------------ per layer
    def layer_caches(self, layer: int) -> list[torch.Tensor]:
        rt = self.runtime
        if rt is None:
            return []
        return [*self.index.layers[layer], rt.hot_kv_c[layer], rt.hot_k_pe[layer]]

    def write(self, layer: int, fwd: ForwardPlan, rows: NewRows) -> None:
        rt = self.runtime
        assert rt is not None and rows.index_k is not None
        placed = fwd.memo.get("sparse_placed")
        if placed is None:  # once per forward part: each layer appends the same rows
            ids = [fwd.requests[r].id for r in fwd.row.tolist()]
            placed = fwd.memo["sparse_placed"] = rt.place_rows(ids, fwd.pos)
        kv_c, k_pe = rows.kv_c, rows.k_pe
        # FP8: quantized once, the pool, the layer buffers and this forward's attention read the same bytes
        if self.fp8:
            kv_c = latent_fp8_rows(fwd, layer, rows)
            k_pe = kv_c[:, :0]
        rt.append_validated(layer, placed, kv_c, k_pe)  # the core checked the rows
        self.index.write_keys(layer, fwd, rows)
        if not fwd.decode and not fwd.layerwise:
            self._rows[layer] = (kv_c, k_pe)

    def keys(self, layer: int, fwd: ForwardPlan) -> KeyRows | None:
        """A multi-token forward's own rows, after each request's earlier rows read from the host pool (FP8
        rows as they are kept: ``KeyRows.fp8``)."""
        if fwd.decode or layer not in self._rows:
            return None
        rows_c, rows_pe = self._rows[layer]
        if fwd.first:
            n_new = [n - o for o, n in zip(fwd.old_len, fwd.new_len, strict=True)]
            return KeyRows(rows_c, rows_pe, [0, *itertools.accumulate(n_new)][:-1], fp8=self.fp8)
        earlier = self.earlier_rows(layer, fwd)
        parts_c, parts_pe, starts, off, pos = [], [], [], 0, 0
        for r, (old, new) in enumerate(zip(fwd.old_len, fwd.new_len, strict=True)):
            parts_c += [earlier[r][0], rows_c[pos : pos + new - old]]
            parts_pe += [earlier[r][1], rows_pe[pos : pos + new - old]]
            starts.append(off)
            off += new
            pos += new - old
        return KeyRows(torch.cat(parts_c), torch.cat(parts_pe), starts, fp8=self.fp8)

    def earlier_rows(
        self, layer: int, fwd: ForwardPlan, at: Sequence[int] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The rows before ``fwd`` (``kv_c``, ``k_pe``) of its requests ``at`` (batch rows; default every
        one) on the device: read from the host pool (counted in ``prefill_host_bytes_h2d``)."""
        rt = self.runtime
        assert rt is not None
        rows = range(fwd.B) if at is None else at
        spans = [(fwd.requests[i].id, 0, fwd.old_len[i]) for i in rows]
        self.counters.add("prefill_host_bytes_h2d", sum(s[2] for s in spans) * rt.pool.row_bytes)
        return self.pool_rows(layer, spans)

    def indexer(self, layer: int, fwd: ForwardPlan) -> IndexerView | None:
        assert self.runtime is not None
        return self.index.view(layer, fwd, self.runtime.top_k)

    def read(
        self, layer: int, requests: Sequence[Request], part: str, start: int = 0, *, stored: bool = False
    ) -> list[torch.Tensor] | None:
        """The requests' rows from ``start`` on from the host pool (every row is appended there; copied host-to-device on
        the runtime's ``h2d`` stream, after the layer's appends so far landed) or the device indexer
        cache. ``stored``: FP8 rows as the pool keeps them (``uint8 [n, W]`` for ``"kv_c"``). ``RuntimeError``
        when the pool keeps the main KV in another dtype than the model's and ``stored`` is not set."""
        rt, spec = self.runtime, self.spec
        if rt is None:
            return None
        if part == "index_k":
            keys = self.index.read_stored if stored else self.index.read_keys
            return [k[start:] for k in keys(layer, requests)]
        pool = rt.pool
        if self.fp8 and not stored:
            raise RuntimeError(
                f"the host pool keeps the main KV as FP8 rows (sparse.kv_dtype={FP8_KV!r}), which do not give "
                "the model's latent KV back exactly; use the model's dtype to read it"
            )
        if pool.dtype != spec.dtype and not self.fp8:
            raise RuntimeError(
                f"the host pool keeps the main KV in {pool.dtype} (sparse.kv_dtype), not in the model's "
                f"{spec.dtype}: its rows do not give the model's values back exactly"
            )
        at = 0 if part == "kv_c" else 1
        return [rows[at] for rows in self.pool_rows(layer, [(r.id, start, r.length) for r in requests])]

    def pool_rows(
        self, layer: int, spans: Sequence[tuple[int, int, int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies on the device of each ``(request id, start, end)``'s host-pool rows of positions ``start ..
        end - 1`` of ``layer`` (``kv_c``, ``k_pe``), after the layer's appends so far landed, on the
        runtime's ``h2d`` stream."""
        rt, device = self.runtime, self.spec.device
        assert rt is not None
        rt.wait_rows(layer)  # the appends so far are in the pool (a TP reader: the writer published them)
        pool = rt.pool
        host_c, host_pe = pool.rows(layer)
        out: list[tuple[torch.Tensor, torch.Tensor]] = []

        def copy() -> None:  # indexing gathers into a new tensor: the pool is never handed out
            for rid, a, b in spans:
                slots = pool.slots(rid, torch.arange(a, b))
                out.append((host_c[slots].to(device), host_pe[slots].to(device)))

        rt.transfer_streams["h2d"].submit(copy, inline=True).wait()
        return out

    def attend(self, layer: int, fwd: ForwardPlan, q: Queries) -> torch.Tensor | None:
        """The fused decode step (indexer + residency + Copy-SFA) over the host pool and hot buffers."""
        if not fwd.decode:
            return None
        step = self.offload_step(layer, fwd, q)
        self._last_step = (layer, fwd, step)
        return step.out

    def offload_step(
        self, layer: int, fwd: ForwardPlan, q: Queries, at: Sequence[int] | None = None
    ) -> StepResult:
        """The fused decode step of ``layer`` for the decode rows ``at`` of ``fwd`` (default: every row; a
        decode forward has one query per request, so a row is a request and its query)."""
        rt, layout = self.runtime, self._layout
        assert rt is not None and layout is not None and q.index_q is not None and q.index_weights is not None
        sub = fwd.memo.get(("sparse_sub", None if at is None else tuple(at)))
        if sub is None:  # the step's per-forward inputs, the same tensors for every layer
            ids = fwd.request_ids if at is None else [fwd.request_ids[i] for i in at]
            index_table = self.index.fwd_table(fwd)
            pick = None if at is None else torch.tensor(at, dtype=torch.int64, device=index_table.device)
            tables = (index_table, fwd.cu_seqlens_q, fwd.seq_lens_k)
            if pick is not None:
                cu = torch.arange(len(at) + 1, dtype=torch.int32, device=fwd.cu_seqlens_q.device)
                tables = (index_table[pick], cu, fwd.seq_lens_k[pick])
            sub = fwd.memo[("sparse_sub", None if at is None else tuple(at))] = [ids, pick, tables, None]
        ids, pick, (index_table, cu_seqlens_q, seq_lens_k), rows = sub
        index_q, weights, q_nope, q_pe = q.index_q, q.index_weights, q.q_nope, q.q_pe
        if pick is not None:
            index_q, weights, q_nope, q_pe = index_q[pick], weights[pick], q_nope[pick], q_pe[pick]
        cache = self.index.layers[layer]
        common = dict(q=index_q, weights=weights, block_table=index_table,
                      cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k)  # fmt: skip
        if self.index.fmt == "int8":
            indexer = IndexerInputs(**common, k_int8_cache=cache[0], k_scale_cache=cache[1])
        elif self.index.fmt == "fp8_e4m3":
            indexer = IndexerInputs(**common, k_fp8_rows=cache[0])
        else:
            common["q"] = index_q.to(cache[0].dtype)
            indexer = IndexerInputs(**common, k_cache=cache[0])
        if rows is None or rows.epoch != rt.epoch:  # e.g. a copy-on-write changed a block table
            stable = fwd.new_len if at is None else [fwd.new_len[i] for i in at]
            decode_rows = DecodeRows(
                request_ids=torch.tensor(ids, dtype=torch.int64),
                stable_len=torch.tensor(stable, dtype=torch.int64),
                host_block_table=rt.pool.block_table(ids, max_blocks=layout.blocks_per_request),
            )
            rows = sub[3] = rt.check_rows(decode_rows, cu_seqlens_q, seq_lens_k)
        return rt.attend(layer, q_nope.contiguous(), q_pe.contiguous(), q.scale, indexer, rows)

    def attended(self, layer: int, fwd: ForwardPlan) -> SelectedRows | None:
        """The rows the decode step of ``layer`` just read: its top-k positions and their hot-buffer rows
        (the residency slots it attended over)."""
        last = self._last_step
        if last is None or last[0] != layer or last[1] is not fwd or self.runtime is None:
            return None
        return self.step_rows(layer, last[2])

    def step_rows(self, layer: int, step: StepResult) -> SelectedRows:
        """The rows decode step ``step`` of ``layer`` read: its top-k positions and their hot-buffer rows."""
        rt = self.runtime
        assert rt is not None
        slots = step.residency.slots.long()  # [T, K], -1 where the top-k entry is -1
        rows = torch.tensor(step.rows, dtype=torch.int64, device=slots.device)[:, None]
        at = slots.clamp(min=0)
        positions = torch.where(slots >= 0, step.topk.long(), -1)
        if self.fp8:
            return SelectedRows(
                positions, *dequantize_rows(rt.hot_kv_c[layer][rows, at], self.spec.kv_lora_rank)
            )
        return SelectedRows(positions, rt.hot_kv_c[layer][rows, at], rt.hot_k_pe[layer][rows, at])

    # ------------------------------------------------------------------------------ accounting
    def device_tensors(self) -> list[torch.Tensor]:
        rt = self.runtime
        hot = [*rt.hot_kv_c, *rt.hot_k_pe] if rt is not None else []
        return hot + self.index.tensors()

    def stats(self) -> dict[str, float]:
        """The runtimes' counters, and the host pool: ``host_pool_bytes`` (the pool this rank allocated:
        its own, or on TP rank 0 the shared one) and ``shared_host_pool_bytes`` (on the other TP ranks:
        the pool they map, allocated by TP rank 0), so that the sum over ranks counts the pool once.
        ``bytes_d2h`` counts the rows this rank copied into the pool (0 on a TP reader)."""
        rt = self.runtime
        sp = self._totals.snapshot(rt)
        pool = rt.pool.nbytes if rt is not None else 0
        return {
            **sp,
            "bytes_h2d": sp["bytes_h2d"] + self.counters.snapshot()["prefill_host_bytes_h2d"],
            "reserved_requests": len(self._reserved),
            "resident_rows": rt.rows_alive if rt is not None else 0,
            "host_pool_bytes": 0 if self._attached is not None else pool,
            "shared_host_pool_bytes": pool if self._attached is not None else 0,
        }


def _shared_runtime(
    tp: TensorParallel, scfg: SparseDecodeConfig, kw: dict, then: Callable[[], None]
) -> tuple[SparseDecodeOffload, HostKVPool | None]:
    """This TP rank's runtime over one host pool shared by the TP group: TP rank 0 creates it (shared
    memory) and writes; the others attach the name it broadcasts and read. ``then`` runs on every rank
    once its runtime exists (the rest of the rank's allocations). Returns the runtime and, on a reader,
    the attached pool (the caller closes it after the runtime).

    Two collectives of ``tp.group`` (every rank of the group calls this in the same resize): the name,
    then every rank's outcome. A rank that failed raises its own error; the others raise a
    ``RuntimeError`` naming it.
    """
    import torch.distributed as dist

    rt: SparseDecodeOffload | None = None
    attached: HostKVPool | None = None
    error: Exception | None = None
    box: list = [None]
    if tp.rank == 0:
        try:
            rt = SparseDecodeOffload(scfg, **kw, shared=True, fence_timeout=FENCE_TIMEOUT_S)
            box = [rt.pool.name]
            then()
        except Exception as exc:  # the readers hear of it below instead of waiting for a name
            error = exc
    dist.broadcast_object_list(box, group=tp.group, group_src=0)
    name = box[0]

    def attach() -> None:
        nonlocal rt, attached
        if error is not None:
            raise error  # rank 0's own failure, before the name was broadcast
        if tp.rank == 0 or name is None:
            return
        row_c, row_pe = scfg.row_dims(kw["kv_lora_rank"], kw["rope_dim"])
        attached = HostKVPool.attach(
            name, num_layers=kw["num_layers"], num_blocks=scfg.host_pool_blocks, block_size=scfg.block_size,
            kv_lora_rank=row_c, rope_dim=row_pe, dtype=scfg.torch_kv_dtype,
        )  # fmt: skip
        rt = SparseDecodeOffload(scfg, **kw, pool=attached, writer=False, fence_timeout=FENCE_TIMEOUT_S)
        then()

    outcomes = exchange_outcomes(tp, attach)
    if not outcomes.failed:
        assert rt is not None
        return rt, attached
    if rt is not None:
        rt.close()
    if attached is not None:
        attached.close()
    outcomes.raise_own()
    what = outcomes.failures()
    hint = ""
    if any(r != 0 for r in outcomes.failed):  # a reader could not attach or allocate
        hint = "; every TP rank must run on the host of TP rank 0 (the pool lives in /dev/shm)"
    raise RuntimeError(
        f"sparse decode offload: the TP group's shared host pool {name or '(not created)'} cannot be used: "
        f"{what}{hint}"
    )
