"""Attach an :class:`OffloadSession` to a Hugging Face model: :func:`attach`, :func:`offload`, :func:`detach`.

``attach(model, config)`` inspects the model (``ValueError`` before any allocation if unsupported), builds
the session, stores it as ``model._kvoffload_session``, wraps ``model.forward`` so that
``begin_forward`` / ``end_forward`` surround every call (the library's cache is supplied when none is
given; ``input_ids`` and a 2-D ``attention_mask`` are required) and wraps ``model.generate`` so that it
generates with ``session.new_cache()`` and reserves room for the prompt plus ``max_new_tokens``.
``offload`` = ``attach`` + the library's eager attention in every MLA attention module.

The wrappers are methods bound to the model: ``copy.deepcopy(model)`` gives a copy whose wrappers serve
the copy, with a fresh session of its own. What they refuse, rather than return what the unmodified model
would not:

* a forward or ``generate`` from a second thread while one runs (``RuntimeError``, nothing changed): a
  session serves one sequence, from one caller, at a time;
* a forward with autograd on and parameters that require grad (``RuntimeError``): the library's attention
  computes no gradients. ``generate`` runs under ``torch.no_grad()`` already.

``use_cache=False`` (a forward, or ``generate``) runs every forward as a sequence of its own over a fresh
library cache that is not returned, as the unmodified model recomputes everything without a cache.

``output_attentions=True`` (the keyword, a ``generate`` option or ``model.config.output_attentions``)
returns the unmodified eager model's attention probabilities, recomputed per layer from the latent KV
(:mod:`torch_kvoffload.integrations.hf.output_attentions`); refused on a P/D node.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from torch_kvoffload.backend import SESSION_ATTR
from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.integrations.hf.custom_mask import (
    CUSTOM_MASK,
    attention_bias,
    custom_mask_bias,
    is_custom_mask,
)
from torch_kvoffload.integrations.hf.exclusive import exclusive
from torch_kvoffload.integrations.hf.inspect import inspect_model
from torch_kvoffload.integrations.hf.no_backward import autograd_anchor, without_autograd
from torch_kvoffload.integrations.hf.output_attentions import collect_attentions, output_attentions_requested
from torch_kvoffload.integrations.hf.packed import (
    PackedRows,
    packed_core_forward,
    packed_forward,
    packed_segments,
)
from torch_kvoffload.integrations.hf.pd import make_role
from torch_kvoffload.integrations.hf.prefix import skip_cached_prefix
from torch_kvoffload.integrations.hf.session import OffloadSession, session_of
from torch_kvoffload.integrations.hf.shared_prefix import compute_shared_prefixes
from torch_kvoffload.layerwise.errors import StoreMissError

__all__ = [
    "attach", "bind_method", "check_no_grad", "deepcopy_rebound", "detach", "new_session", "offload",
]  # fmt: skip


def _resolve_config(config: Any, has_indexer: bool) -> OffloadConfig:
    if config is None:
        return OffloadConfig.default(has_indexer)
    if isinstance(config, dict):
        return OffloadConfig.model_validate(config)
    if not isinstance(config, OffloadConfig):
        raise TypeError(
            f"torch_kvoffload: config must be an OffloadConfig, a dict or None, got {type(config).__name__}"
        )
    return config


def check_no_grad(who: str, tensors: Any) -> None:
    """Raise ``RuntimeError`` if autograd is on and any of ``tensors`` requires grad: the library's
    attention ops compute no gradients, so a backward would leave the attention's weights without any."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"{who}: forward with autograd on and parameters that require grad; the library's attention "
            "computes no gradients (kv_a_proj_with_mqa, kv_b_proj and the indexer would get none). Run it "
            "under torch.no_grad() or torch.inference_mode() (generate() does)"
        )


def bind_method(
    model: torch.nn.Module, impl: Callable[..., Any], like: Callable[..., Any]
) -> types.MethodType:
    """``impl(model, *args, **kwargs)`` as a method bound to ``model``, with the name, docs and signature of
    ``like`` (``generate`` reads the forward's parameters). Bound, not a closure over ``model``, so that
    ``copy.deepcopy`` rebinds it to the copy."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return impl(self, *args, **kwargs)

    sig = inspect.signature(like)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])  # type: ignore[attr-defined]
    for attr in ("__name__", "__qualname__", "__doc__"):
        if hasattr(like, attr):
            setattr(method, attr, getattr(like, attr))
    return types.MethodType(method, model)


def deepcopy_rebound(name: str, fn: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(fn, memo)`` for a model's own ``name`` (a bound method, or a partial over the model:
    the copy calls the copied model). A plain function is refused (``NotImplementedError``): copying
    returns the function itself, which would keep calling the original model."""
    if isinstance(fn, types.FunctionType):
        raise NotImplementedError(
            f"copy.deepcopy of an offloaded model: its {name} was replaced by a plain function before it was "
            "offloaded, which a copy cannot rebind to itself; offload a copy of the model instead"
        )
    return copy.deepcopy(fn, memo)


