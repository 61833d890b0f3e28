"""kvoffload::kvpp_wait_layer / kvpp_prefetch_layer: opcheck, errors, torch.compile graph order."""

from __future__ import annotations

import pytest
import torch
from kvpp_helpers import RecordingTransport, small_allocation

from torch_kvoffload.kvpp import KVPPScheduler
from torch_kvoffload.ops import kvpp_prefetch_layer, kvpp_wait_layer, reference_kernel
from torch_kvoffload.ops.kvpp import register_scheduler, unregister_scheduler


@pytest.fixture
def scheduler():
    alloc = small_allocation(5, 2, 1)
    transport = RecordingTransport(2, 1)
    sched = KVPPScheduler(alloc, transport, name="ops-test")
    yield sched, alloc, transport
    sched.close()


@pytest.mark.parametrize("op", ["kvpp_wait_layer", "kvpp_prefetch_layer"])
def test_opcheck(scheduler, op: str) -> None:
    sched, alloc, _ = scheduler
    sched.schedule_forward(False)  # repeated calls stay legal: a forward without history
    for layer in (0, 3):
        torch.library.opcheck(
            getattr(torch.ops.kvoffload, op).default, ("ops-test", layer, list(alloc.views(layer).values()))
        )
    sched.complete_forward()


def test_eager_ops_drive_the_scheduler(scheduler) -> None:
    sched, alloc, transport = scheduler
    sched.schedule_forward(True)
    for layer in range(5):
        kvpp_wait_layer("ops-test", layer, list(alloc.views(layer).values()))
        if layer + 1 < 5:
            kvpp_prefetch_layer("ops-test", layer + 1, list(alloc.views(layer + 1).values()))
    sched.complete_forward()
    assert transport.layers == [0, 1, 2, 3, 4]
    assert sched.counters.get("waits") == 5


@pytest.mark.parametrize("kernel", ["dispatch", "reference"])
def test_op_errors(scheduler, kernel: str) -> None:
    _, alloc, _ = scheduler
    get = (lambda n: getattr(torch.ops.kvoffload, n)) if kernel == "dispatch" else reference_kernel
    views = list(alloc.views(0).values())
    with pytest.raises(KeyError, match="no KVPP scheduler named 'nope'"):
        get("kvpp_wait_layer")("nope", 0, views)
    with pytest.raises(ValueError, match="kvpp_wait_layer: argument 'layer'"):
        get("kvpp_wait_layer")("ops-test", -1, views)
    with pytest.raises(ValueError, match="kvpp_prefetch_layer: argument 'bundle'"):
        get("kvpp_prefetch_layer")("ops-test", 0, [])
    with pytest.raises(ValueError, match="argument 'scheduler'"):
        get("kvpp_prefetch_layer")("", 0, views)


def test_register_rejects_bad_names() -> None:
    with pytest.raises(ValueError, match="'name'"):
        register_scheduler("", object())
    unregister_scheduler("never-registered")  # no error


def test_compile_fullgraph_keeps_the_hooks_in_order(scheduler) -> None:
    sched, alloc, transport = scheduler
    views = {layer: alloc.views(layer) for layer in range(5)}
    recorded: list[list[tuple[str, int]]] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs):
        calls = []
        for node in gm.graph.nodes:
            parts = str(node.target).split(".")  # kvoffload.<op>[.default]
            if node.op == "call_function" and parts[0] == "kvoffload":
                calls.append((parts[1], node.args[1]))
        recorded.append(calls)
        return gm.forward

    def model(x: torch.Tensor, caches: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor:
        for layer in range(5):
            c = caches[layer]
            h = x * 2.0  # the layer's projections
            torch.ops.kvoffload.kvpp_wait_layer("ops-test", layer, [c["c_kv"], c["k_pe"], c["index_k"]])
            if layer + 1 < 5:
                n = caches[layer + 1]
                torch.ops.kvoffload.kvpp_prefetch_layer(
                    "ops-test", layer + 1, [n["c_kv"], n["k_pe"], n["index_k"]]
                )
            c["c_kv"][0, 0].copy_(h[: c["c_kv"].shape[-1]])
            x = x + c["c_kv"].sum() + c["k_pe"].sum()
        return x

    x = torch.randn(16)
    compiled = torch.compile(model, backend=recording_backend, fullgraph=True)
    sched.schedule_forward(True)
    got = compiled(x, views)
    sched.complete_forward()
    expected_graph = []
    for layer in range(5):
        expected_graph.append(("kvpp_wait_layer", layer))
        if layer + 1 < 5:
            expected_graph.append(("kvpp_prefetch_layer", layer + 1))
    assert recorded == [expected_graph]
    assert transport.layers == [0, 1, 2, 3, 4]
    # eager gives the same result on a fresh copy of the caches
    for layer in range(5):
        for v in alloc.views(layer).values():
            v.zero_()
    sched.schedule_forward(True)
    torch.testing.assert_close(got, model(x, views))
    sched.complete_forward()
