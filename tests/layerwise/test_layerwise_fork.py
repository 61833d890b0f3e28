"""``KVCore.fork`` / ``KVCore.truncate`` and unkeyed requests through the layerwise backend.

Full blocks live in the host store, keyed by the chain of the token ids; the partial last block of each
request lives in a device tail between forwards. A fork continues its source in another slot (beam
search): it finds its source's stored blocks (shared, loaded, never copied) and gets a copy of its tail; a
truncated request continues at an earlier position (assisted decoding), its partial block read back from
the store when it had been saved full. A request fed embeddings (``keyed`` false, ``-1`` placeholder
tokens) never shares blocks with another request, only with its own forks.

The reference keeps every request's rows itself and attends like the model: dense causal softmax over the
request's rows (DeepSeek-V3), or over the lightning indexer's top-k of them (V3.2: scores
``Σ_h w_h · relu(q_h · k)``; fp32 random data, no exact ties).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from support.core_driver import CoreDriver
from support.hf_models import build_model

from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.integrations.hf.inspect import inspect_model
from torch_kvoffload.store.keys import block_hashes, layer_block_keys

BS = 4
SCALE = 0.125
FAMILIES = ("deepseek_v3", "deepseek_v32")


@pytest.fixture(scope="module", params=FAMILIES)
def spec(request):
    model = build_model(request.param, num_hidden_layers=3)
    return inspect_model(model).with_weights(model)


@pytest.fixture
def core(spec, request):
    cfg = OffloadConfig.model_validate({"layerwise": {}, "block_size": BS})
    c = KVCore(spec, cfg, name=f"lw-fork-{request.node.name}")
    c.size(4, 24)
    yield c
    c.close()


def _reference(core: KVCore, seed: int = 0) -> CoreDriver:
    """Checks every real position; the indexer's tensors are drawn for DeepSeek-V3 too (unused there)."""
    return CoreDriver(core, scale=SCALE, seed=seed, draw_index=True, atol=1e-4)


def _stats(core: KVCore) -> dict[str, float]:
    return core.backend_stats()


def _record_bytes(core: KVCore) -> int:
    rt = core.backends.layerwise.runtime
    return sum(rt.record_bytes(layer) for layer in range(core.spec.num_layers))


@pytest.mark.parametrize("prompt", [6, 8], ids=["mid-block", "block-boundary"])
def test_fork_continues_both_requests_apart(core, prompt):
    ref = _reference(core)
    (a,) = core.admit(1)
    ref.forward([a], [ref.tokens(prompt)])
    saved = _stats(core)["bytes_d2h"]
    b = ref.fork(a)
    assert b.tokens == a.tokens and b.slot != a.slot
    after = _stats(core)
    assert after["bytes_d2h"] == saved  # nothing went through the store
    ref.forward([a, b], [ref.tokens(3), ref.tokens(2)])  # different rows from here on
    stats = _stats(core)
    full = prompt // BS
    assert stats["store_hits"] - after["store_hits"] == 2 * full  # both load the shared blocks
    new_full = (prompt + 3) // BS - full + (prompt + 2) // BS - full
    assert stats["bytes_d2h"] - after["bytes_d2h"] == new_full * _record_bytes(core)
    ref.forward([b], [ref.tokens(1)])
    ref.forward([a, b], [ref.tokens(1), ref.tokens(4)])
    c = ref.fork(b)  # a fork of a fork, then the source finishes
    core.finish([b.id])
    ref.forward([c, a], [ref.tokens(2), ref.tokens(1)])


def test_fork_before_any_forward_and_release(core):
    ref = _reference(core)
    (a,) = core.admit(1)
    b = core.fork(a.id)
    assert b.length == 0
    ref.forward([a, b], [ref.tokens(5), ref.tokens(7)])
    core.finish([a.id, b.id])
    assert len(core.requests) == 0


