"""``PrefixStore``: the layerwise store's blocks for prefix reuse when no layerwise offload runs.

A model whose KV lives in the sparse host pool or a resident KV (``OffloadConfig(sparse=...)`` without
``layerwise``) still reuses prompt prefixes (:mod:`torch_kvoffload.core.prefix`): the core stores each
request's full blocks here after the forwards that complete them (read back from the backend that holds
them) and adopts a new prompt's stored prefix from here. The records, keys and checksums are the layerwise
store's (one record per layer and full block, the indexer keys beside the latent KV in the model's dtype, or
as the FP8 indexer cache keeps them, under another namespace),
keyed by the same fingerprint, so a model with layerwise offload and one without, on the same weights and
store (a Mooncake store shared by two servers), find each other's blocks.

No layer buffers: the store is read and written between forwards, block by block, through a layerwise
runtime over one-block host buffers (the record layouts and keys come with it; they do not depend on the
pool size).

A KVPP rank keeps only its owned layers' KV after a forward, so its prefix store holds those layers
(``layers``); their set is in the keys' namespace, so only a rank owning the same layers (of the same
weights) reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.kv.backend import row_parts
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.layerwise.build import build_layerwise_runtime
from torch_kvoffload.layerwise.config import LayerwiseConfig
from torch_kvoffload.layerwise.planner import LayerCacheSpec, TensorSpec
from torch_kvoffload.layerwise.stored import stored_spans
from torch_kvoffload.ops.fp8 import index_row_bytes, kv_row_bytes
from torch_kvoffload.store.base import KVStore
from torch_kvoffload.store.factory import StoreConfig, build_store

__all__ = ["PrefixStore", "store_namespace"]


def store_namespace(
    config: LayerwiseConfig, spec: ModelSpec, indexed: bool, index_fp8: bool = False, kv_fp8: bool = False
) -> LayerwiseConfig:
    """``config`` with the ``model_id`` its store keys carry: the user's, the architecture, the weights
    (fine-tunes of one architecture never share KV), whether the records hold the indexer keys and in which
    formats the records hold the indexer keys and the latent KV (FP8 rows and the model's values never
    mix)."""
    indexer = ("ifp8" if index_fp8 else "i") if indexed else "m"
    parts = (config.model_id, spec.fingerprint, spec.weights_fingerprint, indexer, "kfp8" if kv_fp8 else "")
    return config.model_copy(update={"model_id": "/".join(p for p in parts if p)})


def layer_cache_specs(
    spec: ModelSpec,
    num_blocks: int,
    block_size: int,
    indexed: bool,
    layers: int | None = None,
    index_fp8: bool = False,
    kv_fp8: bool = False,
) -> list[LayerCacheSpec]:
    """``layers`` (default every layer of ``spec``) layers' cache components paged ``[num_blocks, block_size,
    D]`` in the model's dtype: ``kv_c``, ``k_pe`` (main; ``kv_fp8``: one component, the latent KV's FP8 rows
    ``uint8 [num_blocks, block_size, Dc + 4 * Dc / 128 + 2 * Dr]``) and, when ``indexed``, ``index_k``
    (``index_fp8``: the indexer's FP8 rows, ``uint8 [num_blocks, block_size, Di + 4 * Di / 128]``)."""
    dt = spec.dtype
    index = (
        TensorSpec((num_blocks, block_size, index_row_bytes(spec.index_head_dim)), torch.uint8)
        if index_fp8
        else TensorSpec((num_blocks, block_size, spec.index_head_dim), dt)
    )
    idx = (index,) if indexed else None
    main = (
        (TensorSpec((num_blocks, block_size, kv_row_bytes(spec.kv_lora_rank, spec.rope_dim)), torch.uint8),)
        if kv_fp8
        else (
            TensorSpec((num_blocks, block_size, spec.kv_lora_rank), dt),
            TensorSpec((num_blocks, block_size, spec.rope_dim), dt),
        )
    )
    return [LayerCacheSpec(main, idx) for _ in range(spec.num_layers if layers is None else layers)]


class PrefixStore:
    """The store of prefix reuse for ``spec``'s KV without layerwise offload (see the module docstring).

    Parameters
    ----------
    spec : ModelSpec
        With the weights' fingerprint: the store keys carry it.
    index_fp8 : bool
        The records hold the indexer keys as FP8 rows (``sparse.indexer_dtype="fp8_e4m3"``: the rows the
        indexer cache keeps, byte for byte), under their own namespace.
    kv_fp8 : bool
        The records hold the latent KV as FP8 rows (``sparse.kv_dtype="fp8_e4m3"``: one component, the rows
        the host pool or the resident KV keeps, byte for byte), under their own namespace.
    store : StoreConfig
        The host KV pool (``local`` arena, Mooncake, memcache).
    block_size : int
    layers : sequence of int, optional
        The layers whose blocks it holds (a KVPP rank's owned layers; default every layer). The rows
        :meth:`write_block` takes and :meth:`stored_rows` returns are these layers', in this order.
    """

    name = "prefix store"

    def __init__(
        self,
        spec: ModelSpec,
        store: StoreConfig,
        *,
        block_size: int,
        layers: Sequence[int] | None = None,
        index_fp8: bool = False,
        kv_fp8: bool = False,
    ) -> None:
        self.spec, self.block_size = spec, block_size
        self.indexed = spec.has_indexer
        self.index_fp8 = index_fp8 and self.indexed
        self.kv_fp8 = kv_fp8
        #: the components of its records, in order
        self.parts = row_parts(kv_fp8, self.indexed)
        every = list(range(spec.num_layers))
        self.layers: list[int] = every if layers is None else sorted(layers)
        if not self.layers or not set(self.layers) <= set(every):
            raise ValueError(f"PrefixStore: layers must be some of {every}, got {layers}")
        config = store_namespace(LayerwiseConfig(store=store), spec, self.indexed, self.index_fp8, kv_fp8)
        if self.layers != every:  # the keys of layer i below are this rank's i-th owned layer's
            owned = "layers=" + ",".join(map(str, self.layers))
            config = config.model_copy(update={"model_id": f"{config.model_id}/{owned}"})
        specs = layer_cache_specs(spec, 1, block_size, self.indexed, len(self.layers), self.index_fp8, kv_fp8)
        self.store: KVStore = build_store(store)
        try:
            self.runtime = build_layerwise_runtime(config, specs, device="cpu", store=self.store)
        except BaseException:
            self.store.close()
            raise

    #: always built: the one-block runtime is kept (PrefixReuse rebuilds a released layerwise backend)
    built = True

    def rebuild(self, layout: object) -> None:
        """Nothing to build again (the layerwise backend's interface)."""

    def free(self) -> None:
        """Nothing to release (the layerwise backend's interface)."""

    def cached_prefix(self, tokens: Sequence[int], positions: Sequence[int] | None) -> int:
        """Leading tokens of a prompt ``tokens`` (its KV computed at ``positions``; ``None``: token ``t`` at
        ``t``) whose KV every layer has in the store: whole blocks, at least one token left to compute."""
        return self.runtime.lookup(list(tokens), positions)

    def adopt(self, request: Request, key_tokens: Sequence[int], positions: Sequence[int] | None) -> None:
        """Nothing kept here: the adopted rows go to the backends that hold the request's KV."""

    def stored_blocks(self, request: Request) -> int:
        """Leading full blocks of ``request`` every layer has in the store."""
        return self.runtime.stored_blocks(list(request.tokens), self._positions(request))

    def write_block(self, request: Request, block: int, rows: Sequence[Sequence[torch.Tensor]]) -> None:
        """Store full block ``block`` of ``request`` (a keyed one) from ``rows`` (per layer: ``kv_c``,
        ``k_pe`` [, ``index_k``], host ``[block_size, D]`` in the model's dtype; ``index_k`` as the indexer
        cache keeps it with ``index_fp8``)."""
        self.runtime.write_block(list(request.tokens), block, self._positions(request), rows)

    def stored_rows(
        self,
        requests: Sequence[Request],
        key_tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int] | None],
        spans: Sequence[tuple[int, int]],
    ) -> list[list[torch.Tensor]]:
        """As :meth:`LayerwiseBackend.stored_rows`: per layer, per component, the stored rows of
        ``spans[r]`` of each request one after the other (host). ``StoreMissError`` when a block is gone."""
        return stored_spans(self.runtime, requests, key_tokens, positions, spans)

    @staticmethod
    def _positions(r: Request) -> list[int] | None:
        return None if r.positions is None else r.positions[: r.length]

    def stats(self) -> dict[str, float]:
        """The store's figures (summed with the other backends' under the same names)."""
        store = self.store.counters.snapshot()
        return {
            "corrupt_records": store.get("corrupt_records", 0),
            "store_errors": store.get("store_errors", 0) + self.runtime.counters.get("store_errors"),
        }

    def close(self) -> None:
        try:
            self.runtime.close()
        finally:
            self.store.close()
