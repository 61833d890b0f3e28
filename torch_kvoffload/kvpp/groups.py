"""KVPP communication groups from the [ExternalDP, DP, PP, PCP, TP] rank layout.

Global ranks are laid out with TP varying fastest, then PCP, PP, DP and external DP:
``rank = (((e * dp + d) * pp + p) * pcp + c) * tp + t``. The KV of an MLA layer is replicated over the
flattened (PCP, TP) domain, so that domain is split into groups of the KVPP size (``pcp * tp``): one group
per (external DP, DP replica, PP stage), never crossing them. Owner ids used by ownership and the plan are
group-local (0 .. size-1) and map to global ranks through the group's rank list.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["KVPPGroup", "create_kvpp_group", "kvpp_groups", "kvpp_size"]


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"kvpp_groups: argument '{name}' must be a positive integer, got {value!r}")


def kvpp_size(pcp: int, tp: int) -> int:
    """The KVPP group size: the (PCP × TP) replication domain."""
    return pcp * tp


def kvpp_groups(world_size: int, dp: int, pp: int, pcp: int, tp: int) -> list[list[int]]:
    """Global ranks of every KVPP group, in layout order.

    ``world_size`` must be a multiple of ``dp * pp * pcp * tp``; the quotient is the external DP size.
    Returns ``world_size / (pcp * tp)`` groups of ``pcp * tp`` ranks each, ordered by
    (external DP, DP, PP); inside a group, ranks are ordered by (PCP, TP), which is the group-local id.
    """
    for name, value in (("world_size", world_size), ("dp", dp), ("pp", pp), ("pcp", pcp), ("tp", tp)):
        _positive(name, value)
    inner = dp * pp * pcp * tp
    if world_size % inner:
        raise ValueError(
            f"kvpp_groups: world_size {world_size} is not divisible by dp*pp*pcp*tp = "
            f"{dp}*{pp}*{pcp}*{tp} = {inner}"
        )
    external_dp = world_size // inner
    size = kvpp_size(pcp, tp)
    layout = torch.arange(world_size).reshape(external_dp, dp, pp, pcp, tp)
    flat = layout.flatten(-2)  # [ext_dp, dp, pp, pcp*tp]
    return [list(map(int, g)) for g in flat.reshape(-1, size)]


@dataclass(frozen=True)
class KVPPGroup:
    """This rank's KVPP group.

    ``ranks`` are the global ranks (index = group-local owner id), ``local_rank`` this rank's id in it,
    ``pp_stage`` the pipeline stage the group serves, ``process_group`` the dedicated
    ``torch.distributed`` group (``None`` for a single-rank group), ``control_group`` a gloo group over the
    same ranks for the small host-side exchanges before a forward (the process group itself when it is
    gloo; ``None``: use ``process_group``).
    """

    ranks: tuple[int, ...]
    local_rank: int
    pp_stage: int
    process_group: Any = None
    backend: str | None = None
    control_group: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, owner: int) -> int:
        """Map a group-local owner id to its global rank."""
        if not 0 <= owner < len(self.ranks):
            raise ValueError(f"KVPPGroup: owner id {owner} out of range [0, {len(self.ranks)})")
        return self.ranks[owner]


def _backend_for(device: torch.device) -> str:
    """The collective backend for tensors on ``device`` (probe-guarded)."""
    import torch.distributed as dist

    if device.type == "cpu":
        if not dist.is_gloo_available():
            raise RuntimeError("KVPP on CPU needs the gloo backend, which this torch build lacks")
        return "gloo"
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise RuntimeError("KVPP on CUDA needs the nccl backend, which this torch build lacks")
        return "nccl"
    if device.type == "npu":
        try:
            import torch_npu  # noqa: F401
        except (ImportError, RuntimeError) as exc:
            raise RuntimeError(f"KVPP on NPU needs torch_npu (hccl backend): {exc}") from exc
        return "hccl"
    raise RuntimeError(f"KVPP: no collective backend known for device {device}")


def create_kvpp_group(dp: int, pp: int, pcp: int, tp: int, device: torch.device) -> KVPPGroup:
    """Create every KVPP process group (a collective call: all ranks, same order) and return this rank's.

    Needs an initialised default process group. KVPP gets dedicated groups created with ``new_group``:
    its broadcasts run on a transfer thread, and collectives of one group must be issued in the same
    order on all ranks — sharing the group with other traffic would break that. With nccl / hccl each
    group also gets a gloo group for the host-side agreement exchange of every forward (no device sync).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("create_kvpp_group: torch.distributed is not initialised")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = kvpp_groups(world, dp, pp, pcp, tp)
    backend = _backend_for(device)
    mine: KVPPGroup | None = None
    for index, ranks in enumerate(groups):
        pg = control = None
        if len(ranks) > 1:
            pg = dist.new_group(ranks, backend=backend)
            control = pg if backend == "gloo" else dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = KVPPGroup(tuple(ranks), ranks.index(rank), index % pp, pg, backend, control)
    assert mine is not None  # every rank is in exactly one group
    logger.info(
        "rank %d: KVPP group %s (local id %d, pp stage %d)", rank, mine.ranks, mine.local_rank, mine.pp_stage
    )
    return mine
