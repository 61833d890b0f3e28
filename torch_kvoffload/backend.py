"""The ``kvoffload`` ``torch.compile`` backend, :func:`compile` and :func:`explain`.

``kvoffload_backend(gm, example_inputs, options=...)`` receives each graph Dynamo captured, rewrites it
with the offload passes (:mod:`torch_kvoffload.passes`) for the model's offload session, and returns a
callable that runs the rewritten graph eagerly (no Inductor): it passes the session's layer caches as the
extra inputs the passes added. It is registered as ``backend="kvoffload"`` through the
``torch_dynamo_backends`` entry point, so ``torch.compile(fn, backend="kvoffload", options={...})``
needs no import of the package.

``options`` (what ``torch.compile(..., options=...)`` hands the backend):

* ``"session"``: the :class:`~torch_kvoffload.integrations.hf.session.OffloadSession` to wire the graph to;
* ``"model"``: a model with a session attached (``torch_kvoffload.compile`` / ``attach``);
* ``"config"``: an :class:`~torch_kvoffload.api.OffloadConfig` (or dict, ``None``: the model's default)
  for a model compiled without :func:`compile`: the backend builds its session when Dynamo first compiles
  it (the model is the ``self`` of the frame Dynamo traces) and brackets every compiled call with the
  session's ``begin_forward`` / ``end_forward``. The model's own cache is used as it is then (Hugging
  Face's ``DynamicCache`` still stores its KV); :func:`compile` is the path that saves memory.

:func:`compile` is the whole recipe for a Hugging Face model: attach a session, compile the model's own
forward with this backend, and let ``model.generate`` run unchanged. :func:`explain` prints what the passes
found and did, per graph and layer.

Recompiles. The library's cache holds no KV, so before every call :func:`compile` shows Dynamo each
layer's cache as a zero-stride view of the true cached length (no memory) and marks that length dynamic:
a generate compiles one prefill graph and one decode graph whatever the number of new tokens. The batch
and token dims of the forward's inputs are marked dynamic too, so calls of other shapes reuse those graphs;
with Dynamo's specialisation of sizes 0 and 1 and the forwards without an attention mask, one model needs
at most 16 graphs, within the default per-model ``recompile_limit`` set here (``DEFAULT_RECOMPILE_LIMIT``).
The passes drop the dead append of those views.

Each model compiled by :func:`compile` has its own Dynamo recompile budget (``isolate_recompiles``, where
``torch.compile`` offers it): the models of one class share their forward's code object, and past Dynamo's
recompile limit on it a later model would run eagerly. Eagerly the model's own attention reads the
library's cache, which raises (see ``integrations.hf.cache``) rather than attend over the new tokens only.
A deep copy of a compiled model compiles its own graphs for its own session.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from torch_kvoffload.passes import OffloadPassManager, PassContext, PassReport, analyze_graph
from torch_kvoffload.passes._graph import CACHE_INPUTS_KEY

logger = logging.getLogger(__name__)

__all__ = ["compile", "explain", "kvoffload_backend"]

_REPORTS_ATTR = "_kvoffload_compile_reports"
_OPTION_KEYS = ("session", "model", "config")
_OWNED_ATTR = "_kvoffload_backend_forwards"
_COMPILED_ATTR = "_kvoffload_compiled"


class _Reports(list):
    """The graphs compiled for one model; a deep copy of the model starts with none (it compiles its own)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Reports:
        return type(self)()


@dataclass
class CompiledGraph:
    """One graph the backend rewrote: its inputs' shapes (as Dynamo saw them) and the pass report."""

    index: int
    input_shapes: list[tuple[Any, ...]]
    report: PassReport
    node_count: int = 0
    layers: list[int] = field(default_factory=list)


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
    session = getattr(model, "_kvoffload_session", None)
    if session is not None:
        return session, model, bool(getattr(model, _OWNED_ATTR, False))
    from torch_kvoffload.integrations.hf.install import new_session

    session = new_session(model, options.get("config"))
    model._kvoffload_session = session
    setattr(model, _OWNED_ATTR, True)
    return session, model, True


def _pass_context(session: Any) -> PassContext:
    return PassContext(
        runtime=session.name,
        num_caches=lambda layer: len(session.layer_caches(layer)),
        layerwise_runtime=session.layerwise_runtime,
        kvpp_scheduler=session.kvpp_runtime,
        num_layers=session.spec.num_layers,
    )


class _Runner:
    """Runs a rewritten graph eagerly, appending the session's current layer caches to its inputs.

    With ``manage_forwards`` it also brackets each call with the session's ``begin_forward`` /
    ``end_forward``, reading ``input_ids`` and ``attention_mask`` from the graph's inputs (the tokens
    already cached are ``attention_mask`` width minus ``input_ids`` width).
    """

    def __init__(self, gm: fx.GraphModule, session: Any, manage_forwards: bool) -> None:
        self.gm = gm
        self.session = session
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
                per_layer[layer] = self.session.layer_caches(layer)
            extra.append(per_layer[layer][i])
        return self.gm(*args, *extra)

    def __call__(self, *args: Any) -> Any:
        from torch_kvoffload.integrations.hf.install import check_no_grad, exclusive

        check_no_grad("kvoffload backend", args)
        if not self.manage_forwards:
            return self._run(args)
        ids = args[self._ids_at]
        mask = args[self._mask_at] if self._mask_at is not None else None
        past = int(mask.shape[1] - ids.shape[1]) if mask is not None else 0
        with exclusive(self.session, "kvoffload backend"):
            return self.session.run_forward(lambda: self._run(args), ids, mask, None, past=past)


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


