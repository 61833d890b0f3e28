"""Test helpers for KVPP: a transport that records broadcasts and runs them on a real transfer stream."""

from __future__ import annotations

import threading

import torch

from torch_kvoffload.device import TransferEvent, TransferStream
from torch_kvoffload.kvpp import BundleSpec, KVPPAllocation, KVPPGroup, KVPPPlan, assign_owners


class RecordingTransport:
    """Stands in for :class:`BroadcastTransport` in one process: records each broadcast (layer, owner,
    destination span, ordering events) and runs a task on a real :class:`TransferStream`, which fails for
    ``fail_layers`` and, while ``gate`` is clear, blocks — so waits really wait."""

    def __init__(
        self,
        size: int = 2,
        rank: int = 0,
        fail_layers: tuple[int, ...] = (),
        peers_differ: dict | None = None,
    ):
        self.group = KVPPGroup(tuple(range(100, 100 + size)), rank, 0)
        self.stream = TransferStream("kvpp-test")
        self.calls: list[tuple[int, int, int, int, tuple[TransferEvent, ...]]] = []
        self.fail_layers = set(fail_layers)
        self.gate = threading.Event()
        self.gate.set()
        self.peers_differ = peers_differ or {}
        self.closed = False

    def broadcast(self, layer, span, owner, after=()):
        self.calls.append((layer, owner, span.data_ptr(), span.numel(), tuple(after)))

        def run() -> None:
            if not self.gate.wait(10):
                raise TimeoutError("gate never opened")
            if layer in self.fail_layers:
                raise RuntimeError(f"link down during layer {layer}")

        return self.stream.submit(run, after=after)

    def all_gather_object(self, obj):
        others = [{**obj, **self.peers_differ} for _ in range(self.group.size - 1)]
        return [obj, *others]

    def close(self) -> None:
        self.closed = True
        self.stream.close()

    @property
    def layers(self) -> list[int]:
        return [c[0] for c in self.calls]


def small_allocation(
    num_layers: int = 5, size: int = 2, rank: int = 0, drafts: tuple[int, ...] = ()
) -> KVPPAllocation:
    spec = BundleSpec.mla(4, 16, 8, torch.float32, index_dim=8)
    layers = list(range(num_layers))
    owners = assign_owners(layers, size)
    plan = KVPPPlan(
        dict.fromkeys(layers, spec.bytes_per_block), owners, rank, spec.bytes_per_block * len(drafts)
    )
    return KVPPAllocation(plan, dict.fromkeys(layers, spec), 3, "cpu", dict.fromkeys(drafts, spec))
