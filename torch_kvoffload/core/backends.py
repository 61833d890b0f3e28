""":func:`build_backends`: the KV backends of one model, one per enabled feature, picked from the
configuration.

Dispatch is on the type of each configured feature (as torchao dispatches on its config types); each
backend lives in its feature's package and is given only its feature's config (data):
:class:`~torch_kvoffload.layerwise.LayerwiseConfig` → :class:`~torch_kvoffload.layerwise.backend.LayerwiseBackend`,
:class:`~torch_kvoffload.kvpp.KVPPConfig` (requested) → :class:`~torch_kvoffload.kvpp.backend.KVPPBackend`,
:class:`~torch_kvoffload.sparse.config.SparseOptions` → :class:`~torch_kvoffload.sparse.backend.SparseOffloadBackend`
(``offload=True``), :class:`~torch_kvoffload.sparse.resident_backend.ResidentSparseBackend`
(``offload=False``) or :class:`~torch_kvoffload.sparse.hybrid_backend.HybridSparseBackend` (``"auto"``); a P/D role (built by the integration from the :class:`~torch_kvoffload.pd.PDConfig`)
comes first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.core.pd_role import PDRole
from torch_kvoffload.kv.backend import KVBackend
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.kvpp import KVPPConfig
from torch_kvoffload.kvpp.backend import KVPPBackend
from torch_kvoffload.layerwise import LayerwiseConfig
from torch_kvoffload.layerwise.backend import LayerwiseBackend
from torch_kvoffload.layerwise.prefix_store import PrefixStore
from torch_kvoffload.sparse.backend import SparseOffloadBackend
from torch_kvoffload.sparse.config import SparseOptions
from torch_kvoffload.sparse.hybrid_backend import HybridSparseBackend
from torch_kvoffload.sparse.resident_backend import ResidentSparseBackend

__all__ = ["Backends", "build_backends"]


@dataclass
class Backends:
    """The backends of one model, in call order (``all``), and the ones the core addresses by feature."""

    all: list[KVBackend] = field(default_factory=list)
    role: PDRole | None = None
    layerwise: LayerwiseBackend | None = None
    kvpp: KVPPBackend | None = None
    sparse: SparseOffloadBackend | ResidentSparseBackend | None = (
        None  # HybridSparseBackend is a SparseOffloadBackend
    )
    #: the store of prefix reuse without layerwise offload (no forward takes part in it)
    prefix_store: PrefixStore | None = None

    @property
    def store(self) -> LayerwiseBackend | PrefixStore | None:
        """What prefix reuse looks prompts up in and adopts from: the layerwise backend, else the prefix
        store."""
        return self.layerwise if self.layerwise is not None else self.prefix_store

    @property
    def indexer(self) -> KVBackend | None:
        """The backend owning the indexer cache the top-k is selected over: the sparse one's device
        indexer cache, else KVPP's bundle, else the layerwise buffers when they carry the indexer keys."""
        if self.sparse is not None:
            return self.sparse
        if self.kvpp is not None and self.kvpp.spec.has_indexer:
            return self.kvpp
        if self.layerwise is not None and self.layerwise.indexed:
            return self.layerwise
        return None

    def stats(self) -> dict[str, float]:
        """The backends' counters and the prefix store's, summed by name."""
        out: dict[str, float] = {}
        for b in [*self.all, *([self.prefix_store] if self.prefix_store is not None else [])]:
            for k, v in b.stats().items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        """Close the role's endpoints first (outstanding transfers fail instead of holding the buffers),
        then the backends, then the role."""
        if self.role is not None:
            self.role.stop()
        try:
            for b in self.all:
                if b is not self.role:
                    b.close()
            if self.prefix_store is not None:
                self.prefix_store.close()
        finally:
            if self.role is not None:
                self.role.close()


@dataclass
class _Context:
    spec: ModelSpec
    config: OffloadConfig
    block_size: int
    kvpp_name: str
    role: PDRole | None


