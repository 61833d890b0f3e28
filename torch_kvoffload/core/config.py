"""``OffloadConfig``: which capabilities an offloaded model runs, and how.

It groups the capability configs (each ``None`` = off, or the capability's own config given as a model or a
dict, ``{}`` = on with defaults): :class:`~torch_kvoffload.layerwise.LayerwiseConfig`,
:class:`~torch_kvoffload.sparse.config.SparseOptions`
(sparse attention over the lightning indexer's top-k, with the main KV offloaded to a host pool or
resident on the device), :class:`~torch_kvoffload.kvpp.KVPPConfig` and :class:`~torch_kvoffload.pd.PDConfig`.
The configs are data: fields the model determines are resolved by each feature when its backend is built
(:func:`~torch_kvoffload.sparse.config.resolve_sparse_config`,
:func:`~torch_kvoffload.kvpp.config.resolve_kvpp_config`). Invalid combinations raise ``ValueError`` at
construction.
"""

from __future__ import annotations

from pydantic import Field, StrictBool, StrictInt, model_validator

from torch_kvoffload.config import ConfigModel
from torch_kvoffload.kv.fp8_rows import FP8_KV
from torch_kvoffload.kvpp.config import KVPPConfig
from torch_kvoffload.layerwise.config import LayerwiseConfig
from torch_kvoffload.pd.config import PDConfig
from torch_kvoffload.sparse.config import MAX_BLOCK_SIZE, SparseOptions
from torch_kvoffload.store.factory import StoreConfig

__all__ = ["DEFAULT_BLOCK_SIZE", "OffloadConfig", "ServingOptions"]

#: Tokens per block when neither ``OffloadConfig.block_size`` nor ``sparse.block_size`` is given.
DEFAULT_BLOCK_SIZE = 128


class ServingOptions(ConfigModel):
    """How many requests an offloaded model holds at once under continuous batching (``generate_batch``,
    the continuous-batching manager, ``python -m torch_kvoffload.serve``), and how long each may grow.

    ``max_request_tokens``: prompt + generated tokens of one request; every device cache reserves this
    many rows per request (a longer request is refused when it is added). ``max_requests``: requests held
    at once (each holds its device rows from admission to its end; more wait in the queue).
    ``device_kv_budget``: bytes of device KV the session may hold (hot buffers, indexer cache, layer
    buffers, resident KV: what ``stats()["device_kv_bytes"]`` counts); given without ``max_requests``, the
    requests held are as many as fit (measured on the allocated caches); given with it, those must fit.
    Neither given: 8 requests.
    """

    max_request_tokens: StrictInt = Field(default=4096, ge=1)
    max_requests: StrictInt | None = Field(default=None, ge=1)
    device_kv_budget: StrictInt | None = Field(default=None, ge=1)


