"""Prefill side of P/D transfer: the layerwise runtime's physical layer buffers, made readable by the
decode peer through a transport under stable region names (``slot<s>.main<c>``, ``slot<s>.idx<c>``)."""

from __future__ import annotations

from torch_kvoffload.layerwise import LayerBufferPlan, LayerBuffers
from torch_kvoffload.pd.transports import Transport

__all__ = ["export_layer_buffers", "register_layer_buffers", "slot_regions"]


def _region(slot: int, kind: str, c: int) -> str:
    return f"slot{slot}.{kind}{c}"


def export_layer_buffers(plan: LayerBufferPlan, transport: Transport) -> LayerBuffers:
    """The physical buffers of ``plan`` allocated by ``transport`` (readable by the decode peer), as the
    :class:`LayerBuffers` a :class:`~torch_kvoffload.layerwise.LayerwiseOffloadRuntime` runs on."""
    if plan.slot_main_specs is None or plan.slot_indexer_specs is None:
        raise ValueError("export_layer_buffers: the plan was made from a layer count; plan with cache specs")
    main = [
        tuple(transport.allocate(_region(s, "main", c), t.shape, t.dtype) for c, t in enumerate(specs))
        for s, specs in enumerate(plan.slot_main_specs)
    ]
    indexer = [
        None if specs is None else
        tuple(transport.allocate(_region(s, "idx", c), t.shape, t.dtype) for c, t in enumerate(specs))
        for s, specs in enumerate(plan.slot_indexer_specs)
    ]  # fmt: skip
    return LayerBuffers(plan, main, indexer)


def register_layer_buffers(buffers: LayerBuffers, transport: Transport) -> LayerBuffers:
    """Register already allocated layer buffers (e.g. a model session's) with ``transport`` under the
    region names :func:`export_layer_buffers` uses, for transports that read any registered memory
    (``mooncake``, ``memfabric``); ``shm`` needs its own allocation (:func:`export_layer_buffers`)."""
    if transport.name == "shm":
        raise ValueError(
            "register_layer_buffers: the shm transport reads only memory it allocated; use export_layer_buffers"
        )
    for s, (main, idx) in enumerate(zip(buffers.main, buffers.indexer, strict=True)):
        for c, t in enumerate(main):
            transport.register(_region(s, "main", c), t)
        for c, t in enumerate(idx or ()):
            transport.register(_region(s, "idx", c), t)
    return buffers


def slot_regions(buffers: LayerBuffers) -> list[dict]:
    """Per physical buffer ``{"main": [region ids], "indexer": [region ids]}`` (the HELLO's ``slots``)."""
    return [
        {"main": [_region(s, "main", c) for c in range(len(m))],
         "indexer": [_region(s, "idx", c) for c in range(len(i or ()))]}
        for s, (m, i) in enumerate(zip(buffers.main, buffers.indexer, strict=True))
    ]  # fmt: skip
