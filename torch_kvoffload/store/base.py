"""The host KV pool interface: blocks of one layer, keyed by content, stored as raw bytes.

Every backend (the embedded :class:`~torch_kvoffload.store.local.LocalKVStore`, Mooncake Store,
Memcache) implements :class:`KVStore`. Values are CPU tensors of any dtype and shape; a backend stores
their bytes (a copy) and copies them back into a caller-provided tensor of the same byte size, so the
caller keeps ownership of every buffer and decides dtype and shape on the way out.

Backends are thread-safe: the layerwise runtime calls them from transfer worker threads.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from torch_kvoffload.counters import Counters

__all__ = [
    "COUNTER_NAMES",
    "KVStore",
    "StoreClosedError",
    "StoreError",
    "StoreUnavailableError",
    "check_host_tensor",
    "check_key",
    "check_keys",
    "tensor_bytes",
]

#: Counters every backend keeps. ``gets``/``hits``/``misses`` count keys, not calls.
COUNTER_NAMES = (
    "puts",
    "gets",
    "hits",
    "misses",
    "evictions",
    "removes",
    "bytes_put",
    "bytes_got",
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
