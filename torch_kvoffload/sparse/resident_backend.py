"""``ResidentSparseBackend``: sparse attention with the whole main KV resident on the device.

``OffloadConfig(sparse={"offload": False})``: absorbed sparse MLA attention over the lightning indexer's
top-k, what a server runs for V3.2-style models when the KV fits, and the baseline sparse decode offload
is measured against. Per layer the latent ``kv_c [pages, page, Dc]`` and rotary key ``k_pe [pages, page,
Dr]`` live on the device in the model's dtype (or, with ``kv_dtype="fp8_e4m3"``, both in one FP8 row
``uint8 [pages, page, Dc + 4 * Dc / 128 + 2 * Dr]``, DeepSeek's 656-byte format), paged like the indexer
cache (one page of ``tokens`` rows per request, grown in place). Every forward, decode steps included, writes its rows there, selects with
the indexer over the device indexer cache and attends over the selected rows in place: no host pool, no
hot buffers, nothing moved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload._utils import dtype_name, parse_dtype
from torch_kvoffload.kv.backend import IndexerView, KeyRows, KVBackend, NewRows
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.fp8_rows import FP8_KV, check_indexer_format, check_kv_format, latent_fp8_rows
from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.kv.paged import SlotPages
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.ops.fp8 import kv_row_bytes
from torch_kvoffload.sparse.config import SparseOptions
from torch_kvoffload.sparse.indexer_cache import IndexerCache

__all__ = ["ResidentSparseBackend", "resident_rows"]


def resident_rows(spec: ModelSpec, kv_dtype: str | None, mode: str) -> list[tuple[int, torch.dtype]]:
    """``(width, dtype)`` of the tensors a latent row kept on the device takes: the model's ``kv_c`` and
    ``k_pe``, or one ``uint8`` FP8 row (``kv_dtype="fp8_e4m3"``). ``ValueError`` (naming ``mode``) for any
    other ``kv_dtype`` than the model's, or FP8 rows of a ``kv_lora_rank`` not a multiple of 128."""
    check_kv_format(kv_dtype, spec)
    if kv_dtype == FP8_KV:
        return [(kv_row_bytes(spec.kv_lora_rank, spec.rope_dim), torch.uint8)]
    if kv_dtype is not None and parse_dtype("sparse.kv_dtype", kv_dtype) != spec.dtype:
        raise ValueError(
            f"OffloadConfig.sparse: {mode} keeps the latent KV on the device as the model's rows, in its dtype "
            f"{dtype_name(spec.dtype)} or as FP8 rows ({FP8_KV!r}); got kv_dtype={kv_dtype!r}"
        )
    return [(spec.kv_lora_rank, spec.dtype), (spec.rope_dim, spec.dtype)]


class ResidentSparseBackend(KVBackend):
    """Resident sparse attention over ``spec``'s KV under ``options`` (see the module docstring).

    ``ValueError`` when ``sparse.kv_dtype`` names another dtype than the model's or ``"fp8_e4m3"`` (the
    resident KV is the model's own rows or their FP8 rows), or FP8 rows for a ``kv_lora_rank`` that is not a
    multiple of 128.
    """

    name = "resident sparse"

    def __init__(self, spec: ModelSpec, options: SparseOptions) -> None:
        sparse = options
        assert not sparse.offload
        main = resident_rows(spec, sparse.kv_dtype, "offload=False")
        self.fp8 = sparse.kv_dtype == FP8_KV
        self.spec = spec
        self.top_k = sparse.top_k or spec.index_topk
        check_indexer_format(sparse.indexer_dtype or "bf16", spec)
        self.index = IndexerCache(spec, sparse.indexer_dtype or "bf16")
        self.main = SlotPages(spec.num_layers, main, spec.device)
        self._layout: KVLayout | None = None

    @property
    def built(self) -> bool:
        return self.main.built

    def resize(self, layout: KVLayout, live: Sequence[Request]) -> None:
        self._layout = layout
        self.index.allocate(layout, live)
        self.main.allocate(layout, live)

    def free(self) -> None:
        self.index.free()
        self.main.free()

    def fork(self, layout: KVLayout, src: Request, dst: Request, length: int) -> None:
        """Copy ``src``'s first ``length`` rows of every layer (main KV and indexer keys) to ``dst``'s slot."""
        self.index.copy_rows(src.slot, dst.slot, length)
        self.main.copy_rows(src.slot, dst.slot, length)

    def truncate(self, request: Request, length: int) -> None:
        """Nothing to drop: the indexer selects among the request's first ``seq_lens_k`` rows and attention
        reads only the selected ones, so rows past ``length`` are never read before they are rewritten."""

    def layer_caches(self, layer: int) -> list[torch.Tensor]:
        if not self.main.built:
            return []
        return [*self.index.layers[layer], *self.main.layers[layer]]

    def write(self, layer: int, fwd: ForwardPlan, rows: NewRows) -> None:
        assert rows.index_k is not None
        if self.fp8:  # uint8: FP8 rows as kept (a prefix's stored rows), written as they are
            main = [latent_fp8_rows(fwd, layer, rows)]
        else:
            main = [rows.kv_c, rows.k_pe]
        self.main.write(layer, fwd.index_phys, main)
        self.index.write_keys(layer, fwd, rows)

    def keys(self, layer: int, fwd: ForwardPlan) -> KeyRows:
        assert self._layout is not None
        page, pages = self._layout.page
        starts = [s * pages * page for s in fwd.slots]
        if self.fp8:
            (rows,) = self.main.flat(layer)
            return KeyRows(rows, rows[:, :0], starts, fp8=True)
        kv_c, k_pe = self.main.flat(layer)
        return KeyRows(kv_c, k_pe, starts)

    def read(
        self, layer: int, requests: Sequence[Request], part: str, start: int = 0, *, stored: bool = False
    ) -> list[torch.Tensor] | None:
        """Copies of the requests' resident rows (main KV pages, indexer cache) from ``start`` on (``stored``:
        rows as kept, FP8 rows too)."""
        if not self.main.built:
            return None
        if part == "index_k":
            keys = self.index.read_stored if stored else self.index.read_keys
            return [k[start:] for k in keys(layer, requests)]
        if self.fp8 and not stored:
            raise RuntimeError(
                f"the resident KV keeps FP8 rows (sparse.kv_dtype={FP8_KV!r}), which do not give the model's "
                "latent KV back exactly; use the model's dtype to read it"
            )
        at = 0 if part == "kv_c" else 1
        return [parts[at][start:] for parts in self.main.read(layer, requests)]

    def indexer(self, layer: int, fwd: ForwardPlan) -> IndexerView:
        """The configured top-k (default the model's ``index_topk``), at most the reserved tokens: a top-k
        covering every row selects them all."""
        assert self._layout is not None
        return self.index.view(layer, fwd, min(self.top_k, self._layout.tokens))

    def device_tensors(self) -> list[torch.Tensor]:
        return self.index.tensors() + self.main.tensors()
