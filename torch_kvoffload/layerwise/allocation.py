"""Allocate the physical buffers of a :class:`LayerBufferPlan` and hand out per-layer views."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_kvoffload.layerwise.planner import LayerBufferPlan, TensorSpec

__all__ = ["LayerBuffers", "allocate_layer_buffers"]


@dataclass
class LayerBuffers:
    """The device storage of a plan.

    ``main[s]`` / ``indexer[s]``: the component tensors of physical buffer ``s`` (``indexer[s]`` is
    ``None`` where no layer of the buffer has an indexer). Layers sharing a buffer get the very same
    tensors: one address, several logical layers.
    """

    plan: LayerBufferPlan
    main: list[tuple[torch.Tensor, ...]]
    indexer: list[tuple[torch.Tensor, ...] | None]

    def _check_layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer not in self.plan.slot_of:
            raise ValueError(f"LayerBuffers: layer must be in [0, {self.plan.num_layers}), got {layer!r}")
        return self.plan.slot_of[layer]

    def layer_main(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Main-KV components of ``layer`` (views of its physical buffer)."""
        return self.main[self._check_layer(layer)]

    def layer_indexer(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """Indexer components of ``layer``, or ``None`` if the layer has no indexer."""
        slot = self._check_layer(layer)
        specs = self.plan.specs
        if specs is None or specs[layer].indexer is None:
            return None
        return self.indexer[slot]

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, ...]:
        """All cache tensors of ``layer``: main components, then indexer components if any."""
        return self.layer_main(layer) + (self.layer_indexer(layer) or ())

    def allocated_bytes(self) -> int:
        """Bytes of every distinct storage this object holds (main + indexer)."""
        seen: dict[int, int] = {}
        for group in [*self.main, *(g for g in self.indexer if g is not None)]:
            for t in group:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())


def _alloc(specs: tuple[TensorSpec, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(c.shape, dtype=c.dtype, device=device) for c in specs)


def allocate_layer_buffers(plan: LayerBufferPlan, device: torch.device | str | None = None) -> LayerBuffers:
    """Allocate (zero-filled) main and indexer storage for every physical buffer of ``plan``.

    Exactly ``plan.main_bytes + plan.indexer_bytes`` bytes are allocated on ``device`` (default: the
    compute device of :mod:`torch_kvoffload.device`).
    """
    if plan.specs is None or plan.slot_main_specs is None or plan.slot_indexer_specs is None:
        raise ValueError(
            "allocate_layer_buffers: the plan was made from a layer count; plan with cache specs"
        )
    if device is None:
        from torch_kvoffload.device import default_device

        device = default_device()
    device = torch.device(device)
    main = [_alloc(spec, device) for spec in plan.slot_main_specs]
    indexer = [None if spec is None else _alloc(spec, device) for spec in plan.slot_indexer_specs]
    return LayerBuffers(plan, main, indexer)