class OffloadConfig(ConfigModel):
    """What to offload and how.

    ``layerwise``: :class:`~torch_kvoffload.layerwise.LayerwiseConfig` (shared layer buffers + host store).
    ``sparse``: the fields of :class:`~torch_kvoffload.sparse.config.SparseDecodeConfig` to set (a
    ``SparseDecodeConfig`` or a dict; ``top_k`` defaults to the model's ``index_topk``,
    ``host_pool_blocks`` to what the generation needs, ``kv_dtype`` to the model's dtype).
    ``kvpp``: :class:`~torch_kvoffload.kvpp.KVPPConfig` (or a dict); given, it is on unless it sets
    ``enable_kvpp=False``. Fields it leaves unset are resolved by :func:`~torch_kvoffload.kvpp.config.resolve_kvpp_config` when the session is
    built: ``tp_size`` from the world size of the default process group, ``attention`` from the model
    (``"sfa"`` with a lightning indexer, else ``"mla"``). KVPP cannot be combined with ``layerwise`` or
    ``sparse``.
    ``pd``: :class:`~torch_kvoffload.pd.PDConfig`, the session's role in a disaggregated deployment
    (:mod:`torch_kvoffload.integrations.hf.pd`): ``role="prefill"`` needs ``layerwise`` (its layer
    buffers are exported to the decode peer), ``role="decode"`` needs ``sparse`` (the KV arrives in the
    sparse host pool and indexer cache) and excludes KVPP.
    ``serving``: :class:`ServingOptions`, the requests held at once under continuous batching (default:
    ``ServingOptions()``).

    ``prefix_cache``: a forward that starts a request skips the leading full blocks of its prompt whose KV
    (and indexer keys) the store already holds for these weights: the model runs only the
    uncached suffix (:mod:`torch_kvoffload.core.prefix`). On by default. With ``layerwise`` its store serves;
    with ``sparse`` alone (sparse offload or a resident KV) or KVPP ``prefix_store`` does (the core stores
    each request's full blocks there after the forwards that complete them; a KVPP rank its owned layers').
    A model with a lightning indexer stores its indexer keys beside the latent KV.

    ``prefix_store``: the store of prefix reuse without ``layerwise``
    (:class:`~torch_kvoffload.store.factory.StoreConfig`; default ``StoreConfig()``, a local arena of
    1 GiB); with ``layerwise`` set ``layerwise.store`` instead (setting both is an error), and with
    ``prefix_cache=False`` there is nothing to store.

    ``block_size``: tokens per block of every cache the session pages (layer buffers, store records, host
    pool, indexer cache); default ``sparse.block_size`` if given, else 128; an int in
    ``[1, MAX_BLOCK_SIZE]`` (a bool is rejected).

    Sizes are checked before anything is allocated, each ``ValueError`` naming the field: the store's at
    configuration (:class:`~torch_kvoffload.store.factory.StoreConfig`), the sparse ones' bounds at
    configuration (:class:`~torch_kvoffload.sparse.config.SparseDecodeConfig`), and the host pool the
    model and the generation imply against the machine's physical memory when it is sized
    (:func:`~torch_kvoffload.sparse.config.resolve_sparse_config`).
    """

    layerwise: LayerwiseConfig | None = None
    sparse: SparseOptions | None = None
    kvpp: KVPPConfig | None = None
    pd: PDConfig | None = None
    serving: ServingOptions = ServingOptions()
    block_size: StrictInt | None = Field(default=None, ge=1, le=MAX_BLOCK_SIZE)
    prefix_cache: StrictBool = True
    prefix_store: StoreConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> OffloadConfig:
        sparse_bs = self.sparse.block_size if self.sparse is not None else None
        if sparse_bs is not None and self.block_size is not None and sparse_bs != self.block_size:
            raise ValueError(
                f"OffloadConfig: block_size {self.block_size} and sparse.block_size {sparse_bs} differ; "
                "every cache of a session is paged in the same blocks"
            )
        if self.pd is not None:
            if self.pd.role == "decode" and self.kvpp is not None and self.kvpp.active:
                raise ValueError(
                    "OffloadConfig: pd.role='decode' with KVPP on; a decode-only node cannot run KVPP"
                )
            if self.pd.role == "prefill" and self.layerwise is None:
                raise ValueError(
                    "OffloadConfig: pd.role='prefill' needs layerwise offload (its layer buffers are sent)"
                )
            if self.pd.role == "decode" and (self.sparse is None or not self.sparse.offload):
                raise ValueError(
                    "OffloadConfig: pd.role='decode' needs sparse decode offload (the KV lands in its host pool)"
                    + ("; sparse.offload=False keeps no host pool" if self.sparse is not None else "")
                )
            if self.pd.role == "prefill" and self.sparse is not None and self.sparse.offload == "auto":
                raise ValueError(
                    "OffloadConfig: pd.role='prefill' with sparse.offload='auto': a prefill node runs no decode "
                    "step to place; use sparse.offload=True (or no sparse) on it, 'auto' on the decode node"
                )
        if self.kvpp_requested and (self.layerwise is not None or self.sparse is not None):
            both = [n for n in ("layerwise", "sparse") if getattr(self, n) is not None]
            raise ValueError(
                f"OffloadConfig: kvpp cannot be combined with {' and '.join(both)} offload; KVPP keeps each "
                "rank's owned layers in a persistent device pool (use kvpp alone, or kvpp={'enable_kvpp': False})"
            )
        if self.prefix_store is not None and (self.layerwise is not None or not self.prefix_cache):
            why = (
                "layerwise.store is the prefix store" if self.layerwise is not None else "prefix_cache is off"
            )
            raise ValueError(f"OffloadConfig: prefix_store is set but {why}; leave prefix_store unset")
        if self.layerwise is None and self.sparse is None and not self.kvpp_requested:
            raise ValueError(
                "OffloadConfig: nothing is enabled; set layerwise, sparse and/or kvpp (use {} for the defaults) "
                "or pass config=None for the model's default"
            )
        return self

    @classmethod
    def default(cls, has_indexer: bool) -> OffloadConfig:
        """Layerwise offload, plus sparse decode offload for a model with a lightning indexer."""
        return cls(layerwise=LayerwiseConfig(), sparse={} if has_indexer else None)

    @property
    def prefix_store_config(self) -> StoreConfig | None:
        """The store prefix reuse keeps blocks in without layerwise offload: ``prefix_store`` (default
        ``StoreConfig()``) for sparse offload, a resident KV or KVPP with ``prefix_cache`` on and no P/D role
        (FP8 rows are stored as they are kept); ``None`` otherwise (no reuse, the layerwise store serves, or
        the indexer is kept as int8 keys: those are reused from running requests only)."""
        holds = self.sparse is not None or self.kvpp_requested
        if (
            not self.prefix_cache
            or self.layerwise is not None
            or not holds
            or self.pd is not None
            # int8 keys and scales: rows the store's records do not hold (FP8 rows they hold as kept)
            or (self.sparse is not None and self.sparse.indexer_dtype == "int8")
        ):
            return None
        return self.prefix_store if self.prefix_store is not None else StoreConfig()

    @property
    def fp8_kv(self) -> bool:
        """Whether the main KV (resident, the host pool and hot buffers, layer buffers, KVPP bundles) is kept as
        FP8 rows (``sparse.kv_dtype="fp8_e4m3"``, or ``kvpp.kv_dtype`` with KVPP)."""
        if self.kvpp_requested and self.kvpp is not None and self.kvpp.kv_dtype == FP8_KV:
            return True
        return self.sparse is not None and self.sparse.kv_dtype == FP8_KV

    @property
    def fp8_indexer(self) -> bool:
        """Whether the indexer keys are kept as FP8 rows (``sparse.indexer_dtype="fp8_e4m3"``, or
        ``kvpp.indexer_dtype`` with KVPP)."""
        if self.kvpp_requested and self.kvpp is not None and self.kvpp.indexer_dtype == FP8_KV:
            return True
        return self.sparse is not None and self.sparse.indexer_dtype == FP8_KV

    @property
    def stores_kv(self) -> bool:
        """Whether the session keeps KV in a store keyed by the model's weights (layerwise offload, or the
        prefix store)."""
        return self.layerwise is not None or self.prefix_store_config is not None

    @property
    def kvpp_requested(self) -> bool:
        """Whether KVPP is asked for: ``kvpp`` given and not explicitly ``enable_kvpp=False``."""
        kv = self.kvpp
        return kv is not None and (kv.enable_kvpp or "enable_kvpp" not in kv.model_fields_set)

    @property
    def resolved_block_size(self) -> int:
        """``block_size`` with its default applied."""
        if self.block_size is not None:
            return self.block_size
        if self.sparse is not None and self.sparse.block_size is not None:
            return self.sparse.block_size
        return DEFAULT_BLOCK_SIZE
