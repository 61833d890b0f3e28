"""``IndexerCache``: the device indexer cache of the sparse backends (offloaded and resident).

Per layer, in the per-request paging of :class:`~torch_kvoffload.kv.paged.SlotPages`: the indexer keys
``[pages, page, Di]`` in the model's dtype, or (``int8``) Hadamard-rotated int8 keys and their fp32 dequant
scales ``[pages, page]`` (DESIGN §7, "LIC8").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.kv.backend import IndexerView
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.paged import SlotPages
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.ops.indexer import hadamard_quant_int8

__all__ = ["IndexerCache"]


class IndexerCache(SlotPages):
    """The indexer keys of ``spec``'s layers (see the module docstring)."""

    def __init__(self, spec: ModelSpec, *, int8: bool) -> None:
        comps = (
            [(spec.index_head_dim, torch.int8), (None, torch.float32)]
            if int8
            else [(spec.index_head_dim, spec.dtype)]
        )
        super().__init__(spec.num_layers, comps, spec.device)
        self.int8 = int8

    def write_keys(self, layer: int, rows_at: torch.Tensor, index_k: torch.Tensor) -> None:
        """Write ``index_k [N, Di]`` at flat rows ``rows_at int64 [N]`` of ``layer`` (quantised for int8)."""
        if self.int8:
            self.write(layer, rows_at, hadamard_quant_int8(index_k))
        else:
            self.write(layer, rows_at, [index_k])

    def read_keys(self, layer: int, requests: Sequence[Request]) -> list[torch.Tensor]:
        """Per request, a copy of its indexer keys ``[length, Di]`` of ``layer`` as written (model dtype).
        ``RuntimeError`` for an int8 cache: the rotated, quantised keys do not give the written ones back."""
        if self.int8:
            raise RuntimeError(
                "the indexer cache keeps int8 keys (Hadamard-rotated, one scale per row: "
                "sparse.indexer_dtype='int8'), which do not give the model's indexer keys back exactly; "
                "use the default indexer_dtype to read them"
            )
        return [parts[0] for parts in self.read(layer, requests)]

    def view(self, layer: int, fwd: ForwardPlan, top_k: int) -> IndexerView:
        """``layer``'s cache as the indexer of forward ``fwd`` reads it (the requests' pages)."""
        return IndexerView(self.layers[layer], fwd.index_table, top_k, quantized=self.int8)
