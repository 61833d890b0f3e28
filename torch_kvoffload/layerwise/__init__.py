"""Layerwise prefill offload: plan shared layer buffers, allocate them, run load / save around each layer."""

from torch_kvoffload.layerwise.allocation import LayerBuffers, allocate_layer_buffers
from torch_kvoffload.layerwise.config import LayerwiseConfig
from torch_kvoffload.layerwise.planner import LayerBufferPlan, LayerCacheSpec, TensorSpec, plan_layer_buffers
from torch_kvoffload.layerwise.runtime import (
    CompletionProvider,
    LayerwiseOffloadRuntime,
    PrefixEvictedError,
    SlotPoisonedError,
    StoreMissError,
    get_runtime,
    register_runtime,
    unregister_runtime,
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
    "get_runtime",
    "plan_layer_buffers",
    "register_runtime",
    "unregister_runtime",
]
