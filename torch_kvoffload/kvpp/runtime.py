"""A rank's KVPP runtime: its plan, allocation and scheduler, assembled by :func:`~torch_kvoffload.kvpp.build.build_kvpp_runtime`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.kvpp.allocation import KVPPAllocation
from torch_kvoffload.kvpp.groups import KVPPGroup
from torch_kvoffload.kvpp.layout import BundleSpec
from torch_kvoffload.kvpp.ownership import assign_owners
from torch_kvoffload.kvpp.plan import KVPPPlan
from torch_kvoffload.kvpp.scheduler import KVPPScheduler
from torch_kvoffload.kvpp.transport import BroadcastTransport

logger = logging.getLogger(__name__)

__all__ = ["KVPPRuntime", "assemble_runtime"]


@dataclass
class KVPPRuntime:
    """What one rank runs: ``plan`` (owners, budget), ``allocation`` (buffers), ``scheduler`` (broadcasts).

    Drive a forward with ``scheduler.begin_forward(has_history, block_tables)``, per attention layer
    ``torch.ops.kvoffload.kvpp_wait_layer(runtime.name, layer, runtime.caches(layer))`` (or
    ``scheduler.wait_layer``), then ``scheduler.end_forward()``.
    """

    plan: KVPPPlan
    allocation: KVPPAllocation
    scheduler: KVPPScheduler

    @property
    def name(self) -> str | None:
        """The name the hook ops reach this runtime's scheduler by (``None``: not registered)."""
        return self.scheduler.name

    @property
    def counters(self) -> Counters:
        return self.scheduler.counters

    def views(self, layer: int) -> dict[str, torch.Tensor]:
        """``{component: [num_blocks, block_size, dim]}`` typed views of ``layer``'s cache on this rank."""
        return self.allocation.views(layer)

    def caches(self, layer: int) -> list[torch.Tensor]:
        """``layer``'s component views in bundle order: the ``bundle`` argument of the hook ops."""
        return list(self.allocation.views(layer).values())

    def close(self) -> None:
        self.scheduler.close()

    def __enter__(self) -> KVPPRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def assemble_runtime(
    group: KVPPGroup,
    bundles: Mapping[int, BundleSpec],
    draft_bundles: Mapping[int, BundleSpec],
    *,
    available_bytes: int | None,
    num_blocks: int | None,
    device: torch.device,
    name: str | None,
    wait_timeout: float | None,
    max_runs: int | None,
) -> KVPPRuntime:
    """Plan, allocate and schedule one rank's runtime.

    The arguments are those :func:`~torch_kvoffload.kvpp.build.build_kvpp_runtime` checked (call that:
    it validates them against the config first); ``max_runs`` and ``wait_timeout`` are the config's
    ``max_broadcast_runs`` and ``wait_timeout_s``.
    """
    owners = assign_owners(bundles, group.size)
    plan = KVPPPlan(
        {layer: spec.bytes_per_block for layer, spec in bundles.items()},
        owners,
        group.local_rank,
        sum(spec.bytes_per_block for spec in draft_bundles.values()),
    )
    if num_blocks is None:
        assert available_bytes is not None
        num_blocks = plan.group_num_blocks(available_bytes, group.size)
        if num_blocks < 1:
            raise ValueError(
                f"build_kvpp_runtime: available_bytes={available_bytes} holds no block "
                f"({plan.bytes_per_block} bytes per block on this rank, plus 2 MiB-aligned scratch)"
            )
    allocation = KVPPAllocation(plan, bundles, num_blocks, device, draft_bundles)
    transport = BroadcastTransport(group, device, timeout=wait_timeout)
    try:
        scheduler = KVPPScheduler(
            allocation, transport, name=name, wait_timeout=wait_timeout, max_runs=max_runs
        )
    except BaseException:
        transport.close()
        raise
    logger.info(
        "KVPP runtime %r: rank %d of %s, %d blocks, owns %s",
        name,
        group.local_rank,
        group.ranks,
        num_blocks,
        plan.owned,
    )
    return KVPPRuntime(plan, allocation, scheduler)
