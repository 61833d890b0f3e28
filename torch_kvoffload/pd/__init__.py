"""Disaggregated prefill -> decode KV transfer (DESIGN §9).

Prefill (:class:`PrefillSender`, combined with the layerwise runtime by :class:`PrefillMultiConnector`)
publishes each layer as it is written; decode (:class:`DecodeReceiver`) validates, pulls the layer into
its host pool (main KV) and rank-local indexer, and acknowledges. Control plane: pyzmq + msgpack
(:mod:`torch_kvoffload.pd.messages`); bulk data: a :class:`~torch_kvoffload.pd.transports.Transport`
(``shm``, ``mooncake``, ``memfabric``). pyzmq and msgpack come with ``pip install 'torch-kvoffload[pd]'``
and are imported only when an endpoint is built.
"""

from torch_kvoffload.pd.compat import make_compatibility
from torch_kvoffload.pd.config import TRANSPORTS, PDConfig, decode_rank_of, endpoint_port, split_range
from torch_kvoffload.pd.decode import DecodeReceiver
from torch_kvoffload.pd.decode_destinations import main_components
from torch_kvoffload.pd.decode_state import all_ranks_ready
from torch_kvoffload.pd.errors import (
    AckTimeoutError,
    HandshakeError,
    PDTransferError,
    PeerDeadError,
    ReadFailedError,
)
from torch_kvoffload.pd.messages import Compatibility, ProtocolError
from torch_kvoffload.pd.prefill import PrefillMultiConnector, PrefillSender
from torch_kvoffload.pd.prefill_exports import export_layer_buffers, register_layer_buffers
from torch_kvoffload.pd.rendezvous import FileRendezvous, MooncakeMetadataRendezvous, make_rendezvous
from torch_kvoffload.pd.ticket import TicketPart, TransferTicket
from torch_kvoffload.pd.transports import ShmTransport, Transport, TransportError, make_transport

__all__ = [
    "TRANSPORTS",
    "AckTimeoutError",
    "Compatibility",
    "DecodeReceiver",
    "FileRendezvous",
    "HandshakeError",
    "MooncakeMetadataRendezvous",
    "PDConfig",
    "PDTransferError",
    "PeerDeadError",
    "PrefillMultiConnector",
    "PrefillSender",
    "ProtocolError",
    "ReadFailedError",
    "ShmTransport",
    "TicketPart",
    "TransferTicket",
    "Transport",
    "TransportError",
    "all_ranks_ready",
    "decode_rank_of",
    "endpoint_port",
    "export_layer_buffers",
    "main_components",
    "make_compatibility",
    "make_rendezvous",
    "make_transport",
    "register_layer_buffers",
    "split_range",
]
