"""Sparse decode offload (DESIGN §7): host-resident main KV, per-layer hot buffers managed by residency."""

from torch_kvoffload.sparse.config import SparseDecodeConfig, control_plane_port
from torch_kvoffload.sparse.host_pool import HostKVPool
from torch_kvoffload.sparse.policies import (
    PolicyResult,
    Trace,
    belady_misses,
    make_reuse_trace,
    simulate_policy,
)
from torch_kvoffload.sparse.residency import ResidencyTable
from torch_kvoffload.sparse.runtime import DecodeRows, IndexerInputs, SparseDecodeOffload, StepResult

__all__ = [
    "DecodeRows",
    "HostKVPool",
    "IndexerInputs",
    "PolicyResult",
    "ResidencyTable",
    "SparseDecodeConfig",
    "SparseDecodeOffload",
    "StepResult",
    "Trace",
    "belady_misses",
    "control_plane_port",
    "make_reuse_trace",
    "simulate_policy",
]
