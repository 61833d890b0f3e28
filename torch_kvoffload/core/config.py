"""``OffloadConfig``: which capabilities an offloaded model runs, and how.

It groups the capability configs (each ``None`` = off, or the capability's own config given as a model or a
dict, ``{}`` = on with defaults): :class:`~torch_kvoffload.layerwise.LayerwiseConfig`, :class:`SparseOptions`
(sparse attention over the lightning indexer's top-k, with the main KV offloaded to a host pool or
resident on the device), :class:`~torch_kvoffload.kvpp.KVPPConfig` and :class:`~torch_kvoffload.pd.PDConfig`.
Fields the model determines are resolved when a session is built (:meth:`OffloadConfig.sparse_config`,
:meth:`OffloadConfig.kvpp_config`). Invalid combinations raise ``ValueError`` at construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from torch_kvoffload.config import ConfigModel, parse_lax_bool
from torch_kvoffload.kvpp.config import KVPPConfig
from torch_kvoffload.layerwise.config import LayerwiseConfig
from torch_kvoffload.pd.config import PDConfig
from torch_kvoffload.sparse.config import MAX_BLOCK_SIZE, SparseDecodeConfig

if TYPE_CHECKING:
    from torch_kvoffload.core.spec import ModelSpec

__all__ = ["DEFAULT_BLOCK_SIZE", "OffloadConfig", "ServingOptions", "SparseOptions"]

#: Tokens per block when neither ``OffloadConfig.block_size`` nor ``sparse.block_size`` is given.
DEFAULT_BLOCK_SIZE = 128


# SparseDecodeConfig fields that only sparse decode offload (host pool + hot buffers) has
_OFFLOAD_ONLY = ("capacity", "host_pool_blocks", "policy", "fused")


class SparseOptions(ConfigModel):
    """Sparse attention over the lightning indexer's top-k (models with an indexer).

    ``offload``: ``True`` (default) keeps the whole main (latent) KV in a host pool and only per-layer hot
    top-k buffers on the device (sparse decode offload); ``False`` keeps the whole latent KV resident on
    the device and attends over the top-k rows in place (absorbed sparse MLA attention without offload:
    what a server runs when the KV fits, and the baseline offload is measured against). With
    ``offload=False`` the host-pool and hot-buffer fields (``capacity``, ``host_pool_blocks``, ``policy``,
    ``fused``) are refused, and ``kv_dtype`` must be the model's dtype (checked when the session is built).

    The other fields are those of :class:`~torch_kvoffload.sparse.config.SparseDecodeConfig` to set; the
    ones left ``None`` are resolved when the session is built (``top_k`` from the model's ``index_topk``,
    ``host_pool_blocks`` from the generation, ``kv_dtype`` from the model's dtype). The given ones are
    validated at construction with SparseDecodeConfig's own rules.
    """

    offload: StrictBool = True
    top_k: StrictInt | None = None
    capacity: StrictInt | None = None
    host_pool_blocks: StrictInt | None = None
    block_size: StrictInt | None = None
    policy: Literal["lru", "score"] | None = None
    indexer_dtype: Literal["bf16", "int8"] | None = None
    kv_dtype: str | None = None
    fused: bool | None = None
    context_parallel_size: StrictInt | None = None
    pipeline_parallel_size: StrictInt | None = None
    hybrid_kv_layout: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _given_fields(cls, value: Any) -> Any:
        if isinstance(value, SparseDecodeConfig):
            value = value.model_dump(exclude_unset=True)
        if not isinstance(value, dict):
            return value
        known = set(SparseDecodeConfig.model_fields) | {"offload"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"sparse: unknown fields {unknown}; expected fields of SparseDecodeConfig "
                f"{sorted(SparseDecodeConfig.model_fields)} or 'offload'"
            )
        fields = dict(value)
        if "offload" in fields:
            fields["offload"] = parse_lax_bool("sparse.offload", fields["offload"])
        if fields.get("offload") is False:
            host_only = sorted(k for k in _OFFLOAD_ONLY if fields.get(k) is not None)
            if host_only:
                raise ValueError(
                    f"sparse: {host_only} configure the host pool and hot buffers of sparse decode offload; "
                    "offload=False keeps the whole main KV on the device and has neither"
                )
        # validate the given fields now (placeholders for the ones the model determines); the common
        # OffloadConfig.block_size is checked with the pool in OffloadConfig.sparse_config
        trial = {k: v for k, v in fields.items() if k != "offload"}
        trial.setdefault("top_k", trial.get("capacity") or 1)
        trial.setdefault("host_pool_blocks", 1)
        trial.setdefault("block_size", 1)
        SparseDecodeConfig.model_validate(trial)
        return fields

    def given(self) -> dict[str, Any]:
        """The SparseDecodeConfig fields set here (``offload`` and ``None`` left out)."""
        return {
            k: v
            for k, v in self.model_dump(exclude={"offload"}).items()
            if v is not None and k in SparseDecodeConfig.model_fields
        }


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
    ``enable_kvpp=False``. Fields it leaves unset are resolved by :meth:`kvpp_config` when the session is
    built: ``tp_size`` from the world size of the default process group, ``attention`` from the model
    (``"sfa"`` with a lightning indexer, else ``"mla"``). KVPP cannot be combined with ``layerwise`` or
    ``sparse``.
    ``pd``: :class:`~torch_kvoffload.pd.PDConfig`, the session's role in a disaggregated deployment
    (:mod:`torch_kvoffload.integrations.hf.pd`): ``role="prefill"`` needs ``layerwise`` (its layer
    buffers are exported to the decode peer), ``role="decode"`` needs ``sparse`` (the KV arrives in the
    sparse host pool and indexer cache) and excludes KVPP.
    ``serving``: :class:`ServingOptions`, the requests held at once under continuous batching (default:
    ``ServingOptions()``).

    ``block_size``: tokens per block of every cache the session pages (layer buffers, store records, host
    pool, indexer cache); default ``sparse.block_size`` if given, else 128; an int in
    ``[1, MAX_BLOCK_SIZE]`` (a bool is rejected).

    Sizes are checked before anything is allocated, each ``ValueError`` naming the field: the store's at
    configuration (:class:`~torch_kvoffload.store.factory.StoreConfig`), the sparse ones' bounds at
    configuration (:class:`~torch_kvoffload.sparse.config.SparseDecodeConfig`), and the host pool the
    model and the generation imply against the machine's physical memory when it is sized
    (:meth:`sparse_config`).
    """

    layerwise: LayerwiseConfig | None = None
    sparse: SparseOptions | None = None
    kvpp: KVPPConfig | None = None
    pd: PDConfig | None = None
    serving: ServingOptions = ServingOptions()
    block_size: StrictInt | None = Field(default=None, ge=1, le=MAX_BLOCK_SIZE)

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
        if self.kvpp_requested and (self.layerwise is not None or self.sparse is not None):
            both = [n for n in ("layerwise", "sparse") if getattr(self, n) is not None]
            raise ValueError(
                f"OffloadConfig: kvpp cannot be combined with {' and '.join(both)} offload; KVPP keeps each "
                "rank's owned layers in a persistent device pool (use kvpp alone, or kvpp={'enable_kvpp': False})"
            )
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
    def kvpp_requested(self) -> bool:
        """Whether KVPP is asked for: ``kvpp`` given and not explicitly ``enable_kvpp=False``."""
        kv = self.kvpp
        return kv is not None and (kv.enable_kvpp or "enable_kvpp" not in kv.model_fields_set)

    def kvpp_config(self, spec: ModelSpec, *, world_size: int) -> KVPPConfig:
        """The full :class:`KVPPConfig` for ``spec`` in a process group of ``world_size`` ranks.

        Unset fields: ``enable_kvpp=True``, ``tp_size`` = the model's tensor-parallel size (``spec.tp``) or
        else ``world_size // pcp_size``, ``attention`` = ``"sfa"``
        for a model with a lightning indexer, else ``"mla"``. ``ValueError`` if KVPP is not requested, the
        group cannot be split into KVPP groups of ``tp_size * pcp_size`` ranks, the group size is 1 (KVPP
        off), or ``attention`` contradicts the model.
        """
        if not self.kvpp_requested:
            raise ValueError("OffloadConfig.kvpp_config: KVPP is off")
        from torch_kvoffload._utils import check_int

        world_size = check_int("OffloadConfig.kvpp_config", "world_size", world_size, minimum=1)
        assert self.kvpp is not None
        fields = self.kvpp.model_dump(exclude_unset=True)
        fields["enable_kvpp"] = True
        pcp = int(fields.get("pcp_size", 1))
        fields.setdefault("tp_size", spec.tp_size if spec.tp is not None else max(1, world_size // pcp))
        model_attention = "sfa" if spec.has_indexer else "mla"
        attention = str(fields.setdefault("attention", model_attention)).strip().lower()
        if attention != model_attention:
            raise ValueError(
                f"kvpp.attention={attention!r} but {spec.model_class} is {model_attention!r} "
                f"({'with' if spec.has_indexer else 'without'} a lightning indexer)"
            )
        cfg = KVPPConfig.model_validate(fields)
        size = cfg.tp_size * cfg.pcp_size
        if size < 2:
            raise ValueError(
                f"KVPP needs a group of at least 2 ranks; tp_size * pcp_size = {cfg.tp_size} * {cfg.pcp_size} "
                f"with a process group of {world_size} rank(s)"
            )
        if world_size % size:
            raise ValueError(
                f"KVPP: the process group of {world_size} ranks cannot be split into groups of "
                f"tp_size * pcp_size = {cfg.tp_size} * {cfg.pcp_size} = {size} ranks"
            )
        return cfg

    @property
    def resolved_block_size(self) -> int:
        """``block_size`` with its default applied."""
        if self.block_size is not None:
            return self.block_size
        if self.sparse is not None and self.sparse.block_size is not None:
            return self.sparse.block_size
        return DEFAULT_BLOCK_SIZE

    def sparse_config(self, spec: ModelSpec, *, host_pool_blocks: int) -> SparseDecodeConfig:
        """The full :class:`SparseDecodeConfig` for ``spec``.

        ``ValueError`` if sparse is off, a field is out of bounds, or the host pool it sizes (``spec``'s
        layers x ``host_pool_blocks`` x ``block_size`` rows of the main KV) exceeds this machine's physical
        memory (naming ``host_pool_blocks``).
        """
        if self.sparse is None:
            raise ValueError("OffloadConfig.sparse_config: sparse decode offload is off")
        from torch_kvoffload._utils import dtype_name
        from torch_kvoffload.store.sizes import check_host_bytes

        fields = {
            "top_k": spec.index_topk,
            "host_pool_blocks": host_pool_blocks,
            "kv_dtype": dtype_name(spec.dtype),
            **self.sparse.given(),
            "block_size": self.resolved_block_size,
        }
        cfg = SparseDecodeConfig.model_validate(fields)
        row_bytes = (spec.kv_lora_rank + spec.rope_dim) * cfg.torch_kv_dtype.itemsize
        pool = spec.num_layers * cfg.host_pool_blocks * cfg.block_size * row_bytes
        check_host_bytes(
            f"sparse decode offload of {spec.model_class}", "host_pool_blocks (the host pool)", pool
        )
        return cfg
