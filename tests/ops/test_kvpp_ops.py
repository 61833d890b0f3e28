"""kvoffload::kvpp_wait_layer / kvpp_prefetch_layer: opcheck on a forward with history, errors, graph
order under torch.compile, and correct results under a functionalizing backend (aot_eager).

The scheduler runs over a :class:`LoopbackTransport`: for the layers this rank (1 of 2) does not own, a
broadcast really writes the remote owner's bytes (``sources``) into the scratch buffer for the forward's
block runs, so the ops have an effect to check.
"""

from __future__ import annotations

import pytest
import torch
from support.kvpp_helpers import LoopbackTransport, small_allocation

from torch_kvoffload.kvpp import KVPPScheduler
from torch_kvoffload.ops import kvpp_prefetch_layer, kvpp_wait_layer, reference_kernel
from torch_kvoffload.ops.kvpp import runtimes

NUM_LAYERS, NUM_BLOCKS = 5, 6
TABLES = [[1, 2], [4]]
BLOCKS = [1, 2, 4]


def _owner_caches(alloc) -> dict[int, dict[str, torch.Tensor]]:
    """What each layer holds on its owner: random fp32 per component (rank 1 owns 3 and 4)."""
    g = torch.Generator().manual_seed(5)
    return {
        layer: {n: torch.randn(v.shape, generator=g) for n, v in alloc.views(layer).items()}
        for layer in range(NUM_LAYERS)
    }


@pytest.fixture
def setup():
    alloc = small_allocation(NUM_LAYERS, 2, 1, num_blocks=NUM_BLOCKS)
    truth = _owner_caches(alloc)
    sources = {}
    for layer in range(NUM_LAYERS):
        # the owner's bundle bytes: components back to back, each all blocks (component-major)
        sources[layer] = torch.cat(
            [truth[layer][n].reshape(-1).view(torch.uint8) for n in ("c_kv", "k_pe", "index_k")]
        )
        if alloc.plan.is_persistent(layer):
            for n, v in alloc.views(layer).items():
                v.copy_(truth[layer][n])
    transport = LoopbackTransport(alloc, sources)
    sched = KVPPScheduler(alloc, transport, name="ops-test")
    yield sched, alloc, transport, truth
    sched.close()


def _scratch_holds_the_owners_blocks(alloc, truth, layer: int) -> bool:
    return all(torch.equal(v[BLOCKS], truth[layer][n][BLOCKS]) for n, v in alloc.views(layer).items())


def test_opcheck_on_a_forward_with_history(setup) -> None:
    sched, alloc, transport, truth = setup
    for v in alloc.scratch:
        v.fill_(0)
    sched.begin_forward(True, TABLES)
    wait = torch.ops.kvoffload.kvpp_wait_layer.default
    prefetch = torch.ops.kvoffload.kvpp_prefetch_layer.default
    # opcheck calls the op several times (eager, fake, AOT with copies of the arguments): the first wait
    # of layer 0 moves its blocks and starts layer 1; the later ones are no-op waits that refresh copies
    torch.library.opcheck(wait, ("ops-test", 0, list(alloc.views(0).values())))
    assert transport.layers == [0, 1]
    assert _scratch_holds_the_owners_blocks(alloc, truth, 0)
    torch.library.opcheck(prefetch, ("ops-test", 1, list(alloc.views(1).values())))  # started already
    assert transport.layers == [0, 1]
    for layer in range(1, NUM_LAYERS):
        kvpp_wait_layer("ops-test", layer, list(alloc.views(layer).values()))
    sched.end_forward()
    assert transport.layers == [0, 1, 2, 3, 4]
    assert sched.counters.get("waits") == 5


def test_eager_ops_drive_the_scheduler(setup) -> None:
    sched, alloc, transport, truth = setup
    sched.begin_forward(True, TABLES)
    for layer in range(NUM_LAYERS):
        kvpp_wait_layer("ops-test", layer, list(alloc.views(layer).values()))
        assert _scratch_holds_the_owners_blocks(alloc, truth, layer)
        if layer + 1 < NUM_LAYERS:
            kvpp_prefetch_layer("ops-test", layer + 1, list(alloc.views(layer + 1).values()))
    sched.end_forward()
    assert transport.layers == [0, 1, 2, 3, 4]
    assert sched.counters.get("waits") == 5


