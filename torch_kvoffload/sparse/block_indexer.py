"""``BlockIndexerCache``: hybrid sparse attention's indexer cache, blocks taken as requests grow.

The same formats and interface as :class:`~torch_kvoffload.sparse.indexer_cache.IndexerCache` (which keeps a
page of ``tokens`` rows for every request slot from sizing on), over a
:class:`~torch_kvoffload.sparse.device_blocks.DeviceBlocks` pool keyed by request slot: a request holds
blocks for the rows it has, so the device holds the indexer keys of the live requests' rows only, and the
budget that is not needed for them goes to resident latent rows. Per layer the indexer ops read
``[num_blocks, block_size, ·]`` views through a table of each request's blocks (:meth:`fwd_table`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.kv.backend import IndexerView, NewRows
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.sparse.config import IndexerDtype
from torch_kvoffload.sparse.device_blocks import DeviceBlocks
from torch_kvoffload.sparse.indexer_cache import IndexReads, index_components, index_values

__all__ = ["BlockIndexerCache"]


class BlockIndexerCache(IndexReads):
    """The indexer keys of ``spec``'s layers kept as ``fmt`` in blocks of ``block_size`` rows (see the module
    docstring). Its owner sizes :attr:`blocks` and gives requests blocks (``blocks.ensure(slot, rows)``)
    before their rows are written."""

    def __init__(self, spec: ModelSpec, fmt: IndexerDtype, block_size: int) -> None:
        self.fmt: IndexerDtype = fmt
        self.components = index_components(spec, fmt)
        self.blocks = DeviceBlocks(spec.num_layers, self.components, block_size, spec.device)
        self._views: tuple[list, list[tuple[torch.Tensor, ...]]] = ([], [])

    @property
    def layers(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer the paged views of its components (made again after the pool is reallocated)."""
        if self._views[0] is not self.blocks.layers:
            self._views = (self.blocks.layers, [self.blocks.paged(i) for i in range(len(self.blocks.layers))])
        return self._views[1]

    @property
    def built(self) -> bool:
        return self.blocks.built

    def allocate(self, layout: KVLayout, live: Sequence[Request] = ()) -> None:
        """A new layout drops every request's rows (``live`` empty); a grown one keeps them (blocks do not
        depend on the layout)."""
        if not live:
            self.blocks.free()

    def free(self) -> None:
        self.blocks.free()

    def slot_pages(self, slot: int) -> list[int]:
        """The blocks request slot ``slot`` holds (given by its owner), in row order."""
        return self.blocks.blocks_of(slot)

    def copy_rows(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Slot ``dst_slot`` gets blocks for and a copy of ``src_slot``'s first ``n`` rows of every layer."""
        if not self.blocks.ensure(dst_slot, n):
            raise RuntimeError(f"BlockIndexerCache.copy_rows: no free blocks for {n} rows of slot {dst_slot}")
        self.blocks.copy_rows(src_slot, dst_slot, n)

    def fwd_table(self, fwd: ForwardPlan) -> torch.Tensor:
        """``int32 [B, blocks]``: the blocks of ``fwd``'s requests (the same tensor for every layer)."""
        table = fwd.memo.get("index_blocks")
        if table is None:
            device = fwd.index_table.device
            table = fwd.memo["index_blocks"] = self.blocks.table(fwd.slots, device).to(torch.int32)
        return table

    def write_keys(self, layer: int, fwd: ForwardPlan, rows: NewRows) -> None:
        """Write ``rows.index_k`` as :func:`~torch_kvoffload.sparse.indexer_cache.index_values` keeps them
        at ``fwd``'s new positions of each request's blocks."""
        at = fwd.memo.get("index_block_rows")
        if at is None:
            slots = fwd.slots
            at = fwd.memo["index_block_rows"] = self.blocks.flat_rows(
                [slots[r] for r in fwd.row.tolist()], fwd.pos.tolist(), fwd.pos.device
            )
        self.blocks.write(layer, at, index_values(self.fmt, layer, fwd, rows))

    def read(self, layer: int, requests: Sequence[Request]) -> list[list[torch.Tensor]]:
        """Per request, per component, a copy of its rows ``0 .. length - 1`` of ``layer``."""
        return [self.blocks.read(layer, r.slot, 0, r.length) for r in requests]

    def view(self, layer: int, fwd: ForwardPlan, top_k: int) -> IndexerView:
        return IndexerView(self.layers[layer], self.fwd_table(fwd), top_k, fmt=self.fmt)

    def tensors(self) -> list[torch.Tensor]:
        return self.blocks.tensors()