def _reserve_for(session: Any, gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Size a session the backend built (its caches exist only once sized) for this graph's batch."""
    ids_at, mask_at = _token_inputs(gm)
    ids = example_inputs[ids_at] if ids_at is not None else None
    mask = example_inputs[mask_at] if mask_at is not None else None
    if not isinstance(ids, torch.Tensor):
        raise ValueError("kvoffload backend: the captured graph takes no input_ids tensor")
    width = mask.shape[1] if isinstance(mask, torch.Tensor) else ids.shape[1]
    session.reserve(int(ids.shape[0]), int(width))


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


def kvoffload_backend(
    gm: fx.GraphModule, example_inputs: list[Any], *, options: dict[str, Any] | None = None, **_: Any
) -> Any:
    """Rewrite ``gm`` with the offload passes for the model's session; return an eager runner.

    ``options``: see the module docstring. A graph with MLA cache appends that the analysis cannot map
    onto the runtime ops is an error (run unmodified it would read a cache that holds no KV).
    """
    opts = dict(options or {})
    session, model, manage_forwards = _resolve_session(opts)
    if manage_forwards and not session.layer_caches(0):
        _reserve_for(session, gm, example_inputs)
    ctx = _pass_context(session)
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
    owner = model if model is not None else session
    reports = getattr(owner, _REPORTS_ATTR, None)
    if reports is None:
        reports = _Reports()
        setattr(owner, _REPORTS_ATTR, reports)
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    reports.append(
        CompiledGraph(len(reports), shapes, report, node_count=len(gm.graph.nodes), layers=report.layers())
    )
    logger.info("kvoffload backend: graph %d rewritten, layers %s", len(reports) - 1, report.layers())
    return _Runner(gm, session, manage_forwards)


# the per-call inputs of a Hugging Face causal LM whose dims 0 (batch) and 1 (tokens) vary between calls
_TOKEN_INPUTS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "cache_position")


def _mark_dynamic(t: torch.Tensor, *dims: int) -> None:
    """``maybe_mark_dynamic`` the ``dims`` of ``t`` whose size is past 1 (Dynamo specialises 0 and 1)."""
    for dim in dims:
        if t.dim() > dim and t.shape[dim] >= 2:
            torch._dynamo.maybe_mark_dynamic(t, dim)


def _mark_token_dims(kwargs: dict[str, Any]) -> None:
    """Mark the batch and token dims of a forward's inputs dynamic before Dynamo first sees them.

    Left to Dynamo's automatic dynamic shapes, each of them would first compile a graph specialised to
    the first size it saw, then one more when it changes: every input variant (prefill, decode, with and
    without ``attention_mask``) would then cost a graph per varying size, enough to use up the recompile
    budget over a few ``generate`` calls of other shapes.
    """
    for name in _TOKEN_INPUTS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            _mark_dynamic(value, *range(min(value.dim(), 2)))


def _expose_cache_lengths(session: Any, cache: Any, batch: int) -> None:
    """Give each layer of the library's cache zero-stride placeholders of the true cached length.

    Dynamo reads the cache layers' tensors as graph inputs; with the cached length ``T`` as their size the
    model's masks and appends trace consistently, and ``T`` and the batch (marked dynamic once past 1) do
    not specialise the graph. The views share one scalar: they hold no memory.
    """
    spec = session.spec
    past = int(cache.get_seq_length())
    base = torch.zeros((), dtype=spec.dtype, device=spec.device)
    widths = (spec.kv_lora_rank, spec.rope_dim)
    for layer in cache.layers:
        keys = base.expand(batch, 1, past, widths[0])
        values = base.expand(batch, 1, past, widths[1])
        index = base.expand(batch, past, spec.index_head_dim) if spec.has_indexer else None
        _mark_dynamic(keys, 0, 2)
        _mark_dynamic(values, 0, 2)
        if index is not None:
            _mark_dynamic(index, 0, 1)
        layer.keys, layer.values = keys, values
        if spec.has_indexer:
            layer.indexer_keys = index
        layer.device = spec.device
        layer.is_initialized = True


# Dynamo's own default (8) is below the graphs one model may need: a prefill and a decode graph for each
# of batch 1 / more, one / more prompt tokens (past length 1 / more when decoding) and with / without an
# attention mask, at most 16 in all once the batch and token dims are dynamic (see _mark_token_dims)
DEFAULT_RECOMPILE_LIMIT = 32


@functools.cache
def _compile_accepts(name: str) -> bool:
    return name in inspect.signature(torch.compile).parameters


