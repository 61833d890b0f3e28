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

from torch_kvoffload.pd.transports.base import EngineTransport, TransportError

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


class MemFabricTransport(EngineTransport):
    """Regions registered with a MemFabric TransferEngine; reads pull from the peer named by its id."""

    name = "memfabric"
    device_memory = True
    target_key = "unique_id"

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
        self.unique_id = self._target = unique_id

    def close(self) -> None:
        super().close()
        destroy = getattr(self._engine, "destroy", None)
        if destroy is not None:
            destroy()
