"""Prefix reuse: a new request starts with the leading tokens of its prompt whose KV the store already holds.

A request's prompt is looked up once (:meth:`PrefixReuse.lookup`: the store's chained block
hashes over the token ids and the model positions, every layer; whole blocks, at least one token left to
compute, so the last prompt position still yields its logits). The caller then *adopts* a prefix of each
new request no longer than what was found (:meth:`PrefixReuse.adopt`): the request holds those tokens
without a forward. A layerwise backend reads them from the store when the next forward needs them (as it
reads any earlier tokens), the rows of a partial last block going into its device tail now; every other
backend that keeps a request's rows (the sparse host pool and device indexer cache, a resident KV) is
written the stored rows layer by layer, as a forward would write them, in rounds of
:data:`ROUND_BLOCKS` blocks per request (the host holds one round of rows at a time). The model then
computes only the rest of the prompt.

A running request is a tier too: when one holds the whole blocks a new prompt starts with (at the same
positions), the new request takes them from it (:meth:`KVBackend.fork` of that many rows: the sparse host
pool shares the blocks copy-on-write, a resident KV or the indexer cache copies rows on the device, a KVPP
rank its owned layers' rows) instead of reading the store; without layerwise offload, whose pipeline reads
every prefix from the store, the lookup counts what a running request holds too, so blocks the store
lost are still found while a request holds them.

The latent KV and the indexer keys of a prefix are one unit: with prefix reuse the store keeps the indexer
keys beside the latent KV (``core.backends``), and a store namespace without them is never looked up for a
model with an indexer.

The store is the layerwise backend's (its pipeline saves every full block as the layers run) or, for a
model with sparse offload, a resident KV or KVPP and no layerwise offload, the
:class:`~torch_kvoffload.layerwise.prefix_store.PrefixStore`: after each forward the core stores the full
blocks it completed there, read back from the backend that holds them (:meth:`PrefixReuse.store_completed`).
A KVPP rank stores and takes over its owned layers only; the next forward's broadcasts bring the taken-over
rows to the other ranks, as they bring any earlier rows.

Reuse is on with ``OffloadConfig.prefix_cache`` and a store, on a P/D prefill node too (it computes only
the uncached suffix; the whole prompt's KV is sent from the layer buffers, which hold the prefix's blocks
as loaded from the store) but not a decode node (:attr:`PrefixReuse.enabled`); otherwise every lookup
finds nothing. Under tensor parallelism or KVPP the ranks take the same prefix over, or none does
(:meth:`PrefixReuse.agree`, :meth:`PrefixReuse.together`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.kv.backend import NewRows
from torch_kvoffload.kv.forward import plan_packed
from torch_kvoffload.kv.group_outcomes import exchange_outcomes
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import TensorParallel

logger = logging.getLogger(__name__)

__all__ = ["ROUND_BLOCKS", "PrefixReuse", "shared_prefix"]

#: Blocks per request whose stored rows one round of :meth:`PrefixReuse.adopt` holds on the host.
ROUND_BLOCKS = 32

_COUNTERS = (
    "prefix_lookups", "prefix_lookup_seconds", "prompt_tokens", "prefix_store_tokens", "prefix_fallbacks",
    "persisted_blocks", "persist_failures", "prefix_waits", "prefix_live_tokens", "shared_prefix_tokens",
)  # fmt: skip


def _host_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` on the host, floating ones in ``dtype`` (an FP8 indexer cache's byte rows as they are)."""
    return rows.to("cpu", dtype) if rows.is_floating_point() else rows.to("cpu")


def shared_prefix(prompt: Sequence[int], other: Sequence[int], block_size: int) -> int:
    """Leading tokens of ``prompt`` in whole blocks of ``block_size`` that ``other`` starts with too: the
    prefix whose stored blocks ``other``'s forward would give ``prompt`` (at most ``len(prompt) - 1``, as
    :meth:`PrefixReuse.lookup` finds)."""
    limit = min(len(prompt) - 1, len(other)) // block_size * block_size
    shared = 0
    while shared < limit and prompt[shared : shared + block_size] == other[shared : shared + block_size]:
        shared += block_size
    return shared


