"""Adapter for Mooncake Store behind the :class:`KVStore` interface.

Mooncake comes from the PyPI wheel ``mooncake-transfer-engine-non-cuda`` (module ``mooncake.store``;
it needs Debian's ``libibverbs1`` even for TCP). A master (and a metadata server) must be running —
see ``docs/store.md`` (the repository's ``tools/mooncake_master.py`` starts one on loopback). Calls used
(``MooncakeDistributedStore``):

* ``setup(config: dict) -> int`` with ``local_hostname``, ``metadata_server``, ``master_server_addr``,
  ``protocol`` (``"tcp"`` here), ``global_segment_size`` (memory this client lends to the pool),
  ``local_buffer_size``; ``health_check() -> int`` (0 = healthy); ``close()``;
* ``upsert_from(key, ptr, size, config)`` / ``batch_upsert_from(...)`` (insert or replace; a plain
  ``put_from`` silently keeps an existing value), returning 0 or a negative error code;
* ``get_into(key, ptr, size)`` / ``batch_get_into(...)``: the number of bytes read, or negative
  (-704: no such object; -600: buffer too small);
* ``get_size(key)`` (negative when absent), ``batch_get_replica_desc(keys)`` (sizes of a batch in one
  round trip), ``is_exist`` / ``batch_is_exist`` (1 / 0 / negative),
  ``remove(key)`` / ``batch_remove(keys)`` (0 = removed; fails while a read lease is held — the lease
  length is the master's ``--default_kv_lease_ttl``), ``register_buffer(ptr, size)``.

``setup`` can return 0 for a transport that cannot move data, so the constructor proves the client
works with a real round trip of a probe object before returning.
"""

from __future__ import annotations

import importlib
import logging
import os
import uuid
from typing import Any

import torch

from torch_kvoffload.store._remote import RemoteKVStore
from torch_kvoffload.store.base import StoreError, StoreUnavailableError, check_host_tensor
from torch_kvoffload.store.sizes import check_host_bytes

logger = logging.getLogger(__name__)

__all__ = ["MooncakeKVStore", "import_mooncake_store"]

PACKAGE = "mooncake-transfer-engine-non-cuda"
DEFAULT_LOCAL_BUFFER = 16 << 20
_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
MIN_SEGMENT = 16 << 20  # the client refuses to mount a smaller segment ("Total size must be at least")


def import_mooncake_store() -> Any:
    """Import ``mooncake.store``; raise :class:`StoreUnavailableError` with the install hint if it fails."""
    try:
        return importlib.import_module("mooncake.store")
    except (ImportError, RuntimeError, OSError) as exc:
        raise StoreUnavailableError(
            f"MooncakeKVStore needs the 'mooncake' package: pip install {PACKAGE} "
            f"(and apt-get install libibverbs1): {type(exc).__name__}: {exc}"
        ) from exc