def _layerwise(ctx: _Context, cfg: LayerwiseConfig) -> LayerwiseBackend:
    # the layer buffers carry the indexer keys when no sparse indexer cache exists, on a P/D prefill node
    # whatever else runs (the decode peer reads the indexer from them), and with prefix reuse (a stored
    # prefix without its indexer keys cannot be reused: the top-k of later tokens reads them)
    cfg_all = ctx.config
    indexed = ctx.spec.has_indexer and (
        cfg_all.sparse is None or ctx.role is not None or cfg_all.prefix_cache
    )
    factory = None
    if ctx.role is not None:
        role = ctx.role

        def factory(lw, specs, store):
            return role.build_layerwise_runtime(lw, specs, store=store)

    # FP8 indexer rows where the sparse indexer cache keeps them: a P/D decode peer lands them as they are
    return LayerwiseBackend(ctx.spec, cfg, block_size=ctx.block_size, indexed=indexed, kv_fp8=cfg_all.fp8_kv,
                            index_fp8=cfg_all.fp8_indexer, build_runtime=factory)  # fmt: skip


def _kvpp(ctx: _Context, cfg: KVPPConfig) -> KVPPBackend:
    return KVPPBackend(ctx.spec, cfg, block_size=ctx.block_size, name=ctx.kvpp_name)


def _sparse(ctx: _Context, cfg: SparseOptions) -> SparseOffloadBackend | ResidentSparseBackend:
    if cfg.offload == "auto":
        budget = ctx.config.serving.device_kv_budget
        return HybridSparseBackend(
            ctx.spec, cfg, block_size=ctx.block_size, budget=budget, receives=ctx.role is not None
        )
    if cfg.offload:
        return SparseOffloadBackend(ctx.spec, cfg, block_size=ctx.block_size)
    return ResidentSparseBackend(ctx.spec, cfg)


_BUILDERS: dict[type, Callable[[_Context, Any], KVBackend]] = {
    LayerwiseConfig: _layerwise,
    KVPPConfig: _kvpp,
    SparseOptions: _sparse,
}
_SLOTS = {LayerwiseConfig: "layerwise", KVPPConfig: "kvpp", SparseOptions: "sparse"}


def build_backends(
    spec: ModelSpec, config: OffloadConfig, *, block_size: int, kvpp_name: str, role: PDRole | None = None
) -> Backends:
    """The backends ``config`` enables for ``spec``, in call order: the P/D ``role``, layerwise, KVPP,
    sparse; with prefix reuse on and sparse or KVPP without layerwise, the :class:`PrefixStore` (of a KVPP
    rank's owned layers). A backend that fails to build closes the ones built before it."""
    ctx = _Context(spec, config, block_size, kvpp_name, role)
    out = Backends(role=role)
    if role is not None:
        out.all.append(role)
    features = [config.layerwise, config.kvpp if config.kvpp_requested else None, config.sparse]
    try:
        for feature in features:
            if feature is None:
                continue
            backend = _BUILDERS[type(feature)](ctx, feature)
            setattr(out, _SLOTS[type(feature)], backend)
            out.all.append(backend)
        if isinstance(out.sparse, HybridSparseBackend):  # the budget holds every device cache
            out.sparse.others = [b for b in out.all if b is not out.sparse]
        # none for a spec without the weights' fingerprint (a core driven directly): its keys could match
        # another model's; none on any rank when a KVPP group outnumbers the layers (a rank would own none)
        holds = out.kvpp is None or spec.num_layers >= out.kvpp.group.size
        if (store := config.prefix_store_config) is not None and spec.weights_fingerprint and holds:
            layers = out.kvpp.owned_layers if out.kvpp is not None else None
            out.prefix_store = PrefixStore(
                spec, store, block_size=block_size, layers=layers, index_fp8=config.fp8_indexer,
                kv_fp8=config.fp8_kv,
            )  # fmt: skip
    except BaseException:
        for b in out.all:
            if b is not role:
                b.close()
        raise
    return out
