"""Build a rank's KVPP runtime (plan → allocation → transport → scheduler) from its configuration."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torch_kvoffload.kvpp.allocation import KVPPAllocation
from torch_kvoffload.kvpp.groups import KVPPGroup
from torch_kvoffload.kvpp.layout import BundleSpec
from torch_kvoffload.kvpp.ownership import assign_owners
from torch_kvoffload.kvpp.plan import KVPPPlan
from torch_kvoffload.kvpp.scheduler import KVPPScheduler
from torch_kvoffload.kvpp.transport import BroadcastTransport

logger = logging.getLogger(__name__)

__all__ = ["KVPPRuntime", "build_kvpp_runtime"]


@dataclass
class KVPPRuntime:
    plan: KVPPPlan
    allocation: KVPPAllocation
    scheduler: KVPPScheduler

    def views(self, layer: int) -> dict[str, torch.Tensor]:
        return self.allocation.views(layer)

    def close(self) -> None:
        self.scheduler.close()


def build_kvpp_runtime(
    group: KVPPGroup,
    bundles: Mapping[int, BundleSpec],
    available_bytes: int,
    *,
    draft_bundles: Mapping[int, BundleSpec] | None = None,
    device: torch.device | str = "cpu",
    name: str | None = None,
    num_blocks: int | None = None,
    wait_timeout: float | None = None,
) -> KVPPRuntime:
    """Plan, allocate and schedule this PP stage's layers on this rank.

    ``bundles`` holds the stage's target layers (draft / MTP layers go in ``draft_bundles``). The block
    count is the minimum any rank of the group can hold within ``available_bytes`` (all ranks number
    blocks alike), unless ``num_blocks`` is given.
    """
    draft_bundles = dict(draft_bundles or {})
    owners = assign_owners(bundles, group.size)
    plan = KVPPPlan(
        {layer: spec.bytes_per_block for layer, spec in bundles.items()},
        owners,
        group.local_rank,
        sum(spec.bytes_per_block for spec in draft_bundles.values()),
    )
    if num_blocks is None:
        num_blocks = plan.group_num_blocks(available_bytes, group.size)
        if num_blocks < 1:
            raise ValueError(
                f"build_kvpp_runtime: {available_bytes} bytes hold no block "
                f"({plan.bytes_per_block} bytes per block on the fullest rank or more)"
            )
    allocation = KVPPAllocation(plan, bundles, num_blocks, device, draft_bundles)
    transport = BroadcastTransport(group, device)
    scheduler = KVPPScheduler(allocation, transport, name=name, wait_timeout=wait_timeout)
    return KVPPRuntime(plan, allocation, scheduler)
