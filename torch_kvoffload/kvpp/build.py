"""``build_kvpp_runtime``: a :class:`~torch_kvoffload.kvpp.KVPPConfig` (data) made into a rank's running
:class:`~torch_kvoffload.kvpp.runtime.KVPPRuntime`, after checking the rest of the deployment against the
group and the layer bundles it is given."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.kvpp.config import INDEXER_COMPONENT, KVPPConfig
from torch_kvoffload.kvpp.groups import KVPPGroup
from torch_kvoffload.kvpp.layout import BundleSpec
from torch_kvoffload.kvpp.runtime import KVPPRuntime, assemble_runtime
from torch_kvoffload.ops.kvpp import runtimes

__all__ = ["build_kvpp_runtime"]

#: the collective backend a cache on each device type broadcasts with
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def build_kvpp_runtime(
    config: KVPPConfig,
    group: KVPPGroup,
    bundles: Mapping[int, BundleSpec],
    available_bytes: int | None = None,
    *,
    num_blocks: int | None = None,
    draft_bundles: Mapping[int, BundleSpec] | None = None,
    device: torch.device | str = "cpu",
    name: str | None = None,
) -> KVPPRuntime:
    """Build this rank's KVPP runtime under ``config`` for one PP stage (plan → allocation → transport →
    scheduler).

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
    where = "build_kvpp_runtime"
    if not config.enable_kvpp:
        raise ValueError(f"{where}: KVPP is disabled (enable_kvpp=False); there is no runtime to build")
    if config.size == 1:
        raise ValueError(
            f"{where}: the KVPP group size tp_size * pcp_size is 1 ({config.tp_size} * {config.pcp_size}), "
            "which means KVPP is off; there is no runtime to build"
        )
    if not isinstance(group, KVPPGroup):
        raise TypeError(f"{where}: argument 'group' must be a KVPPGroup, got {type(group).__name__}")
    if group.size != config.size:
        raise ValueError(
            f"{where}: group {list(group.ranks)} has {group.size} ranks, the config expects "
            f"tp_size * pcp_size = {config.tp_size} * {config.pcp_size} = {config.size}"
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
                raise TypeError(f"{where}: {arg}[{layer}] must be a BundleSpec, got {type(spec).__name__}")
    if not bundles:
        raise ValueError(f"{where}: argument 'bundles' holds no target layer")
    overlap = sorted(set(bundles) & set(draft_bundles))
    if overlap:
        raise ValueError(f"{where}: layers {overlap} are in both 'bundles' and 'draft_bundles'")
    if draft_bundles and config.speculative_method is None:
        raise ValueError(
            f"{where}: draft bundles {sorted(draft_bundles)} given, but speculative_method is None"
        )
    block_sizes = {spec.block_size for spec in [*bundles.values(), *draft_bundles.values()]}
    if len(block_sizes) != 1:
        raise ValueError(f"{where}: every bundle must have the same block_size, got {sorted(block_sizes)}")
    with_indexer = sorted(
        layer for layer, spec in bundles.items() if any(c.name == INDEXER_COMPONENT for c in spec.components)
    )
    if config.attention == "sfa" and len(with_indexer) != len(bundles):
        missing = sorted(set(bundles) - set(with_indexer))
        raise ValueError(
            f"{where}: attention='sfa' needs an {INDEXER_COMPONENT!r} component in every bundle; "
            f"layers {missing} have none"
        )
    if config.attention == "mla" and with_indexer:
        raise ValueError(
            f"{where}: attention='mla' bundles have no indexer, but layers {with_indexer} hold "
            f"{INDEXER_COMPONENT!r} (use attention='sfa')"
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
        wait_timeout=config.wait_timeout_s,
        max_runs=config.max_broadcast_runs,
    )
