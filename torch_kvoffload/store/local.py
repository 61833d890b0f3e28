"""The embedded host KV pool: one preallocated host arena, a first-fit allocator, LRU eviction.

Storage is a single ``uint8`` arena of exactly ``capacity_bytes`` (pinned when an accelerator exists so
that device copies from / to it are asynchronous DMA). Each value occupies one contiguous region,
allocated first-fit from a sorted, coalescing free list; when no region fits, the least recently used
entries are evicted until one does. ``get`` and ``put`` make an entry the most recently used; ``exists``
does not.

Concurrency: metadata changes happen under one lock, but the byte copies themselves (``Tensor.copy_``
and the ``copy_blocks`` kernel, both releasing the GIL) run outside it, so several transfer threads copy
in parallel. A region being read is pinned by a reader count and is neither evicted nor reused until the
readers finish; a region being written is invisible until the copy completes. A ``put`` that finds
every byte held by in-flight copies waits for one of them to finish.

Leases (:meth:`LocalKVStore.lease`) pin entries for longer — a layerwise forward pins the prefix it
found at lookup until the forward ends. Eviction skips leased entries; a leased entry that is removed or
replaced keeps its region until the lease is released. A ``put`` that cannot find room because every
held byte is leased (nothing in flight that will finish by itself) is skipped and counted in
``put_skipped`` — never waits for a lease, never overwrites a pinned region.

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

import bisect
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torch_kvoffload import device
from torch_kvoffload._utils import check_int, round_up
from torch_kvoffload.counters import Counters
from torch_kvoffload.ops.copy import copy_blocks
from torch_kvoffload.store.base import (
    COUNTER_NAMES,
    KVStore,
    RecordLayout,
    StoreClosedError,
    StoreLease,
    check_host_tensor,
    check_key,
    check_keys,
    leased_keys,
    tensor_bytes,
)
from torch_kvoffload.store.factory import check_host_bytes
from torch_kvoffload.store.integrity import checksums

logger = logging.getLogger(__name__)

__all__ = ["LocalKVStore"]

#: ``copy(arena, [(entry, source index)])``: fills freshly allocated regions during a put.
_Copier = Callable[[torch.Tensor, list], None]


@dataclass(eq=False)
class _Entry:
    key: str
    offset: int
    reserved: int  # arena bytes held (nbytes rounded up to the alignment)
    nbytes: int
    readers: int = 0  # in-flight copies out of the region
    leases: int = 0  # leases pinning the entry against eviction
    retired: bool = False  # replaced / removed / evicted; region freed once readers drop to 0
    crc: int = 0  # integrity.checksum of the bytes, set once they are written


def _check_entry_sizes(
    fn: str,
    keys: Sequence[str],
    found: Sequence[_Entry | None],
    sizes: Sequence[int],
    what: Callable[[int], str],
) -> None:
    """Raise if a present entry's size differs from ``sizes[i]``; ``what(i)`` describes that size."""
    for i, (key, entry, size) in enumerate(zip(keys, found, sizes, strict=True)):
        if entry is not None and entry.nbytes != size:
            raise ValueError(f"LocalKVStore.{fn}: key {key!r} holds {entry.nbytes} bytes but {what(i)}")