@pytest.mark.parametrize("kernel", ["dispatch", "reference"])
def test_op_errors(setup, kernel: str) -> None:
    _, alloc, _, _ = setup
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


def test_registry_rejects_bad_names() -> None:
    with pytest.raises(ValueError, match="'name'"):
        runtimes.register("", object())
    runtimes.unregister("never-registered")  # no error


def _model(x: torch.Tensor, caches: dict[int, list[torch.Tensor]]) -> torch.Tensor:
    """Per layer: projections, the KVPP wait and next-layer prefetch, a cache write, reads of the forward's
    blocks (a stand-in for attention)."""
    blocks = torch.tensor(BLOCKS)
    for layer in range(NUM_LAYERS):
        c_kv, k_pe, index_k = caches[layer]
        h = x * 2.0
        torch.ops.kvoffload.kvpp_wait_layer("ops-test", layer, [c_kv, k_pe, index_k])
        if layer + 1 < NUM_LAYERS:
            torch.ops.kvoffload.kvpp_prefetch_layer("ops-test", layer + 1, caches[layer + 1])
        c_kv[4, 3].copy_(h)  # the new row of the request in block 4
        rows = torch.cat([c_kv[blocks].flatten(0, 1), k_pe[blocks].flatten(0, 1).repeat(1, 2)], dim=0)
        x = x + (rows @ x).softmax(0) @ rows + index_k[blocks].sum()
    return x


def _expected(x: torch.Tensor, truth) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
    caches = {layer: [v.clone() for v in truth[layer].values()] for layer in range(NUM_LAYERS)}
    blocks = torch.tensor(BLOCKS)
    for layer in range(NUM_LAYERS):
        c_kv, k_pe, index_k = caches[layer]
        c_kv[4, 3].copy_(x * 2.0)
        rows = torch.cat([c_kv[blocks].flatten(0, 1), k_pe[blocks].flatten(0, 1).repeat(1, 2)], dim=0)
        x = x + (rows @ x).softmax(0) @ rows + index_k[blocks].sum()
    return x, caches


def test_compile_fullgraph_keeps_the_hooks_in_order(setup) -> None:
    sched, alloc, transport, truth = setup
    caches = {layer: list(alloc.views(layer).values()) for layer in range(NUM_LAYERS)}
    recorded: list[list[tuple[str, int]]] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs):
        calls = []
        for node in gm.graph.nodes:
            parts = str(node.target).split(".")  # kvoffload.<op>[.default]
            if node.op == "call_function" and parts[0] == "kvoffload":
                calls.append((parts[1], node.args[1]))
        recorded.append(calls)
        return gm.forward

    x = torch.randn(16)
    compiled = torch.compile(_model, backend=recording_backend, fullgraph=True)
    sched.begin_forward(True, TABLES)
    got = compiled(x, caches)
    sched.end_forward()
    expected_graph = []
    for layer in range(NUM_LAYERS):
        expected_graph.append(("kvpp_wait_layer", layer))
        if layer + 1 < NUM_LAYERS:
            expected_graph.append(("kvpp_prefetch_layer", layer + 1))
    assert recorded == [expected_graph]
    assert transport.layers == [0, 1, 2, 3, 4]
    torch.testing.assert_close(got, _expected(x, truth)[0])


def test_functionalizing_backend_reads_the_broadcast_data(setup) -> None:
    """Under aot_eager the hook ops receive copies of the caches; the wait must fill them with the
    broadcast data (for the scratch layers) or the layer's own cache, or the graph reads stale rows."""
    sched, alloc, transport, truth = setup
    for v in alloc.scratch:
        v.fill_(0)
    caches = {layer: list(alloc.views(layer).values()) for layer in range(NUM_LAYERS)}
    x = torch.randn(16)
    compiled = torch.compile(_model, backend="aot_eager", fullgraph=True)
    sched.begin_forward(True, TABLES)
    got = compiled(x, caches)
    sched.end_forward()
    assert transport.layers == [0, 1, 2, 3, 4]
    want, want_caches = _expected(x, truth)
    torch.testing.assert_close(got, want)
    # the owned layers' caches (with the new row) are what eager execution leaves
    for layer in alloc.plan.owned:
        for v, w in zip(alloc.views(layer).values(), want_caches[layer], strict=True):
            torch.testing.assert_close(v, w)
