"""The ``kvoffload`` ``torch.compile`` backend: a captured graph -> the offload passes -> an eager runner.

``kvoffload_backend(gm, example_inputs, options=...)`` receives each graph Dynamo captured, rewrites it
with the offload passes (:mod:`torch_kvoffload.passes`) for an offload session, and returns a callable that
runs the rewritten graph eagerly (no Inductor): it passes the session's layer caches as the extra inputs
the passes added. It is registered as ``backend="kvoffload"`` through the ``torch_dynamo_backends`` entry
point, so ``torch.compile(fn, backend="kvoffload", options={...})`` needs no import of the package.

``options`` (what ``torch.compile(..., options=...)`` hands the backend):

* ``"session"``: the session to wire the graph to;
* ``"model"``: a model with a session attached as ``model._kvoffload_session`` (:data:`SESSION_ATTR`);
* ``"config"``: an offload config (or its dict form, ``None``: the model's default) for a model compiled
  without the library's ``compile``: the backend builds its session when Dynamo first compiles it (the
  model is the ``self`` of the frame Dynamo traces) and brackets every compiled call with the session's
  forward. The model's own cache is used as it is then (Hugging Face's ``DynamicCache`` still stores its
  KV); ``torch_kvoffload.compile`` is the path that saves memory.

The backend knows nothing of a model library: a session is an opaque object it reaches only through the
:class:`SessionHooks` of the integration that made it (build one for a model, the pass context, the layer
caches, sizing, a guarded forward). The package registers its integration's hooks with
:func:`register_session_hooks` when it is imported (which the entry point does), as a loader called on
first use, so importing this module loads no integration.

Every graph compiled for a model is recorded on it (:func:`compile_reports`) for
``torch_kvoffload.explain``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx

from torch_kvoffload.passes import (
    CACHE_INPUTS_KEY,
    OffloadPassManager,
    PassContext,
    PassReport,
    analyze_graph,
)

logger = logging.getLogger(__name__)

__all__ = [
    "REPORTS_ATTR",
    "SESSION_ATTR",
    "CompileReports",
    "CompiledGraph",
    "SessionHooks",
    "compile_reports",
    "kvoffload_backend",
    "register_session_hooks",
]

#: Attribute under which a model carries its offload session (the integrations attach it there).
SESSION_ATTR = "_kvoffload_session"
#: Attribute under which a model (or, without one, the session) keeps its :class:`CompileReports`.
REPORTS_ATTR = "_kvoffload_compile_reports"
_OPTION_KEYS = ("session", "model", "config")
_OWNED_ATTR = "_kvoffload_backend_forwards"


class SessionHooks(Protocol):
    """What the backend needs of the integration whose sessions it wires graphs to.

    ``session`` is whatever :meth:`build` returns (or the caller passed as ``options["session"]``).
    """

    def build(self, model: torch.nn.Module, config: Any) -> Any:
        """A new session for ``model`` and ``config`` (``ValueError`` naming the model if unsupported)."""
        ...

    def pass_context(self, session: Any) -> PassContext:
        """The runtime names and cache counts the passes wire ``session``'s layers to."""
        ...

    def layer_caches(self, session: Any, layer: int) -> list[torch.Tensor]:
        """``layer``'s current cache tensors, in the order the passes' ``num_caches`` counts them (empty
        before the session is sized)."""
        ...

    def reserve(self, session: Any, batch: int, tokens: int) -> None:
        """Size ``session`` for ``batch`` rows of up to ``tokens`` tokens."""
        ...

    def check_call(self, who: str, args: tuple[Any, ...]) -> None:
        """Raise (naming ``who``) for a call the session cannot serve, e.g. with autograd on."""
        ...

    def run_forward(
        self,
        session: Any,
        fn: Callable[[], Any],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past: int,
    ) -> Any:
        """Run ``fn`` as one forward of ``session`` over ``input_ids [B, S]`` (``past`` tokens already
        cached), holding the session for the calling thread."""
        ...


_hooks_lock = threading.Lock()
_hooks_loader: Callable[[], SessionHooks] | None = None
_hooks: SessionHooks | None = None


