"""KVPP configuration (data): the switch, the replication domain (TP × PCP), the deployment limits.

KVPP is enabled with ``enable_kvpp`` (a lax boolean: ``true``, ``"False"``, ``1`` ...). The group size is
``tp_size * pcp_size`` — the domain over which MLA KV is replicated — and a size of 1 means off. The
deployment fields make combinations KVPP cannot serve fail at construction, each with its own message,
instead of failing (or silently mis-serving) at run time; :func:`~torch_kvoffload.kvpp.build.build_kvpp_runtime`
checks the rest against the group and the layer bundles it is given, then builds the rank's runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator, model_validator

from torch_kvoffload._utils import check_int
from torch_kvoffload.config import ConfigModel, parse_lax_bool
from torch_kvoffload.kv.fp8_rows import FP8_KV

if TYPE_CHECKING:
    from torch_kvoffload.kv.spec import ModelSpec

__all__ = ["INDEXER_COMPONENT", "KVPPConfig", "resolve_kvpp_config"]

_GRAPH_MODES_OK = ("eager", "piecewise")
_ATTENTION_OK = ("mla", "sfa")
_SPEC_METHODS_OK = ("mtp", "dspark")
_KV_ROLES = ("none", "kv_producer", "kv_consumer", "kv_both")
#: the bundle component holding an SFA layer's indexer keys
INDEXER_COMPONENT = "index_k"


class KVPPConfig(ConfigModel):
    """KV layer parallelism inside a TP (× PCP) group.

    Fields
    ------
    enable_kvpp : lax bool, default False.
    tp_size, pcp_size : tensor- and prefill-context-parallel sizes (≥ 1); ``size = tp_size * pcp_size``,
        which :func:`~torch_kvoffload.kvpp.build.build_kvpp_runtime` checks against the group it is given.
    dcp_size : decode-context-parallel size; must be 1 with KVPP.
    graph_mode : ``"eager"`` or ``"piecewise"`` with KVPP (``"full"``, ``"full_and_piecewise"`` rejected).
    attention : ``"mla"`` or ``"sfa"`` (MLA with a lightning indexer) with KVPP; anything else rejected.
        :func:`~torch_kvoffload.kvpp.build.build_kvpp_runtime` checks it against the bundles: ``"sfa"`` bundles hold an ``index_k``
        component, ``"mla"`` bundles do not.
    hybrid_model : a model mixing attention kinds (e.g. MLA + linear / sliding window); rejected with KVPP.
    speculative_method : ``None``, ``"mtp"`` or ``"dspark"`` with KVPP; draft / MTP bundles are accepted
        by :func:`~torch_kvoffload.kvpp.build.build_kvpp_runtime` only with a method.
    num_speculative_tokens : fixed draft length: ≥ 1 with a speculative method, 0 without.
    dynamic_speculative_tokens : a variable draft length (adaptive verification); rejected with KVPP.
    kv_role : P/D role: ``"none"`` (joint), ``"kv_producer"`` (prefill), ``"kv_both"``, ``"kv_consumer"``
        (decode-only node — rejected with KVPP).
    max_broadcast_runs : at most this many contiguous block runs per layer broadcast (≥ 1, default 16):
        a forward's blocks are coalesced into runs, the runs with the smallest gaps merged past this
        count; each run is one collective per bundle component.
    kv_dtype : ``None`` (the model's dtype) or ``"fp8_e4m3"``: the bundles keep the latent KV as DeepSeek's
        FP8 rows (one component ``kv_fp8``, ``uint8 [.., Dc + 4 * Dc / 128 + 2 * Dr]``), so each owned layer
        and each broadcast holds those bytes; attention reads them dequantized. Needs a ``kv_lora_rank``
        that is a multiple of 128 (checked against the model).
    indexer_dtype : ``None`` (the model's dtype) or ``"fp8_e4m3"``: an SFA bundle keeps the indexer keys as
        DeepSeek's FP8 rows (``uint8 [.., Di + 4 * Di / 128]``, Hadamard-rotated, one fp32 scale per 128
        values), which the indexer scores as DeepSeek does; needs a power-of-two ``index_head_dim`` of at
        least 128.
    wait_timeout_s : seconds a CPU wait for a broadcast blocks before ``TimeoutError`` (``None``:
        forever; > 0). On an accelerator a wait is a stream wait and does not block the host. It also
        bounds the host-side collectives: each forward's agreement exchange (every device) and, on CPU,
        each broadcast on the transfer thread, so a peer that failed or is gone surfaces as an error
        within this time instead of the process group's own timeout.
    """

    enable_kvpp: bool = False
    tp_size: int = Field(default=1, ge=1)
    pcp_size: int = Field(default=1, ge=1)
    dcp_size: int = Field(default=1, ge=1)
    graph_mode: str = "eager"
    attention: str = "mla"
    hybrid_model: bool = False
    speculative_method: str | None = None
    num_speculative_tokens: int = Field(default=0, ge=0)
    dynamic_speculative_tokens: bool = False
    kv_role: str = "none"
    max_broadcast_runs: int = Field(default=16, ge=1)
    kv_dtype: str | None = None
    indexer_dtype: str | None = None
    wait_timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @field_validator("enable_kvpp", "hybrid_model", "dynamic_speculative_tokens", mode="before")
    @classmethod
    def _lax_bool(cls, value: Any, info: Any) -> bool:
        return parse_lax_bool(info.field_name, value)

    @field_validator("graph_mode", "attention", "kv_role", mode="before")
    @classmethod
    def _lower(cls, value: Any, info: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError(f"{info.field_name}: expected a string, got {value!r}")
        return value.strip().lower()

    @field_validator("kv_role")
    @classmethod
    def _known_role(cls, value: str) -> str:
        if value not in _KV_ROLES:
            raise ValueError(f"kv_role: expected one of {list(_KV_ROLES)}, got {value!r}")
        return value

    @field_validator("kv_dtype", "indexer_dtype")
    @classmethod
    def _known_format(cls, value: str | None, info: Any) -> str | None:
        if value is not None and value != FP8_KV:
            raise ValueError(
                f"{info.field_name}: expected None (the model's dtype) or {FP8_KV!r}, got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _kvpp_limits(self) -> KVPPConfig:
        if not self.enable_kvpp:
            return self
        if self.dcp_size != 1:
            raise ValueError(f"KVPP and DCP cannot be enabled at the same time (dcp_size={self.dcp_size})")
        if self.graph_mode not in _GRAPH_MODES_OK:
            raise ValueError(
                f"KVPP supports eager execution or piecewise graphs only, got graph_mode={self.graph_mode!r}"
            )
        if self.attention not in _ATTENTION_OK:
            raise ValueError(f"KVPP supports only MLA / SFA models, got attention={self.attention!r}")
        if self.hybrid_model:
            raise ValueError("KVPP supports only non-hybrid MLA models, got hybrid_model=True")
        if self.speculative_method is None and self.num_speculative_tokens:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} needs a speculative_method "
                f"(one of {list(_SPEC_METHODS_OK)})"
            )
        if self.speculative_method is not None:
            if self.speculative_method.lower() not in _SPEC_METHODS_OK:
                raise ValueError(
                    "KVPP supports speculative decoding only with a fixed number of tokens "
                    f"(methods {list(_SPEC_METHODS_OK)}), got speculative_method={self.speculative_method!r}"
                )
            if self.dynamic_speculative_tokens:
                raise ValueError(
                    "KVPP supports only a fixed number of speculative tokens, "
                    "got dynamic_speculative_tokens=True"
                )
            if self.num_speculative_tokens < 1:
                raise ValueError(
                    f"speculative_method={self.speculative_method!r} needs num_speculative_tokens >= 1, got 0"
                )
        if self.kv_role == "kv_consumer":
            raise ValueError(
                "KVPP must be disabled on the decode-only node of a P/D deployment (kv_consumer)"
            )
        return self

    @property
    def size(self) -> int:
        """KVPP group size: ``tp_size * pcp_size`` when enabled, else 1 (1 = off)."""
        return self.tp_size * self.pcp_size if self.enable_kvpp else 1

    @property
    def active(self) -> bool:
        """Whether KVPP actually shards the cache (enabled and a group larger than one rank)."""
        return self.size > 1


def resolve_kvpp_config(options: KVPPConfig, spec: ModelSpec, *, world_size: int) -> KVPPConfig:
    """The full :class:`KVPPConfig` of ``options`` for ``spec`` in a process group of ``world_size`` ranks.

    Unset fields: ``enable_kvpp=True``, ``tp_size`` = the model's tensor-parallel size (``spec.tp``) or
    else ``world_size // pcp_size``, ``attention`` = ``"sfa"`` for a model with a lightning indexer, else
    ``"mla"``. ``ValueError`` if ``options`` turn KVPP off (``enable_kvpp=False``), the group cannot be
    split into KVPP groups of ``tp_size * pcp_size`` ranks, the group size is 1 (KVPP off), or
    ``attention`` contradicts the model.
    """
    if not options.enable_kvpp and "enable_kvpp" in options.model_fields_set:
        raise ValueError("resolve_kvpp_config: KVPP is off (enable_kvpp=False)")
    world_size = check_int("resolve_kvpp_config", "world_size", world_size, minimum=1)
    fields = options.model_dump(exclude_unset=True)
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