class MooncakeKVStore(RemoteKVStore):
    """Host KV pool in a Mooncake Store cluster.

    Args:
        capacity_bytes: bound on the bytes this client keeps in the pool (see :class:`RemoteKVStore`).
        master_server_addr: ``host:port`` of the master's RPC service.
        metadata_server: ``http://host:port/metadata`` of the HTTP metadata server.
        local_hostname: this client's address as other clients reach it (``127.0.0.1`` on one host).
        protocol: ``"tcp"`` (default) or ``"rdma"``.
        rdma_devices: RDMA device names for ``protocol="rdma"``.
        global_segment_size: bytes of host memory this client lends to the pool (``None``: as much as
            ``capacity_bytes``, at least 16 MiB, Mooncake's minimum; ``0``: none — a pure client that stores into others' segments).
        local_buffer_size: the client's registered transfer buffer.
        replica_num: replicas per object.
        setup_retries: attempts to reach the master during setup (Mooncake's
            ``MC_STORE_CLIENT_SETUP_RETRIES``, set only while ``setup`` runs); ``None`` keeps its default,
            which takes about 90 s to give up on an unreachable master.
    """

    _name = "MooncakeKVStore"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        master_server_addr: str,
        metadata_server: str,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        rdma_devices: str = "",
        global_segment_size: int | None = None,
        local_buffer_size: int = DEFAULT_LOCAL_BUFFER,
        replica_num: int = 1,
        setup_retries: int | None = None,
    ) -> None:
        super().__init__(capacity_bytes)
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"MooncakeKVStore: protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if global_segment_size is None:
            global_segment_size = max(capacity_bytes, MIN_SEGMENT)
        check_host_bytes("MooncakeKVStore", "global_segment_size", global_segment_size)
        check_host_bytes("MooncakeKVStore", "local_buffer_size", local_buffer_size)
        if 0 < global_segment_size < MIN_SEGMENT:
            raise ValueError(
                f"MooncakeKVStore: global_segment_size must be 0 or >= {MIN_SEGMENT} bytes, got {global_segment_size}"
            )
        if global_segment_size < 0 or local_buffer_size < 0 or replica_num < 1:
            raise ValueError(
                "MooncakeKVStore: global_segment_size and local_buffer_size must be >= 0 and replica_num >= 1, "
                f"got {global_segment_size}, {local_buffer_size}, {replica_num}"
            )
        module = import_mooncake_store()
        self._client = module.MooncakeDistributedStore()
        self._config = module.ReplicateConfig()
        self._config.replica_num = replica_num
        setup = {
            "local_hostname": local_hostname,
            "metadata_server": metadata_server,
            "master_server_addr": master_server_addr,
            "protocol": protocol,
            "rdma_devices": rdma_devices,
            "global_segment_size": global_segment_size,
            "local_buffer_size": local_buffer_size,
            "enable_client_http_server": False,
        }
        if protocol == "tcp":
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        if setup_retries is not None and setup_retries < 1:
            raise ValueError(f"MooncakeKVStore: setup_retries must be >= 1, got {setup_retries}")
        saved = os.environ.get(_RETRIES_ENV)
        if setup_retries is not None:
            os.environ[_RETRIES_ENV] = str(setup_retries)
        try:
            rc = self._client.setup(setup)
        except (RuntimeError, OSError, TypeError) as exc:
            raise StoreUnavailableError(f"MooncakeKVStore: setup failed: {exc}") from exc
        finally:
            if setup_retries is not None:
                if saved is None:
                    os.environ.pop(_RETRIES_ENV, None)
                else:
                    os.environ[_RETRIES_ENV] = saved
        if rc != 0:
            raise StoreUnavailableError(
                f"MooncakeKVStore: setup returned {rc} (master {master_server_addr}, metadata {metadata_server})"
            )
        self._probe()

    def _probe(self) -> None:
        """A real write + read + remove round trip; setup() alone does not prove the transport works."""
        health = self._client.health_check()
        if health != 0:
            self._client.close()
            raise StoreUnavailableError(
                f"MooncakeKVStore: health_check returned {health} (master unreachable?)"
            )
        key = f"kvoffload-probe/{uuid.uuid4().hex}"
        src = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        wrote = self._client.upsert_from(key, src.data_ptr(), src.nbytes, self._config)
        read = self._client.get_into(key, dst.data_ptr(), dst.nbytes) if wrote == 0 else None
        self._client.remove(key, True)  # the probe's own lease must not keep it alive
        if wrote != 0 or read != src.nbytes or not torch.equal(src, dst):
            self._client.close()
            raise StoreUnavailableError(
                f"MooncakeKVStore: setup succeeded but a probe transfer failed (write={wrote}, read={read}); "
                "is any memory mounted in the pool (global_segment_size=0 needs another client's segment)?"
            )

    def register(self, tensor: torch.Tensor) -> None:
        """Register a host tensor's memory for zero-copy transfers (needed by RDMA)."""
        check_host_tensor("MooncakeKVStore.register", "tensor", tensor)
        rc = self._client.register_buffer(tensor.data_ptr(), tensor.nbytes)
        if rc != 0:
            raise StoreError(f"MooncakeKVStore.register: register_buffer failed with code {rc}")

    # ---------------------------------------------------------------------------------- primitives
    def _sizes(self, keys: list[str]) -> list[int]:
        if len(keys) == 1:
            return [int(self._client.get_size(keys[0]))]
        # one metadata round trip for the batch: sizes from the replicas' buffer descriptors
        found = self._client.batch_get_replica_desc(keys)
        sizes = []
        for key in keys:
            memory = [r for r in found.get(key, ()) if r.is_memory_replica()]
            if memory:
                sizes.append(int(memory[0].get_memory_descriptor().buffer_descriptor.size))
            else:  # absent, or only on disk: ask for the size directly
                sizes.append(int(self._client.get_size(key)) if key in found else 0)
        return sizes

    def _exist(self, keys: list[str]) -> list[int]:
        if len(keys) == 1:
            return [int(self._client.is_exist(keys[0]))]
        return [int(c) for c in self._client.batch_is_exist(keys)]

    def _remove(self, keys: list[str]) -> list[bool]:
        if len(keys) == 1:
            return [self._client.remove(keys[0]) == 0]
        return [c == 0 for c in self._client.batch_remove(keys)]

    def _remove_corrupt(self, keys: list[str]) -> list[bool]:
        return [self._client.remove(key, True) == 0 for key in keys]  # force: no reader may use them

    def _write(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if len(keys) == 1:
            return [int(self._client.upsert_from(keys[0], ptrs[0], sizes[0], self._config))]
        return [int(c) for c in self._client.batch_upsert_from(keys, ptrs, sizes, self._config)]

    def _read(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        if len(keys) == 1:
            got = [int(self._client.get_into(keys[0], ptrs[0], sizes[0]))]
        else:
            got = [int(c) for c in self._client.batch_get_into(keys, ptrs, sizes)]
        return [g == n for g, n in zip(got, sizes, strict=True)]

    def _shutdown(self) -> None:
        self._client.close()
