"""The hook methods' arguments: the layer index and the optional ``caches`` a caller (or a graph) passes.

``caches`` are the layer's cache tensors in eager code, or copies of them made by a functionalizing
backend; :func:`sync_caches` keeps such copies and the runtime's buffers in step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.layerwise.allocation import LayerBuffers
from torch_kvoffload.ops import sync_copies

__all__ = ["check_caches", "check_layer", "sync_caches"]


def check_layer(fn: str, layer: object, num_layers: int) -> int:
    """``layer`` as an int in ``[0, num_layers)``; ``ValueError`` naming ``LayerwiseOffloadRuntime.{fn}``."""
    if type(layer) is int and 0 <= layer < num_layers:  # the per-layer calls' fast path
        return layer
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(
            f"LayerwiseOffloadRuntime.{fn}: 'layer' must be an int in [0, {num_layers}), got {layer!r}"
        )
    return layer


def check_caches(fn: str, layer: int, caches: Sequence[torch.Tensor] | None, buffers: LayerBuffers) -> None:
    """``caches`` (when given) match ``layer``'s buffers: as many tensors (main components, then indexer),
    each of the buffer's dtype, shape and device."""
    if caches is None:
        return
    own = buffers.layer_caches(layer)
    if len(caches) != len(own):
        raise ValueError(
            f"LayerwiseOffloadRuntime.{fn}: 'caches' of layer {layer} must hold {len(own)} tensors "
            f"(main components, then indexer), got {len(caches)}"
        )
    for i, (t, b) in enumerate(zip(caches, own, strict=True)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"LayerwiseOffloadRuntime.{fn}: 'caches[{i}]' must be a tensor, got {type(t).__name__}"
            )
        if t.dtype != b.dtype:
            raise TypeError(
                f"LayerwiseOffloadRuntime.{fn}: 'caches[{i}]' of layer {layer} must have dtype {b.dtype}, got {t.dtype}"
            )
        if t.shape != b.shape or t.device != b.device:
            raise ValueError(
                f"LayerwiseOffloadRuntime.{fn}: 'caches[{i}]' of layer {layer} must be {list(b.shape)} on "
                f"{b.device}, got {list(t.shape)} on {t.device}"
            )


def sync_caches(
    layer: int, caches: Sequence[torch.Tensor] | None, buffers: LayerBuffers, *, into_buffers: bool
) -> None:
    """Copy ``layer``'s buffers into ``caches`` (``into_buffers`` false: what a reader sees) or ``caches``
    into the buffers (what a writer wrote), skipping tensors that are the buffers themselves."""
    if caches is None:
        return
    own = buffers.layer_caches(layer)
    if into_buffers:
        sync_copies(own, caches)
    else:
        sync_copies(caches, own)
