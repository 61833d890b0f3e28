"""``KVLayout``: the sizes every device cache of a model's KV is allocated for."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVLayout"]


@dataclass(frozen=True)
class KVLayout:
    """What the device caches are sized for: ``slots`` requests of ``tokens`` tokens each, paged in blocks
    of ``block_size``. Per-request caches (indexer cache, resident KV) hold one page of ``tokens`` rows per
    slot, or, with ``paged_by_block`` (a P/D decode peer writes them block by block), the slot's blocks."""

    slots: int
    tokens: int
    block_size: int
    paged_by_block: bool = False

    @property
    def blocks_per_request(self) -> int:
        """Blocks of ``block_size`` tokens each slot owns in the paged caches (``M``)."""
        return -(-self.tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks of a paged cache: ``slots * M``."""
        return self.slots * self.blocks_per_request

    @property
    def page(self) -> tuple[int, int]:
        """``(rows per page, pages per slot)`` of the per-request caches."""
        if self.paged_by_block:
            return self.block_size, self.blocks_per_request
        return self.tokens, 1
