"""``KVLayout``: the sizes every device cache of a model's KV is allocated for."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    # (slots of a forward's requests, device) -> their tables, most recent last (see tables())
    _tables: dict[tuple[tuple[int, ...], torch.device], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )  # not an init field: dataclasses.replace() (a resized layout) starts with none

    #: How many sets of slots keep their tables (a batch's decode steps reuse one set)
    KEPT_TABLES = 8

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

    def tables(self, slots: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table int32 [B, M], index_table int32 [B, pages])`` of requests in device ``slots``: a
        slot's blocks and pages are its own contiguous ranges. Read only: kept for the next forwards of the
        same slots (every decode step of a batch), the last :attr:`KEPT_TABLES` sets, with this layout."""
        key = (slots, device)
        found = self._tables.pop(key, None)
        if found is None:
            M, pages = self.blocks_per_request, self.page[1]
            with torch.inference_mode(False):  # kept across forwards: never an inference tensor
                s = torch.tensor(slots, dtype=torch.int64)[:, None]
                found = (
                    (s * M + torch.arange(M)).to(device=device, dtype=torch.int32),
                    (s * pages + torch.arange(pages)).to(device=device, dtype=torch.int32),
                )
            while len(self._tables) >= self.KEPT_TABLES:
                self._tables.pop(next(iter(self._tables)))
        self._tables[key] = found  # the most recent last
        return found