def register_session_hooks(loader: Callable[[], SessionHooks]) -> None:
    """Make ``loader()`` (called once, on first use) the :class:`SessionHooks` of every later graph; a later
    registration replaces an earlier one."""
    global _hooks_loader, _hooks
    if not callable(loader):
        raise TypeError(f"register_session_hooks: 'loader' must be callable, got {type(loader).__name__}")
    with _hooks_lock:
        _hooks_loader, _hooks = loader, None


def _session_hooks() -> SessionHooks:
    global _hooks
    with _hooks_lock:
        if _hooks is None:
            if _hooks_loader is None:
                raise RuntimeError(
                    "kvoffload backend: no session hooks registered (import torch_kvoffload, which registers "
                    "its integration's)"
                )
            _hooks = _hooks_loader()
        return _hooks


@dataclass
class CompiledGraph:
    """One graph the backend rewrote: its inputs' shapes (as Dynamo saw them) and the pass report."""

    index: int
    input_shapes: list[tuple[Any, ...]]
    report: PassReport
    node_count: int = 0
    layers: list[int] = field(default_factory=list)


class CompileReports(list):
    """The graphs compiled for one model; a deep copy of the model starts with none (it compiles its own)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> CompileReports:
        return type(self)()


def compile_reports(owner: Any) -> CompileReports | None:
    """The :class:`CompiledGraph` records kept on ``owner`` (a model or a session), ``None`` if none."""
    return getattr(owner, REPORTS_ATTR, None)


def _traced_self() -> Any:
    """The ``self`` of the frame Dynamo is tracing (the model), or ``None``."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return None
    if tx is None:
        return None
    value = tx.f_locals.get("self")
    return getattr(value, "value", value)


def _resolve_session(options: dict[str, Any]) -> tuple[Any, Any, bool]:
    """``(session, model or None, whether the backend runs the session's forwards)`` from the options.

    A model compiled through the entry point alone (no ``torch_kvoffload.compile``) gets a session built
    here from ``options["config"]``, stored as ``model._kvoffload_session``; no wrapper brackets its
    calls then, so the runner begins and ends each forward itself.
    """
    unknown = sorted(set(options) - set(_OPTION_KEYS))
    if unknown:
        raise ValueError(
            f"kvoffload backend: unknown options {unknown}; expected some of {list(_OPTION_KEYS)}"
        )
    session = options.get("session")
    model = options.get("model")
    if session is not None:
        return session, model, False
    if model is None:
        model = _traced_self()
    if model is None or not isinstance(model, torch.nn.Module):
        raise ValueError(
            "kvoffload backend: no offload session; pass options={'session': ...} or {'model': ...}, or compile "
            "with torch_kvoffload.compile(model, config)"
        )
    session = getattr(model, SESSION_ATTR, None)
    if session is not None:
        return session, model, bool(getattr(model, _OWNED_ATTR, False))
    session = _session_hooks().build(model, options.get("config"))
    setattr(model, SESSION_ATTR, session)
    setattr(model, _OWNED_ATTR, True)
    return session, model, True


class _Runner:
    """Runs a rewritten graph eagerly, appending the session's current layer caches to its inputs.

    With ``manage_forwards`` it also runs each call as one forward of the session, reading ``input_ids``
    and ``attention_mask`` from the graph's inputs (the tokens already cached are ``attention_mask`` width
    minus ``input_ids`` width).
    """

    def __init__(self, gm: fx.GraphModule, session: Any, hooks: SessionHooks, manage_forwards: bool) -> None:
        self.gm = gm
        self.session = session
        self.hooks = hooks
        self.cache_inputs = list(gm.meta.get(CACHE_INPUTS_KEY, []))
        self.manage_forwards = manage_forwards
        self._ids_at, self._mask_at = _token_inputs(gm)
        if manage_forwards and self._ids_at is None:
            raise ValueError(
                "kvoffload backend: the captured graph takes no input_ids; the session needs the token ids of "
                "every forward (compile with torch_kvoffload.compile, or pass input_ids)"
            )

    def _run(self, args: tuple[Any, ...]) -> Any:
        if not self.cache_inputs:
            return self.gm(*args)
        per_layer: dict[int, list[torch.Tensor]] = {}
        extra = []
        for layer, i in self.cache_inputs:
            if layer not in per_layer:
                per_layer[layer] = self.hooks.layer_caches(self.session, layer)
            extra.append(per_layer[layer][i])
        return self.gm(*args, *extra)

    def __call__(self, *args: Any) -> Any:
        self.hooks.check_call("kvoffload backend", args)
        if not self.manage_forwards:
            return self._run(args)
        ids = args[self._ids_at]
        mask = args[self._mask_at] if self._mask_at is not None else None
        past = int(mask.shape[1] - ids.shape[1]) if mask is not None else 0
        return self.hooks.run_forward(self.session, lambda: self._run(args), ids, mask, past)


