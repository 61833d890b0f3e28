"""``KVCore`` without any model library: requests with independent lifetimes through every backend.

A request finishes while another continues, a new one takes the freed slot, and forwards mix a new
request's prefill with an older request's next token. The reference is a dense causal softmax over each
request's own rows (the indexer's top-k covers every row here, so the sparse backends attend to all of
them too).
"""

from __future__ import annotations

import pytest
from support.core_driver import CORE_CONFIGS, TOY_SCALE, CoreDriver, toy_spec

from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.kv.spec import ModelSpec

BS = 4
SCALE = TOY_SCALE
CONFIGS = CORE_CONFIGS


def _spec(indexer: bool) -> ModelSpec:
    return toy_spec(indexer, top_k=64, index_heads=2)


def _driver(core: KVCore, seed: int = 0) -> CoreDriver:
    """Checks real positions against a dense causal softmax, and that padding seeing no token stays zero."""
    return CoreDriver(core, scale=SCALE, seed=seed, dense=True, padding="zero")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_request_finishes_while_another_continues(name):
    indexer, cfg = CONFIGS[name]
    core = KVCore(_spec(indexer), OffloadConfig(**cfg, block_size=BS), name=f"core-{name}")
    try:
        core.size(2, 12)
        a, b = core.admit(2)
        drv = _driver(core)
        drv.forward([a, b], drv.random_tokens(5, 3))
        drv.forward([a, b], drv.random_tokens(1, 1))
        core.finish([a.id])
        assert a.id not in core.requests and core.requests.free_slots() == [0]
        (c,) = core.admit(1)
        assert c.slot == a.slot and c.id != a.id
        drv.forward([b], drv.random_tokens(1))  # b alone
        drv.forward([c, b], drv.random_tokens(4, 2))  # c's prompt next to b's continuation
        drv.forward([c, b], drv.random_tokens(1, 1))
        drv.forward([b], drv.random_tokens(1))
        assert (b.length, c.length) == (9, 5)
        if name.startswith("sparse-offload"):
            stats = core.backend_stats()
            assert stats["reserved_requests"] == 2 and stats["hits"] + stats["misses"] > 0
    finally:
        core.close()


def test_growth_keeps_the_live_requests_rows():
    """Resident caches grow in place while two requests of different lengths are live."""
    core = KVCore(_spec(True), OffloadConfig(sparse={"offload": False}, block_size=BS), name="core-grow")
    try:
        core.size(2, 6)
        a, b = core.admit(2)
        drv = _driver(core, seed=1)
        drv.forward([a, b], drv.random_tokens(5, 2))
        core.grow(14)
        assert core.layout.tokens == 14 and core.counters.snapshot()["resizes"] == 2
        drv.forward([a, b], drv.random_tokens(6, 3))
    finally:
        core.close()


def test_fixed_pools_refuse_growth_before_any_change():
    core = KVCore(_spec(True), OffloadConfig(sparse={}, block_size=BS), name="core-fixed")
    try:
        core.size(1, 8)
        (a,) = core.admit(1)
        drv = _driver(core)
        drv.forward([a], drv.random_tokens(3))
        with pytest.raises(ValueError, match="need 9 tokens per request but 8 were reserved"):
            core.grow(9)
        assert core.layout.tokens == 8
        core.grow(8)  # what the pool holds: nothing to do
    finally:
        core.close()


@pytest.mark.parametrize("name", ["sparse-offload", "sparse-auto", "layerwise"])
def test_a_backend_failing_to_begin_leaves_the_requests_as_they_were(name, monkeypatch):
    indexer, cfg = CONFIGS[name]
    core = KVCore(_spec(indexer), OffloadConfig(**cfg, block_size=BS), name=f"core-begin-{name}")
    try:
        core.size(2, 12)
        a, b = core.admit(2)
        drv = _driver(core, seed=2)
        drv.forward([a, b], drv.random_tokens(5, 3))
        backend = core.backends.all[-1]
        real = type(backend).begin_forward
        calls = {"n": 0}

        def failing(self, fwd):
            calls["n"] += 1
            if calls["n"] == 1:
                raise OSError("injected: the backend cannot begin")
            return real(self, fwd)

        monkeypatch.setattr(type(backend), "begin_forward", failing)
        tokens = (list(a.tokens), list(b.tokens))
        with pytest.raises(OSError, match="injected"):
            drv.forward([a, b], drv.random_tokens(1, 1))
        assert core.forward is None and (a.tokens, b.tokens) == tokens
        drv.forward([a, b], drv.random_tokens(1, 1))  # checked against the reference
        assert (a.length, b.length) == (6, 4)
    finally:
        core.close()
