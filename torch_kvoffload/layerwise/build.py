"""``build_layerwise_runtime``: a :class:`~torch_kvoffload.layerwise.LayerwiseConfig` (data) made into a
running :class:`~torch_kvoffload.layerwise.runtime.LayerwiseOffloadRuntime`: plan, allocation, store."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.layerwise.allocation import allocate_layer_buffers
from torch_kvoffload.layerwise.config import LayerwiseConfig
from torch_kvoffload.layerwise.planner import LayerCacheSpec, plan_layer_buffers
from torch_kvoffload.layerwise.runtime import LayerwiseOffloadRuntime
from torch_kvoffload.store.base import KVStore
from torch_kvoffload.store.factory import build_store

__all__ = ["build_layerwise_runtime"]


def build_layerwise_runtime(
    config: LayerwiseConfig,
    specs: Sequence[LayerCacheSpec],
    *,
    device: torch.device | str | None = None,
    store: KVStore | None = None,
) -> LayerwiseOffloadRuntime:
    """Plan, allocate and start a runtime for ``specs`` under ``config``; the store is built from
    ``config.store`` unless one is given."""
    plan = plan_layer_buffers(specs, config.num_shared_buffers, config.independent_layers)
    buffers = allocate_layer_buffers(plan, device)
    return LayerwiseOffloadRuntime(
        plan,
        buffers,
        store if store is not None else build_store(config.store),
        prefetch_depth=config.prefetch_depth,
        model_id=config.model_id,
    )
