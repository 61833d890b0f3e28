"""KVPP configuration: the switch, the replication domain (TP × PCP), the deployment limits, and the
runtime it builds.

KVPP is enabled with ``enable_kvpp`` (a lax boolean: ``true``, ``"False"``, ``1`` ...). The group size is
``tp_size * pcp_size`` — the domain over which MLA KV is replicated — and a size of 1 means off. The
deployment fields make combinations KVPP cannot serve fail at construction, each with its own message,
instead of failing (or silently mis-serving) at run time; :meth:`KVPPConfig.build_runtime` checks the
rest against the group and the layer bundles it is given, then builds the rank's runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator

from torch_kvoffload._utils import check_int
from torch_kvoffload.config import ConfigModel, parse_lax_bool
from torch_kvoffload.kvpp.groups import KVPPGroup
from torch_kvoffload.kvpp.layout import BundleSpec
from torch_kvoffload.kvpp.runtime import KVPPRuntime, assemble_runtime
from torch_kvoffload.ops.kvpp import runtimes

__all__ = ["KVPPConfig"]

_GRAPH_MODES_OK = ("eager", "piecewise")
_ATTENTION_OK = ("mla", "sfa")
_SPEC_METHODS_OK = ("mtp", "dspark")
_KV_ROLES = ("none", "kv_producer", "kv_consumer", "kv_both")
_INDEXER_COMPONENT = "index_k"
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class KVPPConfig(ConfigModel):
    """KV layer parallelism inside a TP (× PCP) group.

    Fields
    ------
    enable_kvpp : lax bool, default False.
    tp_size, pcp_size : tensor- and prefill-context-parallel sizes (≥ 1); ``size = tp_size * pcp_size``,
        which :meth:`build_runtime` checks against the group it is given.
    dcp_size : decode-context-parallel size; must be 1 with KVPP.
    graph_mode : ``"eager"`` or ``"piecewise"`` with KVPP (``"full"``, ``"full_and_piecewise"`` rejected).
    attention : ``"mla"`` or ``"sfa"`` (MLA with a lightning indexer) with KVPP; anything else rejected.
        :meth:`build_runtime` checks it against the bundles: ``"sfa"`` bundles hold an ``index_k``
        component, ``"mla"`` bundles do not.
    hybrid_model : a model mixing attention kinds (e.g. MLA + linear / sliding window); rejected with KVPP.
    speculative_method : ``None``, ``"mtp"`` or ``"dspark"`` with KVPP; draft / MTP bundles are accepted
        by :meth:`build_runtime` only with a method.
    num_speculative_tokens : fixed draft length: ≥ 1 with a speculative method, 0 without.
    dynamic_speculative_tokens : a variable draft length (adaptive verification); rejected with KVPP.
    kv_role : P/D role: ``"none"`` (joint), ``"kv_producer"`` (prefill), ``"kv_both"``, ``"kv_consumer"``
        (decode-only node — rejected with KVPP).
    max_broadcast_runs : at most this many contiguous block runs per layer broadcast (≥ 1, default 16):
        a forward's blocks are coalesced into runs, the runs with the smallest gaps merged past this
        count; each run is one collective per bundle component.
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

    # ------------------------------------------------------------------------------------ the runtime

    def build_runtime(
        self,
        group: KVPPGroup,
        bundles: Mapping[int, BundleSpec],
        available_bytes: int | None = None,
        *,
        num_blocks: int | None = None,
        draft_bundles: Mapping[int, BundleSpec] | None = None,
        device: torch.device | str = "cpu",
        name: str | None = None,
    ) -> KVPPRuntime:
        """Build this rank's KVPP runtime for one PP stage (plan → allocation → transport → scheduler).

        Parameters
        ----------
        group : this rank's :class:`~torch_kvoffload.kvpp.KVPPGroup` (``create_kvpp_group``); its size
            must be ``tp_size * pcp_size``.
        bundles : ``{target layer index: BundleSpec}`` of the stage (draft / MTP layers excluded).
        available_bytes : KV memory of this rank; the block count is the largest every rank of the group
            can hold (all ranks number blocks alike). Give this or ``num_blocks``, not both.
        num_blocks : an explicit block count per layer (≥ 1).
        draft_bundles : ``{draft / MTP layer: BundleSpec}``, allocated locally (needs a
            ``speculative_method``).
        device : where the cache lives (its collective backend must be the group's).
        name : register the scheduler under this name for ``torch.ops.kvoffload.kvpp_*``.

        Everything is checked before anything is allocated; a bad argument raises ``ValueError`` /
        ``TypeError`` naming it.
        """
        where = "KVPPConfig.build_runtime"
        if not self.enable_kvpp:
            raise ValueError(f"{where}: KVPP is disabled (enable_kvpp=False); there is no runtime to build")
        if self.size == 1:
            raise ValueError(
                f"{where}: the KVPP group size tp_size * pcp_size is 1 ({self.tp_size} * {self.pcp_size}), "
                "which means KVPP is off; there is no runtime to build"
            )
        if not isinstance(group, KVPPGroup):
            raise TypeError(f"{where}: argument 'group' must be a KVPPGroup, got {type(group).__name__}")
        if group.size != self.size:
            raise ValueError(
                f"{where}: group {list(group.ranks)} has {group.size} ranks, the config expects "
                f"tp_size * pcp_size = {self.tp_size} * {self.pcp_size} = {self.size}"
            )
        dev = torch.device(device)
        backend = _BACKENDS.get(dev.type)
        if backend is None:
            raise ValueError(f"{where}: argument 'device' {dev} has no KVPP collective backend")
        if group.backend is not None and group.backend != backend:
            raise ValueError(
                f"{where}: a cache on {dev} needs a {backend} group, the group's backend is {group.backend!r}"
            )
        draft_bundles = dict(draft_bundles or {})
        for arg, specs in (("bundles", bundles), ("draft_bundles", draft_bundles)):
            if not isinstance(specs, Mapping):
                raise TypeError(f"{where}: argument '{arg}' must be a mapping, got {type(specs).__name__}")
            for layer, spec in specs.items():
                check_int(where, f"{arg} key", layer, minimum=0)
                if not isinstance(spec, BundleSpec):
                    raise TypeError(
                        f"{where}: {arg}[{layer}] must be a BundleSpec, got {type(spec).__name__}"
                    )
        if not bundles:
            raise ValueError(f"{where}: argument 'bundles' holds no target layer")
        overlap = sorted(set(bundles) & set(draft_bundles))
        if overlap:
            raise ValueError(f"{where}: layers {overlap} are in both 'bundles' and 'draft_bundles'")
        if draft_bundles and self.speculative_method is None:
            raise ValueError(
                f"{where}: draft bundles {sorted(draft_bundles)} given, but speculative_method is None"
            )
        block_sizes = {spec.block_size for spec in [*bundles.values(), *draft_bundles.values()]}
        if len(block_sizes) != 1:
            raise ValueError(
                f"{where}: every bundle must have the same block_size, got {sorted(block_sizes)}"
            )
        with_indexer = sorted(
            layer
            for layer, spec in bundles.items()
            if any(c.name == _INDEXER_COMPONENT for c in spec.components)
        )
        if self.attention == "sfa" and len(with_indexer) != len(bundles):
            missing = sorted(set(bundles) - set(with_indexer))
            raise ValueError(
                f"{where}: attention='sfa' needs an {_INDEXER_COMPONENT!r} component in every bundle; "
                f"layers {missing} have none"
            )
        if self.attention == "mla" and with_indexer:
            raise ValueError(
                f"{where}: attention='mla' bundles have no indexer, but layers {with_indexer} hold "
                f"{_INDEXER_COMPONENT!r} (use attention='sfa')"
            )
        if (available_bytes is None) == (num_blocks is None):
            raise ValueError(f"{where}: give exactly one of 'available_bytes' and 'num_blocks'")
        if available_bytes is not None:
            available_bytes = check_int(where, "available_bytes", available_bytes, minimum=0)
        if num_blocks is not None:
            num_blocks = check_int(where, "num_blocks", num_blocks, minimum=1)
        if name is not None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where}: argument 'name' must be a non-empty str, got {name!r}")
            if name in runtimes.names():
                raise ValueError(f"{where}: a KVPP scheduler named {name!r} is already registered")
        return assemble_runtime(
            group,
            dict(bundles),
            draft_bundles,
            available_bytes=available_bytes,
            num_blocks=num_blocks,
            device=dev,
            name=name,
            wait_timeout=self.wait_timeout_s,
            max_runs=self.max_broadcast_runs,
        )