class Originals(dict):
    """The model's own ``forward`` / ``generate`` the wrappers call; deep-copied rebound to the copy."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Originals:
        out = type(self)()
        memo[id(self)] = out
        for name, fn in self.items():
            out[name] = deepcopy_rebound(name, fn, memo)
        return out


def _strip_cache(out: Any, cache: Any) -> Any:
    """``out`` without ``cache`` (what the unmodified model returns for ``use_cache=False``)."""
    if isinstance(out, tuple):
        return tuple(x for x in out if x is not cache)
    if hasattr(out, "items"):
        return type(out)(**{k: v for k, v in out.items() if v is not cache})
    return out


def _check_custom_mask(name: str, session: Any, attentions: bool) -> None:
    """``ValueError`` where a custom 4-D ``attention_mask`` cannot be served (see ``custom_mask``)."""
    what = f"{name}: a custom 4-D attention_mask"
    if attentions:
        raise ValueError(f"{what} with output_attentions=True is not supported; pass one or the other")
    if session.pd is not None:
        raise ValueError(f"{what} is not supported on a P/D node: the peer's KV follows the causal rule")
    if session.core.backends.kvpp is not None:
        raise ValueError(f"{what} is not supported with KVPP: each rank reads only the layers it owns")


def _custom_mask_real(name: str, session: Any, cache: Any, B: int, S: int, past: int) -> torch.Tensor:
    """``bool [B, past + S]``: the positions holding KV for a custom-mask forward of ``cache``'s sequence:
    its earlier real positions, then every new one."""
    new = torch.ones(B, S, dtype=torch.bool)
    if past == 0:
        return new
    seq = session._seq
    if seq.owner is not cache or tuple(seq.masks.shape) != (B, past):
        raise ValueError(
            f"{name}: this cache's sequence is not the one the session holds with {B} rows and {past} "
            "positions; a custom 4-D attention_mask continues the session's running sequence only"
        )
    return torch.cat([seq.masks.to(torch.bool), new], dim=1)


def _forward(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    from torch_kvoffload.integrations.hf.cache import is_offload_cache

    session = session_of(model)
    name = f"offloaded {type(model).__name__}"
    serving = getattr(kwargs.get("cache"), "_kvoffload_serving", None)
    if serving is not None and serving.session is session:
        with exclusive(session, name):  # a continuous-batching step, from its generation thread
            return serving.run_step(model, kwargs)
    session.check_not_serving(name)
    anchor = autograd_anchor(model)
    if anchor is not None:  # the unmodified model's values, no backward (see no_backward)
        return without_autograd(name, anchor, lambda: _forward(model, *args, **kwargs))
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    shape = None
    if input_ids is None:
        if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3:
            raise ValueError(
                f"{name}: pass input_ids [batch, tokens] or inputs_embeds [batch, tokens, hidden]"
            )
        if session.pd is not None:
            raise ValueError(
                f"{name}: inputs_embeds without input_ids on a P/D node: the peer is told each request's token "
                "ids; pass input_ids"
            )
        shape = (int(embeds.shape[0]), int(embeds.shape[1]))
    attentions = output_attentions_requested(model, kwargs)
    if attentions and session.pd is not None:
        raise ValueError(
            f"{name}: output_attentions=True is not supported on a P/D node (config.pd): part of the "
            "sequence's KV is computed or placed by the peer; run the model without P/D to inspect them"
        )
    rows, width = (input_ids if input_ids is not None else embeds).shape[:2]
    custom = is_custom_mask(kwargs.get("attention_mask"))
    if custom:
        _check_custom_mask(name, session, attentions)
    # transformers uses a 4-D mask as given: no packed-sequence detection then
    layout = None if custom else packed_segments(name, model, kwargs, int(rows), int(width))
    if layout is not None and not attentions and session.pd is None and _eager_attention(session):
        # several independent sequences in a row: one packed forward of the core, a request each
        body = model._kvoffload_originals["forward"]
        with exclusive(session, name):
            return packed_core_forward(model, body, layout, args, kwargs, session.run_packed)
    if layout is not None:  # compiled graphs, the attention probabilities, a P/D node: a batch of segments

        def segments(**kw: Any) -> Any:
            out = _forward(model, **kw)
            if attentions and out.attentions:  # the batch of segments' [segments, H, L, L] -> packed rows
                out["attentions"] = tuple(_packed_attentions(layout, a) for a in out.attentions)
            return out

        return packed_forward(name, model, segments, layout, args, kwargs)
    cache = _user_cache(name, kwargs)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", True)
    private = cache is None and not use_cache  # a sequence of its own, not returned
    if cache is None:
        cache = session.new_cache()
    elif not is_offload_cache(cache):
        raise ValueError(
            f"{name}: the cache must be the library's (model._kvoffload_session.new_cache(), or none), got "
            f"{type(cache).__name__}"
        )
    if cache.session is not session:
        raise ValueError(f"{name}: the cache belongs to another session")
    kwargs["cache"] = cache
    kwargs["use_cache"] = True
    mask = kwargs.get("attention_mask")
    if mask is not None and not custom and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        got = (
            f"a tensor of shape {tuple(mask.shape)}"
            if isinstance(mask, torch.Tensor)
            else type(mask).__name__
        )
        raise ValueError(
            f"{name}: attention_mask must be a 2-D [batch, past + new] or 4-D [batch, 1, new, past + new] "
            f"tensor, got {got}"
        )
    with exclusive(session, name):
        past = cache.seen_tokens
        full = None  # the call as given, when its cached prefix is skipped (run whole if that fails)
        if past == 0 and not custom and not attentions and input_ids is not None:
            if len(args) == 1 and args[0] is input_ids and "input_ids" not in kwargs:
                args, kwargs = (), {**kwargs, "input_ids": input_ids}
            if not args:
                full = dict(kwargs)
                past, kwargs = skip_cached_prefix(model, session, cache, kwargs)
                if past:
                    input_ids, width = kwargs["input_ids"], int(width) - past
                    cache.seen_tokens = past  # the model computes positions and masks from past on
                else:
                    full = None
        bias = None
        if custom:  # the 2-D mask of the positions holding KV; the 4-D one becomes the attention's bias
            mask = _custom_mask_real(name, session, cache, int(rows), int(width), past)
            bias = custom_mask_bias(name, kwargs["attention_mask"], mask, indexer=session.spec.has_indexer)
        body = functools.partial(model._kvoffload_originals["forward"], *args, **kwargs)
        if attentions:  # the attention probabilities, recomputed per layer from the latent KV
            body = functools.partial(collect_attentions, session.core, mask, past, body)
        try:
            with attention_bias(session.core, bias):
                out = session.run_forward(
                    body, input_ids, mask, kwargs.get("cache_position"), past=past, owner=cache, shape=shape,
                    position_ids=kwargs.get("position_ids"), unkeyed=CUSTOM_MASK if custom else None,
                )  # fmt: skip
        except StoreMissError as exc:
            if full is None:
                raise
            # the adopted prefix could not be loaded when its layer needed it: compute the whole prompt
            cache.seen_tokens = 0
            session.core.prefix.fell_back(name, exc)
            body = functools.partial(model._kvoffload_originals["forward"], **full)
            past, width = 0, int(full["input_ids"].shape[1])
            out = session.run_forward(
                body, full["input_ids"], mask, None, past=0, owner=cache, shape=shape,
                position_ids=full.get("position_ids"),
            )  # fmt: skip
        except BaseException:
            if full is not None:
                cache.seen_tokens = 0  # the failed sequence ended: a fresh forward may follow
            raise
        cache.seen_tokens = past + width
    return _strip_cache(out, cache) if private else out


def _eager_attention(session: OffloadSession) -> bool:
    """Whether the model's attention modules run the library's eager attention (:func:`offload`), which
    follows the core's packed forwards; a compiled model's graphs were captured for batches."""
    return all(hasattr(m, "_kvoffload_original_forward") for m in session.spec.attention_modules)


def _packed_attentions(layout: PackedRows, batch: torch.Tensor) -> torch.Tensor:
    """One layer's attentions of the batch of ``layout``'s segments (``[segments, H, L, L]``) in the packed
    rows' layout ``[rows, H, width, width]``: each segment's block on the diagonal, zero elsewhere (a
    segment attends only to itself, as in the unmodified model's packed mask)."""
    out = batch.new_zeros((layout.rows, batch.shape[1], layout.width, layout.width))
    for i, (row, start, n) in enumerate(layout.spans):
        out[row, :, start : start + n, start : start + n] = batch[i, :, :n, :n]
    return out


def _user_cache(who: str, kwargs: dict[str, Any]) -> Any:
    """The cache passed as ``cache`` or under its older name ``past_key_values`` (moved to ``cache``)."""
    legacy = kwargs.pop("past_key_values", None)
    if legacy is not None and kwargs.get("cache") is not None and kwargs["cache"] is not legacy:
        raise ValueError(f"{who}: pass the cache once (cache=...), got both cache and past_key_values")
    if legacy is not None:
        kwargs["cache"] = legacy
    return kwargs.get("cache")


# cache_implementation values the library's cache serves: it is allocated once per generate for the prompt
# plus max_new_tokens (as a static cache is) and grows only past that, and it is what offloads the KV
_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static", "offloaded", "offloaded_static")


def _generation_option(model: torch.nn.Module, kwargs: dict[str, Any], key: str, default: Any = None) -> Any:
    """What ``generate`` will use for option ``key``: the keyword, else the given ``generation_config``'s
    value, else ``model.generation_config``'s (transformers fills a given config's unset values from it)."""
    if key in kwargs:
        return kwargs[key]
    for gen in (kwargs.get("generation_config"), model.generation_config):
        value = getattr(gen, key, None)
        if value is not None:
            return value
    return default


def _generation_request(model: torch.nn.Module, kwargs: dict[str, Any]) -> int:
    """Check the cache ``generate`` is asked for, and return the rows per prompt row it will run
    (``max(num_beams, num_return_sequences)``).

    A ``cache_implementation`` the library's cache serves is turned off in ``kwargs`` (the library's cache
    is passed instead); any other one is a ``ValueError`` naming it, and so is a static one with
    ``output_attentions``."""
    name = f"offloaded {type(model).__name__}"
    impl = _generation_option(model, kwargs, "cache_implementation")
    if impl not in _CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"{name}: generate(cache_implementation={impl!r}) is not supported: the library keeps the KV in its "
            f"own cache, which serves cache_implementation in {[c for c in _CACHE_IMPLEMENTATIONS if c]} or None"
        )
    if impl in ("static", "offloaded_static") and _generation_option(
        model, kwargs, "output_attentions", getattr(model.config, "output_attentions", False)
    ):
        raise ValueError(
            f"{name}: generate(output_attentions=True, cache_implementation={impl!r}) is not supported: the "
            "unmodified model's attentions then span the static cache's whole allocated length, the library's "
            "cover the sequence's positions (pass cache_implementation=None or 'dynamic')"
        )
    if impl is not None:
        kwargs["cache_implementation"] = None
    beams = int(_generation_option(model, kwargs, "num_beams", 1) or 1)
    seqs = int(_generation_option(model, kwargs, "num_return_sequences", 1) or 1)
    return max(beams, seqs)


