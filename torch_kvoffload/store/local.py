"""The embedded host KV pool: one preallocated host arena, a first-fit allocator, LRU eviction.

Storage is a single ``uint8`` arena of exactly ``capacity_bytes`` (pinned when an accelerator exists so
that device copies from / to it are asynchronous DMA). Each value occupies one contiguous region,
allocated first-fit from a sorted, coalescing free list; when no region fits, the least recently used
entries are evicted until one does. ``get`` and ``put`` make an entry the most recently used; ``exists``
does not.

Concurrency: metadata changes happen under one lock, but the byte copies themselves (``Tensor.copy_``,
which releases the GIL) run outside it, so several transfer threads copy in parallel. A region being
read is pinned by a reader count and is neither evicted nor reused until the readers finish; a region
being written is invisible until the copy completes. A ``put`` that finds every byte held by in-flight
copies waits for one of them to finish.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torch_kvoffload import device
from torch_kvoffload.counters import Counters
from torch_kvoffload.store.base import (
    COUNTER_NAMES,
    KVStore,
    StoreClosedError,
    check_host_tensor,
    check_key,
    check_keys,
    tensor_bytes,
)

logger = logging.getLogger(__name__)

__all__ = ["LocalKVStore"]


@dataclass(eq=False)
class _Entry:
    key: str
    offset: int
    reserved: int  # arena bytes held (nbytes rounded up to the alignment)
    nbytes: int
    readers: int = 0
    retired: bool = False  # replaced / removed / evicted; region freed once readers drop to 0


class LocalKVStore(KVStore):
    """In-process, capacity-bounded, LRU host KV pool.

    Args:
        capacity_bytes: size of the arena; ``used_bytes`` never exceeds it.
        alignment: every region starts at a multiple of this many bytes and holds a multiple of it
            (except at the arena's end); padding counts against the capacity. ``1`` (default) makes
            the capacity exact in payload bytes; 64 or 512 give cache-line / DMA-friendly offsets.
        pin_memory: pin the arena; ``None`` pins exactly when an accelerator exists.

    Extra counters: ``evicted_bytes``, ``put_waits`` (puts that waited for in-flight copies).
    """

    def __init__(self, capacity_bytes: int, *, alignment: int = 1, pin_memory: bool | None = None) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(
                f"LocalKVStore: capacity_bytes must be an int, got {type(capacity_bytes).__name__}"
            )
        if capacity_bytes < 1:
            raise ValueError(f"LocalKVStore: capacity_bytes must be >= 1, got {capacity_bytes}")
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
        self.counters = Counters([*COUNTER_NAMES, "evicted_bytes", "put_waits"])
        self._cond = threading.Condition(threading.Lock())
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # live entries, least recently used first
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)]  # sorted, coalesced [start, end)
        self._held = 0  # arena bytes not on the free list
        self._stored = 0  # payload bytes of live entries
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

    # ------------------------------------------------------------------------------------ allocator
    def _reserve_size(self, nbytes: int) -> int:
        a = self.alignment
        return (nbytes + a - 1) // a * a

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
        self._cond.notify_all()

    def _retire(self, entry: _Entry) -> None:
        """Take a live entry out of service; free its region when no reader holds it. Lock held."""
        entry.retired = True
        self._stored -= entry.nbytes
        if entry.readers == 0:
            self._release_region(entry.offset, entry.reserved)

    def _evict_one(self) -> bool:
        for key, entry in self._index.items():
            if entry.readers == 0:
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
        nbytes = value.nbytes
        if nbytes > self.capacity_bytes:
            raise ValueError(
                f"LocalKVStore.put: value of {nbytes} bytes does not fit in a store of {self.capacity_bytes} bytes"
            )
        src = tensor_bytes(value)
        waited = False
        with self._cond:
            arena = self._check_open("put")
            old = self._index.pop(key, None)
            if old is not None:
                self._retire(old)
            while True:
                region = self._allocate(nbytes)
                if region is not None:
                    break
                if self._evict_one():
                    continue
                waited = True  # every held byte is being read or written right now
                self._cond.wait()
                arena = self._check_open("put")
            entry = _Entry(key, region[0], region[1], nbytes)
        if waited:
            self.counters.add("put_waits")
        try:
            if nbytes:
                arena[entry.offset : entry.offset + nbytes].copy_(src)
        except BaseException:
            with self._cond:
                self._release_region(entry.offset, entry.reserved)
            raise
        with self._cond:
            if self._closed:
                raise StoreClosedError("LocalKVStore.put: the store was closed during the put")
            racing = self._index.pop(key, None)  # a concurrent put of the same key published first
            if racing is not None:
                self._retire(racing)
            self._index[key] = entry
            self._stored += nbytes
            self._cond.notify_all()  # a new evictable entry
        self.counters.add("puts")
        self.counters.add("bytes_put", nbytes)

    def _pin(self, fn: str, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list]:
        """Look up, size-check, then pin and refresh every hit — all or nothing. Lock held."""
        arena = self._check_open(fn)
        found = [self._index.get(key) for key in keys]
        for key, entry, out in zip(keys, found, outs, strict=True):
            if entry is not None and entry.nbytes != out.nbytes:
                raise ValueError(
                    f"LocalKVStore.{fn}: key {key!r} holds {entry.nbytes} bytes but out has {out.nbytes} bytes "
                    f"(shape {tuple(out.shape)}, dtype {out.dtype})"
                )
        for key, entry in zip(keys, found, strict=True):
            if entry is not None:
                entry.readers += 1
                self._index.move_to_end(key)
        return arena, found

    def _unpin(self, found: Sequence[_Entry | None]) -> None:
        with self._cond:
            for entry in found:
                if entry is None:
                    continue
                entry.readers -= 1
                if entry.readers == 0:
                    if entry.retired:
                        self._release_region(entry.offset, entry.reserved)
                    else:
                        self._cond.notify_all()  # evictable again

    def _copy_out(self, fn: str, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[bool]:
        with self._cond:
            arena, found = self._pin(fn, keys, outs)
        got = 0
        try:
            for entry, out in zip(found, outs, strict=True):
                if entry is not None and entry.nbytes:
                    tensor_bytes(out).copy_(arena[entry.offset : entry.offset + entry.nbytes])
                    got += entry.nbytes
        finally:
            self._unpin(found)
        hits = sum(entry is not None for entry in found)
        self.counters.add("gets", len(keys))
        self.counters.add("hits", hits)
        self.counters.add("misses", len(keys) - hits)
        self.counters.add("bytes_got", got)
        return [entry is not None for entry in found]

    def get(self, key: str, out: torch.Tensor) -> bool:
        check_key("LocalKVStore.get", key)
        check_host_tensor("LocalKVStore.get", "out", out)
        return self._copy_out("get", [key], [out])[0]

    def batch_get(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Like ``get`` per key; a size mismatch on any hit raises before anything is copied."""
        self._check_batch("LocalKVStore.batch_get", keys, outs, "outs")
        return self._copy_out("batch_get", keys, outs)

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
        self.counters.add("removes")
        return True

    def clear(self) -> None:
        """Remove every entry (regions still being read are freed when their readers finish)."""
        with self._cond:
            self._check_open("clear")
            while self._index:
                _, entry = self._index.popitem(last=False)
                self._retire(entry)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._index.clear()
            self._arena = None  # in-flight copies keep their own reference to the arena
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (
            f"LocalKVStore(capacity_bytes={self.capacity_bytes}, used_bytes={self._held}, "
            f"entries={len(self._index)}, pinned={self.pinned})"
        )
