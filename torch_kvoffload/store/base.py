"""The host KV pool interface: blocks of one layer, keyed by content, stored as raw bytes.

Every backend (the embedded :class:`~torch_kvoffload.store.local.LocalKVStore`, Mooncake Store,
Memcache) implements :class:`KVStore`. Values are CPU tensors of any dtype and shape; a backend stores
their bytes (a copy) and copies them back into a caller-provided tensor of the same byte size, so the
caller keeps ownership of every buffer and decides dtype and shape on the way out.

Besides single values, a store moves *records* straight between its storage and paged block tensors
(:meth:`KVStore.batch_get_blocks` / :meth:`KVStore.batch_put_blocks` with a :class:`RecordLayout`): a
record is one block of several tensors side by side, so a layer's blocks move in one call per layer
instead of one copy per block. And it can *lease* keys (:meth:`KVStore.lease`) so that eviction does
not take them while a reader still needs them; backends that cannot pin report ``pinned=False``.

Backends are thread-safe: the layerwise runtime calls them from transfer worker threads.
"""

from __future__ import annotations

import abc
import itertools
import threading
from collections.abc import Callable, Sequence

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.ops.copy import copy_blocks

__all__ = [
    "COUNTER_NAMES",
    "KVStore",
    "RecordLayout",
    "StoreClosedError",
    "StoreError",
    "StoreLease",
    "StoreUnavailableError",
    "check_host_tensor",
    "check_key",
    "check_keys",
    "leased_keys",
    "tensor_bytes",
]

#: Counters every backend keeps. ``gets``/``hits``/``misses`` count keys, not calls; ``corrupt_records``
#: counts values found that failed their checksum or had the wrong size (each also a miss).
COUNTER_NAMES = (
    "puts",
    "gets",
    "hits",
    "misses",
    "evictions",
    "removes",
    "bytes_put",
    "bytes_got",
    "corrupt_records",
)


class StoreClosedError(RuntimeError):
    """An operation was attempted on a store after :meth:`KVStore.close`."""


class StoreUnavailableError(RuntimeError):
    """A backend's optional package is missing or its service cannot be reached / initialised."""


class StoreError(RuntimeError):
    """A backend reported a failure (an error code) for an operation."""


def check_key(fn: str, key: object) -> str:
    """Return ``key`` if it is a non-empty ``str``; raise ``TypeError``/``ValueError`` naming ``fn``."""
    if not isinstance(key, str):
        raise TypeError(f"{fn}: key must be a str, got {type(key).__name__}")
    if not key:
        raise ValueError(f"{fn}: key must be a non-empty string")
    return key


def check_keys(fn: str, keys: Sequence[str]) -> None:
    """Validate a sequence of keys (a single ``str`` is rejected, not iterated)."""
    if isinstance(keys, str):
        raise TypeError(f"{fn}: keys must be a sequence of str, got a single str")
    if all(type(key) is str and key for key in keys):  # the common case, without a call per key
        return
    for key in keys:
        check_key(fn, key)