def _generate(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    from torch_kvoffload.integrations.hf.cache import is_offload_cache

    session = session_of(model)
    name = f"offloaded {type(model).__name__}"
    session.check_not_serving(f"{name}.generate")
    if kwargs.get("assistant_model") is model:
        raise ValueError(
            f"{name}: generate(assistant_model=<the model itself>) is not supported: the model's session holds "
            "one sequence, which the assistant's drafts would replace; pass another model as the assistant "
            "(e.g. a copy.deepcopy of the model taken before offloading)"
        )
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    rows_per_prompt = _generation_request(model, kwargs)
    cache = _user_cache(name, kwargs)
    if cache is not None and not is_offload_cache(cache):
        raise ValueError(
            f"{name}: generate(cache=...) must be given the library's cache (model._kvoffload_session.new_cache(), "
            f"or the one a previous generate returned) or none, got {type(cache).__name__}"
        )
    use_cache = _generation_option(model, kwargs, "use_cache", True)
    # without a cache, generate recomputes the whole sequence every step: each forward starts its own
    if use_cache is not False and cache is None:
        kwargs["cache"] = session.new_cache()
    with exclusive(session, name):
        if (
            isinstance(input_ids, torch.Tensor)
            and embeds is None
            and cache is None
            and use_cache is not False
        ):
            pad = _generation_option(model, kwargs, "pad_token_id")
            compute_shared_prefixes(model, session, input_ids, kwargs.get("attention_mask"), pad)
        prompt = input_ids if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else None
        if prompt is None and isinstance(embeds, torch.Tensor) and embeds.dim() == 3:
            prompt = embeds
        if prompt is not None and cache is None:
            max_new = _generation_option(model, kwargs, "max_new_tokens")
            if max_new is not None:
                total = prompt.shape[1] + int(max_new)
            else:
                total = int(_generation_option(model, kwargs, "max_length", prompt.shape[1]))
            session.plan_generation(prompt.shape[0] * rows_per_prompt, total)
        try:
            return model._kvoffload_originals["generate"](*args, **kwargs)
        except BaseException:
            # a generate that fails between forwards (a feature the cache refuses) holds no requests either
            session.end_sequence()
            raise


def new_session(model: torch.nn.Module, config: Any = None) -> OffloadSession:
    """Inspect ``model`` and build its session for ``config`` (an ``OffloadConfig``, its dict form or
    ``None``). With a store (layerwise offload, prefix reuse) the weights are fingerprinted here, once
    (every byte read): the store keys carry the fingerprint."""
    spec = inspect_model(model)
    cfg = _resolve_config(config, spec.has_indexer)
    if cfg.stores_kv:
        spec = spec.with_weights(model)
    return OffloadSession(spec, cfg, role_factory=make_role)


def attach(model: torch.nn.Module, config: Any = None) -> OffloadSession:
    """Inspect ``model``, build its session and wrap ``forward`` / ``generate`` (see the module docstring)."""
    if getattr(model, SESSION_ATTR, None) is not None:
        raise ValueError(f"{type(model).__name__} is already offloaded (model._kvoffload_session is set)")
    session = new_session(model, config)
    originals = Originals(forward=model.forward, generate=model.generate)
    model.forward = bind_method(model, _forward, originals["forward"])
    model.generate = bind_method(model, _generate, originals["generate"])
    setattr(model, SESSION_ATTR, session)
    model._kvoffload_originals = originals
    if hasattr(type(model), "init_continuous_batching"):  # offload() replaces it by the serving one
        model.init_continuous_batching = types.MethodType(_no_continuous_batching, model)
    return session


def _no_continuous_batching(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    raise ValueError(
        f"{type(model).__name__}: continuous batching (generate_batch, init_continuous_batching) runs models "
        "offloaded with torch_kvoffload.offload, not torch_kvoffload.compile"
    )


def offload(model: torch.nn.Module, config: Any = None) -> torch.nn.Module:
    """:func:`attach` + replace every MLA attention's ``forward`` by the library's eager attention."""
    from torch_kvoffload.integrations.hf.attention import mla_attention_forward, rope_functions

    for module in inspect_model(model).attention_modules:  # before anything is allocated
        rope_functions(module)
    session = attach(model, config)
    for module in session.spec.attention_modules:
        module._kvoffload_session = session
        module._kvoffload_original_forward = module.forward
        module.forward = types.MethodType(mla_attention_forward, module)
    if hasattr(type(model), "init_continuous_batching"):
        from torch_kvoffload.integrations.hf.continuous_batching import enable_mla_continuous_batching

        enable_mla_continuous_batching(model)
    return model


def detach(model: torch.nn.Module) -> None:
    """Undo :func:`attach` / :func:`offload` and close the session (``RuntimeError``, nothing changed,
    while a continuous-batching manager serves the model)."""
    session = session_of(model)
    if session.serving is not None and session.serving.is_open:
        raise RuntimeError(
            f"detach: {type(model).__name__} is serving continuous batching; stop its manager first"
        )
    for module in session.spec.attention_modules:
        if hasattr(module, "_kvoffload_original_forward"):
            module.forward = module._kvoffload_original_forward
            del module._kvoffload_original_forward
        if hasattr(module, "_kvoffload_session"):
            del module._kvoffload_session
    vars(model).pop("init_continuous_batching", None)
    originals = model._kvoffload_originals
    model.forward, model.generate = originals["forward"], originals["generate"]
    del model._kvoffload_originals
    delattr(model, SESSION_ATTR)
    session.close()