@pytest.mark.parametrize(
    ("prompt", "length"),
    [(10, 9), (10, 8), (10, 6), (8, 6), (11, 1), (10, 0)],
    ids=["in-tail", "to-boundary", "into-saved-block", "saved-block-boundary", "first-block", "to-zero"],
)
def test_truncate_drops_the_later_rows(core, prompt, length):
    ref = _reference(core)
    a, other = core.admit(2)
    ref.forward([a, other], [ref.tokens(prompt), ref.tokens(5)])
    ref.truncate(a, length)
    assert a.length == length
    ref.forward([a], [ref.tokens(3)])  # new tokens: new rows at the dropped positions
    ref.forward([a, other], [ref.tokens(1), ref.tokens(2)])
    ref.truncate(a, a.length - 1)
    ref.forward([a], [ref.tokens(2)])


def test_truncate_after_a_fork_leaves_the_fork_alone(core):
    ref = _reference(core)
    (a,) = core.admit(1)
    ref.forward([a], [ref.tokens(9)])
    b = ref.fork(a)
    ref.truncate(a, 5)
    ref.forward([a, b], [ref.tokens(2), ref.tokens(2)])
    ref.truncate(b, 6)
    ref.forward([b, a], [ref.tokens(3), ref.tokens(1)])


def test_truncate_into_an_evicted_block_raises(core):
    ref = _reference(core)
    (a,) = core.admit(1)
    ref.forward([a], [ref.tokens(10)])
    lw = core.backends.layerwise
    h = block_hashes(a.tokens, BS, salt=lw.runtime.salt)[1]
    for layer in range(core.spec.num_layers):
        (key,) = layer_block_keys([h], layer, model_id=lw.runtime.fingerprint)
        assert lw.store.remove(key)
    with pytest.raises(RuntimeError, match="no longer holds block 1 of request"):
        core.truncate(a.id, 6)
    assert a.id not in core.requests  # the core finished it
    ref2 = _reference(core, seed=1)
    (c,) = core.admit(1)
    ref2.forward([c], [ref2.tokens(5)])


def test_unkeyed_requests_never_share_blocks(core):
    """Identical placeholder tokens, different rows: neither finds the other's blocks; a fork of one
    shares its blocks (loaded), and its own history round-trips through the store."""
    ref = _reference(core)
    a, b = core.admit(2)
    a.keyed = b.keyed = False
    ref.forward([a], [[-1] * 9])
    hits = _stats(core)["store_hits"]
    ref.forward([b], [[-1] * 9])  # a keyed store would find a's two blocks here
    assert _stats(core)["store_hits"] == hits
    ref.forward([a, b], [[-1] * 3, [-1] * 3])  # both reload their own blocks
    assert _stats(core)["store_hits"] - hits == 4
    c = ref.fork(a)
    assert not c.keyed
    hits = _stats(core)["store_hits"]
    ref.forward([c], [[7, 8]])  # real ids after the embeddings
    assert _stats(core)["store_hits"] - hits == 3  # a's three full blocks, shared
    ref.truncate(c, 6)  # back into a saved block, then the same placeholders again
    ref.forward([c, a], [[-1] * 4, [-1]])
    # a keyed request with the same tokens finds nothing of theirs
    (d,) = core.admit(1)
    hits = _stats(core)["store_hits"]
    ref.forward([d], [list(a.tokens)])
    assert _stats(core)["store_hits"] == hits


def test_the_buffers_released_for_sparse_decode_leave_nothing_to_do(spec):
    if not spec.has_indexer:
        pytest.skip("the sparse backend needs an indexer")
    cfg = OffloadConfig.model_validate({"layerwise": {}, "sparse": {"offload": False}, "block_size": BS})
    core = KVCore(spec, cfg, name="lw-fork-sparse")
    try:
        core.size(2, 24)
        (a,) = core.admit(1)
        ref = _reference(core)
        ref.forward([a], [ref.tokens(6)])
        lw = core.backends.layerwise
        assert lw.built
        core.drop_prefill_buffers()  # what the first decode step does
        assert not lw.built and not lw.device_tensors()
        (b,) = core.admit(1)
        lw.fork(core.layout, a, b, a.length)  # nothing held: nothing to do, no failure
        lw.truncate(a, 5)
    finally:
        core.close()