def _token_inputs(gm: fx.GraphModule) -> tuple[int | None, int | None]:
    """Positions among ``gm``'s inputs of the token ids (the integer input of the first embedding
    lookup) and of the 2-D attention mask (the input named ``attention_mask``), ``None`` when absent."""
    import torch.nn.functional as F

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ids_at = None
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (F.embedding, torch.embedding):
            src = node.args[0]
            if isinstance(src, fx.Node) and src.op == "placeholder":
                ids_at = placeholders.index(src)
            break
    mask_at = next((i for i, n in enumerate(placeholders) if n.name.endswith("attention_mask_")), None)
    return ids_at, mask_at


def _reserve_for(hooks: SessionHooks, session: Any, gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Size a session the backend built (its caches exist only once sized) for this graph's batch."""
    ids_at, mask_at = _token_inputs(gm)
    ids = example_inputs[ids_at] if ids_at is not None else None
    mask = example_inputs[mask_at] if mask_at is not None else None
    if not isinstance(ids, torch.Tensor):
        raise ValueError("kvoffload backend: the captured graph takes no input_ids tensor")
    width = mask.shape[1] if isinstance(mask, torch.Tensor) else ids.shape[1]
    hooks.reserve(session, int(ids.shape[0]), int(width))


def _own_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's graph module to rewrite (Dynamo still reads its own graph's placeholders)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {}, return_output_node=True)
    value, output = out if isinstance(out, tuple) else (out, None)
    node = graph.output(value)
    if output is not None:
        node.meta = dict(output.meta)
    new = fx.GraphModule(gm, graph)
    new.meta.update(gm.meta)
    return new


def _record(owner: Any, gm: fx.GraphModule, example_inputs: list[Any], report: PassReport) -> None:
    reports = compile_reports(owner)
    if reports is None:
        reports = CompileReports()
        setattr(owner, REPORTS_ATTR, reports)
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    reports.append(
        CompiledGraph(len(reports), shapes, report, node_count=len(gm.graph.nodes), layers=report.layers())
    )
    logger.info("kvoffload backend: graph %d rewritten, layers %s", len(reports) - 1, report.layers())


def kvoffload_backend(
    gm: fx.GraphModule, example_inputs: list[Any], *, options: dict[str, Any] | None = None, **_: Any
) -> Any:
    """Rewrite ``gm`` with the offload passes for the model's session; return an eager runner.

    ``options``: see the module docstring. A graph with MLA cache appends that the analysis cannot map
    onto the runtime ops is an error (run unmodified it would read a cache that holds no KV).
    """
    opts = dict(options or {})
    session, model, manage_forwards = _resolve_session(opts)
    hooks = _session_hooks()
    if manage_forwards and not hooks.layer_caches(session, 0):
        _reserve_for(hooks, session, gm, example_inputs)
    ctx = hooks.pass_context(session)
    gm = _own_copy(gm)
    report = OffloadPassManager()(gm, ctx)
    skipped = [r for r in report.records if r.action == "skipped"]
    if skipped:
        raise ValueError(
            "kvoffload backend: attention layers the passes could not rewrite: "
            + "; ".join(r.detail for r in skipped)
        )
    left = analyze_graph(gm).layers
    assert not left, f"kvoffload backend: layers {[s.layer for s in left]} still re-expand the cache"
    _record(model if model is not None else session, gm, example_inputs, report)
    return _Runner(gm, session, hooks, manage_forwards)
