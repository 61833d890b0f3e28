"""The user surface for a model: :class:`OffloadConfig`, :func:`offload` and :func:`stats`.

``offload(model, config)`` inspects a Hugging Face MLA / SFA model, builds an
:class:`~torch_kvoffload.integrations.hf.session.OffloadSession` and replaces each MLA attention's forward
by the library's (the model's own weights are reused); afterwards ``model.generate(...)`` works unchanged.
``stats(model)`` reports what the session holds and moved.

``OffloadConfig`` groups the feature configs. Each is ``None`` (off) or the capability's own config, given
as a model or a dict (``{}``: on, with defaults). Fields the model determines are filled in when the
session is built: the sparse top-k from the model's ``index_topk``, row widths and layer count from its
attention, the host pool size from the generation length. ``OffloadConfig.default()`` (what ``config=None``
means): layerwise offload on, plus sparse decode offload when the model has a lightning indexer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, StrictInt, field_validator, model_validator

from torch_kvoffload.config import ConfigModel
from torch_kvoffload.kvpp.config import KVPPConfig
from torch_kvoffload.layerwise.config import LayerwiseConfig
from torch_kvoffload.pd.config import PDConfig
from torch_kvoffload.sparse.config import MAX_BLOCK_SIZE, SparseDecodeConfig

if TYPE_CHECKING:
    import torch

    from torch_kvoffload.integrations.hf.inspect import ModelSpec

__all__ = ["DEFAULT_BLOCK_SIZE", "OffloadConfig", "offload", "stats"]

#: Tokens per block when neither ``OffloadConfig.block_size`` nor ``sparse.block_size`` is given.
DEFAULT_BLOCK_SIZE = 128


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
    sparse: dict[str, Any] | None = None
    kvpp: KVPPConfig | None = None
    pd: PDConfig | None = None
    block_size: StrictInt | None = Field(default=None, ge=1, le=MAX_BLOCK_SIZE)

    @field_validator("sparse", mode="before")
    @classmethod
    def _sparse_fields(cls, value: Any) -> Any:
        if isinstance(value, SparseDecodeConfig):
            return value.model_dump(exclude_unset=True)
        if value is None or not isinstance(value, dict):
            return value
        unknown = sorted(set(value) - set(SparseDecodeConfig.model_fields))
        if unknown:
            raise ValueError(
                f"sparse: unknown fields {unknown}; expected fields of SparseDecodeConfig "
                f"{sorted(SparseDecodeConfig.model_fields)}"
            )
        # validate the given fields now (placeholders for the ones the model determines)
        trial = dict(value)
        trial.setdefault("top_k", trial.get("capacity") or 1)
        trial.setdefault("host_pool_blocks", 1)
        trial.setdefault(
            "block_size", 1
        )  # OffloadConfig.block_size is checked with the pool in sparse_config
        SparseDecodeConfig.model_validate(trial)
        return dict(value)

    @model_validator(mode="after")
    def _check(self) -> OffloadConfig:
        sparse_bs = (self.sparse or {}).get("block_size")
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
            if self.pd.role == "decode" and self.sparse is None:
                raise ValueError(
                    "OffloadConfig: pd.role='decode' needs sparse decode offload (the KV lands in its host pool)"
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

        Unset fields: ``enable_kvpp=True``, ``tp_size = world_size // pcp_size``, ``attention`` = ``"sfa"``
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
        fields.setdefault("tp_size", max(1, world_size // pcp))
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
        return int((self.sparse or {}).get("block_size", DEFAULT_BLOCK_SIZE))

    def sparse_config(self, spec: ModelSpec, *, host_pool_blocks: int) -> SparseDecodeConfig:
        """The full :class:`SparseDecodeConfig` for ``spec``.

        ``ValueError`` if sparse is off, a field is out of bounds, or the host pool it sizes (``spec``'s
        layers x ``host_pool_blocks`` x ``block_size`` rows of the main KV) exceeds this machine's physical
        memory (naming ``host_pool_blocks``).
        """
        if self.sparse is None:
            raise ValueError("OffloadConfig.sparse_config: sparse decode offload is off")
        from torch_kvoffload._utils import dtype_name
        from torch_kvoffload.store.factory import check_host_bytes

        fields = {
            "top_k": spec.index_topk,
            "host_pool_blocks": host_pool_blocks,
            "kv_dtype": dtype_name(spec.dtype),
            **self.sparse,
            "block_size": self.resolved_block_size,
        }
        cfg = SparseDecodeConfig.model_validate(fields)
        row_bytes = (spec.kv_lora_rank + spec.rope_dim) * cfg.torch_kv_dtype.itemsize
        pool = spec.num_layers * cfg.host_pool_blocks * cfg.block_size * row_bytes
        check_host_bytes(
            f"sparse decode offload of {spec.model_class}", "host_pool_blocks (the host pool)", pool
        )
        return cfg


def offload(model: torch.nn.Module, config: OffloadConfig | dict[str, Any] | None = None) -> torch.nn.Module:
    """Offload ``model``'s KV cache with the library's eager attention; return ``model``.

    ``config``: an :class:`OffloadConfig` (or its dict form); ``None`` = :meth:`OffloadConfig.default`.
    Raises ``ValueError`` (naming the model class and the reason) for a model the library cannot handle,
    before anything is allocated.
    """
    from torch_kvoffload.integrations.hf.install import offload as _offload

    return _offload(model, config)


def stats(model: torch.nn.Module) -> dict[str, float]:
    """What the offloaded ``model`` holds and moved: ``device_kv_bytes``, ``dense_kv_bytes``,
    ``bytes_h2d``, ``bytes_d2h``, ``hits``, ``misses``, ``layer_loads``, ``layer_saves``, ``broadcasts``
    and more (see :meth:`OffloadSession.stats`)."""
    from torch_kvoffload.integrations.hf.install import session_of

    return session_of(model).stats()