class _CompiledForward:
    """``model``'s own ``forward`` compiled with the ``kvoffload`` backend for ``model``, with a recompile
    budget of its own; a deep copy of the model gets one compiled for the copy."""

    def __init__(self, model: torch.nn.Module, forward: Any, kwargs: dict[str, Any]) -> None:
        self.model = model
        self.forward = forward
        self.kwargs = dict(kwargs)
        options = dict(self.kwargs)
        if _compile_accepts("isolate_recompiles"):
            options.setdefault("isolate_recompiles", True)
        if _compile_accepts("recompile_limit") and options.get("recompile_limit") is None:
            options["recompile_limit"] = DEFAULT_RECOMPILE_LIMIT
        self.fn = torch.compile(forward, backend=kvoffload_backend, options={"model": model}, **options)

    def __deepcopy__(self, memo: dict[int, Any]) -> _CompiledForward:
        from torch_kvoffload.integrations.hf.install import deepcopy_rebound

        model = copy.deepcopy(self.model, memo)
        return type(self)(model, deepcopy_rebound("forward", self.forward, memo), self.kwargs)


def _compiled_forward(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``model.forward`` of a compiled model: the cached lengths shown to Dynamo, then the compiled call."""
    from torch_kvoffload.integrations.hf.cache import is_offload_cache

    cache = kwargs.get("cache")
    if is_offload_cache(cache):
        ids = kwargs.get("input_ids", args[0] if args else None)
        _expose_cache_lengths(cache.session, cache, int(ids.shape[0]))
    _mark_token_dims(kwargs)
    if args and isinstance(args[0], torch.Tensor):
        _mark_dynamic(args[0], 0, 1)  # input_ids given positionally
    return getattr(model, _COMPILED_ATTR).fn(*args, **kwargs)


def compile(model: torch.nn.Module, config: Any = None, **torch_compile_kwargs: Any) -> torch.nn.Module:
    """Offload ``model``'s KV cache through Dynamo and the offload passes; return ``model``.

    Attaches an offload session (``config``: an :class:`~torch_kvoffload.api.OffloadConfig`, its dict
    form, or ``None`` for the model's default), then compiles the model's own ``forward`` with the
    ``kvoffload`` backend; ``begin_forward`` / ``end_forward`` of the session surround each call and
    ``model.generate(...)`` works unchanged (it generates with the library's cache).
    ``torch_compile_kwargs`` go to ``torch.compile`` (``backend`` and ``options`` are set here;
    ``isolate_recompiles`` defaults to ``True`` and ``recompile_limit`` to ``DEFAULT_RECOMPILE_LIMIT``
    where ``torch.compile`` has them).
    """
    from torch_kvoffload.integrations.hf.install import attach, bind_method

    for key in ("backend", "options"):
        if key in torch_compile_kwargs:
            raise ValueError(f"torch_kvoffload.compile: {key!r} is set by the library, got {key}=...")
    if getattr(model, "_kvoffload_session", None) is not None:
        raise ValueError(f"torch_kvoffload.compile: {type(model).__name__} is already offloaded")
    original = model.forward
    setattr(model, _COMPILED_ATTR, _CompiledForward(model, original, torch_compile_kwargs))
    model.forward = bind_method(model, _compiled_forward, original)
    try:
        attach(model, config)
    except BaseException:
        model.forward = original
        delattr(model, _COMPILED_ATTR)
        raise
    setattr(model, _REPORTS_ATTR, _Reports())
    return model


def explain(model: torch.nn.Module, *args: Any, **kwargs: Any) -> str:
    """What the passes found and did in every graph compiled for ``model`` so far, per layer.

    With ``args`` / ``kwargs`` and no graph compiled yet, runs ``model(*args, **kwargs)`` once (no grad)
    to capture one. ``ValueError`` if ``model`` was not compiled with :func:`compile`.
    """
    reports = getattr(model, _REPORTS_ATTR, None)
    if reports is None:
        raise ValueError(f"explain: {type(model).__name__} was not compiled with torch_kvoffload.compile")
    if not reports and (args or kwargs):
        with torch.no_grad():
            model(*args, **kwargs)
    if not reports:
        return f"{type(model).__name__}: no graph compiled yet (pass inputs to explain to run one forward)"
    lines = [f"{type(model).__name__}: {len(reports)} graph(s) compiled with the kvoffload passes"]
    for cg in reports:
        ids_shape = next((s for s in cg.input_shapes if isinstance(s, tuple) and len(s) == 2), None)
        lines.append(
            f"graph {cg.index}: {cg.node_count} nodes, input_ids {list(ids_shape) if ids_shape else '?'}"
        )
        for layer in cg.report.layers():
            lines.append(f"  layer {layer}:")
            for rec in cg.report.for_layer(layer):
                lines.append(f"    {rec.action:<9} [{rec.pass_name}] {rec.detail}")
        for rec in cg.report.for_layer(-1):
            lines.append(f"  {rec.action:<9} [{rec.pass_name}] {rec.detail}")
    return "\n".join(lines)
