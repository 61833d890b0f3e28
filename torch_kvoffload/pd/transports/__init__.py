"""P/D bulk-data transports behind one interface (:class:`Transport`)."""

from __future__ import annotations

from torch_kvoffload.pd.transports.base import ReadOp, RemotePeer, Transport, TransportError
from torch_kvoffload.pd.transports.shm import ShmTransport

__all__ = ["ReadOp", "RemotePeer", "ShmTransport", "Transport", "TransportError", "make_transport"]


def make_transport(config, *, rank_name: str) -> Transport:
    """The transport ``config.transport`` names (a :class:`~torch_kvoffload.pd.config.PDConfig`);
    ``rank_name`` (letters, digits, ``-``) goes into the names of the exported shared-memory files."""
    if config.transport == "shm":
        return ShmTransport(tag=rank_name)
    if config.transport == "mooncake":
        from torch_kvoffload.pd.transports.mooncake import MooncakeTransport

        return MooncakeTransport(config.host, config.mooncake_metadata_server, config.mooncake_protocol)
    if config.transport == "memfabric":
        from torch_kvoffload._utils import free_port
        from torch_kvoffload.pd.transports.memfabric import MemFabricTransport

        return MemFabricTransport(
            config.memfabric_store_url, f"{config.host}:{free_port(config.host)}", config.role
        )
    raise ValueError(f"make_transport: unknown transport {config.transport!r}")
