"""Rows read back from the layerwise store between forwards: a truncated request's partial block, an
adopted prefix (:mod:`torch_kvoffload.core.prefix`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.kv.requests import Request
from torch_kvoffload.layerwise.errors import StoreMissError
from torch_kvoffload.layerwise.runtime import LayerwiseOffloadRuntime

__all__ = ["stored_block", "stored_spans"]


def stored_block(
    rt: LayerwiseOffloadRuntime,
    request_id: int,
    key_tokens: Sequence[int],
    positions: Sequence[int] | None,
    block: int,
    who: str,
) -> list[list[torch.Tensor]]:
    """Every layer's stored record of full block ``block`` of ``key_tokens`` (at ``positions``; ``None``:
    token ``t`` at ``t``): per layer, per component, a host ``[block_size, D]`` tensor.
    :class:`StoreMissError` (a ``RuntimeError``) naming ``who`` and request ``request_id`` when the store no
    longer gives it (evicted, damaged, its write failed)."""
    bs = rt.block_size
    end = (block + 1) * bs
    rows = rt.read_block(key_tokens[:end], block, None if positions is None else positions[:end])
    if rows is None:
        raise StoreMissError(
            f"{who}: the host store no longer holds block {block} of request {request_id} (tokens "
            f"{block * bs}..{end - 1}): evicted, damaged or its write failed; raise the store capacity "
            "(layerwise.store.capacity_bytes, or prefix_store's without layerwise offload)"
        )
    return rows


def stored_spans(
    rt: LayerwiseOffloadRuntime,
    requests: Sequence[Request],
    key_tokens: Sequence[Sequence[int]],
    positions: Sequence[Sequence[int] | None],
    spans: Sequence[tuple[int, int]],
) -> list[list[torch.Tensor]]:
    """Per layer, per component, the stored rows of tokens ``spans[r] = (start, end)`` of each request one
    after the other (host ``[sum of the spans, D]``), from the blocks of ``key_tokens[r]`` at
    ``positions[r]``, each block read once for every layer. :class:`StoreMissError` as :func:`stored_block`."""
    bs = rt.block_size
    per_layer: list[list[list[torch.Tensor]]] | None = None
    for r, keys, pos, (start, end) in zip(requests, key_tokens, positions, spans, strict=True):
        for block in range(start // bs, -(-end // bs)):
            rows = stored_block(rt, r.id, keys, pos, block, "prefix reuse")
            if per_layer is None:
                per_layer = [[[] for _ in layer] for layer in rows]
            lo, hi = max(start - block * bs, 0), min(end - block * bs, bs)
            for layer, stored in enumerate(rows):
                for c, comp in enumerate(stored):
                    per_layer[layer][c].append(comp[lo:hi])
    assert per_layer is not None, "stored_spans: every span is empty"
    return [[torch.cat(parts) for parts in layer] for layer in per_layer]
