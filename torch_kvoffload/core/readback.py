"""Reading a request's KV rows back out of a :class:`~torch_kvoffload.core.kv.KVCore`, wherever its backends
keep them (for callers that show the cache in another layout, e.g. Hugging Face's ``layers[i].keys``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.kv.backend import ROW_PARTS
from torch_kvoffload.kv.requests import Request

__all__ = ["read_rows"]


def read_rows(core: KVCore, layer: int, requests: Sequence[Request], part: str) -> list[torch.Tensor]:
    """Per live request of ``requests`` of ``core``, its rows ``0 .. length - 1`` of ``layer``'s ``part`` (``"kv_c"``
    ``[n, Dc]``, ``"k_pe"`` ``[n, Dr]``, ``"index_k"`` ``[n, Di]``; see :meth:`KVBackend.read`): new
    tensors on the compute device, in the model's dtype, equal to what was written. Between forwards.

    Read from the backend that keeps the whole history: the sparse one (host pool or resident pages;
    indexer cache), else the layerwise one (host store for full blocks, device tails for the partial
    last one). Costs a copy of every row returned (host-to-device for the host tiers; the layerwise
    store is read a whole block of every layer at a time). Refused where the rows cannot be given back
    exactly: ``NotImplementedError`` on a P/D node and with KVPP; ``RuntimeError`` when the backend
    keeps them in a lossy format or no longer holds them.
    """
    where = "read_rows"
    core.check_layer("read_rows", layer)
    if part not in ROW_PARTS:
        raise ValueError(f"{where}: part must be one of {list(ROW_PARTS)}, got {part!r}")
    if part == "index_k" and not core.spec.has_indexer:
        raise ValueError(f"{where}: {core.spec.model_class} has no indexer keys")
    if core.forward is not None:
        raise RuntimeError(f"{where}: a forward is running; read the rows between forwards")
    for r in requests:
        core.requests.get(r.id)  # KeyError naming a request that is not live
    b = core.backends
    if b.role is not None:
        raise NotImplementedError(
            f"{where}: reading the KV back is not supported on a P/D node: its sequence's KV was computed "
            "on the prefill node and placed here by the peer (prefill: it leaves through the transport), "
            "and neither side checks that it holds every row of every layer"
        )
    if b.kvpp is not None:
        raise NotImplementedError(
            f"{where}: reading the KV back is not supported with KVPP: each rank keeps only the layers it "
            "owns (the others' rows arrive by broadcast, into a scratch buffer the next layer reuses)"
        )
    for backend in (b.sparse, b.layerwise):
        rows = backend.read(layer, requests, part) if backend is not None else None
        if rows is not None:
            return rows
    raise RuntimeError(
        f"{where}: no backend keeps the rows of layer {layer} ({part}) now (the caches were released)"
    )
