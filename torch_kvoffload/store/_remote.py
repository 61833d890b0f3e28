"""Shared logic of the remote-pool adapters (Mooncake, Memcache): validation, client quota, counters.

A subclass supplies five primitives over raw pointers — :meth:`RemoteKVStore._sizes`,
:meth:`_write`, :meth:`_read`, :meth:`_exist`, :meth:`_remove` — and :meth:`_shutdown`. This class
turns them into the :class:`KVStore` contract:

* values move straight between the caller's tensors and the pool (``data_ptr()``), no staging copy;
* ``get`` checks the stored size before copying, so a size mismatch raises ``ValueError`` with ``out``
  untouched, and a batch with any mismatch copies nothing;
* this client's share of the pool is bounded by ``capacity_bytes`` (:class:`ClientLedger`): before a
  put, the client's least recently used keys are removed. Removal respects the pool's read leases
  (a key being read elsewhere cannot be dropped under the reader); if not enough bytes can be freed,
  the put is dropped — for a cache that is the same as an immediate eviction — and counted in
  ``put_dropped``. So ``used_bytes`` never exceeds ``capacity_bytes``.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Sequence

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.store._ledger import ClientLedger
from torch_kvoffload.store.base import (
    COUNTER_NAMES,
    KVStore,
    StoreClosedError,
    StoreError,
    check_host_tensor,
    check_key,
    check_keys,
)

logger = logging.getLogger(__name__)


class RemoteKVStore(KVStore):
    """Base of the adapters to external pools. Subclasses set ``_name`` and implement the primitives.

    Extra counters: ``server_evictions`` (keys this client wrote that the pool dropped, noticed on a
    later get / exists), ``put_dropped`` (puts not stored because the quota could not be freed).
    """

    _name = "RemoteKVStore"

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"{self._name}: capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.counters = Counters([*COUNTER_NAMES, "server_evictions", "put_dropped"])
        self._ledger = ClientLedger(capacity_bytes)
        self._put_lock = threading.Lock()  # quota decisions + writes are serialised; reads are not
        self._closed = False

    # ---------------------------------------------------------------------------------- primitives
    @abc.abstractmethod
    def _sizes(self, keys: list[str]) -> list[int]:
        """Stored byte size per key; ``<= 0`` means absent."""

    @abc.abstractmethod
    def _write(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Insert-or-replace each value from host memory; 0 = stored, else the backend's error code."""

    @abc.abstractmethod
    def _read(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """Copy each value (of exactly ``sizes[i]`` bytes) into host memory; ``True`` where it did."""

    @abc.abstractmethod
    def _exist(self, keys: list[str]) -> list[int]:
        """1 = present, 0 = absent, negative = error."""

    @abc.abstractmethod
    def _remove(self, keys: list[str]) -> list[bool]:
        """Remove (respecting read leases); ``True`` where the key was removed."""

    @abc.abstractmethod
    def _shutdown(self) -> None:
        """Release the backend client."""

    # ------------------------------------------------------------------------------------- helpers
    @property
    def used_bytes(self) -> int:
        """Bytes this client wrote and has not seen removed (≤ ``capacity_bytes``)."""
        return self._ledger.used_bytes

    def _check_open(self, fn: str) -> None:
        if self._closed:
            raise StoreClosedError(f"{self._name}.{fn}: the store is closed")

    def _check_value(self, fn: str, value: torch.Tensor) -> int:
        n = value.nbytes
        if n == 0:
            raise ValueError(f"{self._name}.{fn}: empty values cannot be stored in this backend")
        if n > self.capacity_bytes:
            raise ValueError(
                f"{self._name}.{fn}: value of {n} bytes does not fit in a store of {self.capacity_bytes} bytes"
            )
        return n

    def _make_room(self, items: list[tuple[str, int]]) -> bool:
        """Remove this client's LRU keys until ``items`` fit. Put lock held. False if it could not."""
        leased: set[str] = set()
        while True:
            victims = self._ledger.victims_for(items, frozenset(leased))
            if victims is None:
                return False
            if not victims:
                return True
            failed = []
            for key, ok in zip(victims, self._remove(victims), strict=True):
                if not ok:
                    failed.append(key)
                elif self._ledger.forget(key):
                    self.counters.add("evictions")
            if failed:
                for key, code in zip(failed, self._exist(failed), strict=True):
                    if code == 0:
                        self._note_missing(key)  # the pool already dropped it
                    else:
                        leased.add(key)  # being read elsewhere: try the next-oldest keys instead

    def _note_missing(self, key: str) -> None:
        if self._ledger.forget(key):
            self.counters.add("server_evictions")

    # ---------------------------------------------------------------------------------------- puts
    def put(self, key: str, value: torch.Tensor) -> None:
        check_key(f"{self._name}.put", key)
        check_host_tensor(f"{self._name}.put", "value", value)
        self._put_many("put", [key], [value])

    def batch_put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> None:
        """Stores the batch in one backend call when it fits the quota (a later duplicate key wins)."""
        self._check_batch(f"{self._name}.batch_put", keys, values, "values")
        last = {key: i for i, key in enumerate(keys)}
        if sum(values[i].nbytes for i in last.values()) > self.capacity_bytes:
            for key, i in last.items():  # cannot coexist: one by one, the quota decides what stays
                self.put(key, values[i])
            return
        self._put_many("batch_put", list(last), [values[i] for i in last.values()])

    def _put_many(self, fn: str, keys: list[str], values: list[torch.Tensor]) -> None:
        items = [(key, self._check_value(fn, value)) for key, value in zip(keys, values, strict=True)]
        with self._put_lock:
            self._check_open(fn)
            if not self._make_room(items):
                self.counters.add("put_dropped", len(items))
                logger.debug("%s: quota full of leased keys, dropped %d put(s)", self._name, len(items))
                return
            codes = self._write(keys, [v.data_ptr() for v in values], [n for _, n in items])
            failed = []
            for (key, n), code in zip(items, codes, strict=True):
                if code == 0:
                    self._ledger.record(key, n)
                else:
                    failed.append((key, code))
        stored = [(k, n) for k, n in items if all(k != f for f, _ in failed)]
        self.counters.add("puts", len(stored))
        self.counters.add("bytes_put", sum(n for _, n in stored))
        if failed:
            raise StoreError(
                f"{self._name}.{fn}: the backend failed to store {len(failed)} key(s): {failed[:4]}"
            )

    # ---------------------------------------------------------------------------------------- gets
    def get(self, key: str, out: torch.Tensor) -> bool:
        check_key(f"{self._name}.get", key)
        check_host_tensor(f"{self._name}.get", "out", out)
        return self._get_many("get", [key], [out])[0]

    def batch_get(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Sizes are checked for every present key before anything is copied."""
        self._check_batch(f"{self._name}.batch_get", keys, outs, "outs")
        return self._get_many("batch_get", list(keys), list(outs))

    def _get_many(self, fn: str, keys: list[str], outs: list[torch.Tensor]) -> list[bool]:
        self._check_open(fn)
        if not keys:
            return []
        sizes = self._sizes(keys)
        for key, size, out in zip(keys, sizes, outs, strict=True):
            if size > 0 and size != out.nbytes:
                raise ValueError(
                    f"{self._name}.{fn}: key {key!r} holds {size} bytes but out has {out.nbytes} bytes "
                    f"(shape {tuple(out.shape)}, dtype {out.dtype})"
                )
        present = [i for i, size in enumerate(sizes) if size > 0]
        hits = [False] * len(keys)
        if present:
            ok = self._read(
                [keys[i] for i in present], [outs[i].data_ptr() for i in present], [sizes[i] for i in present]
            )
            for i, hit in zip(present, ok, strict=True):
                hits[i] = hit
        got = 0
        for i, (key, hit) in enumerate(zip(keys, hits, strict=True)):
            if hit:
                got += sizes[i]
                self._ledger.touch(key)
            else:
                self._note_missing(key)
        n_hits = sum(hits)
        self.counters.add("gets", len(keys))
        self.counters.add("hits", n_hits)
        self.counters.add("misses", len(keys) - n_hits)
        self.counters.add("bytes_got", got)
        return hits

    # ---------------------------------------------------------------------------------- other ops
    def exists(self, key: str) -> bool:
        check_key(f"{self._name}.exists", key)
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        check_keys(f"{self._name}.batch_exists", keys)
        self._check_open("batch_exists")
        if not keys:
            return []
        codes = self._exist(list(keys))
        bad = [(k, c) for k, c in zip(keys, codes, strict=True) if c not in (0, 1)]
        if bad:
            raise StoreError(f"{self._name}.exists: the backend failed for {bad[:4]}")
        for key, code in zip(keys, codes, strict=True):
            if code == 0:
                self._note_missing(key)
        return [code == 1 for code in codes]

    def remove(self, key: str) -> bool:
        """Remove ``key``; ``False`` if absent or still leased by a reader (the pool keeps it)."""
        check_key(f"{self._name}.remove", key)
        with self._put_lock:
            self._check_open("remove")
            removed = self._remove([key])[0]
            if removed:
                self._ledger.forget(key)
        if removed:
            self.counters.add("removes")
        return removed

    def close(self) -> None:
        with self._put_lock:
            if self._closed:
                return
            self._closed = True
        self._shutdown()
