"""Per-rank physical cache plan and memory budget of KVPP.

Bytes per block on a rank::

    Σ owned target-bundle bytes/block + local draft (MTP) bytes/block + 2 × largest target-bundle bytes/block

and ``blocks = floor(available / bytes per block)``. The two scratch buffers are each rounded up to a
multiple of 2 MiB (:data:`SCRATCH_ALIGNMENT`); :meth:`KVPPPlan.num_blocks` gives up the few blocks that
padding would push over the budget, so an allocation of that many blocks always fits. The logical cache
(block numbering, per-layer specs) is unchanged: only physical placement differs between ranks, and every
rank of a group must use the same block count (:meth:`KVPPPlan.group_num_blocks`).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch_kvoffload._utils import round_up

__all__ = ["SCRATCH_ALIGNMENT", "SCRATCH_BUFFER_COUNT", "KVPPPlan"]

# One scratch buffer for the layer being computed, one for the next layer's prefetch.
SCRATCH_BUFFER_COUNT = 2
SCRATCH_ALIGNMENT = 2 * 1024 * 1024


class KVPPPlan:
    """Where each layer's bundle lives on one rank.

    Parameters
    ----------
    bundle_bytes_per_block : {target layer index: bundle bytes per block}
    owners : {target layer index: group-local owner id}; keys must equal ``bundle_bytes_per_block``'s.
    rank : this rank's group-local id.
    draft_bytes_per_block : bytes per block of the draft / MTP caches this rank allocates locally.
    """

    def __init__(
        self,
        bundle_bytes_per_block: Mapping[int, int],
        owners: Mapping[int, int],
        rank: int,
        draft_bytes_per_block: int = 0,
    ) -> None:
        if set(bundle_bytes_per_block) != set(owners):
            missing = sorted(set(bundle_bytes_per_block) ^ set(owners))
            raise ValueError(
                f"KVPPPlan: every target layer needs a bundle size and an owner; mismatch at {missing}"
            )
        for layer, nbytes in bundle_bytes_per_block.items():
            if not isinstance(nbytes, int) or nbytes <= 0:
                raise ValueError(
                    f"KVPPPlan: bundle bytes per block of layer {layer} must be positive, got {nbytes!r}"
                )
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"KVPPPlan: argument 'rank' must be a non-negative int, got {rank!r}")
        if not isinstance(draft_bytes_per_block, int) or draft_bytes_per_block < 0:
            raise ValueError(
                f"KVPPPlan: argument 'draft_bytes_per_block' must be a non-negative int, got {draft_bytes_per_block!r}"
            )
        self.bundle_bytes_per_block = dict(bundle_bytes_per_block)
        self.owners = dict(owners)
        self.rank = rank
        self.draft_bytes_per_block = draft_bytes_per_block
        self.target_layers = sorted(self.owners)
        self._target_index = {layer: i for i, layer in enumerate(self.target_layers)}
        self.owned = [layer for layer in self.target_layers if self.owners[layer] == rank]
        self.owned_bytes_per_block = sum(self.bundle_bytes_per_block[layer] for layer in self.owned)
        self.scratch_bytes_per_block = max(self.bundle_bytes_per_block.values(), default=0)

    # ------------------------------------------------------------------------------------------ budget

    @property
    def bytes_per_block(self) -> int:
        """Σ owned bundle bytes/block + local draft bytes/block + 2 × largest target bundle bytes/block."""
        return (
            self.owned_bytes_per_block
            + self.draft_bytes_per_block
            + SCRATCH_BUFFER_COUNT * self.scratch_bytes_per_block
        )

    def scratch_buffer_bytes(self, num_blocks: int) -> int:
        """Size of one scratch buffer: the largest target bundle for ``num_blocks``, 2 MiB aligned."""
        return round_up(self.scratch_bytes_per_block * num_blocks, SCRATCH_ALIGNMENT)

    def allocation_bytes(self, num_blocks: int) -> int:
        """Bytes an allocation of ``num_blocks`` blocks takes (the formula plus scratch padding)."""
        return (self.owned_bytes_per_block + self.draft_bytes_per_block) * num_blocks + (
            SCRATCH_BUFFER_COUNT * self.scratch_buffer_bytes(num_blocks)
        )

    def num_blocks(self, available_bytes: int) -> int:
        """``floor(available / bytes_per_block)``, less any block the 2 MiB scratch padding would not fit."""
        if available_bytes < 0:
            raise ValueError(
                f"KVPPPlan.num_blocks: available_bytes must be non-negative, got {available_bytes}"
            )
        if self.bytes_per_block == 0:
            return 0
        n = available_bytes // self.bytes_per_block
        while n > 0 and self.allocation_bytes(n) > available_bytes:
            n -= 1
        return n

    def group_num_blocks(self, available_bytes: int, group_size: int) -> int:
        """The block count every rank of the group can hold (the minimum over the group's plans)."""
        return min(
            KVPPPlan(self.bundle_bytes_per_block, self.owners, r, self.draft_bytes_per_block).num_blocks(
                available_bytes
            )
            for r in range(group_size)
        )

    # --------------------------------------------------------------------------------------- placement

    def _check_target(self, layer: int) -> None:
        if layer not in self._target_index:
            raise KeyError(
                f"KVPPPlan: layer {layer} is not a target layer of this plan ({self.target_layers})"
            )

    def is_target(self, layer: int) -> bool:
        return layer in self._target_index

    def is_persistent(self, layer: int) -> bool:
        """Owned target layers (and draft layers, which are always local) have a persistent buffer."""
        if layer not in self._target_index:
            return True
        return self.owners[layer] == self.rank

    def target_index(self, layer: int) -> int:
        self._check_target(layer)
        return self._target_index[layer]

    def scratch_index(self, layer: int) -> int:
        """Which of the two scratch buffers a target layer uses here: its index among target layers % 2."""
        return self.target_index(layer) % SCRATCH_BUFFER_COUNT

    def next_target(self, layer: int) -> int | None:
        i = self.target_index(layer) + 1
        return self.target_layers[i] if i < len(self.target_layers) else None

    def describe(self) -> dict:
        """Picklable description of what every rank of the group must agree on."""
        return {
            "owners": sorted(self.owners.items()),
            "bundle_bytes_per_block": sorted(self.bundle_bytes_per_block.items()),
        }
