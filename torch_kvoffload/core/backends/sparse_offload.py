"""``SparseOffloadBackend``: sparse decode offload as a KV backend (DESIGN §7).

Every new row goes to the host pool (:meth:`SparseDecodeOffload.append`); the indexer keys go to the device
:class:`~torch_kvoffload.core.backends.indexer_cache.IndexerCache`. A decode step (one new token per request)
runs the fused indexer + residency + Copy-SFA path (:meth:`SparseDecodeOffload.attend`); a multi-token
forward without the layerwise pipeline attends over its own rows plus, for a chunked prefill, the
requests' earlier rows read from the host pool for that layer only, on the runtime's ``h2d`` transfer
stream (``prefill_host_bytes_h2d``).

Sizes: the host pool holds ``slots * M`` blocks, one range of ``M`` blocks reserved per request at
admission and released when it ends; it keeps the size of a sequence's first forward (growing past a
request's reservation is refused by :meth:`can_grow`). The hot buffers hold ``min(capacity, tokens)``
rows with a top-k of ``min(top_k, tokens)`` (a top-k covering a request's whole context selects what the
configured one would: every row).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from torch_kvoffload.core.backends.indexer_cache import IndexerCache
from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.core.forward import ForwardPlan
from torch_kvoffload.core.kv_backend import IndexerView, KeyRows, KVBackend, NewRows, Queries
from torch_kvoffload.core.layout import KVLayout
from torch_kvoffload.core.requests import Request
from torch_kvoffload.core.spec import ModelSpec
from torch_kvoffload.core.totals import RuntimeTotals
from torch_kvoffload.counters import Counters
from torch_kvoffload.sparse import DecodeRows, IndexerInputs, SparseDecodeOffload
from torch_kvoffload.sparse.step_inputs import CheckedRows

__all__ = ["SparseOffloadBackend"]

# the runtime's counters stats() reports, summed over every runtime the backend built
_TOTALS = ("bytes_h2d", "bytes_d2h", "hits", "misses", "evictions", "fork_shared_blocks", "cow_copies")


class SparseOffloadBackend(KVBackend):
    """Sparse decode offload of ``spec``'s KV under ``config.sparse`` (see the module docstring)."""

    name = "sparse"

    def __init__(self, spec: ModelSpec, config: OffloadConfig) -> None:
        assert config.sparse is not None and config.sparse.offload
        self.spec, self.config = spec, config
        self.runtime: SparseDecodeOffload | None = None
        self.index = IndexerCache(spec, int8=config.sparse.indexer_dtype == "int8")
        self._layout: KVLayout | None = None
        self._configured = (0, 0)  # (top_k, hot capacity) of the configuration, before clipping to a layout
        self._reserved: list[int] = []  # request ids holding host-pool blocks
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this forward's rows per layer
        # per forward (the plan they were made for): the request id of each new row, and a decode
        # forward's request ids, lengths and host block table, checked once for every layer
        self._write_ids: tuple[ForwardPlan, list[int]] | None = None
        self._decode_rows: tuple[ForwardPlan, CheckedRows] | None = None
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
        scfg = self.config.sparse_config(spec, host_pool_blocks=layout.num_blocks)
        self._configured = (scfg.top_k, scfg.hot_capacity)
        k, cap = self._hot_sizes(layout, scfg.top_k, scfg.hot_capacity)
        scfg = scfg.model_copy(update={"top_k": k, "capacity": cap})
        self.runtime = SparseDecodeOffload(
            scfg, num_layers=spec.num_layers, max_rows=layout.slots, kv_lora_rank=spec.kv_lora_rank,
            rope_dim=spec.rope_dim, device=spec.device,
        )  # fmt: skip
        self.index.allocate(layout)

    def free(self) -> None:
        rt, self.runtime = self.runtime, None
        self._reserved = []
        self.index.free()
        if rt is not None:
            self._totals.retire(rt)  # a rebuilt runtime's counters keep counting in stats

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

    def fork(self, layout: KVLayout, src: Request, dst: Request) -> None:
        """``dst`` continues ``src``'s rows: its host-pool table shares ``src``'s full blocks (copy-on-write:
        an append or a truncated beam's rewrite into a shared block copies it first) and gets a copy of
        the partial last one; the indexer-cache pages are copied. ``dst`` holds no hot-buffer rows (its
        first decode step loads what it selects)."""
        rt = self.runtime
        assert rt is not None
        rt.fork(src.id, dst.id, src.length)
        self.index.copy_rows(src.slot, dst.slot, src.length)

    def truncate(self, request: Request, length: int) -> None:
        """Forget ``request``'s hot-buffer rows of positions ``>= length`` in every layer; its pool rows
        there are replaced by the next appends, and the indexer reads at most ``seq_lens_k`` rows."""
        assert self.runtime is not None
        self.runtime.truncate(request.id, length)

    # ------------------------------------------------------------------------------ forwards
    def begin_forward(self, fwd: ForwardPlan) -> None:
        self._rows = {}
        self._decode_rows = self._write_ids = None

    def end_forward(self, fwd: ForwardPlan) -> None:
        self._rows = {}
        self._decode_rows = self._write_ids = None

    # ------------------------------------------------------------------------------ per layer
    def layer_caches(self, layer: int) -> list[torch.Tensor]:
        rt = self.runtime
        if rt is None:
            return []
        return [*self.index.layers[layer], rt.hot_kv_c[layer], rt.hot_k_pe[layer]]

    def write(self, layer: int, fwd: ForwardPlan, rows: NewRows) -> None:
        rt = self.runtime
        assert rt is not None and rows.index_k is not None
        if self._write_ids is None or self._write_ids[0] is not fwd:
            self._write_ids = (fwd, [fwd.requests[r].id for r in fwd.row.tolist()])
        rt.append(layer, self._write_ids[1], fwd.pos, rows.kv_c, rows.k_pe)
        self.index.write_keys(layer, fwd.index_phys, rows.index_k)
        if not fwd.decode and not fwd.layerwise:
            self._rows[layer] = (rows.kv_c, rows.k_pe)

    def keys(self, layer: int, fwd: ForwardPlan) -> KeyRows | None:
        """A multi-token forward's own rows, after each request's earlier rows read from the host pool."""
        if fwd.decode or layer not in self._rows:
            return None
        rt, spec = self.runtime, self.spec
        assert rt is not None
        rows_c, rows_pe = self._rows[layer]
        if fwd.first:
            n_new = [n - o for o, n in zip(fwd.old_len, fwd.new_len, strict=True)]
            return KeyRows(rows_c, rows_pe, [0, *itertools.accumulate(n_new)][:-1])
        rt.sync()  # the appends of earlier forwards are in the pool
        pool = rt.pool
        host_c = pool.kv_c(layer).reshape(-1, spec.kv_lora_rank)
        host_pe = pool.k_pe(layer).reshape(-1, spec.rope_dim)
        earlier: list[tuple[torch.Tensor, torch.Tensor]] = []

        def read() -> None:
            for r, old in enumerate(fwd.old_len):
                slots = pool.slots(fwd.requests[r].id, torch.arange(old))
                earlier.append((host_c[slots].to(spec.device), host_pe[slots].to(spec.device)))

        rt.transfer_streams["h2d"].submit(read, inline=True).wait()
        parts_c, parts_pe, starts, off, pos = [], [], [], 0, 0
        for r, (old, new) in enumerate(zip(fwd.old_len, fwd.new_len, strict=True)):
            parts_c += [earlier[r][0], rows_c[pos : pos + new - old]]
            parts_pe += [earlier[r][1], rows_pe[pos : pos + new - old]]
            self.counters.add("prefill_host_bytes_h2d", old * pool.row_bytes)
            starts.append(off)
            off += new
            pos += new - old
        return KeyRows(torch.cat(parts_c), torch.cat(parts_pe), starts)

    def indexer(self, layer: int, fwd: ForwardPlan) -> IndexerView | None:
        assert self.runtime is not None
        return self.index.view(layer, fwd, self.runtime.top_k)

    def attend(self, layer: int, fwd: ForwardPlan, q: Queries) -> torch.Tensor | None:
        """The fused decode step (indexer + residency + Copy-SFA) over the host pool and hot buffers."""
        if not fwd.decode:
            return None
        rt, layout = self.runtime, self._layout
        assert rt is not None and layout is not None and q.index_q is not None and q.index_weights is not None
        cache = self.index.layers[layer]
        common = dict(q=q.index_q, weights=q.index_weights, block_table=fwd.index_table,
                      cu_seqlens_q=fwd.cu_seqlens_q, seq_lens_k=fwd.seq_lens_k)  # fmt: skip
        if self.index.int8:
            indexer = IndexerInputs(**common, k_int8_cache=cache[0], k_scale_cache=cache[1])
        else:
            common["q"] = q.index_q.to(cache[0].dtype)
            indexer = IndexerInputs(**common, k_cache=cache[0])
        stale = self._decode_rows is None or self._decode_rows[0] is not fwd
        if stale or self._decode_rows[1].epoch != rt.epoch:  # e.g. a copy-on-write changed a block table
            ids = fwd.request_ids
            decode_rows = DecodeRows(
                request_ids=torch.tensor(ids, dtype=torch.int64),
                stable_len=torch.tensor(fwd.new_len, dtype=torch.int64),
                host_block_table=rt.pool.block_table(ids, max_blocks=layout.blocks_per_request),
            )
            self._decode_rows = (fwd, rt.check_rows(decode_rows, fwd.cu_seqlens_q, fwd.seq_lens_k))
        rows = self._decode_rows[1]
        return rt.attend(layer, q.q_nope.contiguous(), q.q_pe.contiguous(), q.scale, indexer, rows).out

    # ------------------------------------------------------------------------------ accounting
    def device_tensors(self) -> list[torch.Tensor]:
        rt = self.runtime
        hot = [*rt.hot_kv_c, *rt.hot_k_pe] if rt is not None else []
        return hot + self.index.tensors()

    def stats(self) -> dict[str, float]:
        sp = self._totals.snapshot(self.runtime)
        return {
            **sp,
            "bytes_h2d": sp["bytes_h2d"] + self.counters.snapshot()["prefill_host_bytes_h2d"],
            "reserved_requests": len(self._reserved),
            "resident_rows": self.runtime.rows_alive if self.runtime is not None else 0,
        }
