"""Order the offload passes and run them over a captured graph."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch.fx as fx

from torch_kvoffload.passes import _graph as g
from torch_kvoffload.passes.absorb import AbsorbMLAPass
from torch_kvoffload.passes.context import PassContext
from torch_kvoffload.passes.kvpp import KVPPHooksPass
from torch_kvoffload.passes.layerwise import LayerwiseHooksPass

__all__ = ["OffloadPass", "OffloadPassManager", "PassReport", "default_passes"]


class OffloadPass(Protocol):
    """A pass: a name, a stable ``uuid()`` (changes when its rewrite changes) and a call over a graph."""

    name: str

    def uuid(self) -> str: ...

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> list[g.PassRecord]: ...


@dataclass
class PassReport:
    """What a manager run did: every record, in order, and the graph's layer-cache inputs."""

    records: list[g.PassRecord] = field(default_factory=list)
    cache_inputs: list[tuple[int, int]] = field(default_factory=list)

    def layers(self) -> list[int]:
        return sorted({r.layer for r in self.records if r.layer >= 0})

    def for_layer(self, layer: int) -> list[g.PassRecord]:
        return [r for r in self.records if r.layer == layer]


def default_passes() -> list[OffloadPass]:
    """Absorb first (it creates the write nodes the hooks anchor on), then layerwise, then KVPP."""
    return [AbsorbMLAPass(), LayerwiseHooksPass(), KVPPHooksPass()]


class OffloadPassManager:
    """Run ``passes`` in order; each one lints and recompiles the graph it changed."""

    def __init__(self, passes: Sequence[OffloadPass] | None = None) -> None:
        self.passes = list(default_passes() if passes is None else passes)
        names = [p.name for p in self.passes]
        if len(set(names)) != len(names):
            raise ValueError(f"OffloadPassManager: pass names must be unique, got {names}")

    def uuid(self) -> str:
        """A key for caching compiled graphs: changes when any pass or their order changes."""
        return hashlib.sha256("|".join(p.uuid() for p in self.passes).encode()).hexdigest()[:16]

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassReport:
        for p in self.passes:
            p(gm, ctx)
        return PassReport(records=list(g.records(gm)), cache_inputs=list(g.cache_inputs(gm)))
