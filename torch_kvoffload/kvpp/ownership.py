"""Layer ownership: contiguous, balanced ranges of a PP stage's target layers per KVPP rank."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["assign_owners", "extract_layer_index", "owned_layers"]

_INDEX = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)(?:\.|$)")


def extract_layer_index(name: str) -> int:
    """The layer index in a module / cache name such as ``model.layers.7.self_attn.attn``."""
    match = _INDEX.search(name)
    if match is None:
        numbers = re.findall(r"\.(\d+)(?:\.|$)", name)
        if len(numbers) != 1:
            raise ValueError(f"extract_layer_index: cannot find one layer index in {name!r}")
        return int(numbers[0])
    return int(match.group(1))


def assign_owners(
    layer_indices: Iterable[int], size: int, draft_layers: Iterable[int] = ()
) -> dict[int, int]:
    """Map each target layer of one PP stage to its group-local owner rank.

    The target layers (``layer_indices`` minus ``draft_layers``) are sorted and split into ``size``
    contiguous ranges: ``base, rem = divmod(n, size)``, ranks ``0 .. rem-1`` own ``base + 1`` layers, the
    others ``base``. The result depends only on the set of layers, not on the input order. Draft / MTP
    layers get no owner (they are allocated locally on every rank). When ``size`` exceeds the number of
    target layers, the trailing ranks own nothing.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"assign_owners: argument 'size' must be a positive integer, got {size!r}")
    layers = list(layer_indices)
    if len(set(layers)) != len(layers):
        dup = sorted({i for i in layers if layers.count(i) > 1})
        raise ValueError(f"assign_owners: argument 'layer_indices' repeats layers {dup}")
    if any(i < 0 for i in layers):
        raise ValueError(f"assign_owners: layer indices must be non-negative, got {sorted(layers)}")
    drafts = set(draft_layers)
    targets = sorted(i for i in layers if i not in drafts)
    base, rem = divmod(len(targets), size)
    owners: dict[int, int] = {}
    start = 0
    for rank in range(size):
        count = base + int(rank < rem)
        for layer in targets[start : start + count]:
            owners[layer] = rank
        start += count
    return owners


def owned_layers(owners: dict[int, int], rank: int) -> list[int]:
    """The layers ``rank`` owns, sorted."""
    return sorted(layer for layer, owner in owners.items() if owner == rank)
