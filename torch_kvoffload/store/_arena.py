"""The arena of :class:`~torch_kvoffload.store.local.LocalKVStore` and its bookkeeping: which region holds
which key, in which LRU order, pinned by whom. No value byte is copied here.

Storage is a single ``uint8`` arena of exactly ``capacity_bytes`` (pinned when an accelerator exists so
that device copies from / to it are asynchronous DMA). Each value occupies one contiguous region,
allocated first-fit from a sorted, coalescing free list; when no region fits, the least recently used
entries are evicted until one does. ``get`` and ``put`` make an entry the most recently used; ``exists``
does not.

Concurrency: metadata changes happen under one lock (``_cond``), while the store copies bytes outside
it. A region being read is pinned by a reader count and is neither evicted nor reused until the readers
finish; a region being written is invisible until it is published. A put that finds every byte held by
in-flight copies waits for one of them to finish; one that finds every held byte leased (nothing in
flight that will finish by itself) skips the value and counts it in ``put_skipped`` — it never waits for
a lease, never overwrites a pinned region. A leased entry that is removed or replaced keeps its region
until the lease is released.
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
from torch_kvoffload.store.base import COUNTER_NAMES, StoreClosedError, check_key, check_keys
from torch_kvoffload.store.sizes import check_host_bytes

logger = logging.getLogger(__name__)

__all__ = ["ArenaIndex", "Entry"]

#: ``(key, nbytes, source index)``: one value of a put, in the caller's order.
PutItem = tuple[str, int, int]


@dataclass(eq=False)
class Entry:
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
    found: Sequence[Entry | None],
    sizes: Sequence[int],
    what: Callable[[int], str],
) -> None:
    """Raise if a present entry's size differs from ``sizes[i]``; ``what(i)`` describes that size."""
    for i, (key, entry, size) in enumerate(zip(keys, found, sizes, strict=True)):
        if entry is not None and entry.nbytes != size:
            raise ValueError(f"LocalKVStore.{fn}: key {key!r} holds {entry.nbytes} bytes but {what(i)}")


class ArenaIndex:
    """A host arena and the index of the entries in it: the state of a local store, without the copies
    of value bytes (:class:`~torch_kvoffload.store.local.LocalKVStore` adds those, and the checksums).

    Methods documented "lock held" expect the caller to hold ``_cond``; the others take it themselves.
    """

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
        self._index: OrderedDict[str, Entry] = OrderedDict()  # live entries, least recently used first
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)]  # sorted, coalesced [start, end)
        self._held = 0  # arena bytes not on the free list
        self._stored = 0  # payload bytes of live entries
        self._busy = 0  # copy operations in flight (reads and write rounds): they finish by themselves
        self._leased_bytes = 0  # arena bytes of entries held by at least one lease (live or retired)
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

    def _retire(self, entry: Entry) -> None:
        """Take a live entry out of service; free its region when no reader or lease holds it. Lock held."""
        entry.retired = True
        self._stored -= entry.nbytes
        if entry.readers == 0 and entry.leases == 0:
            self._release_region(entry.offset, entry.reserved)

    def _drop_hold(self, entry: Entry) -> None:
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

    # ---------------------------------------------------------------------------------------- puts
    def _reserve_round(
        self, fn: str, items: list[PutItem], pos: int
    ) -> tuple[torch.Tensor, list[tuple[Entry, int]], int]:
        """Allocate regions for ``items[pos:]``, as many as can be had without waiting once some are held.

        Returns the arena, the ``(entry, source index)`` pairs whose regions the caller fills, and the
        position reached. With any pairs, the round is a copy in flight until :meth:`_publish` or
        :meth:`_abandon`; its entries are invisible and not evictable until published.
        """
        pending: list[tuple[Entry, int]] = []
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
                    pending.append((Entry(key, old.offset, old.reserved, nbytes), src))
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
                pending.append((Entry(key, region[0], region[1], nbytes), src))
                pos += 1
            if pending:
                self._busy += 1
            self._cond.notify_all()  # regions freed by overwrites / evictions
        if waited:
            self.counters.add("put_waits")
        if skipped:
            self.counters.add("put_skipped", skipped)
            self.counters.add("put_skipped_bytes", skipped_bytes)
        return arena, pending, pos

    def _abandon(self, pending: list[tuple[Entry, int]]) -> None:
        """Free the regions of a round whose copy failed (nothing of it was published)."""
        with self._cond:
            self._busy -= 1
            for entry, _ in pending:
                self._release_region(entry.offset, entry.reserved)
            self._cond.notify_all()

    def _publish(self, fn: str, pending: list[tuple[Entry, int]]) -> None:
        """Make a round's written entries visible (replacing what a concurrent put published first)."""
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

    # ---------------------------------------------------------------------------------------- reads
    def _pin(
        self,
        fn: str,
        keys: Sequence[str],
        sizes: Sequence[int],
        what: Callable[[int], str],
        *,
        records: bool = False,
    ) -> tuple[torch.Tensor, list[Entry | None]]:
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

    def _unpin(self, found: Sequence[Entry | None]) -> None:
        with self._cond:
            self._busy -= 1
            for entry in found:
                if entry is None:
                    continue
                entry.readers -= 1
                self._drop_hold(entry)
            self._cond.notify_all()  # a waiting put may now skip instead of waiting

    def _drop_corrupt(self, entries: Sequence[Entry], why: str) -> None:
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

    # --------------------------------------------------------------------------------------- leases
    def _pin_leased(self, keys: Sequence[str]) -> tuple[torch.Tensor, list[Entry | None], list[Entry]]:
        """Add a lease to the entry of every present key; return the arena, the entry of each key
        (``None``: absent) and the entries pinned (for :meth:`_unpin_leased`). Does not refresh recency."""
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
        return arena, entries, held

    def _unpin_leased(self, held: Sequence[Entry]) -> None:
        """Release one lease of each of ``held``; free the regions of those removed or replaced meanwhile."""
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

    def _touch(self, entries: Sequence[Entry]) -> None:
        """Make the live ones of ``entries`` the most recently used."""
        with self._cond:
            index = self._index
            for entry in entries:
                if not entry.retired:
                    index.move_to_end(entry.key)

    # ------------------------------------------------------------------------------ key operations
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
