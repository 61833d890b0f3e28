"""``HybridSparseBackend``: sparse attention whose requests keep their latent KV resident while it fits in
one device budget and are spilled to the host pool when it does not (``sparse={"offload": "auto"}``).

Every request has a host-pool reservation and indexer-cache rows from admission. The device KV budget
(:mod:`.hybrid_sizing`) holds those, the other backends' caches, and is shared between a pool of blocks
(:class:`~torch_kvoffload.sparse.device_blocks.DeviceBlocks`) holding the *resident* requests' latent rows
and hot buffers for the *offloaded* ones, whose rows live in the host pool and whose decode steps run
sparse decode offload's fused step (only the misses copied). Admission counts the offloaded footprint.

Where a row lives never changes a token: both kinds select with the same indexer over the same indexer
cache and attend over the same rows with the same sparse attention arithmetic (the resident rows in place,
the offloaded ones after their copy into the hot buffers).

Decided when a forward (or a part of a mixed one) begins, never inside one (:mod:`.placement`): a
request's first forward claims blocks (it starts resident), a resident one the blocks its new rows need;
while the claims do not fit the longest context gives way (*spilled*: its rows the host pool lacks copied
there, whole blocks; or a new one starts offloaded); then offloaded requests are *promoted*, shortest
first, while they fit: their host rows are copied into blocks layer by layer during the forward, on the
transfer stream, each layer's before that layer computes (:mod:`.hybrid_moves`). The forward's per-layer
reads and writes are :class:`~torch_kvoffload.sparse.hybrid_layers.HybridLayers`'. A resident request
writes its rows to its blocks only (``_host_len``: the leading rows the host pool already holds, so a request spilled again
copies only what it wrote since). A failed spill or promotion leaves the request where it was (counted in
``spill_failures`` / ``promote_failures``); the forward that needed it raises.

Tensor parallelism: the ranks share the host pool and take the same decisions over their own device pools:
they agree on one budget at each sizing (the smallest) and, after a forward's moves, on whether every
rank's succeeded; a move failed on any rank fails the forward on all and the live requests cannot continue
(caches rebuilt, on every rank, when the last of them ends: a server goes on). P/D decode:
a received request starts offloaded (:meth:`received`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.kv.backend import KVBackend
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.group_outcomes import exchange_outcomes
from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.sparse.block_indexer import BlockIndexerCache
from torch_kvoffload.sparse.config import SparseOptions
from torch_kvoffload.sparse.device_blocks import DeviceBlocks
from torch_kvoffload.sparse.hybrid_layers import HybridLayers
from torch_kvoffload.sparse.hybrid_moves import PromotionLanding, rows_to_host
from torch_kvoffload.sparse.hybrid_sizing import check_options, chunk, device_budget, fit
from torch_kvoffload.sparse.placement import DeviceBudget, plan_pressure, plan_promotions
from torch_kvoffload.sparse.resident_backend import resident_rows

logger = logging.getLogger(__name__)

__all__ = ["HybridSparseBackend"]


_COUNTERS = (
    "spills", "promotions", "spill_bytes_d2h", "promote_bytes_h2d", "spill_failures", "promote_failures",
    "started_offloaded",
)  # fmt: skip


class HybridSparseBackend(HybridLayers):
    """Sparse attention over ``spec``'s KV, resident while it fits in ``budget`` bytes of device KV
    (``None``: what is free on the device), offloaded when it does not (see the module docstring).

    ``ValueError`` at construction when ``sparse.kv_dtype`` is neither the model's dtype nor ``"fp8_e4m3"``
    (a resident and an offloaded row must be the same bytes), or when ``budget`` cannot hold even the hot
    buffers and indexer rows of one request of ``capacity`` tokens. ``receives``: a P/D decode node."""

    name = "hybrid sparse"
    #: what :meth:`stats` adds to sparse decode offload's
    STATS = (*_COUNTERS, "resident_requests", "offloaded_requests", "resident_pool_blocks",
             "resident_pool_free_blocks", "offloaded_kv_bytes", "resident_kv_bytes_wanted")  # fmt: skip

    def __init__(
        self, spec: ModelSpec, options: SparseOptions, *, block_size: int, budget: int | None,
        receives: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(spec, options, block_size=block_size)
        self.index = BlockIndexerCache(spec, options.indexer_dtype or "bf16", block_size)
        # a resident and an offloaded row are the same bytes: the model's, or FP8 rows
        main = resident_rows(spec, options.kv_dtype, "offload='auto'")
        self.blocks = DeviceBlocks(spec.num_layers, main, block_size, spec.device)
        self.budget = budget
        self.receives = receives  # transfers land indexer keys in the pool: it never moves
        check_options(spec, options, budget, self.blocks.block_bytes // block_size,
                      self.index.blocks.block_bytes // block_size)  # fmt: skip
        #: the model's other backends, whose device caches take from the same budget (set by build_backends)
        self.others: list[KVBackend] = []
        self._requests: dict[int, Request] = {}
        self._written: dict[int, int] = {}  # rows each request wrote (its forwards that ended)
        self._host_len: dict[int, int] = {}  # leading rows the host pool holds, per request
        self._offloaded: set[int] = set()
        self.hybrid = Counters(_COUNTERS)
        # the last decode step of a forward with resident rows: (layer, plan, top-k, block rows, offloaded step)
        self._last_hybrid: tuple | None = None
        self._no_pool = False
        self._freed = True  # blocks came free since the last decisions (a promotion may fit)
        self._sizes = (0, 0)  # (the offloaded footprint of every slot, the pool of every request resident)
        self._budget: DeviceBudget | None = None  # of the current layout
        self._diverged: str | None = None  # a move failed on a TP rank: what to tell the next forwards
        self._pending: dict[int, int] = {}  # promoted in this forward: request id -> host rows to copy
        self._landing: PromotionLanding | None = None  # their copies, from the forward's first layer on

    # -------------------------------------------------------------------------------- sizing
    @contextlib.contextmanager
    def without_pool(self) -> Iterator[None]:
        """Within: caches sized without the resident pool (to measure the requests' offloaded footprint)."""
        self._no_pool = True
        try:
            yield
        finally:
            self._no_pool = False

    def hot_rows(self, layout: KVLayout) -> int:
        """Hot rows to start with: one chunk (every slot's while measuring the offloaded footprint)."""
        return layout.slots if self._no_pool else min(layout.slots, chunk(layout.slots))

    def _index_need(self, grow: dict[int, int]) -> int:
        """Indexer blocks the live requests hold once the requests in ``grow`` (slot → rows) have theirs."""
        index = self.index.blocks
        held = {r.slot: index.held(r.slot) for r in self._requests.values()}
        for slot, n in grow.items():
            held[slot] = max(held.get(slot, 0), index.blocks_for(n))
        return sum(held.values())

    def _fit(self, index_need: int, offloaded: int | None = None) -> None:
        assert self.runtime is not None and self._budget is not None and self._layout is not None
        n = len(self._offloaded) if offloaded is None else offloaded
        fit(self.runtime, self.blocks, self.index.blocks, self._budget, self._layout, n, index_need)

    def _make_room(self, grow: dict[int, int]) -> int:
        """Spill the longest resident requests until the indexer rows of ``grow`` (slot → rows) fit; returns
        the indexer blocks then needed (sizes not yet fitted)."""
        assert self._budget is not None
        need = self._index_need(grow)
        spill, _, _ = plan_pressure(
            self.blocks, self._budget, {}, self._written, (), len(self._offloaded), need
        )
        if spill:  # the longest first
            self._moved("spill", lambda: [self._spill(rid) for rid in spill])
        return need

    def resize(self, layout: KVLayout, live: Sequence[Request]) -> None:
        super().resize(layout, live)
        if not live:
            self._forget()
        index = self.index.blocks
        if self._no_pool:  # every slot's full indexer rows and hot buffers: the offloaded footprint
            self._budget = None
            index.allocate(layout.slots * index.blocks_for(layout.tokens))
            return
        rest, runtime = sum(t.nbytes for b in self.others for t in b.device_tensors()), self.runtime
        assert runtime is not None
        sized = exchange_outcomes(
            self.spec.tp,
            lambda: device_budget(self.budget, layout, runtime, self.blocks, index, rest, self.receives),
        ).values_or_raise("hybrid sparse: sizing")
        self._budget, self._sizes = min(sized, key=lambda s: s[0].total)  # TP: the smallest budget
        self._freed = True
        self._fit(self._make_room({}))

    def _forget(self) -> None:
        self._freed, self._diverged = True, None
        self.blocks.free()
        for c in (self._requests, self._written, self._host_len, self._offloaded):
            c.clear()

    def free(self) -> None:
        try:
            super().free()
        finally:
            self._forget()

    # ------------------------------------------------------------------------------ requests
    def admit(self, layout: KVLayout, requests: Sequence[Request]) -> None:
        super().admit(layout, requests)
        for r in requests:
            self._requests[r.id], self._written[r.id], self._host_len[r.id] = r, 0, 0

    def received(self, request: Request, length: int) -> None:
        """A P/D transfer places ``request``'s first ``length`` rows in the host pool and its indexer keys in
        the blocks it gets here: it starts offloaded, promoted when space allows."""
        if not self.index.blocks.ensure(request.slot, length):  # the pool holds every slot's full rows
            raise RuntimeError(f"hybrid sparse: no indexer blocks for {length} received rows")
        self._written[request.id] = self._host_len[request.id] = length
        self._offloaded.add(request.id)
        self._freed = True

    def release(self, request_ids: Sequence[int]) -> None:
        self._freed = True
        for rid in request_ids:
            if rid in self._requests:
                self.index.blocks.drop(self._requests[rid].slot)
            self.blocks.drop(rid)
            self._offloaded.discard(rid)
            for d in (self._requests, self._written, self._host_len):
                d.pop(rid, None)
        super().release(request_ids)
        if self._diverged is not None and not self._requests and self._layout is not None:
            self.resize(self._layout, [])  # TP ranks in lock step: a new shared pool, placements agree again

    def fork(self, layout: KVLayout, src: Request, dst: Request, length: int) -> None:
        """``dst`` continues ``src``: resident when ``src`` is and its blocks fit (rows copied on the device),
        else offloaded (``src``'s rows brought into the host pool first, then shared copy-on-write)."""
        budget = self._budget
        assert budget is not None
        need = self._make_room({dst.slot: length})
        self._fit(need)
        self.index.copy_rows(src.slot, dst.slot, length)
        self._written[dst.id] = length
        if self.blocks.holds(src.id) and plan_promotions(
            self.blocks, budget, {dst.id: length}, len(self._offloaded) + 1, need
        ):
            self.blocks.ensure(dst.id, length)
            self.blocks.copy_rows(src.id, dst.id, length)
            return
        if self.blocks.holds(src.id):
            self._moved("spill", lambda: self._to_host(src.id, length))
        assert self.runtime is not None
        self.runtime.fork(src.id, dst.id, length)
        self._host_len[dst.id] = length
        if length:
            self._offloaded.add(dst.id)

    def truncate(self, request: Request, length: int) -> None:
        super().truncate(request, length)
        rid = request.id
        self._written[rid] = min(self._written.get(rid, 0), length)
        self._host_len[rid] = min(self._host_len.get(rid, 0), length)
        self._freed = True
        self.blocks.shrink(rid, length)
        self.index.blocks.shrink(request.slot, length)

    # ---------------------------------------------------------------------- spill / promote
    def _to_host(self, rid: int, upto: int) -> int:
        """Copy ``rid``'s resident rows the host pool lacks (``_host_len .. upto - 1``) there; the bytes."""
        assert self.runtime is not None
        moved = rows_to_host(self.runtime, self.blocks, rid, self._host_len.get(rid, 0), upto, fp8=self.fp8)
        self._host_len[rid] = max(upto, self._host_len.get(rid, 0))
        return moved

    def _spill(self, rid: int) -> None:
        """Move resident ``rid`` to the host pool (its rows the pool lacks copied, its blocks freed)."""
        try:
            moved = self._to_host(rid, self._written.get(rid, 0))
        except BaseException:
            self.hybrid.add("spill_failures")
            raise
        self.blocks.drop(rid)
        self._offloaded.add(rid)
        self.hybrid.add("spills")
        self.hybrid.add("spill_bytes_d2h", moved)
        logger.debug("hybrid sparse: request %d spilled to the host pool (%d bytes)", rid, moved)

    def _promote(self, promote: Sequence[tuple[int, int]], *, now: bool) -> None:
        """Offloaded requests (id, rows to hold) become resident: blocks now, their host rows copied ``now``
        (every layer before the forward) or layer by layer during it (:meth:`HybridLayers._land`)."""
        for rid, n in promote:
            assert self.blocks.ensure(rid, n)
            self._offloaded.discard(rid)
            self._pending[rid] = self._written.get(rid, 0)
        if now:
            landing = self._current_landing()
            assert landing is not None
            try:
                landing.run()
            except BaseException:
                landing.failed = True
                self._promoted(landing, False)
                raise
            self._promoted(landing, True)

    def _land_all(self) -> None:
        """The forward ended: its promotions complete (a layer no compute asked for is copied now; if that
        fails, the rows the forward wrote to the requests' blocks go to the host pool and they stay
        offloaded)."""
        landing = self._current_landing()
        if landing is None:
            return
        try:
            landing.finish()
        except Exception as exc:
            landing.cancel()
            landing.failed = True
            logger.warning("hybrid sparse: a promotion failed (%s); its requests stay offloaded", exc)
            for rid in landing.request_ids:
                self._to_host(rid, self._requests[rid].length)
            self._promoted(landing, False)
        else:
            self._promoted(landing, True)

    def _promoted(self, landing: PromotionLanding, ok: bool) -> None:
        """``landing``'s promotion completed (``ok``) or not (failed, or its forward did): its requests
        offloaded again, their blocks given up."""
        self._landing = None
        if ok:
            self.hybrid.add("promotions", len(landing.request_ids))
            self.hybrid.add("promote_bytes_h2d", landing.bytes)
            return
        if landing.failed:
            self.hybrid.add("promote_failures")
        self._freed = True  # the next forward sizes their hot rows and may promote them again
        for rid in landing.request_ids:
            self.blocks.drop(rid)
            self._offloaded.add(rid)

    def _place(self, fwd: ForwardPlan) -> None:
        """Decide where each request of ``fwd`` runs, spilling and promoting (:mod:`.placement`), fit the
        pools and hot rows to the decisions, give the requests their blocks."""
        budget = self._budget
        assert budget is not None, "HybridSparseBackend: a forward while measuring the offloaded footprint"
        index, rows = self.index.blocks, zip(fwd.request_ids, fwd.slots, fwd.new_len, strict=True)
        if not self._freed and all(
            index.need(slot, n) == 0 and (rid in self._offloaded or self.blocks.need(rid, n) == 0)
            for rid, slot, n in rows
        ):
            return  # no block claimed, none came free since the last decisions: nothing would change
        tokens = dict(zip(fwd.request_ids, fwd.new_len, strict=True))
        need = self._index_need(dict(zip(fwd.slots, fwd.new_len, strict=True)))
        claims = {rid: n for rid, n in tokens.items() if rid not in self._offloaded}
        spill, start, kept = plan_pressure(
            self.blocks, budget, claims, self._written, (), len(self._offloaded), need
        )
        if spill:
            self._moved("spill", lambda: [self._spill(rid) for rid in spill])
        for rid in start:
            self._offloaded.add(rid)
            self.hybrid.add("started_offloaded")
        self._fit(need)
        for slot, n in zip(fwd.slots, fwd.new_len, strict=True):
            assert self.index.blocks.ensure(slot, n)
        for rid, n in kept.items():
            assert self.blocks.ensure(rid, n)
        # a request's length counts the tokens of this forward (of any part)
        waiting = {r: self._requests[r].length for r in self._offloaded if r not in spill}
        promote = plan_promotions(self.blocks, budget, waiting, len(self._offloaded), need)
        if promote:
            self._fit(need, len(self._offloaded) - len(promote))  # the pool grows first
            if self.spec.tp is not None and self.spec.tp.size > 1:  # every rank's outcome before compute
                self._moved("promotion", lambda: self._promote(promote, now=True))
            else:
                self._promote(promote, now=False)
        self._freed = False  # decisions complete (a failure above leaves the next forward deciding again)

    def _moved(self, what: str, moves: Callable[[], object]) -> None:
        """Run ``moves``; under TP every rank learns whether every rank's succeeded (see the module docstring)."""
        try:
            exchange_outcomes(self.spec.tp, moves).values_or_raise(f"hybrid sparse: a {what}")
        except Exception as exc:
            if self.spec.tp is not None and self.spec.tp.size > 1:
                self._diverged = f"a {what} failed ({type(exc).__name__}: {exc})"
            raise

    # ------------------------------------------------------------------------------ forwards
    def begin_forward(self, fwd: ForwardPlan) -> None:
        if self._diverged is not None:
            raise RuntimeError(
                f"hybrid sparse: {self._diverged} in an earlier forward of this sequence; the TP ranks may now "
                "place its requests differently, so they cannot continue: start a new sequence"
            )
        super().begin_forward(fwd)
        self._last_hybrid = None
        self._place(fwd)

    def end_forward(self, fwd: ForwardPlan) -> None:
        try:
            self._land_all()
            super().end_forward(fwd)
        finally:
            for rid, n in zip(fwd.request_ids, fwd.new_len, strict=True):
                if rid in self._written:
                    self._written[rid] = n
                    if rid in self._offloaded:
                        self._host_len[rid] = n

    def abort_forward(self, fwd: ForwardPlan) -> None:
        """The forward's rows count as never written (its requests keep their earlier rows); a promotion
        under way is given up (its requests stay offloaded)."""
        landing = self._current_landing()
        if landing is not None:
            landing.cancel()
            self._promoted(landing, False)
        try:
            super().end_forward(fwd)  # sparse offload's: this class's would count the rows as written
        finally:
            for rid, old in zip(fwd.request_ids, fwd.old_len, strict=True):
                if rid in self._host_len:
                    self._host_len[rid] = min(self._host_len[rid], old)

    # ------------------------------------------------------------------------------ accounting
    def device_tensors(self) -> list[torch.Tensor]:
        return super().device_tensors() + self.blocks.tensors()

    def stats(self) -> dict[str, float]:
        """Sparse decode offload's counters and :attr:`STATS`: requests resident / offloaded now, spills and
        promotions (bytes, failures), requests whose first rows did not fit, the latent pool's blocks; at the
        last sizing the offloaded footprint of every slot and the pool every request resident would take."""
        return {
            **super().stats(),
            **self.hybrid.snapshot(),
            "resident_requests": len(self.blocks.holders()),
            "offloaded_requests": len(self._offloaded),
            "resident_pool_blocks": self.blocks.num_blocks,
            "resident_pool_free_blocks": self.blocks.free_blocks,
            "offloaded_kv_bytes": self._sizes[0],
            "resident_kv_bytes_wanted": self._sizes[1],
        }
