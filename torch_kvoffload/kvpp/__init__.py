"""KVPP — KV layer parallelism inside a TP (× PCP) group.

Each rank of a group persistently stores only the layers it owns; just before a layer runs, its owner
broadcasts the layer bundle — the blocks the forward reads — into the peers' scratch buffers, one layer
ahead, into two alternating scratch buffers. Build a rank's runtime with
:func:`build_kvpp_runtime` from a :class:`KVPPConfig`. See ``docs/kvpp.md``.
"""

from torch_kvoffload.kvpp.allocation import KVPPAllocation
from torch_kvoffload.kvpp.blocks import BlockTables, block_runs, run_byte_ranges
from torch_kvoffload.kvpp.build import build_kvpp_runtime
from torch_kvoffload.kvpp.config import KVPPConfig
from torch_kvoffload.kvpp.groups import KVPPGroup, create_kvpp_group, kvpp_groups, kvpp_size
from torch_kvoffload.kvpp.layout import BundleSpec, ComponentSpec, bundle_layout
from torch_kvoffload.kvpp.ownership import assign_owners, extract_layer_index, owned_layers
from torch_kvoffload.kvpp.plan import SCRATCH_ALIGNMENT, SCRATCH_BUFFER_COUNT, KVPPPlan
from torch_kvoffload.kvpp.runtime import KVPPRuntime
from torch_kvoffload.kvpp.scheduler import KVPPScheduler
from torch_kvoffload.kvpp.transport import BroadcastTransport

__all__ = [
    "SCRATCH_ALIGNMENT",
    "SCRATCH_BUFFER_COUNT",
    "BlockTables",
    "BroadcastTransport",
    "BundleSpec",
    "ComponentSpec",
    "KVPPAllocation",
    "KVPPConfig",
    "KVPPGroup",
    "KVPPPlan",
    "KVPPRuntime",
    "KVPPScheduler",
    "assign_owners",
    "block_runs",
    "build_kvpp_runtime",
    "bundle_layout",
    "create_kvpp_group",
    "extract_layer_index",
    "kvpp_groups",
    "kvpp_size",
    "owned_layers",
    "run_byte_ranges",
]