class PrefixReuse:
    """The prefix reuse of ``core`` (see the module docstring). ``counters``: ``prefix_lookups`` and
    ``prefix_lookup_seconds`` (prompts looked up, time spent), ``prompt_tokens`` (tokens of the prompts
    looked up), ``prefix_store_tokens`` (of those, tokens adopted from the store: not computed),
    ``prefix_live_tokens`` (tokens adopted from a running request that held them: not computed either),
    ``prefix_fallbacks`` (prefixes found but not taken over, see :meth:`fell_back`: their prompts were
    computed), ``prefix_waits`` (steps a new continuous-batching request sat out while another request of
    the step computed the prefix they share, which it then adopted)."""

    def __init__(self, core: Any) -> None:  # a KVCore (core.kv imports this module)
        self.core = core
        self.counters = Counters(_COUNTERS)
        # request id -> its full blocks when store_completed last stored them
        self._stored: dict[int, int] = {}

    @property
    def enabled(self) -> bool:
        """Whether lookups may find anything: ``prefix_cache`` on, a store, no P/D role but a prefill
        node's."""
        core = self.core
        b = core.backends
        return (
            core.config.prefix_cache and b.store is not None and (b.role is None or b.role.computes_prompts)
        )

    def _group(self) -> TensorParallel | None:
        """The ranks that take a prefix over together: the tensor-parallel group, else a KVPP group (its
        ranks replicate the model and each stores its owned layers)."""
        core = self.core
        kvpp = core.backends.kvpp
        if core.spec.tp is not None or kvpp is None or kvpp.group.size == 1:
            return core.spec.tp
        g = kvpp.group
        control = g.control_group if g.control_group is not None else g.process_group
        return TensorParallel(g.size, g.local_rank, g.ranks, control)

    def agree(self, found: Sequence[int]) -> list[int]:
        """``found`` (this rank's :meth:`lookup` of each prompt) as every rank of a tensor-parallel group
        takes it over: each prompt's least over the group (each rank stores the KV of its own weight shards
        under keys of its own, so the ranks' stores can differ). A collective of the group; unchanged
        without one."""
        tp = self._group()
        if tp is None or tp.size == 1:
            return list(found)
        gathered = exchange_outcomes(tp, lambda: list(found)).values_or_raise("prefix reuse: the lookup")
        return [min(values) for values in zip(*gathered, strict=True)]

    def together(
        self, adopt: Callable[[], Any], undo: Callable[[], None], recoverable: Collection[str] | None
    ) -> BaseException | None:
        """``adopt()`` on every rank of a tensor-parallel group (a collective; alone without one): the ranks
        take a prefix over together or none does. ``None`` when every rank took it over. Otherwise the ranks
        that did ``undo()`` it, and the error is returned (this rank's own, or one naming the ranks that
        failed) when every failure is of a type named in ``recoverable`` (``None``: any) — every rank then
        computes the prompt — or raised on every rank."""
        names = ("prefix_store_tokens", "prefix_live_tokens")
        counted = {k: self.counters.get(k) for k in names}
        outcome = exchange_outcomes(self._group(), adopt)
        if not outcome.failed:
            return None
        if outcome.error is None:
            undo()
            for k in names:
                self.counters.add(k, counted[k] - self.counters.get(k))
        error = outcome.error or RuntimeError(f"the prefix was not taken over on {outcome.failures()}")
        if recoverable is None or all(kind in recoverable for kind, _ in outcome.failed.values()):
            return error
        outcome.raise_own()
        raise error

    def lookup(self, tokens: Sequence[int], positions: Sequence[int] | None, *, new: bool = True) -> int:
        """Leading tokens of the prompt ``tokens`` (its KV computed at ``positions``; ``None``: token ``t`` at
        ``t``) whose KV and indexer keys every layer has in the store: whole blocks, fewer than
        ``len(tokens)``; 0 when reuse is off. Counts the prompt's tokens unless ``new`` is false (a prompt
        looked up again: a request still waiting for its first step)."""
        if new:
            self.counters.add("prompt_tokens", len(tokens))
        lw = self.core.backends.store
        if not self.enabled or lw is None or len(tokens) < 2:
            return 0
        start = time.perf_counter()
        try:
            found = lw.cached_prefix(tokens, positions)
            # the layerwise pipeline reads every prefix from the store; the others take running requests' too
            if self.core.backends.layerwise is None:
                found = max(found, self._live_match(tokens, positions)[1])
            return found
        finally:
            self.counters.add("prefix_lookups")
            self.counters.add("prefix_lookup_seconds", time.perf_counter() - start)

    def shared_unstored(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """The prefixes to compute once before a batch of new ``prompts`` (token ids, each prompt's token
        ``t`` at position ``t``) starts, so that its rows take them over instead of each computing them: for
        each prompt the longest run of whole blocks it starts with that another prompt of the batch starts
        with too (:func:`shared_prefix`), longest first, none that a kept one starts with, and none the store
        holds already. Empty when reuse is off, on a P/D node (a forward there belongs to its transfers) or
        for fewer than two prompts. Under tensor parallelism or KVPP the store is not asked (the ranks' stores
        differ; every rank must run the same forwards), only the prompts decide."""
        core = self.core
        if not self.enabled or core.backends.role is not None or len(prompts) < 2:
            return []
        bs = core.block_size
        wanted = []
        for i, p in enumerate(prompts):
            n = max((shared_prefix(p, q, bs) for j, q in enumerate(prompts) if j != i), default=0)
            if n:
                wanted.append(list(p[:n]))
        kept: list[list[int]] = []
        for w in sorted(wanted, key=len, reverse=True):
            if not any(k[: len(w)] == w for k in kept):
                kept.append(w)
        lw, group = core.backends.store, self._group()
        if (group is not None and group.size > 1) or lw is None or not kept:
            return kept
        released = not lw.built and core.layout is not None
        if released:  # layerwise buffers released for decode: the store's keys come with them
            lw.rebuild(core.layout)
        try:
            # one token more: the lookup leaves the last token to compute, here past the prefix's last block
            return [w for w in kept if lw.cached_prefix([*w, 0], None) < len(w)]
        finally:
            if released:
                lw.free()

    def adopt(
        self,
        requests: Sequence[Request],
        prompts: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int] | None],
        lengths: Sequence[int],
    ) -> None:
        """Live ``requests`` holding no tokens take the first ``lengths[r]`` tokens of ``prompts[r]`` (at
        ``positions[r]``, the whole prompt's; ``None``: logical) without a forward; ``lengths[r]`` is at
        most what :meth:`lookup` found (any length: a partial last block is read from the stored block
        that holds it). Between forwards only. On any failure (:class:`~torch_kvoffload.layerwise.errors.
        StoreMissError` when the store no longer holds a block) every one of ``requests`` is finished and
        the error propagates."""
        core = self.core
        lw = core.backends.store
        if core.forward is not None:
            raise RuntimeError("PrefixReuse.adopt: a forward is running")
        if lw is None or not self.enabled:
            raise RuntimeError("PrefixReuse.adopt: prefix reuse is off for this model's configuration")
        for r, prompt, n in zip(requests, prompts, lengths, strict=True):
            if r.length or not 0 <= n < len(prompt):
                raise ValueError(
                    f"PrefixReuse.adopt: request {r.id} must hold no tokens and adopt fewer than its prompt's "
                    f"{len(prompt)} tokens; it holds {r.length}, adopts {n}"
                )
        stored = list(lengths)
        try:
            for i, (r, prompt, pos, n) in enumerate(zip(requests, prompts, positions, lengths, strict=True)):
                if not n:
                    continue
                src, held = self._live_match(prompt, pos, requests) if n % core.block_size == 0 else (None, 0)
                if src is not None and held >= n:  # a running request holds these rows: share / copy them
                    for b in core.backends.all:
                        b.fork(core.layout, src, r, n)
                    stored[i] = 0
                core.requests.extend(r.id, prompt[:n])
                r.add_positions(0, None if pos is None else pos[:n])
                lw.adopt(r, prompt, pos)
            self._write_stored(requests, prompts, positions, stored)
        except BaseException:
            core.finish([r.id for r in requests])
            raise
        self.counters.add("prefix_store_tokens", sum(stored))
        self.counters.add("prefix_live_tokens", sum(lengths) - sum(stored))

    def _live_match(
        self, prompt: Sequence[int], positions: Sequence[int] | None, exclude: Collection[Request] = ()
    ) -> tuple[Request | None, int]:
        """The running request (not in ``exclude``) whose tokens, at the same positions, start with the most
        whole blocks of ``prompt`` (at ``positions``; ``None``: logical), and that many tokens (fewer than
        the prompt's); ``(None, 0)`` without one. Not on a P/D node (its role cannot fork), nor with
        layerwise offload alone (it keeps no request's rows between forwards)."""
        core = self.core
        b = core.backends
        # a P/D role cannot fork; layerwise offload alone reads every prefix from the store
        if b.role is not None or core.layout is None or all(x is b.layerwise for x in b.all):
            return None, 0
        bs = core.block_size
        skip = {r.id for r in exclude}
        best: tuple[Request | None, int] = (None, 0)
        for src in core.requests:
            if src.id in skip or not src.keyed or src.length < max(bs, best[1] + bs):
                continue
            n = shared_prefix(prompt, src.tokens, bs)
            if n <= best[1]:
                continue
            mine = list(range(n)) if positions is None else list(positions[:n])
            theirs = list(range(n)) if src.positions is None else src.positions[:n]
            if mine == theirs:
                best = (src, n)
        return best

    def fell_back(self, who: str, exc: BaseException) -> None:
        """A prefix the lookup found could not be read when it was needed (``exc``, naming the block): counted
        in ``prefix_fallbacks`` and logged; the caller computes the whole prompt instead."""
        self.counters.add("prefix_fallbacks")
        logger.warning("%s: %s; the prompt is computed", who, exc)

    def persist(self, requests: Sequence[Request]) -> None:
        """Store the full blocks of ``requests`` the store lacks, before they end: the blocks their decode
        steps completed on a backend that keeps rows elsewhere (the sparse host pool, a resident KV), so
        that a later prompt extending them (the next turn of a conversation) finds them too. Between
        forwards. A failure is logged and counted (``persist_failures``), never raised: a block not stored
        is only a later miss."""
        core = self.core
        lw = core.backends.store
        holders = [b for b in core.backends.all if b is not lw]
        live = [r for r in requests if r.id in core.requests and r.keyed and r.length >= core.block_size]
        if not self.enabled or lw is None or core.layout is None or core.forward is not None or not holders:
            return
        if not live or (lw.indexed and getattr(getattr(holders[0], "index", None), "int8", False)):
            return  # int8 indexer keys do not give the model's keys back: those blocks stay unstored
        released = not lw.built
        lw.rebuild(core.layout)  # released for decode: the store's keys and record layouts come with it
        try:
            self._persist(lw, holders[0], live)
        finally:
            if released:
                lw.free()

    def store_completed(self, requests: Sequence[Request]) -> None:
        """With the :class:`~torch_kvoffload.layerwise.prefix_store.PrefixStore` (no layerwise pipeline saves
        blocks as the layers run): :meth:`persist` the requests of a forward that just ended whose count of
        full blocks changed since they were last stored, so that a later prompt finds the blocks of this
        one while it still runs. Between forwards; never raises."""
        core = self.core
        if core.backends.prefix_store is None or not self.enabled:
            return
        bs = core.block_size
        due = [r for r in requests if r.keyed and r.length // bs != self._stored.get(r.id, 0)]
        self._stored = {rid: n for rid, n in self._stored.items() if rid in core.requests}
        for r in due:
            self._stored[r.id] = r.length // bs
        if due:
            self.persist(due)

    def _persist(self, lw: Any, holder: Any, live: Sequence[Request]) -> None:
        core = self.core
        bs, spec = core.block_size, core.spec
        parts = lw.parts  # the records' components (FP8 latent rows hold their RoPE values)
        # rows as the holder keeps them only where the records hold that format (FP8 rows); the records
        # take the model's values otherwise, which an FP8 cache refuses
        stored = {"kv_c": lw.kv_fp8, "k_pe": False, "index_k": lw.index_fp8}
        for r in live:
            full = r.length // bs
            try:
                have = lw.stored_blocks(r)
                if have >= full:
                    continue
                rows = []
                for layer in lw.layers:
                    read = [holder.read(layer, [r], p, start=have * bs, stored=stored[p]) for p in parts]
                    if any(x is None for x in read):
                        return  # the holder keeps no such rows
                    n = (full - have) * bs  # FP8 rows stay bytes
                    rows.append([_host_rows(x[0][:n], spec.dtype) for x in read])
                for block in range(have, full):
                    lo = (block - have) * bs
                    lw.write_block(r, block, [[c[lo : lo + bs] for c in layer] for layer in rows])
                self.counters.add("persisted_blocks", full - have)
            except Exception as exc:  # only a later miss
                self.counters.add("persist_failures")
                logger.warning("prefix reuse: blocks of request %d not stored: %s", r.id, exc)

    def _write_stored(
        self,
        requests: Sequence[Request],
        prompts: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int] | None],
        lengths: Sequence[int],
    ) -> None:
        """The adopted rows into every backend but the store's that takes part in a forward of them,
        in rounds of :data:`ROUND_BLOCKS` blocks per request (packed forwards that only write)."""
        core = self.core
        lw, layout, spec = core.backends.store, core.layout, core.spec
        assert lw is not None and layout is not None
        step = ROUND_BLOCKS * core.block_size
        for start in range(0, max(lengths, default=0), step):
            spans = [(min(start, n), min(start + step, n)) for n in lengths]
            n_new = [e - s for s, e in spans]
            plan = plan_packed(
                requests, [s for s, _ in spans], n_new, layout, decode=False, layerwise=False,
                device=spec.device,
            )  # fmt: skip
            plan.writes_only = True
            writers = [b for b in core.backends.all if b is not lw and b.takes_part(plan)]
            if not writers:
                return
            rows = lw.stored_rows(requests, prompts, positions, spans)
            begun = []
            try:
                for b in writers:
                    b.begin_forward(plan)
                    begun.append(b)
                for layer, parts in zip(lw.layers, rows, strict=True):
                    parts = [p.to(spec.device) for p in parts]
                    if lw.kv_fp8:  # FP8 latent rows, written as they are kept (an empty rotary part)
                        parts = [parts[0], parts[0][:, :0], *parts[1:]]
                    kv_c, k_pe = parts[:2]
                    index_k = parts[2] if len(parts) > 2 and spec.has_indexer else None
                    for b in writers:
                        b.write(layer, plan, NewRows(kv_c, k_pe, index_k))
            except BaseException:
                for b in reversed(begun):
                    b.abort_forward(plan)
                raise
            for b in reversed(begun):
                b.end_forward(plan)