def check_host_tensor(fn: str, arg: str, t: object) -> torch.Tensor:
    """Validate that ``t`` is a contiguous CPU tensor (any dtype); return it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{fn}: {arg} must be a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {arg} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    return t


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of the bytes of a contiguous tensor (no copy)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8)


class RecordLayout:
    """How one stored record maps onto one block of each of several paged tensors.

    Record ``i`` of a batch is ``record_bytes`` bytes; its bytes ``[offsets[j], offsets[j] + B_j)`` are
    block ``blocks[i]`` of ``tensors[j]``, where ``B_j`` is the byte size of one block of ``tensors[j]``
    (``tensors[j][0].nbytes``). Bytes of the record covered by no part (alignment padding) are
    unspecified. Validated once at construction, so per-call work stays small.

    Args:
        tensors: CPU, contiguous, ``[num_blocks, *block_shape]`` each (any dtypes, equal ``num_blocks``).
        offsets: byte offset of each tensor's block inside the record; parts must not overlap.
        record_bytes: the record size (``>=`` the end of every part).

    Attributes:
        num_blocks: ``tensors[j].shape[0]``.
        byte_views: per tensor, a ``uint8 [num_blocks, B_j]`` view of its storage (no copy).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], record_bytes: int) -> None:
        fn = "RecordLayout"
        tensors = tuple(tensors)
        offsets = tuple(offsets)
        if not tensors:
            raise ValueError(f"{fn}: 'tensors' must hold at least one tensor")
        if len(offsets) != len(tensors):
            raise ValueError(f"{fn}: got {len(tensors)} tensors but {len(offsets)} offsets")
        if isinstance(record_bytes, bool) or not isinstance(record_bytes, int) or record_bytes < 0:
            raise ValueError(f"{fn}: 'record_bytes' must be an int >= 0, got {record_bytes!r}")
        views, spans = [], []
        for j, (t, off) in enumerate(zip(tensors, offsets, strict=True)):
            check_host_tensor(fn, f"tensors[{j}]", t)
            if t.dim() < 1:
                raise ValueError(f"{fn}: tensors[{j}] must have a leading block dimension, got a scalar")
            if t.shape[0] != tensors[0].shape[0]:
                raise ValueError(
                    f"{fn}: tensors[{j}] has {t.shape[0]} blocks, tensors[0] has {tensors[0].shape[0]}"
                )
            if isinstance(off, bool) or not isinstance(off, int) or off < 0:
                raise ValueError(f"{fn}: offsets[{j}] must be an int >= 0, got {off!r}")
            nb = t.shape[0]
            block = t.nbytes // nb if nb else 0
            if off + block > record_bytes:
                raise ValueError(
                    f"{fn}: part {j} ({block} bytes at offset {off}) ends past record_bytes={record_bytes}"
                )
            views.append(tensor_bytes(t).view(nb, block) if nb else torch.empty(0, 0, dtype=torch.uint8))
            spans.append((off, off + block, j))
        spans.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise ValueError(f"{fn}: parts {a} and {b} overlap inside the record")
        self.tensors = tensors
        self.offsets = offsets
        self.record_bytes = record_bytes
        self.num_blocks = tensors[0].shape[0]
        self.byte_views: tuple[torch.Tensor, ...] = tuple(views)

    def check_blocks(self, fn: str, blocks: Sequence[int] | torch.Tensor, n: int) -> list[int]:
        """``blocks`` as a list of ``n`` ints, after checking length, range and distinctness."""
        if isinstance(blocks, torch.Tensor):
            if blocks.dtype != torch.int64 or blocks.dim() != 1:
                raise ValueError(
                    f"{fn}: 'blocks' must be an int64 [n] tensor, got {blocks.dtype} {list(blocks.shape)}"
                )
            ids = blocks.tolist()
        else:
            ids = list(blocks)
            for i, v in enumerate(ids):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TypeError(f"{fn}: blocks[{i}] must be an int, got {type(v).__name__}")
        if len(ids) != n:
            raise ValueError(f"{fn}: got {n} keys but {len(ids)} blocks")
        if n:
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= self.num_blocks:
                bad = lo if lo < 0 else hi
                raise IndexError(f"{fn}: 'blocks' holds {bad}, expected a block in [0, {self.num_blocks})")
            if len(set(ids)) != n:
                raise ValueError(f"{fn}: 'blocks' must be distinct")
        return ids

    def staging_parts(self, staging: torch.Tensor) -> list[torch.Tensor]:
        """Views ``uint8 [n, B_j]`` of the parts of a ``uint8 [n, record_bytes]`` record tensor."""
        return [
            staging[:, off : off + v.shape[1]] for off, v in zip(self.offsets, self.byte_views, strict=True)
        ]


def leased_keys(fn: str, segments: Sequence[tuple[StoreLease, int, int]]) -> list[str]:
    """The keys named by ``(lease, start, stop)`` segments, after checking that every pinning lease is
    still held and every range lies inside its lease."""
    keys: list[str] = []
    for i, seg in enumerate(segments):
        if not (isinstance(seg, tuple) and len(seg) == 3 and isinstance(seg[0], StoreLease)):
            raise TypeError(f"{fn}: segments[{i}] must be a (StoreLease, start, stop) tuple, got {seg!r}")
        lease, start, stop = seg
        if lease.pinned and lease.released:
            raise ValueError(f"{fn}: the lease of segments[{i}] was already released")
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop))
        if not (ints and 0 <= start <= stop <= len(lease.keys)):
            raise ValueError(
                f"{fn}: segments[{i}] range [{start}, {stop}) is not inside its lease of {len(lease.keys)} keys"
            )
        keys += lease.keys[start:stop]
    return keys


