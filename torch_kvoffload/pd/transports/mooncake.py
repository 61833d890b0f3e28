"""``mooncake``: Mooncake TransferEngine (wheel ``mooncake-transfer-engine-non-cuda``), TCP or RDMA.

Calls used (``mooncake.engine.TransferEngine``): ``initialize(local_hostname, metadata_server, protocol,
device_name) -> int`` (``metadata_server="P2PHANDSHAKE"``: peers handshake directly, no service);
``get_rpc_port()``; ``register_memory(addr, nbytes) -> int``; ``batch_transfer_sync_read(session,
local_addrs, remote_addrs, lengths) -> int`` (0 = ok, negative = failed), ``session`` being
``"host:rpc_port"`` of the peer. ``initialize`` returns 0 even for a protocol that cannot move data, so
every :meth:`MooncakeTransport.connect` proves the path with a real read of the peer's probe region
(bytes derived from the peer's session name) before any KV is read.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from typing import Any

import torch

from torch_kvoffload.pd.transports.base import EngineTransport, ReadOp, RemotePeer, TransportError

logger = logging.getLogger(__name__)

__all__ = ["MooncakeTransport", "import_transfer_engine"]

PACKAGE = "mooncake-transfer-engine-non-cuda"
_PROBE = "__probe__"
_PROBE_BYTES = 64


def import_transfer_engine() -> Any:
    """``mooncake.engine.TransferEngine``; :class:`TransportError` with the install hint if unavailable."""
    try:
        return importlib.import_module("mooncake.engine").TransferEngine
    except (ImportError, AttributeError, OSError) as exc:
        raise TransportError(
            f"the 'mooncake' P/D transport needs Mooncake's TransferEngine: pip install {PACKAGE} "
            f"(and apt-get install libibverbs1): {type(exc).__name__}: {exc}"
        ) from exc


def _probe_pattern(session: str) -> torch.Tensor:
    digest = hashlib.sha256(session.encode()).digest()
    return torch.frombuffer(bytearray((digest * 2)[:_PROBE_BYTES]), dtype=torch.uint8)


class MooncakeTransport(EngineTransport):
    """Host regions registered with a TransferEngine; reads pull from the peer's engine."""

    name = "mooncake"
    target_key = "session"

    def __init__(
        self, hostname: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp"
    ) -> None:
        super().__init__()
        engine_cls = import_transfer_engine()
        self._engine = engine_cls()
        if metadata_server != "P2PHANDSHAKE" and ":" not in hostname:
            # through a metadata server segments are named by "host:port": one name per engine
            from torch_kvoffload._utils import free_port

            hostname = f"{hostname}:{free_port(hostname)}"
        rc = self._engine.initialize(hostname, metadata_server, protocol, "")
        if rc != 0:
            raise TransportError(
                f"MooncakeTransport: TransferEngine.initialize({hostname!r}, {metadata_server!r}, "
                f"{protocol!r}) returned {rc}"
            )
        self.session = self._target = (
            f"{hostname}:{self._engine.get_rpc_port()}" if metadata_server == "P2PHANDSHAKE" else hostname
        )
        self._probe = _probe_pattern(self.session).clone()
        self.register(_PROBE, self._probe)

    def _register(self, region: str, data: torch.Tensor) -> None:
        if data.device.type != "cpu":
            raise TransportError(
                f"MooncakeTransport.register({region!r}): this wheel moves host memory only, got {data.device}"
            )
        super()._register(region, data)

    def connect(self, description: dict, peer_name: str) -> RemotePeer:
        peer = self._peer(description, peer_name)
        if _PROBE not in peer.sizes:
            raise TransportError(f"MooncakeTransport.connect: peer {peer_name} exports no probe region")
        # initialize() says 0 even for a transport that cannot move data: prove it with a real read
        scratch_name = f"{_PROBE}:{description['session']}"
        scratch = self._local.get(scratch_name)
        if scratch is None:
            self.register(scratch_name, torch.zeros(_PROBE_BYTES, dtype=torch.uint8))
            scratch = self._local[scratch_name]
        scratch.zero_()
        self.read(peer, [ReadOp(_PROBE, 0, scratch_name, 0, _PROBE_BYTES)])
        if not torch.equal(scratch, _probe_pattern(description["session"])):
            raise TransportError(
                f"MooncakeTransport.connect: the probe read from peer {peer.name} returned wrong bytes; "
                "the transport does not move data"
            )
        return peer
