"""Sparse decode offload (DESIGN §7): host-resident main KV, per-layer hot buffers managed by residency.

Residency policy studies (reuse traces, Belady's optimum) live in ``tools/residency_policies.py`` (not part of the package).
"""

from torch_kvoffload.sparse.config import SparseDecodeConfig
from torch_kvoffload.sparse.host_pool import HostKVPool
from torch_kvoffload.sparse.residency import ResidencyTable
from torch_kvoffload.sparse.runtime import (
    DecodeRows,
    IndexerInputs,
    PlacedRows,
    SparseDecodeOffload,
    StepResult,
)

__all__ = [
    "DecodeRows",
    "HostKVPool",
    "IndexerInputs",
    "PlacedRows",
    "ResidencyTable",
    "SparseDecodeConfig",
    "SparseDecodeOffload",
    "StepResult",
]
