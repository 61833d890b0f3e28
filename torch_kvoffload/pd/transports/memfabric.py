"""``memfabric``: thin adapter over ``memfabric_hybrid``'s TransferEngine (Ascend), targeting 1.3.0.

Calls used (``memfabric_hybrid.TransferEngine``): ``initialize(store_url, unique_id, role, device_id)
-> int`` (``store_url`` ``tcp://ip:port`` of the config store, ``unique_id`` ``"ip:port"`` naming this
instance); ``register_memory(addr, nbytes) -> int``; ``batch_transfer_sync_read(dest_unique_id,
local_addrs, remote_addrs, lengths) -> int`` (0 = ok); ``unregister_memory(addr)``; ``destroy()``.
Device (HBM) regions are allowed: MemFabric moves NPU memory directly. ``memfabric_hybrid`` is imported
only when the transport is built.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from torch_kvoffload.pd.transports.base import ReadOp, RemotePeer, Transport, TransportError

logger = logging.getLogger(__name__)

__all__ = ["MemFabricTransport", "import_memfabric"]

PACKAGE = "memfabric_hybrid"


def import_memfabric() -> Any:
    try:
        return importlib.import_module(PACKAGE)
    except (ImportError, RuntimeError, OSError) as exc:
        raise TransportError(
            f"the 'memfabric' P/D transport needs {PACKAGE} 1.3.0 and the Ascend driver (CANN): "
            f"pip install memfabric-hybrid: {type(exc).__name__}: {exc}"
        ) from exc


class MemFabricTransport(Transport):
    """Regions registered with a MemFabric TransferEngine; reads pull from the peer named by its id."""

    name = "memfabric"
    device_memory = True

    def __init__(self, store_url: str, unique_id: str, role: str, device_id: int = 0) -> None:
        super().__init__()
        mf = import_memfabric()
        self._engine = mf.TransferEngine()
        rc = self._engine.initialize(store_url, unique_id, role, device_id)
        if rc != 0:
            raise TransportError(
                f"MemFabricTransport: TransferEngine.initialize({store_url!r}, {unique_id!r}, {role!r}, "
                f"{device_id}) returned {rc}"
            )
        self.unique_id = unique_id
        self._addrs: dict[str, int] = {}

    def _register(self, region: str, data: torch.Tensor) -> None:
        rc = self._engine.register_memory(data.data_ptr(), max(data.numel(), 1))
        if rc != 0:
            raise TransportError(f"MemFabricTransport.register({region!r}): register_memory returned {rc}")
        self._addrs[region] = data.data_ptr()

    def describe(self) -> dict:
        return {
            "kind": self.name,
            "unique_id": self.unique_id,
            "regions": {r: {"addr": self._addrs[r], "nbytes": self._local[r].numel()} for r in self._addrs},
        }

    def connect(self, description: dict, peer_name: str) -> RemotePeer:
        if description.get("kind") != self.name or not isinstance(description.get("unique_id"), str):
            raise TransportError(
                f"MemFabricTransport.connect: peer {peer_name} does not describe MemFabric regions"
            )
        regions = description.get("regions", {})
        addrs = {r: int(i["addr"]) for r, i in regions.items()}
        sizes = {r: int(i["nbytes"]) for r, i in regions.items()}
        return RemotePeer(
            f"{peer_name} ({description['unique_id']})", sizes, (description["unique_id"], addrs)
        )

    def _read(self, peer: RemotePeer, ops: list[ReadOp]) -> None:
        dest, addrs = peer.state
        ops = [op for op in ops if op.nbytes]
        rc = self._engine.batch_transfer_sync_read(
            dest,
            [self._local[op.local].data_ptr() + op.local_offset for op in ops],
            [addrs[op.remote] + op.remote_offset for op in ops],
            [op.nbytes for op in ops],
        )
        if rc != 0:
            raise TransportError(
                f"MemFabricTransport.read: batch_transfer_sync_read of {len(ops)} ranges from {peer.name} "
                f"returned {rc}"
            )

    def close(self) -> None:
        for ptr in self._addrs.values():
            try:
                self._engine.unregister_memory(ptr)
            except (RuntimeError, AttributeError) as exc:
                logger.debug("unregister_memory failed: %s", exc)
        self._addrs.clear()
        destroy = getattr(self._engine, "destroy", None)
        if destroy is not None:
            destroy()
