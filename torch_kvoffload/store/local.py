"""The embedded host KV pool: one preallocated host arena, a first-fit allocator, LRU eviction.

The arena, its allocator, LRU order, eviction and pins are
:class:`~torch_kvoffload.store._arena.ArenaIndex` (metadata under one lock); :class:`LocalKVStore` adds the
byte copies, which run outside the lock (``Tensor.copy_`` and the ``copy_blocks`` kernel, both releasing
the GIL), so several transfer threads copy in parallel. Every copy runs on the calling thread: the store
owns no thread (callers such as the layerwise runtime call it from their
:class:`~torch_kvoffload.transfer.TransferStream`).

Leases (:meth:`LocalKVStore.lease`) pin entries for longer — a layerwise forward pins the prefix it
found at lookup until the forward ends. Eviction skips leased entries; a leased entry that is removed or
replaced keeps its region until the lease is released. A ``put`` that cannot find room because every
held byte is leased is skipped and counted in ``put_skipped``.

Integrity: each entry keeps the checksum of its bytes (:mod:`torch_kvoffload.store.integrity`), computed
from the arena once a put's copy completes. Reads by key verify it before copying anything out, and
:meth:`LocalKVStore.lease` verifies every entry it finds before pinning it (a leased entry is never
written by the store until released, so reads through the lease use what was verified). A mismatch is a
miss: the entry is removed and counted in ``corrupt_records``; so is a record whose size differs from
the record layout read into.

Records (:meth:`LocalKVStore.batch_get_blocks` / :meth:`LocalKVStore.batch_put_blocks`) move between
the arena and paged block tensors with one ``kvoffload::copy_blocks`` call per record part: the arena is
viewed as overlapping ``[capacity - part_bytes + 1, part_bytes]`` rows, one starting at every byte, so
"block ``o``" of that view is the part at byte offset ``o`` and a batch of records at arbitrary arena
offsets is one gather / scatter by offset, with no staging copy and no per-block Python work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from torch_kvoffload.ops.copy import copy_blocks
from torch_kvoffload.store._arena import ArenaIndex, Entry, PutItem
from torch_kvoffload.store.base import (
    KVStore,
    RecordLayout,
    StoreLease,
    check_host_tensor,
    check_key,
    check_keys,
    leased_keys,
    tensor_bytes,
)
from torch_kvoffload.store.integrity import checksums

__all__ = ["LocalKVStore"]

#: ``copy(arena, [(entry, source index)])``: fills freshly allocated regions during a put.
_Copier = Callable[[torch.Tensor, list], None]


class _LocalLease(StoreLease):
    """A lease of a :class:`LocalKVStore`: ``entries[i]`` is the pinned entry of ``keys[i]`` (``None``
    when it was absent)."""

    def __init__(self, *args, owner: LocalKVStore, entries: list[Entry | None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.owner = owner
        self.entries = entries


class LocalKVStore(ArenaIndex, KVStore):
    """In-process, capacity-bounded, LRU host KV pool.

    Args:
        capacity_bytes: size of the arena; ``used_bytes`` never exceeds it.
        alignment: every region starts at a multiple of this many bytes and holds a multiple of it
            (except at the arena's end); padding counts against the capacity. ``1`` (default) makes
            the capacity exact in payload bytes; 64 or 512 give cache-line / DMA-friendly offsets.
        pin_memory: pin the arena; ``None`` pins exactly when an accelerator exists.

    Extra counters: ``evicted_bytes``, ``put_waits`` (puts that waited for in-flight copies),
    ``put_skipped`` / ``put_skipped_bytes`` (values not stored because every held byte was leased),
    ``leases`` (leases taken), ``leased_keys`` (keys pinned by them), ``corrupt_records`` (entries found
    with bytes that fail their checksum, or records of the wrong size: missed and removed).
    """

    pins_leases = True

    def __init__(self, capacity_bytes: int, *, alignment: int = 1, pin_memory: bool | None = None) -> None:
        super().__init__(capacity_bytes, alignment=alignment, pin_memory=pin_memory)
        self._record_views: dict[tuple[int, int], torch.Tensor] = {}  # (part bytes, shift) -> arena view

    # ------------------------------------------------------------------------------------- put/get
    def put(self, key: str, value: torch.Tensor) -> None:
        check_key("LocalKVStore.put", key)
        check_host_tensor("LocalKVStore.put", "value", value)
        self._check_fits("put", value.nbytes)
        self._put_items("put", [(key, value.nbytes, 0)], self._value_copier([value]))

    def batch_put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> None:
        """Like ``put`` per pair (a later duplicate key wins), with one lock round trip per round.

        Every argument is validated before anything is stored.
        """
        self._check_batch("LocalKVStore.batch_put", keys, values, "values")
        for value in values:
            self._check_fits("batch_put", value.nbytes)
        last = {key: i for i, key in enumerate(keys)}
        items = [(key, values[i].nbytes, i) for key, i in last.items()]
        self._put_items("batch_put", items, self._value_copier(values))

    def _check_fits(self, fn: str, nbytes: int) -> None:
        if nbytes > self.capacity_bytes:
            raise ValueError(
                f"LocalKVStore.{fn}: value of {nbytes} bytes does not fit in a store of "
                f"{self.capacity_bytes} bytes"
            )

    @staticmethod
    def _value_copier(values: Sequence[torch.Tensor]) -> _Copier:
        def copy(arena: torch.Tensor, pending: list[tuple[Entry, int]]) -> None:
            for entry, i in pending:
                if entry.nbytes:
                    arena[entry.offset : entry.offset + entry.nbytes].copy_(tensor_bytes(values[i]))

        return copy

    def _put_items(self, fn: str, items: list[PutItem], copy: _Copier) -> None:
        """Store ``(key, nbytes, source index)`` items; ``copy`` fills the allocated regions."""
        pos = 0
        while pos < len(items):
            pos = self._put_round(fn, items, pos, copy)

    def _put_round(self, fn: str, items: list[PutItem], pos: int, copy: _Copier) -> int:
        """Allocate regions for ``items[pos:]`` (as many as can be had without waiting once some are
        held), copy and checksum outside the lock, publish; return the position reached."""
        arena, pending, pos = self._reserve_round(fn, items, pos)
        if not pending:
            return pos
        try:
            copy(arena, pending)
            entries = [entry for entry, _ in pending]
            crcs = checksums(
                [e.key for e in entries], [arena[e.offset : e.offset + e.nbytes] for e in entries]
            )
            for entry, crc in zip(entries, crcs, strict=True):
                entry.crc = crc
        except BaseException:
            self._abandon(pending)
            raise
        self._publish(fn, pending)
        return pos

    def _verify(self, arena: torch.Tensor, found: list[Entry | None]) -> list[Entry | None]:
        """``found`` with the entries whose bytes fail their checksum replaced by ``None`` (those are
        dropped). The entries must be pinned (read or leased) so their regions cannot change."""
        live = [e for e in found if e is not None]
        crcs = checksums([e.key for e in live], [arena[e.offset : e.offset + e.nbytes] for e in live])
        bad = [e for e, crc in zip(live, crcs, strict=True) if crc != e.crc]
        if not bad:
            return found
        with self._cond:
            self._drop_corrupt(bad, "bytes that fail their checksum")
        ids = set(map(id, bad))
        return [None if id(e) in ids else e for e in found]

    def _count_gets(self, found: Sequence[Entry | None], got: int) -> list[bool]:
        hits = sum(entry is not None for entry in found)
        self.counters.add("gets", len(found))
        self.counters.add("hits", hits)
        self.counters.add("misses", len(found) - hits)
        self.counters.add("bytes_got", got)
        return [entry is not None for entry in found]

    def _copy_out(self, fn: str, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[bool]:
        def what(i: int) -> str:
            out = outs[i]
            return f"out has {out.nbytes} bytes (shape {tuple(out.shape)}, dtype {out.dtype})"

        with self._cond:
            arena, pinned = self._pin(fn, keys, [out.nbytes for out in outs], what)
        got = 0
        try:
            found = self._verify(arena, pinned)
            for entry, out in zip(found, outs, strict=True):
                if entry is not None and entry.nbytes:
                    tensor_bytes(out).copy_(arena[entry.offset : entry.offset + entry.nbytes])
                    got += entry.nbytes
        finally:
            self._unpin(pinned)
        return self._count_gets(found, got)

    def get(self, key: str, out: torch.Tensor) -> bool:
        check_key("LocalKVStore.get", key)
        check_host_tensor("LocalKVStore.get", "out", out)
        return self._copy_out("get", [key], [out])[0]

    def batch_get(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Like ``get`` per key; a size mismatch on any hit raises before anything is copied."""
        self._check_batch("LocalKVStore.batch_get", keys, outs, "outs")
        return self._copy_out("batch_get", keys, outs)

    # ------------------------------------------------------------------------------------ records
    def _records(self, arena: torch.Tensor, part_bytes: int, shift: int) -> torch.Tensor:
        """``uint8 [capacity - shift - part_bytes + 1, part_bytes]``: row ``o`` is the arena's bytes
        ``[shift + o, shift + o + part_bytes)``.

        Rows overlap (one starts at every byte); a gather or scatter by offset touches only the rows
        it names, and the allocator keeps the regions of distinct entries disjoint. ``shift`` is a
        part's offset inside its record, so the rows of every part of a batch are named by the same
        record offsets (one mapping tensor serves all parts).
        """
        view = self._record_views.get((part_bytes, shift))
        if view is None:
            rows = self.capacity_bytes - shift - part_bytes + 1
            view = arena.as_strided((rows, part_bytes), (1, 1), shift)
            self._record_views[(part_bytes, shift)] = view
        return view

    def _part_copies(
        self,
        arena: torch.Tensor,
        layout: RecordLayout,
        offsets: list[int],
        blocks: list[int],
        *,
        out: bool,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
        """The ``copy_blocks(src, dst, mapping, streaming=)`` calls that move the records at arena
        ``offsets`` out to (``out``) or in from ``blocks`` of every non-empty part of ``layout``, one per
        part, all sharing one mapping tensor (each part's arena view starts at the part's offset in the
        record). Writes into the arena stream (see :meth:`_copy_parts`)."""
        pairs = list(zip(offsets, blocks, strict=True) if out else zip(blocks, offsets, strict=True))
        mapping = torch.tensor(pairs, dtype=torch.int64)
        copies = []
        for off, view in zip(layout.offsets, layout.byte_views, strict=True):
            part = view.shape[1]
            if part == 0:
                continue
            records = self._records(arena, part, off)
            copies.append((records, view, mapping, False) if out else (view, records, mapping, True))
        return copies

    def _copy_parts(
        self,
        arena: torch.Tensor,
        layout: RecordLayout,
        offsets: list[int],
        blocks: list[int],
        *,
        out: bool,
    ) -> None:
        """Move the records at arena ``offsets`` from / to ``blocks`` of every part (one kernel call each).

        Runs on transfer threads next to compute: the Python around the kernels is kept to one small
        tensor per part (every interpreter step here holds the GIL the compute thread may need). Writes
        into the arena use streaming stores: records are read back by a later request, if ever, so
        caching them would only evict what compute keeps in the cache, and a cached write first reads
        each destination line from memory.
        """
        for src, dst, mapping, streaming in self._part_copies(arena, layout, offsets, blocks, out=out):
            copy_blocks(src, dst, mapping, streaming=streaming)

    def batch_get_blocks(
        self, keys: Sequence[str], layout: RecordLayout, blocks: Sequence[int] | torch.Tensor
    ) -> list[bool]:
        """Copy each found record from the arena straight into its blocks: one ``copy_blocks`` per part."""
        fn = "batch_get_blocks"
        check_keys(f"LocalKVStore.{fn}", keys)
        b = layout.check_blocks(f"LocalKVStore.{fn}", blocks, len(keys))
        if not keys:
            return []
        with self._cond:
            arena, pinned = self._pin(
                fn,
                keys,
                [layout.record_bytes] * len(keys),
                lambda i: f"the record layout has {layout.record_bytes} bytes",
                records=True,
            )
        got = 0
        try:
            found = self._verify(arena, pinned)
            hits = [i for i, entry in enumerate(found) if entry is not None]
            if hits and layout.record_bytes:
                offsets = [found[i].offset for i in hits]  # type: ignore[union-attr]
                self._copy_parts(arena, layout, offsets, [b[i] for i in hits], out=True)
                got = len(hits) * layout.record_bytes
        finally:
            self._unpin(pinned)
        return self._count_gets(found, got)

    def batch_get_leased_blocks(
        self,
        segments: Sequence[tuple[StoreLease, int, int]],
        layout: RecordLayout,
        blocks: Sequence[int] | torch.Tensor,
    ) -> list[bool]:
        """Copy the records of leased keys straight into their blocks, without looking the keys up again.

        The entries a lease of this store found are pinned until it is released: their regions are
        neither evicted, reused nor overwritten in place, so the copy needs no per-key lookup and no
        reader pin (one lock round trip refreshes their recency). A key that was absent when its
        lease was taken is a miss. Leases of another store, or that do not pin, read by key.
        """
        fn = "batch_get_leased_blocks"
        keys = leased_keys(f"LocalKVStore.{fn}", segments)
        if not all(isinstance(lease, _LocalLease) and lease.owner is self for lease, _, _ in segments):
            return self.batch_get_blocks(keys, layout, blocks)
        b = layout.check_blocks(f"LocalKVStore.{fn}", blocks, len(keys))
        arena = self._check_open(fn)
        found: list[Entry | None] = []
        for lease, start, stop in segments:
            found += lease.entries[start:stop]  # type: ignore[attr-defined]
        size = layout.record_bytes
        wrong = [e for e in found if e is not None and e.nbytes != size]
        if wrong:  # verified when leased, but no record of this layout: a miss
            with self._cond:
                self._drop_corrupt(wrong, "a size other than the record layout's")
            found = [None if e is not None and e.nbytes != size else e for e in found]
        hits = [i for i, entry in enumerate(found) if entry is not None]
        if hits and size:
            offsets = [found[i].offset for i in hits]  # type: ignore[union-attr]
            self._copy_parts(arena, layout, offsets, [b[i] for i in hits], out=True)
        self._touch([found[i] for i in hits])  # type: ignore[misc]
        return self._count_gets(found, len(hits) * size)

    def batch_put_blocks(
        self, keys: Sequence[str], layout: RecordLayout, blocks: Sequence[int] | torch.Tensor
    ) -> None:
        """Scatter the blocks straight into freshly allocated arena regions: one ``copy_blocks`` per part."""
        fn = "batch_put_blocks"
        check_keys(f"LocalKVStore.{fn}", keys)
        b = layout.check_blocks(f"LocalKVStore.{fn}", blocks, len(keys))
        if not keys:
            return
        self._check_fits(fn, layout.record_bytes)
        last = {key: i for i, key in enumerate(keys)}
        items = [(key, layout.record_bytes, i) for key, i in last.items()]

        def copy(arena: torch.Tensor, pending: list[tuple[Entry, int]]) -> None:
            if not layout.record_bytes:
                return
            offsets = [entry.offset for entry, _ in pending]
            self._copy_parts(arena, layout, offsets, [b[i] for _, i in pending], out=False)

        self._put_items(fn, items, copy)

    # ------------------------------------------------------------------------------------- leases
    def lease(self, keys: Sequence[str], *, nbytes: Sequence[int] | None = None) -> StoreLease:
        """Pin the present ``keys`` against eviction (``pinned=True``) until the lease is released.

        Every entry found is verified before it counts as found: its checksum, and its size against
        ``nbytes[i]`` when given; one that fails is absent for the lease, removed and counted in
        ``corrupt_records``. Reads through the lease (:meth:`batch_get_leased_blocks`) use these verified
        bytes: the store writes no leased region. Does not refresh recency. Released leases free the
        regions of entries removed or replaced meanwhile. A lease outliving :meth:`close` is released as
        a no-op.
        """
        check_keys("LocalKVStore.lease", keys)
        if nbytes is not None and len(nbytes) != len(keys):
            raise ValueError(f"LocalKVStore.lease: got {len(keys)} keys but {len(nbytes)} sizes in 'nbytes'")
        arena, entries, held = self._pin_leased(keys)
        # verified once pinned (the store writes no leased region, so reads through the lease use these
        # bytes); entries that fail stay pinned (``held``) until the release, then are freed
        if nbytes is not None:
            wrong = [e for e, n in zip(entries, nbytes, strict=True) if e is not None and e.nbytes != n]
            if wrong:
                with self._cond:
                    self._drop_corrupt(wrong, "a size other than the reader's")
                bad = set(map(id, wrong))
                entries = [None if id(e) in bad else e for e in entries]
        entries = self._verify(arena, entries)
        found = [entry is not None for entry in entries]
        self.counters.add("leases")
        self.counters.add("leased_keys", len(held))

        release = functools.partial(self._unpin_leased, held)
        return _LocalLease(keys, found, pinned=True, on_release=release, owner=self, entries=entries)

    # ---------------------------------------------------------------------------------- other ops
    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._index.clear()
            self._record_views.clear()
            self._arena = None  # in-flight copies keep their own reference to the arena
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (
            f"LocalKVStore(capacity_bytes={self.capacity_bytes}, used_bytes={self._held}, "
            f"entries={len(self._index)}, pinned={self.pinned})"
        )