class _LocalLease(StoreLease):
    """A lease of a :class:`LocalKVStore`: ``entries[i]`` is the pinned entry of ``keys[i]`` (``None``
    when it was absent)."""

    def __init__(self, *args, owner: LocalKVStore, entries: list[_Entry | None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.owner = owner
        self.entries = entries


class LocalKVStore(KVStore):
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
        capacity_bytes = check_int("LocalKVStore", "capacity_bytes", capacity_bytes, minimum=1)
        check_host_bytes("LocalKVStore", "capacity_bytes", capacity_bytes)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"LocalKVStore: alignment must be an int >= 1, got {alignment!r}")
        if alignment & (alignment - 1):
            raise ValueError(f"LocalKVStore: alignment must be a power of two, got {alignment}")
        self.capacity_bytes = capacity_bytes
        self.alignment = alignment
        if pin_memory is None:
            self._arena: torch.Tensor | None = device.empty_host((capacity_bytes,), torch.uint8)
        else:
            self._arena = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.pinned = bool(self._arena.is_pinned())
        self.counters = Counters(
            [
                *COUNTER_NAMES,
                "evicted_bytes",
                "put_waits",
                "put_skipped",
                "put_skipped_bytes",
                "leases",
                "leased_keys",
            ]
        )
        self._cond = threading.Condition(threading.Lock())
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # live entries, least recently used first
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)]  # sorted, coalesced [start, end)
        self._held = 0  # arena bytes not on the free list
        self._stored = 0  # payload bytes of live entries
        self._busy = 0  # copy operations in flight (reads and write rounds): they finish by themselves
        self._leased_bytes = 0  # arena bytes of entries held by at least one lease (live or retired)
        self._record_views: dict[tuple[int, int], torch.Tensor] = {}  # (part bytes, shift) -> arena view
        self._closed = False

    # ---------------------------------------------------------------------------------- properties
    @property
    def used_bytes(self) -> int:
        """Arena bytes held: live entries plus regions still being written or read after removal."""
        with self._cond:
            return self._held

    @property
    def stored_bytes(self) -> int:
        """Payload bytes of the entries currently visible (≤ ``used_bytes``)."""
        with self._cond:
            return self._stored

    def __len__(self) -> int:
        with self._cond:
            return len(self._index)

    def __contains__(self, key: object) -> bool:
        with self._cond:
            return key in self._index

    def lru_keys(self) -> list[str]:
        """Stored keys, least recently used first."""
        with self._cond:
            return list(self._index)

    @property
    def leased_bytes(self) -> int:
        """Arena bytes of entries pinned by at least one lease (live or already retired)."""
        with self._cond:
            return self._leased_bytes

    def leased_keys(self) -> list[str]:
        """Keys of the live entries pinned by a lease."""
        with self._cond:
            return [e.key for e in self._index.values() if e.leases]

    # ------------------------------------------------------------------------------------ allocator
    def _reserve_size(self, nbytes: int) -> int:
        return round_up(nbytes, self.alignment)

    def _allocate(self, nbytes: int) -> tuple[int, int] | None:
        """First fit; returns ``(offset, reserved)`` or ``None``. Caller holds the lock."""
        if nbytes == 0:
            return (0, 0)
        want = self._reserve_size(nbytes)
        for i, (start, end) in enumerate(self._free):
            if end - start >= nbytes:
                reserved = min(want, end - start)  # clipped only at the arena's end
                if start + reserved == end:
                    del self._free[i]
                else:
                    self._free[i] = (start + reserved, end)
                self._held += reserved
                return start, reserved
        return None

    def _release_region(self, offset: int, reserved: int) -> None:
        """Return a region to the free list, merging with its neighbours. Caller holds the lock."""
        if reserved == 0:
            return
        start, end = offset, offset + reserved
        i = bisect.bisect_left(self._free, (start, end))
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            start = self._free[i - 1][0]
            i -= 1
            self._free.pop(i)
        self._free.insert(i, (start, end))
        self._held -= reserved
        assert self._held >= 0, "arena accounting went negative"
        # waiting puts are woken once per operation by the caller, not once per region

    def _retire(self, entry: _Entry) -> None:
        """Take a live entry out of service; free its region when no reader or lease holds it. Lock held."""
        entry.retired = True
        self._stored -= entry.nbytes
        if entry.readers == 0 and entry.leases == 0:
            self._release_region(entry.offset, entry.reserved)

    def _drop_hold(self, entry: _Entry) -> None:
        """A reader or a lease let go of ``entry``: free a retired region. Lock held; the caller wakes
        waiting puts (the entry may be evictable again)."""
        if not (entry.readers or entry.leases) and entry.retired:
            self._release_region(entry.offset, entry.reserved)

    def _evict_one(self) -> bool:
        for key, entry in self._index.items():
            if entry.readers == 0 and entry.leases == 0:
                del self._index[key]
                self._retire(entry)
                self.counters.add("evictions")
                self.counters.add("evicted_bytes", entry.nbytes)
                logger.debug("evicted %s (%d bytes)", key, entry.nbytes)
                return True
        return False

    def _check_open(self, fn: str) -> torch.Tensor:
        if self._closed or self._arena is None:
            raise StoreClosedError(f"LocalKVStore.{fn}: the store is closed")
        return self._arena

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
        def copy(arena: torch.Tensor, pending: list[tuple[_Entry, int]]) -> None:
            for entry, i in pending:
                if entry.nbytes:
                    arena[entry.offset : entry.offset + entry.nbytes].copy_(tensor_bytes(values[i]))

        return copy

    def _put_items(self, fn: str, items: list[tuple[str, int, int]], copy: _Copier) -> None:
        """Store ``(key, nbytes, source index)`` items; ``copy`` fills the allocated regions."""
        pos = 0
        while pos < len(items):
            pos = self._put_round(fn, items, pos, copy)

    def _put_round(self, fn: str, items: list[tuple[str, int, int]], pos: int, copy: _Copier) -> int:
        """Allocate regions for ``items[pos:]`` (as many as can be had without waiting once some are
        held), copy outside the lock, publish; return the position reached."""
        pending: list[tuple[_Entry, int]] = []
        waited = False
        skipped = skipped_bytes = 0
        with self._cond:
            arena = self._check_open(fn)
            while pos < len(items):
                key, nbytes, src = items[pos]
                old = self._index.pop(key, None)
                if old is not None and not (old.readers or old.leases) and old.nbytes == nbytes:
                    # an overwrite of the same size nobody holds: write in place (hidden from readers
                    # until published, like any new region), without freeing and reallocating
                    old.retired = True
                    self._stored -= nbytes
                    pending.append((_Entry(key, old.offset, old.reserved, nbytes), src))
                    pos += 1
                    continue
                if old is not None:
                    self._retire(old)
                region = self._allocate(nbytes)
                while region is None and self._evict_one():
                    region = self._allocate(nbytes)
                if region is None:
                    if pending:
                        break  # publish this round first: its regions are not evictable while written
                    if self._busy:
                        waited = True  # held bytes are being read or written right now: they free up
                        self._cond.notify_all()  # regions this round freed may serve another put
                        self._cond.wait()
                        arena = self._check_open(fn)
                        continue
                    # every held byte is leased: waiting could wait for the very forward that puts
                    skipped += 1
                    skipped_bytes += nbytes
                    logger.debug("put of %s (%d bytes) skipped: the rest of the store is leased", key, nbytes)
                    pos += 1
                    continue
                pending.append((_Entry(key, region[0], region[1], nbytes), src))
                pos += 1
            if pending:
                self._busy += 1
            self._cond.notify_all()  # regions freed by overwrites / evictions
        if waited:
            self.counters.add("put_waits")
        if skipped:
            self.counters.add("put_skipped", skipped)
            self.counters.add("put_skipped_bytes", skipped_bytes)
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
            with self._cond:
                self._busy -= 1
                for entry, _ in pending:
                    self._release_region(entry.offset, entry.reserved)
                self._cond.notify_all()
            raise
        with self._cond:
            self._busy -= 1
            if self._closed:
                raise StoreClosedError(f"LocalKVStore.{fn}: the store was closed during the put")
            for entry, _ in pending:
                racing = self._index.pop(entry.key, None)  # a concurrent put of the same key published first
                if racing is not None:
                    self._retire(racing)
                self._index[entry.key] = entry
                self._stored += entry.nbytes
            self._cond.notify_all()  # new evictable entries
        self.counters.add("puts", len(pending))
        self.counters.add("bytes_put", sum(entry.nbytes for entry, _ in pending))
        return pos

    def _pin(
        self,
        fn: str,
        keys: Sequence[str],
        sizes: Sequence[int],
        what: Callable[[int], str],
        *,
        records: bool = False,
    ) -> tuple[torch.Tensor, list[_Entry | None]]:
        """Look up, size-check, then pin and refresh every hit — all or nothing. Lock held.

        ``what(i)`` describes the size of destination ``i`` for the size-mismatch message. With
        ``records`` an entry of another size is no record of the layout: a miss, dropped as corrupt.
        """
        arena = self._check_open(fn)
        found = [self._index.get(key) for key in keys]
        if records:
            wrong = [e for e, size in zip(found, sizes, strict=True) if e is not None and e.nbytes != size]
            if wrong:
                self._drop_corrupt(wrong, "a size other than the record layout's")
                bad = set(map(id, wrong))
                found = [None if id(e) in bad else e for e in found]
        _check_entry_sizes(fn, keys, found, sizes, what)
        for key, entry in zip(keys, found, strict=True):
            if entry is not None:
                entry.readers += 1
                self._index.move_to_end(key)
        self._busy += 1
        return arena, found

    def _drop_corrupt(self, entries: Sequence[_Entry], why: str) -> None:
        """Remove ``entries`` (still the live entries of their keys) as corrupt and count them. Lock held."""
        for entry in entries:
            if self._index.get(entry.key) is entry:
                del self._index[entry.key]
                self._retire(entry)
        self.counters.add("corrupt_records", len(entries))
        logger.warning(
            "LocalKVStore: %d entr%s with %s treated as missing and removed (first: %s)",
            len(entries), "y" if len(entries) == 1 else "ies", why, entries[0].key,
        )  # fmt: skip
        self._cond.notify_all()

    def _verify(self, arena: torch.Tensor, found: list[_Entry | None]) -> list[_Entry | None]:
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

    def _unpin(self, found: Sequence[_Entry | None]) -> None:
        with self._cond:
            self._busy -= 1
            for entry in found:
                if entry is None:
                    continue
                entry.readers -= 1
                self._drop_hold(entry)
            self._cond.notify_all()  # a waiting put may now skip instead of waiting

    def _count_gets(self, found: Sequence[_Entry | None], got: int) -> list[bool]:
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
        found: list[_Entry | None] = []
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
        with self._cond:
            index = self._index
            for i in hits:
                entry = found[i]
                if not entry.retired:  # type: ignore[union-attr]
                    index.move_to_end(entry.key)  # type: ignore[union-attr]
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

        def copy(arena: torch.Tensor, pending: list[tuple[_Entry, int]]) -> None:
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
        # a forward leases every layer's prefix at once (hundreds of keys) on its critical path: the
        # loops below touch each entry once and keep only a byte total for ``leased_bytes``
        with self._cond:
            arena = self._check_open("lease")
            entries = list(map(self._index.get, keys))
            held = [entry for entry in entries if entry is not None]
            pinned = 0
            for entry in held:
                if not entry.leases:
                    pinned += entry.reserved
                entry.leases += 1
            self._leased_bytes += pinned
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

        def release() -> None:
            with self._cond:
                unpinned = 0
                for entry in held:
                    left = entry.leases - 1
                    entry.leases = left
                    if not left:
                        unpinned += entry.reserved
                        if entry.retired:
                            self._drop_hold(entry)
                    assert left >= 0, "lease count went negative"
                self._leased_bytes -= unpinned
                self._cond.notify_all()

        return _LocalLease(keys, found, pinned=True, on_release=release, owner=self, entries=entries)

    # ---------------------------------------------------------------------------------- other ops
    def exists(self, key: str) -> bool:
        check_key("LocalKVStore.exists", key)
        with self._cond:
            self._check_open("exists")
            return key in self._index

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        check_keys("LocalKVStore.batch_exists", keys)
        with self._cond:
            self._check_open("batch_exists")
            return [key in self._index for key in keys]

    def remove(self, key: str) -> bool:
        check_key("LocalKVStore.remove", key)
        with self._cond:
            self._check_open("remove")
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            self._retire(entry)
            self._cond.notify_all()
        self.counters.add("removes")
        return True

    def clear(self) -> None:
        """Remove every entry (regions still being read are freed when their readers finish)."""
        with self._cond:
            self._check_open("clear")
            while self._index:
                _, entry = self._index.popitem(last=False)
                self._retire(entry)
            self._cond.notify_all()

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
