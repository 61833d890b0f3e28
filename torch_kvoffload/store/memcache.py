"""Adapter for Memcache (``memcache_hybrid``, Ascend) behind the :class:`KVStore` interface.

``memcache_hybrid`` is optional and imported only when a :class:`MemcacheKVStore` is built; it needs
``memfabric_hybrid`` and, to hold data, the Ascend driver (CANN). The adapter targets the 1.3.0 Python
API of ``memcache_hybrid.DistributedObjectStore``:

* ``init(device_id, init_bm) -> int`` (0 = ok); the local service reads the file named by
  ``MMC_LOCAL_CONFIG_PATH`` (meta service URL, protocol, DRAM size) — set from ``config_path`` here;
* ``put_from(key, buffer_ptr, size, direct) -> int`` / ``batch_put_from(keys, ptrs, sizes, direct)
  -> list[int]`` with ``direct = memcache_hybrid.H2G`` (host DRAM → pool). A put to an existing key is
  skipped by the service (it keeps the old value), so the adapter removes an existing key first;
* ``get_into(key, buffer_ptr, size, direct) -> int`` / ``batch_get_into(...) -> list[int]`` with
  ``direct = memcache_hybrid.G2H`` (0 = ok);
* ``get_key_info(key).size()`` / ``batch_get_key_info(keys)`` (size 0 = absent), ``is_exist(key)`` /
  ``batch_is_exist(keys)`` (1 / 0 / negative error), ``remove(key)`` / ``remove_batch(keys)``
  (0 = removed; fails while a read lease is held), ``register_buffer(ptr, size)``, ``close()``.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

import torch

from torch_kvoffload.store._remote import RemoteKVStore
from torch_kvoffload.store.base import StoreError, StoreUnavailableError, check_host_tensor

logger = logging.getLogger(__name__)

__all__ = ["MemcacheKVStore", "import_memcache"]

PACKAGE = "memcache_hybrid"


def import_memcache() -> Any:
    """Import ``memcache_hybrid``; raise :class:`StoreUnavailableError` naming the package if it fails."""
    try:
        return importlib.import_module(PACKAGE)
    except (ImportError, RuntimeError, OSError) as exc:
        raise StoreUnavailableError(
            f"MemcacheKVStore needs the '{PACKAGE}' package (pip install memcache-hybrid; it also needs "
            f"memfabric_hybrid and the Ascend driver / CANN to hold data): {type(exc).__name__}: {exc}"
        ) from exc


class MemcacheKVStore(RemoteKVStore):
    """Host KV pool in a Memcache (``memcache_hybrid``) cluster.

    Args:
        capacity_bytes: bound on the bytes this client keeps in the pool (see :class:`RemoteKVStore`).
        device_id: the NPU this process uses (``DistributedObjectStore.init``).
        config_path: a ``mmc-local.conf``; exported as ``MMC_LOCAL_CONFIG_PATH`` before ``init``.
        init_bm: passed to ``init`` (initialise the big-memory layer; ``True`` for data-holding clients).
    """

    _name = "MemcacheKVStore"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        device_id: int = 0,
        config_path: str | None = None,
        init_bm: bool = True,
    ) -> None:
        super().__init__(capacity_bytes)
        if config_path is not None and not os.path.isfile(config_path):
            raise ValueError(f"MemcacheKVStore: config_path {config_path!r} is not a file")
        module = import_memcache()
        if config_path is not None:
            os.environ["MMC_LOCAL_CONFIG_PATH"] = config_path
        try:
            client = module.DistributedObjectStore()
            rc = client.init(device_id, init_bm)
        except (RuntimeError, OSError) as exc:
            raise StoreUnavailableError(f"MemcacheKVStore: {PACKAGE} init failed: {exc}") from exc
        if rc != 0:
            raise StoreUnavailableError(
                f"MemcacheKVStore: {PACKAGE} DistributedObjectStore.init(device_id={device_id}) returned {rc} "
                "(is the meta service running and MMC_LOCAL_CONFIG_PATH set?)"
            )
        self._client = client
        self._h2g = module.H2G
        self._g2h = module.G2H

    def register(self, tensor: torch.Tensor) -> None:
        """Register a host tensor's memory with the pool (needed by the RDMA protocols)."""
        check_host_tensor("MemcacheKVStore.register", "tensor", tensor)
        rc = self._client.register_buffer(tensor.data_ptr(), tensor.nbytes)
        if rc != 0:
            raise StoreError(f"MemcacheKVStore.register: register_buffer failed with code {rc}")

    # ---------------------------------------------------------------------------------- primitives
    def _sizes(self, keys: list[str]) -> list[int]:
        if len(keys) == 1:
            return [int(self._client.get_key_info(keys[0]).size())]
        return [int(info.size()) for info in self._client.batch_get_key_info(keys)]

    def _exist(self, keys: list[str]) -> list[int]:
        if len(keys) == 1:
            return [int(self._client.is_exist(keys[0]))]
        return [int(c) for c in self._client.batch_is_exist(keys)]

    def _remove(self, keys: list[str]) -> list[bool]:
        if len(keys) == 1:
            return [self._client.remove(keys[0]) == 0]
        return [c == 0 for c in self._client.remove_batch(keys)]

    def _write(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        # The service skips a put to an existing key, so old values are removed first. One that is
        # leased by a reader cannot be: content keys mean it holds the same bytes, so it is kept when
        # the size agrees (code 0, not rewritten) and reported as an error (-1) otherwise.
        codes = [0] * len(keys)
        existing = [i for i, c in enumerate(self._exist(keys)) if c == 1]
        if existing:
            removed = self._remove([keys[i] for i in existing])
            stuck = [i for i, ok in zip(existing, removed, strict=True) if not ok]
            if stuck:
                old = self._sizes([keys[i] for i in stuck])
                for i, size in zip(stuck, old, strict=True):
                    codes[i] = 0 if size == sizes[i] else -1
                    logger.debug("key %s is leased; kept its stored value", keys[i])
            todo = [i for i in range(len(keys)) if i not in set(stuck)]
        else:
            todo = list(range(len(keys)))
        if len(todo) == 1:
            i = todo[0]
            codes[i] = int(self._client.put_from(keys[i], ptrs[i], sizes[i], self._h2g))
        elif todo:
            res = self._client.batch_put_from(
                [keys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo], self._h2g
            )
            for i, c in zip(todo, res, strict=True):
                codes[i] = int(c)
        return codes

    def _read(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        if len(keys) == 1:
            return [self._client.get_into(keys[0], ptrs[0], sizes[0], self._g2h) == 0]
        return [c == 0 for c in self._client.batch_get_into(keys, ptrs, sizes, self._g2h)]

    def _shutdown(self) -> None:
        self._client.close()
