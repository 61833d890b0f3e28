"""Layerwise prefill offload: plan shared layer buffers, allocate them, run load / save around each layer.

The hook ops (``torch.ops.kvoffload.layer_wait`` / ``layer_prefetch`` / ``layer_save``) reach a runtime
registered by name in :data:`torch_kvoffload.ops.layer_hooks.runtimes`.
"""

from torch_kvoffload.layerwise.allocation import LayerBuffers, allocate_layer_buffers
from torch_kvoffload.layerwise.build import build_layerwise_runtime
from torch_kvoffload.layerwise.config import LayerwiseConfig
from torch_kvoffload.layerwise.planner import LayerBufferPlan, LayerCacheSpec, TensorSpec, plan_layer_buffers
from torch_kvoffload.layerwise.runtime import (
    CompletionProvider,
    LayerwiseOffloadRuntime,
    PrefixEvictedError,
    SlotPoisonedError,
    StoreMissError,
)

__all__ = [
    "CompletionProvider",
    "LayerBufferPlan",
    "LayerBuffers",
    "LayerCacheSpec",
    "LayerwiseConfig",
    "LayerwiseOffloadRuntime",
    "PrefixEvictedError",
    "SlotPoisonedError",
    "StoreMissError",
    "TensorSpec",
    "allocate_layer_buffers",
    "build_layerwise_runtime",
    "plan_layer_buffers",
]
