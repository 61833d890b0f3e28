"""``torch_kvoffload.compile`` and ``explain`` for Hugging Face models, and the session hooks
(:data:`SESSION_HOOKS`) through which the ``kvoffload`` backend reaches this integration's sessions.

:func:`compile` is the whole recipe for a Hugging Face model: attach a session, compile the model's own
forward with the ``kvoffload`` backend (:mod:`torch_kvoffload.backend`), and let ``model.generate`` run
unchanged. :func:`explain` prints what the passes found and did, per graph and layer.

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

Where Dynamo is told to build no graph at all (``torch.compiler.set_stance("force_eager")``, or Dynamo
disabled when the model was compiled), a call runs the model's forward with the library's eager attention
(``integrations.hf.attention``, what ``offload`` installs) for that call, over the same session and cache:
the tokens are the unmodified model's, a sequence continues across the switch, and the compiled graphs
serve the calls after it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from torch_kvoffload.backend import (
    REPORTS_ATTR,
    SESSION_ATTR,
    CompileReports,
    compile_reports,
    kvoffload_backend,
)
from torch_kvoffload.integrations.hf.cache import is_offload_cache
from torch_kvoffload.integrations.hf.custom_mask import is_custom_mask
from torch_kvoffload.integrations.hf.dynamo_settings import tracing_settings
from torch_kvoffload.integrations.hf.exclusive import exclusive
from torch_kvoffload.integrations.hf.install import (
    attach,
    bind_method,
    check_no_grad,
    deepcopy_rebound,
    new_session,
)
from torch_kvoffload.integrations.hf.no_backward import autograd_anchor, without_autograd
from torch_kvoffload.integrations.hf.output_attentions import output_attentions_requested
from torch_kvoffload.passes import PassContext

__all__ = ["DEFAULT_RECOMPILE_LIMIT", "SESSION_HOOKS", "compile", "explain"]

_COMPILED_ATTR = "_kvoffload_compiled"


class _SessionHooks:
    """The ``kvoffload`` backend's view of an :class:`~torch_kvoffload.integrations.hf.session.OffloadSession`
    (see :class:`torch_kvoffload.backend.SessionHooks`)."""

    def build(self, model: torch.nn.Module, config: Any) -> Any:
        return new_session(model, config)

    def pass_context(self, session: Any) -> PassContext:
        return PassContext(
            runtime=session.name,
            num_caches=lambda layer: len(session.layer_caches(layer)),
            layerwise_runtime=session.layerwise_runtime,
            kvpp_scheduler=session.kvpp_runtime,
            num_layers=session.spec.num_layers,
            runtime_runs_hooks=True,  # the session's KV core, in cache_write
        )

    def layer_caches(self, session: Any, layer: int) -> list[torch.Tensor]:
        return session.layer_caches(layer)

    def reserve(self, session: Any, batch: int, tokens: int) -> None:
        session.reserve(batch, tokens)

    def check_call(self, who: str, args: tuple[Any, ...]) -> None:
        check_no_grad(who, args)

    def run_forward(
        self,
        session: Any,
        fn: Callable[[], Any],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past: int,
    ) -> Any:
        with exclusive(session, "kvoffload backend"):
            return session.run_forward(fn, input_ids, attention_mask, None, past=past)


#: What :func:`torch_kvoffload.backend.register_session_hooks` is given for this integration.
SESSION_HOOKS = _SessionHooks()

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


def _as_keywords(forward: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of a call of ``forward`` with its leading positional arguments given by name
    (``model(ids)`` as ``model(input_ids=ids)``): Dynamo guards on how many arguments came positionally, so
    the two spellings of one call would otherwise compile a graph each. ``TypeError`` for a call ``forward``
    could not bind (an argument given twice: the forward's own error, which Dynamo does not raise)."""
    if not args:
        return args, kwargs
    signature = inspect.signature(forward)
    signature.bind(*args, **kwargs)
    params = list(signature.parameters.values())[: len(args)]
    if len(params) < len(args) or any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return args, kwargs
    return (), {**{p.name: a for p, a in zip(params, args, strict=True)}, **kwargs}


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
        layer.set_placeholders(keys, values, index)
        layer.device = spec.device


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
        model = copy.deepcopy(self.model, memo)
        return type(self)(model, deepcopy_rebound("forward", self.forward, memo), self.kwargs)


def _dynamo_runs_eagerly(compiled: _CompiledForward) -> bool:
    """Whether calling ``compiled.fn`` now would run the model's own forward without any graph: under
    ``torch.compiler.set_stance("force_eager")``, or when Dynamo was disabled as the model was compiled
    (``TORCHDYNAMO_DISABLE=1``: ``torch.compile`` returned the forward itself). The stance has no public
    getter; it is read from ``torch._dynamo.eval_frame`` (``"default"`` where that is missing)."""
    from torch._dynamo import eval_frame

    stance = getattr(getattr(eval_frame, "_stance", None), "stance", "default")
    return stance == "force_eager" or compiled.fn is compiled.forward


_ABSENT = object()


