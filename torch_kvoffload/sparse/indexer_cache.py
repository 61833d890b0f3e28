"""``IndexerCache``: the device indexer cache of the sparse backends (offloaded and resident).

Per layer, in the per-request paging of :class:`~torch_kvoffload.kv.paged.SlotPages`, in one of the
formats of ``sparse.indexer_dtype``: ``"bf16"``, the indexer keys ``[pages, page, Di]`` in the model's
dtype; ``"int8"``, Hadamard-rotated int8 keys and their fp32 dequant scales ``[pages, page]`` (DESIGN §7,
"LIC8"); ``"fp8_e4m3"``, Hadamard-rotated FP8 rows ``uint8 [pages, page, Di + 4 * Di / 128]`` (DeepSeek's
132-byte indexer rows for ``Di = 128``; :mod:`torch_kvoffload.ops.fp8_indexer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from torch_kvoffload.kv.backend import IndexerView, NewRows
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.fp8_rows import index_fp8_rows
from torch_kvoffload.kv.paged import SlotPages
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.ops.fp8 import index_row_bytes
from torch_kvoffload.ops.indexer import hadamard_quant_int8
from torch_kvoffload.sparse.config import IndexerDtype

__all__ = ["IndexerCache", "index_components", "index_values"]


def index_components(spec: ModelSpec, fmt: IndexerDtype) -> list[tuple[int | None, torch.dtype]]:
    """``(width or None, dtype)`` of each tensor an indexer cache of ``fmt`` keeps per layer (``None``: one
    value per row)."""
    if fmt == "int8":
        return [(spec.index_head_dim, torch.int8), (None, torch.float32)]
    if fmt == "fp8_e4m3":
        return [(index_row_bytes(spec.index_head_dim), torch.uint8)]
    return [(spec.index_head_dim, spec.dtype)]


def index_values(fmt: IndexerDtype, layer: int, fwd: ForwardPlan, rows: NewRows) -> list[torch.Tensor]:
    """What a cache of ``fmt`` keeps of ``rows.index_k [N, Di]`` (the model's keys), one tensor per
    component: quantised here for int8; for FP8 once per layer for every cache of the forward keeping FP8
    rows (:func:`~torch_kvoffload.kv.fp8_rows.index_fp8_rows`), or rows as kept, ``uint8 [N, row bytes]``
    from :meth:`IndexerCache.read_stored`, as they are."""
    index_k = rows.index_k
    assert index_k is not None
    if fmt == "int8":
        return list(hadamard_quant_int8(index_k))
    if fmt == "fp8_e4m3":
        return [index_fp8_rows(fwd, layer, rows)]
    return [index_k]


class IndexReads:
    """Reading an indexer cache's rows back, for a cache of format ``fmt`` whose ``read(layer, requests)``
    gives per request a copy of each component's rows ``0 .. length - 1``."""

    fmt: IndexerDtype
    read: Callable[[int, Sequence[Request]], list[list[torch.Tensor]]]

    def read_keys(self, layer: int, requests: Sequence[Request]) -> list[torch.Tensor]:
        """Per request, a copy of its indexer keys ``[length, Di]`` of ``layer`` as written (model dtype).
        ``RuntimeError`` for a quantized cache: its rotated, quantised rows do not give the written keys
        back."""
        if self.fmt != "bf16":
            raise RuntimeError(
                f"the indexer cache keeps {self.fmt} rows (Hadamard-rotated and quantised: "
                f"sparse.indexer_dtype={self.fmt!r}), which do not give the model's indexer keys back exactly; "
                "use the default indexer_dtype to read them"
            )
        return [parts[0] for parts in self.read(layer, requests)]

    def read_stored(self, layer: int, requests: Sequence[Request]) -> list[torch.Tensor]:
        """Per request, a copy of its rows of ``layer`` as kept (FP8: ``uint8 [length, row bytes]``; the
        model's keys for ``"bf16"``). ``RuntimeError`` for int8 (keys and scales are kept apart)."""
        if self.fmt == "int8":
            raise RuntimeError(
                "the int8 indexer cache keeps keys and scales apart; it has no stored rows to read"
            )
        return [parts[0] for parts in self.read(layer, requests)]


class IndexerCache(IndexReads, SlotPages):
    """The indexer keys of ``spec``'s layers kept as ``fmt`` (see the module docstring)."""

    def __init__(self, spec: ModelSpec, fmt: IndexerDtype) -> None:
        super().__init__(spec.num_layers, index_components(spec, fmt), spec.device)
        self.fmt: IndexerDtype = fmt

    def write_keys(self, layer: int, fwd: ForwardPlan, rows: NewRows) -> None:
        """Write ``rows.index_k`` as :func:`index_values` keeps them at ``fwd``'s flat rows ``index_phys`` of
        ``layer``."""
        self.write(layer, fwd.index_phys, index_values(self.fmt, layer, fwd, rows))

    def fwd_table(self, fwd: ForwardPlan) -> torch.Tensor:
        """``int32 [B, pages]``: the pages of ``fwd``'s requests."""
        return fwd.index_table

    def view(self, layer: int, fwd: ForwardPlan, top_k: int) -> IndexerView:
        """``layer``'s cache as the indexer of forward ``fwd`` reads it (the requests' pages)."""
        return IndexerView(self.layers[layer], fwd.index_table, top_k, fmt=self.fmt)
