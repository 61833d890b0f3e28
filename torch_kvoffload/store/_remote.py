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
  ``put_dropped``. So ``used_bytes`` never exceeds ``capacity_bytes``;
* every stored object is the value's bytes followed by a trailer holding its length and checksum
  (:mod:`~torch_kvoffload.store.integrity`; ``TRAILER_BYTES`` more per object in the pool, not counted in
  ``capacity_bytes``), written from one host staging copy. Reads go through a host staging copy too and
  check the trailer before copying anything out: a value that fails (flipped bytes, a truncated or
  foreign object) is a miss, counted in ``corrupt_records`` and removed from the pool. At the record layer
  (:meth:`RemoteKVStore.batch_get_blocks`) an object of another size is such a miss as well.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Sequence

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.ops.copy import copy_blocks
from torch_kvoffload.store._ledger import ClientLedger
from torch_kvoffload.store.base import (
    COUNTER_NAMES,
    KVStore,
    RecordLayout,
    StoreClosedError,
    StoreError,
    check_host_tensor,
    check_key,
    check_keys,
    tensor_bytes,
)
from torch_kvoffload.store.integrity import TRAILER_BYTES, seal, unseal

logger = logging.getLogger(__name__)


class RemoteKVStore(KVStore):
    """Base of the adapters to external pools. Subclasses set ``_name`` and implement the primitives.

    Extra counters: ``server_evictions`` (keys this client wrote that the pool dropped, noticed on a
    later get / exists), ``put_dropped`` (puts not stored: the quota could not be freed, or the backend
    failed), ``store_errors`` (backend calls of gets and puts that raised or reported a failure; a failed
    read is a miss, a failed write a dropped put — logged, never raised).
    """

    _name = "RemoteKVStore"

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"{self._name}: capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.counters = Counters([*COUNTER_NAMES, "server_evictions", "put_dropped", "store_errors"])
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

    def _remove_corrupt(self, keys: list[str]) -> list[bool]:
        """Remove objects that failed their check (default: :meth:`_remove`; a backend that can should
        not let its read leases keep them)."""
        return self._remove(keys)

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
        sizes = [self._check_value(fn, value) for value in values]
        staging = torch.empty(sum(sizes) + TRAILER_BYTES * len(sizes), dtype=torch.uint8)
        rows, start = [], 0
        for key, value, n in zip(keys, values, sizes, strict=True):
            row = staging[start : start + n + TRAILER_BYTES]
            row[:n].copy_(tensor_bytes(value))
            seal(key, row)
            rows.append(row)
            start += n + TRAILER_BYTES
        self._put_sealed(fn, keys, rows)

    def _put_sealed(self, fn: str, keys: list[str], rows: list[torch.Tensor]) -> None:
        """Write sealed objects (``uint8`` rows: value ‖ trailer), within this client's quota."""
        items = [(key, row.numel() - TRAILER_BYTES) for key, row in zip(keys, rows, strict=True)]
        with self._put_lock:
            self._check_open(fn)
            try:
                if not self._make_room(items):
                    self.counters.add("put_dropped", len(items))
                    logger.debug("%s: quota full of leased keys, dropped %d put(s)", self._name, len(items))
                    return
                codes = self._write(keys, [r.data_ptr() for r in rows], [r.numel() for r in rows])
            except Exception as exc:  # a cache that could not store: the values are recomputed when needed
                self._backend_failed(fn, exc)
                self.counters.add("put_dropped", len(items))
                return
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
            self._backend_failed(fn, StoreError(f"failed to store {len(failed)} key(s): {failed[:4]}"))
            self.counters.add("put_dropped", len(failed))

    def _backend_failed(self, fn: str, exc: Exception) -> None:
        """The backend raised or reported a failure: counted in ``store_errors`` and logged; the caller
        treats it as a miss (reads) or a dropped put (writes)."""
        self.counters.add("store_errors")
        logger.warning(
            "%s.%s: the backend failed (%s: %s); treated as a miss / dropped put",
            self._name, fn, type(exc).__name__, exc,
        )  # fmt: skip

    def _sizes_or_unknown(self, fn: str, keys: list[str]) -> list[int]:
        """``_sizes`` with ``0`` for absent; when the backend fails, ``-1`` per key: unknown, read as a
        miss that is not taken for an eviction (the key may well be there)."""
        try:
            return [max(int(size), 0) for size in self._sizes(keys)]
        except Exception as exc:
            self._backend_failed(fn, exc)
            return [-1] * len(keys)

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
        sizes = self._sizes_or_unknown(fn, keys)
        for key, size, out in zip(keys, sizes, outs, strict=True):
            if size > 0 and size != out.nbytes + TRAILER_BYTES and self._is_sealed_value(key, size):
                # an intact value of another size: the caller's mistake (a damaged object is a miss)
                raise ValueError(
                    f"{self._name}.{fn}: key {key!r} holds {size - TRAILER_BYTES} bytes but out has "
                    f"{out.nbytes} bytes (shape {tuple(out.shape)}, dtype {out.dtype})"
                )
        rows = self._read_sealed(keys, sizes, [out.nbytes for out in outs])
        got = 0
        for out, row in zip(outs, rows, strict=True):
            if row is not None:
                tensor_bytes(out).copy_(row[: out.nbytes])
                got += out.nbytes
        return self._count_gets(keys, [row is not None for row in rows], got, sizes)

    def _is_sealed_value(self, key: str, size: int) -> bool:
        """Whether the object of ``key`` (``size`` bytes) is an intact sealed value (read to tell a value
        of another size from a truncated or foreign object; one larger than this client could have
        written counts as a value)."""
        if size > self.capacity_bytes + TRAILER_BYTES:
            return True
        if size <= TRAILER_BYTES:
            return False
        buf = torch.empty(size, dtype=torch.uint8)
        try:
            ok = self._read([key], [buf.data_ptr()], [size])[0]
        except Exception as exc:
            self._backend_failed("get", exc)
            return False
        return ok and unseal(key, buf)

    def _read_sealed(self, keys: list[str], sizes: list[int], nbytes: list[int]) -> list[torch.Tensor | None]:
        """Read the objects of ``keys`` that hold sealed values of ``nbytes[i]`` bytes (``sizes``: the
        pool's object sizes) into a host staging tensor; per key the verified row (value ‖ trailer), or
        ``None`` for a miss. Objects of another size and values that fail their trailer are dropped as
        corrupt."""
        rows: list[torch.Tensor | None] = [None] * len(keys)
        want = [n + TRAILER_BYTES for n in nbytes]
        present = [i for i, size in enumerate(sizes) if size > 0 and size == want[i]]
        corrupt = [keys[i] for i, size in enumerate(sizes) if size > 0 and size != want[i]]
        if present:
            staging = torch.empty(sum(want[i] for i in present), dtype=torch.uint8)
            views, start = [], 0
            for i in present:
                views.append(staging[start : start + want[i]])
                start += want[i]
            try:
                ok = self._read(
                    [keys[i] for i in present], [v.data_ptr() for v in views], [want[i] for i in present]
                )
            except Exception as exc:
                self._backend_failed("get", exc)
                ok = [False] * len(present)
            for i, view, hit in zip(present, views, ok, strict=True):
                if not hit:
                    continue
                if unseal(keys[i], view):
                    rows[i] = view
                else:
                    corrupt.append(keys[i])
        if corrupt:
            self._drop_corrupt(corrupt)
        return rows

    def _drop_corrupt(self, keys: list[str]) -> None:
        """Count ``keys`` as corrupt and remove them from the pool (where no reader holds them)."""
        self.counters.add("corrupt_records", len(keys))
        logger.warning(
            "%s: %d object(s) failed their size or checksum and were treated as missing (first: %s)",
            self._name, len(keys), keys[0],
        )  # fmt: skip
        with self._put_lock:
            if self._closed:
                return
            try:
                removed = self._remove_corrupt(keys)
            except Exception as exc:
                self._backend_failed("remove", exc)
                return
            for key, gone in zip(keys, removed, strict=True):
                if gone:
                    self._ledger.forget(key)

    def _count_gets(self, keys: list[str], hits: list[bool], got: int, sizes: list[int]) -> list[bool]:
        """Count a read; the ledger forgets keys the pool reported absent (size 0), not those whose read
        failed or that were dropped as corrupt (already forgotten where removed)."""
        for key, hit, size in zip(keys, hits, sizes, strict=True):
            if hit:
                self._ledger.touch(key)
            elif size == 0:
                self._note_missing(key)
        n_hits = sum(hits)
        self.counters.add("gets", len(keys))
        self.counters.add("hits", n_hits)
        self.counters.add("misses", len(keys) - n_hits)
        self.counters.add("bytes_got", got)
        return hits

    # ------------------------------------------------------------------------------------ records
    def batch_put_blocks(
        self, keys: Sequence[str], layout: RecordLayout, blocks: Sequence[int] | torch.Tensor
    ) -> None:
        """Gather the records into sealed staging rows (one ``copy_blocks`` per part), then write them."""
        fn = f"{self._name}.batch_put_blocks"
        check_keys(fn, keys)
        b = layout.check_blocks(fn, blocks, len(keys))
        if not keys:
            return
        if layout.record_bytes == 0:
            raise ValueError(f"{fn}: empty records cannot be stored in this backend")
        last = {key: i for i, key in enumerate(keys)}
        if layout.record_bytes > self.capacity_bytes:
            raise ValueError(
                f"{fn}: a record of {layout.record_bytes} bytes does not fit in a store of "
                f"{self.capacity_bytes} bytes"
            )
        staging = torch.zeros(len(last), layout.record_bytes + TRAILER_BYTES, dtype=torch.uint8)
        mapping = torch.tensor([[b[i], row] for row, i in enumerate(last.values())], dtype=torch.int64)
        for part, view in zip(layout.staging_parts(staging), layout.byte_views, strict=True):
            if part.shape[1]:
                copy_blocks(view, part, mapping)
        rows = list(staging.unbind(0))
        for key, row in zip(last, rows, strict=True):
            seal(key, row)
        if layout.record_bytes * len(last) > self.capacity_bytes:
            for key, row in zip(last, rows, strict=True):  # cannot coexist: the quota decides what stays
                self._put_sealed("batch_put_blocks", [key], [row])
            return
        self._put_sealed("batch_put_blocks", list(last), rows)

    def batch_get_blocks(
        self, keys: Sequence[str], layout: RecordLayout, blocks: Sequence[int] | torch.Tensor
    ) -> list[bool]:
        """Read the records into staging rows, check them, then one ``copy_blocks`` per part.

        An object of another size than ``layout.record_bytes`` (plus the trailer) is a miss, counted in
        ``corrupt_records`` and removed, like one that fails its checksum; its blocks are left untouched.
        """
        fn = f"{self._name}.batch_get_blocks"
        check_keys(fn, keys)
        b = layout.check_blocks(fn, blocks, len(keys))
        self._check_open("batch_get_blocks")
        if not keys:
            return []
        keys = list(keys)
        sizes = self._sizes_or_unknown("batch_get_blocks", keys)
        rows = self._read_sealed(keys, sizes, [layout.record_bytes] * len(keys))
        hits = [i for i, row in enumerate(rows) if row is not None]
        if hits:
            staging = torch.stack([rows[i] for i in hits])  # type: ignore[misc]
            mapping = torch.tensor([[j, b[i]] for j, i in enumerate(hits)], dtype=torch.int64)
            for part, view in zip(layout.staging_parts(staging), layout.byte_views, strict=True):
                if part.shape[1]:
                    copy_blocks(part, view, mapping)
        return self._count_gets(
            keys, [row is not None for row in rows], len(hits) * layout.record_bytes, sizes
        )

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
