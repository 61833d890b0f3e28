"""The ``kvoffload`` backend is generic: it loads and imports no model-library integration, and it reaches a
session only through the registered session hooks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from torch_kvoffload import backend
from torch_kvoffload.passes import PassContext


def test_importing_the_backend_loads_no_integration():
    code = (
        "import sys, torch_kvoffload.backend\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch_kvoffload.integrations')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_backend_and_passes_import_nothing_above_them():
    """The static import graph (function-level and ``TYPE_CHECKING`` imports included): no chain from the
    backend or the passes to the integrations, and the passes reach no core module."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("torch_kvoffload", cache_dir=None)
    for importer in ("torch_kvoffload.backend", "torch_kvoffload.passes"):
        chain = graph.find_shortest_chain(
            importer=importer, imported="torch_kvoffload.integrations", as_packages=True
        )
        assert chain is None, chain
    chain = graph.find_shortest_chain(
        importer="torch_kvoffload.passes", imported="torch_kvoffload.core", as_packages=True
    )
    assert chain is None, chain


class _Hooks:
    """Session hooks over an opaque session that record what the backend asked of them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def build(self, model, config):
        raise AssertionError("not used with options['session']")

    def pass_context(self, session):
        self.calls.append("pass_context")
        return PassContext(runtime="layers-test", num_caches=lambda layer: 1)

    def layer_caches(self, session, layer):
        self.calls.append("layer_caches")
        return []

    def reserve(self, session, batch, tokens):
        raise AssertionError("not used with options['session']")

    def check_call(self, who, args):
        self.calls.append(f"check_call:{who}")

    def run_forward(self, session, fn, input_ids, attention_mask, past):
        raise AssertionError("not used with options['session']")


@pytest.fixture
def hooks():
    saved = backend._hooks_loader
    mine = _Hooks()
    backend.register_session_hooks(lambda: mine)
    yield mine
    backend.register_session_hooks(saved)


class _OpaqueSession:
    """Holds only what the backend records on it (its compiled graphs); any other attribute is missing."""

    __slots__ = (backend.REPORTS_ATTR,)


def test_backend_reaches_the_session_only_through_the_hooks(hooks):
    session = _OpaqueSession()
    lin = torch.nn.Linear(2, 3)
    gm = torch.fx.symbolic_trace(lin)
    run = backend.kvoffload_backend(gm, [torch.zeros(1, 2)], options={"session": session})
    x = torch.randn(4, 2)
    with torch.no_grad():
        torch.testing.assert_close(run(x), lin(x), rtol=0, atol=0)
    assert hooks.calls == ["pass_context", "check_call:kvoffload backend"]
    reports = backend.compile_reports(session)
    assert [(r.index, r.input_shapes, r.layers) for r in reports] == [(0, [(1, 2)], [])]


def test_register_session_hooks_refuses_a_non_callable():
    with pytest.raises(TypeError, match="'loader' must be callable"):
        backend.register_session_hooks(object())
