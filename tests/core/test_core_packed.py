"""Packed forwards through ``KVCore``: the requests' new tokens one after the other in one row ``[1, N]``.

The layout vLLM and transformers' continuous batching drive attention with (cumulative sequence lengths,
each request's computed length). Every backend serves it: prompts of different lengths, decode steps,
a chunk next to decode tokens (with a sparse backend one forward of two parts: the decode tokens take the
sparse decode path), a request with no new token, packed and batched forwards mixed in one sequence. Outputs are checked against the pure-PyTorch reference of ``tests/support/core_driver.py``
(dense causal softmax, or the lightning indexer's top-k when it selects fewer rows than the context).
One test runs the driver in a fresh interpreter and checks that nothing imported transformers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support.core_driver import CORE_CONFIGS, TOY_SCALE, CoreDriver, toy_spec

from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.kv.spec import ModelSpec

BS = 4
SCALE = TOY_SCALE
DC, DR, DI = 16, 8, 8
CONFIGS = CORE_CONFIGS


def _spec(indexer: bool, top_k: int = 64) -> ModelSpec:
    return toy_spec(indexer, top_k=top_k)


def _sequence(core: KVCore, drv: CoreDriver) -> None:
    """Packed prompts, packed decode steps, a chunk beside decode tokens, a request with no new token, a
    batched forward in between, a finished request's slot reused by a packed prompt."""
    core.size(3, 24)
    a, b, c = core.admit(3)
    fwd = drv.forward([a, b, c], drv.random_tokens(5, 3, 7), packed=True)
    assert fwd.packed and fwd.shape == (1, 15) and fwd.n_pad == 0
    for _ in range(3):
        fwd = drv.forward([a, b, c], drv.random_tokens(1, 1, 1), packed=True)
        assert fwd.decode == (core.backends.sparse is not None)
    mixed = core.counters.snapshot()["mixed_forwards"]
    fwd = drv.forward([b, a, c], drv.random_tokens(4, 1, 1), packed=True)  # a chunk beside decode tokens
    # with a sparse backend: one forward of two parts, a and c through the decode path, b's chunk the other
    parts = core.backends.sparse is not None
    assert [p.request_ids for p in fwd.parts] == ([[a.id, c.id], [b.id]] if parts else [])
    assert [p.decode for p in fwd.parts] == ([True, False] if parts else [])
    drv.forward([a, b, c], drv.random_tokens(2, 0, 1), packed=True)  # b computes nothing this time
    drv.forward([a, c], drv.random_tokens(1, 1))  # batched, between packed ones
    core.finish([b.id])
    (d,) = core.admit(1)
    drv.forward([c, d, a], drv.random_tokens(1, 6, 1), packed=True)
    drv.forward([a, c, d], drv.random_tokens(1, 1, 1), packed=True)
    assert (a.length, c.length, d.length) == (14, 15, 7)
    assert core.counters.snapshot()["mixed_forwards"] - mixed == (3 if parts else 0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_forwards_through_every_backend(name):
    indexer, cfg = CONFIGS[name]
    core = KVCore(_spec(indexer), OffloadConfig(**cfg, block_size=BS), name=f"packed-{name}")
    try:
        _sequence(core, CoreDriver(core, scale=SCALE, seed=1, dense=True))
    finally:
        core.close()


@pytest.mark.parametrize("offload", [True, False])
def test_packed_forwards_select_the_indexers_top_k(offload):
    """A top-k of 4 over contexts up to 14 rows: the attention reads the indexer's selection."""
    core = KVCore(_spec(True, top_k=4), OffloadConfig(sparse={"offload": offload}, block_size=BS), name="pk")
    try:
        drv = CoreDriver(core, scale=SCALE, seed=2, positive_index=True)
        _sequence(core, drv)
        if offload:
            stats = core.backend_stats()
            assert stats["hits"] + stats["misses"] == drv.decode_entries > 0
    finally:
        core.close()


def test_packed_forwards_refuse_mismatched_inputs_and_stay_usable():
    core = KVCore(_spec(True), OffloadConfig(sparse={}, block_size=BS), name="packed-bad")
    try:
        core.size(2, 16)
        a, b = core.admit(2)
        drv = CoreDriver(core, scale=SCALE, seed=3, dense=True)
        drv.forward([a, b], drv.random_tokens(3, 2), packed=True)
        core.begin_forward([a, b], drv.random_tokens(1, 1))
        with pytest.raises(ValueError, match=r"'kv_c' / 'k_pe' must be \[1, 2, 16\]"):  # batched [2, 1]
            core.cache_write(0, torch.randn(2, 1, DC), torch.randn(2, 1, DR), torch.randn(2, 1, DI))
        core.abort_forward()
        for r in (a, b):  # the aborted forward's tokens are dropped by its caller: here, the requests go
            core.finish([r.id])
        a, b = core.admit(2)
        drv.forward([a, b], drv.random_tokens(2, 4), packed=True)
        drv.forward([a, b], drv.random_tokens(1, 1), packed=True)
    finally:
        core.close()


def test_a_packed_batch_runs_without_transformers():
    """The core is library-independent: a packed prompt and decode steps through sparse offload, in a
    fresh interpreter, checked against the reference, and transformers never imported."""
    tests = Path(__file__).resolve().parents[1]
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tests)!r})
        import torch
        from support.core_driver import CORE_CONFIGS, TOY_SCALE, CoreDriver, toy_spec
        from torch_kvoffload.core.config import OffloadConfig
        from torch_kvoffload.core.kv import KVCore
        from support.core_driver import toy_spec
        spec = toy_spec(True, top_k=4)
        core = KVCore(spec, OffloadConfig(sparse={{}}, block_size=4), name="no-hf")
        core.size(2, 16)
        a, b = core.admit(2)
        drv = CoreDriver(core, scale=spec.scale, seed=0, positive_index=True)
        drv.forward([a, b], drv.random_tokens(6, 3), packed=True)
        for _ in range(3):
            assert drv.forward([a, b], drv.random_tokens(1, 1), packed=True).decode
        core.close()
        assert "transformers" not in sys.modules, "the core imported transformers"
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