class StoreLease:
    """Keys a reader needs, pinned against eviction where the backend can pin (``pinned``).

    ``found[i]``: whether ``keys[i]`` was present when the lease was taken. With ``pinned`` true the found
    entries stay readable until :meth:`release` (eviction skips them; an explicit ``remove`` still
    removes the key). With ``pinned`` false nothing is held: a found key may disappear before it is
    read, and the reader must handle the miss. ``release`` is idempotent.
    """

    def __init__(
        self,
        keys: Sequence[str],
        found: list[bool],
        *,
        pinned: bool,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.keys = list(keys)
        self.found = found
        self.pinned = pinned
        self._on_release = on_release
        self._lock = threading.Lock()

    @property
    def released(self) -> bool:
        return self._on_release is None

    def release(self) -> None:
        with self._lock:
            fn, self._on_release = self._on_release, None
        if fn is not None:
            fn()

    def __enter__(self) -> StoreLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class KVStore(abc.ABC):
    """Host KV pool: blocks of one layer keyed by content. Values are tensors of raw block bytes.

    Keys are produced by :func:`torch_kvoffload.store.keys.layer_block_keys`. ``put`` stores a copy of
    the bytes of a contiguous CPU tensor (any dtype / shape); ``get`` copies them into ``out`` (a
    contiguous CPU tensor with the same ``nbytes``). A stored entry may disappear at any time through
    eviction; callers treat a miss as "recompute".

    Attributes:
        capacity_bytes: the bound on the bytes this store (or this client's share of it) holds.
        counters: ``puts``, ``gets``, ``hits``, ``misses``, ``evictions``, ``removes``, ``bytes_put``,
            ``bytes_got`` (plus backend-specific ones).
    """

    capacity_bytes: int
    counters: Counters
    #: Whether :meth:`lease` pins (keeps leased entries from eviction); ``False`` for the default.
    pins_leases: bool = False

    # -------------------------------------------------------------------------------------- single
    @abc.abstractmethod
    def put(self, key: str, value: torch.Tensor) -> None:
        """Store a copy of the bytes of ``value`` (CPU, contiguous, any dtype) under ``key``.

        Replaces an existing entry. Raises ``ValueError`` if the value cannot fit at all.
        """

    @abc.abstractmethod
    def get(self, key: str, out: torch.Tensor) -> bool:
        """Copy the bytes stored under ``key`` into ``out`` (CPU, contiguous, same ``nbytes``).

        Returns ``False`` (``out`` untouched) if the key is absent; raises ``ValueError`` if the stored
        size differs from ``out.nbytes`` (``out`` and the store untouched).
        """

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (does not refresh recency)."""

    @abc.abstractmethod
    def remove(self, key: str) -> bool:
        """Drop ``key``; ``True`` if it was present."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store's resources; idempotent. Later operations raise :class:`StoreClosedError`."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes currently held (never more than ``capacity_bytes``)."""

    # --------------------------------------------------------------------------------------- batch
    def batch_put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> None:
        """``put`` every pair, in order (a later duplicate key wins). All arguments validated first."""
        self._check_batch("batch_put", keys, values, "values")
        for key, value in zip(keys, values, strict=True):
            self.put(key, value)

    def batch_get(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[bool]:
        """``get`` every pair; returns one hit flag per key."""
        self._check_batch("batch_get", keys, outs, "outs")
        return [self.get(key, out) for key, out in zip(keys, outs, strict=True)]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """``exists`` for every key."""
        check_keys("batch_exists", keys)
        return [self.exists(key) for key in keys]

    # ---------------------------------------------------------------------------------- leases
    def lease(self, keys: Sequence[str], *, nbytes: Sequence[int] | None = None) -> StoreLease:
        """Pin the present ``keys`` against eviction until the lease is released.

        ``nbytes[i]``: the size the reader will read ``keys[i]`` as; a pinning store checks what it pins
        (size and checksum) and reports an entry that fails as absent (a miss, counted in
        ``corrupt_records``). Default (a backend that cannot pin): presence only, ``pinned=False``; the
        values are checked when they are read.
        """
        check_keys(f"{type(self).__name__}.lease", keys)
        return StoreLease(keys, self.batch_exists(keys) if keys else [], pinned=False)

    # ---------------------------------------------------------------------------------- records
    def batch_get_blocks(
        self, keys: Sequence[str], layout: RecordLayout, blocks: Sequence[int] | torch.Tensor
    ) -> list[bool]:
        """Copy the record stored under ``keys[i]`` into block ``blocks[i]`` of every tensor of ``layout``.

        Returns one hit flag per key; the blocks of a missing key are left untouched. A present key
        whose size differs from ``layout.record_bytes`` raises ``ValueError`` before anything is copied.
        ``blocks`` must be distinct. Default: ``batch_get`` into a host staging tensor, then one
        ``copy_blocks`` per part; backends override it to move the bytes directly.
        """
        fn = f"{type(self).__name__}.batch_get_blocks"
        check_keys(fn, keys)
        b = layout.check_blocks(fn, blocks, len(keys))
        if not keys:
            return []
        staging = torch.empty(len(keys), layout.record_bytes, dtype=torch.uint8)
        found = self.batch_get(keys, list(staging.unbind(0)))
        hits = [i for i, f in enumerate(found) if f]
        if hits:
            mapping = torch.tensor([[i, b[i]] for i in hits], dtype=torch.int64)
            for part, view in zip(layout.staging_parts(staging), layout.byte_views, strict=True):
                if part.shape[1]:
                    copy_blocks(part, view, mapping)
        return found

    def batch_get_leased_blocks(
        self,
        segments: Sequence[tuple[StoreLease, int, int]],
        layout: RecordLayout,
        blocks: Sequence[int] | torch.Tensor,
    ) -> list[bool]:
        """``batch_get_blocks`` of the keys ``lease.keys[start:stop]`` of every ``(lease, start, stop)`` of
        ``segments``, in order: the reads of a caller that leased those keys earlier.

        Every pinning lease must still be held (not released) for the whole call. Backends that pin use
        the lease to read without looking the keys up again; the default reads by key. Returns one hit flag
        per key; arguments are validated before anything is copied.
        """
        fn = f"{type(self).__name__}.batch_get_leased_blocks"
        return self.batch_get_blocks(leased_keys(fn, segments), layout, blocks)

    def batch_put_blocks(
        self, keys: Sequence[str], layout: RecordLayout, blocks: Sequence[int] | torch.Tensor
    ) -> None:
        """Store, under ``keys[i]``, the record made of block ``blocks[i]`` of every tensor of ``layout``.

        Like ``batch_put`` (a later duplicate key wins; all arguments validated first). Default: gather
        the records into a host staging tensor with one ``copy_blocks`` per part, then ``batch_put``.
        """
        fn = f"{type(self).__name__}.batch_put_blocks"
        check_keys(fn, keys)
        b = layout.check_blocks(fn, blocks, len(keys))
        if not keys:
            return
        n = len(keys)
        staging = torch.zeros(n, layout.record_bytes, dtype=torch.uint8)
        mapping = torch.tensor([[blk, i] for i, blk in enumerate(b)], dtype=torch.int64)
        for part, view in zip(layout.staging_parts(staging), layout.byte_views, strict=True):
            if part.shape[1]:
                copy_blocks(view, part, mapping)
        self.batch_put(keys, list(staging.unbind(0)))

    # ------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _check_batch(fn: str, keys: Sequence[str], tensors: Sequence[torch.Tensor], arg: str) -> None:
        check_keys(fn, keys)
        if len(keys) != len(tensors):
            raise ValueError(f"{fn}: got {len(keys)} keys but {len(tensors)} {arg}")
        for i, t in enumerate(tensors):
            check_host_tensor(fn, f"{arg}[{i}]", t)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
