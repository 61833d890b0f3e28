"""Physical KVPP cache allocation: persistent owned bundles, two shared scratch buffers, local drafts.

Every buffer is a flat ``uint8`` tensor; a layer's components are typed views into its bundle span
(:mod:`torch_kvoffload.kvpp.layout`). Non-owned target layers alias one of two scratch buffers, chosen by
:meth:`KVPPPlan.scratch_index`, each sized for the largest target bundle (2 MiB aligned) so that any layer
fits; a smaller bundle uses the buffer's prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from torch_kvoffload.kvpp.blocks import run_byte_ranges
from torch_kvoffload.kvpp.layout import BundleSpec
from torch_kvoffload.kvpp.plan import SCRATCH_BUFFER_COUNT, KVPPPlan

logger = logging.getLogger(__name__)

__all__ = ["KVPPAllocation"]


class KVPPAllocation:
    """The buffers of one rank for ``num_blocks`` blocks.

    Parameters
    ----------
    plan : the rank's :class:`KVPPPlan`.
    bundles : {target layer: BundleSpec}; bytes per block must match the plan's.
    num_blocks : blocks per layer (same on every rank of the group).
    device : where the buffers live.
    draft_bundles : {draft / MTP layer: BundleSpec}, allocated locally; their bytes per block must sum
        to ``plan.draft_bytes_per_block``.
    zero : zero-fill the buffers (default) instead of leaving them uninitialised.
    """

    def __init__(
        self,
        plan: KVPPPlan,
        bundles: Mapping[int, BundleSpec],
        num_blocks: int,
        device: torch.device | str = "cpu",
        draft_bundles: Mapping[int, BundleSpec] | None = None,
        *,
        zero: bool = True,
    ) -> None:
        draft_bundles = dict(draft_bundles or {})
        if set(bundles) != set(plan.target_layers):
            raise ValueError(
                f"KVPPAllocation: bundles cover layers {sorted(bundles)}, the plan's targets are {plan.target_layers}"
            )
        for layer, spec in bundles.items():
            if spec.bytes_per_block != plan.bundle_bytes_per_block[layer]:
                raise ValueError(
                    f"KVPPAllocation: layer {layer} bundle has {spec.bytes_per_block} bytes per block, "
                    f"the plan expects {plan.bundle_bytes_per_block[layer]}"
                )
        overlap = set(draft_bundles) & set(bundles)
        if overlap:
            raise ValueError(f"KVPPAllocation: draft layers {sorted(overlap)} are also target layers")
        draft_bpb = sum(s.bytes_per_block for s in draft_bundles.values())
        if draft_bpb != plan.draft_bytes_per_block:
            raise ValueError(
                f"KVPPAllocation: draft bundles take {draft_bpb} bytes per block, "
                f"the plan expects {plan.draft_bytes_per_block}"
            )
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"KVPPAllocation: num_blocks must be a positive int, got {num_blocks!r}")
        self.plan = plan
        self.bundles = dict(bundles)
        self.draft_bundles = draft_bundles
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        make = torch.zeros if zero else torch.empty

        def alloc(nbytes: int) -> torch.Tensor:
            return make(nbytes, dtype=torch.uint8, device=self.device)

        self.persistent: dict[int, torch.Tensor] = {
            layer: alloc(self.bundles[layer].bytes_per_block * num_blocks) for layer in plan.owned
        }
        self.draft: dict[int, torch.Tensor] = {
            layer: alloc(spec.bytes_per_block * num_blocks) for layer, spec in draft_bundles.items()
        }
        needs_scratch = len(plan.owned) < len(plan.target_layers)
        scratch_bytes = plan.scratch_buffer_bytes(num_blocks) if needs_scratch else 0
        self.scratch: list[torch.Tensor] = [alloc(scratch_bytes) for _ in range(SCRATCH_BUFFER_COUNT)]
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        logger.info(
            "KVPP allocation rank %d: %d blocks, owned layers %s, %d scratch bytes x %d, %d bytes in all",
            plan.rank,
            num_blocks,
            plan.owned,
            scratch_bytes,
            SCRATCH_BUFFER_COUNT,
            self.allocated_bytes,
        )

    # ------------------------------------------------------------------------------------------ sizes

    @property
    def persistent_bytes(self) -> int:
        """Bytes of the owned target bundles plus the local draft caches."""
        return sum(t.numel() for t in self.persistent.values()) + sum(t.numel() for t in self.draft.values())

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() for t in self.scratch)

    @property
    def allocated_bytes(self) -> int:
        return self.persistent_bytes + self.scratch_bytes

    # ------------------------------------------------------------------------------------------ spans

    def spec(self, layer: int) -> BundleSpec:
        if layer in self.bundles:
            return self.bundles[layer]
        if layer in self.draft_bundles:
            return self.draft_bundles[layer]
        raise KeyError(f"KVPPAllocation: layer {layer} has no cache here")

    def buffer_kind(self, layer: int) -> str:
        """``"persistent"``, ``"draft"``, or ``"scratch<i>"``."""
        if layer in self.draft_bundles:
            return "draft"
        if self.plan.is_persistent(layer):
            return "persistent"
        return f"scratch{self.plan.scratch_index(layer)}"

    def bundle_span(self, layer: int) -> torch.Tensor:
        """The layer's whole bundle as one contiguous ``uint8`` tensor (what a broadcast moves)."""
        spec = self.spec(layer)
        if layer in self.draft:
            return self.draft[layer]
        if self.plan.is_persistent(layer):
            return self.persistent[layer]
        return self.scratch[self.plan.scratch_index(layer)][: spec.bytes_per_block * self.num_blocks]

    def run_spans(self, layer: int, runs: list[tuple[int, int]] | None = None) -> list[torch.Tensor]:
        """The parts of ``layer``'s bundle span holding block ``runs`` of every component.

        ``runs``: sorted half-open block runs (:func:`~torch_kvoffload.kvpp.blocks.block_runs`);
        ``None``: every block (the whole span). Returns contiguous 1-D ``uint8`` slices of
        :meth:`bundle_span`, component by component (touching ranges merged).
        """
        span = self.bundle_span(layer)
        if runs is None:
            return [span]
        ranges = run_byte_ranges(self.spec(layer).component_bytes_per_block(), self.num_blocks, runs)
        return [span[begin:end] for begin, end in ranges]

    def views(self, layer: int) -> dict[str, torch.Tensor]:
        """Typed views ``{component: [num_blocks, block_size, dim] of its dtype}`` into the bundle span.

        They alias the span's memory (writing one writes the bundle) but are not autograd views of it.
        """
        cached = self._views.get(layer)
        if cached is not None:
            return cached
        spec = self.spec(layer)
        span = self.bundle_span(layer)
        spans, total = spec.layout(self.num_blocks)
        assert total == span.numel()
        out: dict[str, torch.Tensor] = {}
        for comp, (offset, length) in zip(spec.components, spans, strict=True):
            if (span.storage_offset() + offset) % comp.dtype.itemsize:
                raise ValueError(
                    f"KVPPAllocation: component {comp.name!r} of layer {layer} starts at byte {offset}, "
                    f"not aligned to its dtype {comp.dtype}; reorder the bundle's components"
                )
            # A typed alias made with set_(), not a dtype view of the uint8 span: AOT autograd
            # (functionalization) refuses to mutate inputs whose autograd base has another dtype.
            typed = torch.empty(0, dtype=comp.dtype, device=self.device)
            typed.set_(
                span.untyped_storage(),
                (span.storage_offset() + offset) // comp.dtype.itemsize,
                (self.num_blocks, spec.block_size, comp.dim),
            )
            assert typed.numel() * comp.dtype.itemsize == length
            out[comp.name] = typed
        self._views[layer] = out
        return out