def _eager_forward(model: torch.nn.Module, compiled: _CompiledForward, args: tuple, kwargs: dict) -> Any:
    """The model's own forward with the library's eager attention in every MLA attention module (what
    ``torch_kvoffload.offload`` installs), for this call only, over the same session and cache as the
    compiled graphs: both run the same ops on the same session, so a sequence continues across the switch.
    ``ValueError`` (naming the class and the reason) for a model the eager attention does not reproduce."""
    from torch_kvoffload.integrations.hf.attention import mla_attention_forward, rope_functions

    session = getattr(model, SESSION_ATTR)
    modules = list(session.spec.attention_modules)
    try:
        for module in modules:
            rope_functions(module)
    except ValueError as exc:
        raise ValueError(
            f"{type(model).__name__} compiled by torch_kvoffload.compile runs the library's eager attention "
            f"under torch.compiler.set_stance('force_eager') (Dynamo builds no graph then), which cannot serve "
            f"it: {exc}"
        ) from exc
    saved = []
    try:
        for module in modules:
            own = vars(module)
            saved.append((module, own.get("forward", _ABSENT), own.get(SESSION_ATTR, _ABSENT)))
            setattr(module, SESSION_ATTR, session)
            module.forward = types.MethodType(mla_attention_forward, module)
        return compiled.forward(*args, **kwargs)
    finally:  # the modules as they were: the compiled graphs' guards see nothing changed
        for module, forward, own_session in saved:
            for name, value in (("forward", forward), (SESSION_ATTR, own_session)):
                if value is _ABSENT:
                    vars(module).pop(name, None)
                else:
                    setattr(module, name, value)


def _check_eager_attentions(model: torch.nn.Module, what: str) -> None:
    """``ValueError`` naming the model and the reason when a forward asking for ``what`` (the attention
    probabilities, a custom 4-D mask) cannot run: it runs the library's eager attention
    (:func:`_eager_forward`), which serves them."""
    from torch_kvoffload.integrations.hf.attention import rope_functions

    try:
        for module in getattr(model, SESSION_ATTR).spec.attention_modules:
            rope_functions(module)
    except ValueError as exc:
        raise ValueError(
            f"{type(model).__name__} compiled by torch_kvoffload.compile: {what} runs the library's eager "
            f"attention (the compiled graphs serve neither the probabilities nor a custom mask), which cannot "
            f"serve it: {exc}"
        ) from exc


def _compiled_forward(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``model.forward`` of a compiled model: the cached lengths shown to Dynamo, then the compiled call;
    where Dynamo would run the forward eagerly, and for a forward asking for ``output_attentions`` (the
    graphs do not form the probabilities), the library's eager attention instead (:func:`_eager_forward`)."""
    compiled = getattr(model, _COMPILED_ATTR)
    anchor = autograd_anchor(model)
    if (
        anchor is not None
    ):  # the graphs of no_grad forwards, outputs with a backward that raises (no_backward)
        who = f"compiled {type(model).__name__}"
        return without_autograd(who, anchor, lambda: _compiled_forward(model, *args, **kwargs))
    if _dynamo_runs_eagerly(compiled):
        return _eager_forward(model, compiled, args, kwargs)
    eager_for = None
    if output_attentions_requested(model, kwargs):  # the graphs never form the attention probabilities
        eager_for = "output_attentions=True"
    elif is_custom_mask(kwargs.get("attention_mask")):  # the graphs attend causally
        eager_for = "a custom 4-D attention_mask"
    if eager_for is not None:
        _check_eager_attentions(model, eager_for)
        return _eager_forward(model, compiled, args, kwargs)
    args, kwargs = _as_keywords(compiled.forward, args, kwargs)
    cache = kwargs.get("cache")
    if is_offload_cache(cache):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor):
            _expose_cache_lengths(cache.session, cache, int(ids.shape[0]))
    _mark_token_dims(kwargs)
    if args and isinstance(args[0], torch.Tensor):
        _mark_dynamic(args[0], 0, 1)  # input_ids given positionally
    with tracing_settings:  # what Dynamo reads when this call traces (see dynamo_settings)
        return compiled.fn(*args, **kwargs)


def compile(model: torch.nn.Module, config: Any = None, **torch_compile_kwargs: Any) -> torch.nn.Module:
    """Offload ``model``'s KV cache through Dynamo and the offload passes; return ``model``.

    Attaches an offload session (``config``: an :class:`~torch_kvoffload.core.config.OffloadConfig`, its
    dict form, or ``None`` for the model's default), then compiles the model's own ``forward`` with the
    ``kvoffload`` backend; ``begin_forward`` / ``end_forward`` of the session surround each call and
    ``model.generate(...)`` works unchanged (it generates with the library's cache).
    ``torch_compile_kwargs`` go to ``torch.compile`` (``backend`` and ``options`` are set here;
    ``isolate_recompiles`` defaults to ``True`` and ``recompile_limit`` to ``DEFAULT_RECOMPILE_LIMIT``
    where ``torch.compile`` has them).
    """
    from torch_kvoffload.integrations.hf.versions import check_transformers_version

    check_transformers_version()  # RuntimeError outside the supported transformers releases
    for key in ("backend", "options"):
        if key in torch_compile_kwargs:
            raise ValueError(f"torch_kvoffload.compile: {key!r} is set by the library, got {key}=...")
    if getattr(model, SESSION_ATTR, None) is not None:
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
    setattr(model, REPORTS_ATTR, CompileReports())
    return model


def explain(model: torch.nn.Module, *args: Any, **kwargs: Any) -> str:
    """What the passes found and did in every graph compiled for ``model`` so far, per layer.

    With ``args`` / ``kwargs`` and no graph compiled yet, runs ``model(*args, **kwargs)`` once (no grad)
    to capture one. ``ValueError`` if ``model`` was not compiled with :func:`compile`.
    """
    reports = compile_reports(model)
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
