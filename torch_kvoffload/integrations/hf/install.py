"""Attach an :class:`OffloadSession` to a Hugging Face model: :func:`attach`, :func:`offload`, :func:`session_of`.

``attach(model, config)`` inspects the model (``ValueError`` before any allocation if unsupported), builds
the session, stores it as ``model._kvoffload_session``, wraps ``model.forward`` so that
``begin_forward`` / ``end_forward`` surround every call (the library's cache is supplied when none is
given; ``input_ids`` and a 2-D ``attention_mask`` are required) and wraps ``model.generate`` so that it
generates with ``session.new_cache()`` and reserves room for the prompt plus ``max_new_tokens``.
``offload`` = ``attach`` + the library's eager attention in every MLA attention module.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from torch_kvoffload.integrations.hf.inspect import inspect_model
from torch_kvoffload.integrations.hf.session import OffloadSession

__all__ = ["attach", "detach", "offload", "session_of"]

_ATTR = "_kvoffload_session"


def _resolve_config(config: Any, has_indexer: bool):
    from torch_kvoffload.api import OffloadConfig

    if config is None:
        return OffloadConfig.default(has_indexer)
    if isinstance(config, dict):
        return OffloadConfig.model_validate(config)
    if not isinstance(config, OffloadConfig):
        raise TypeError(
            f"torch_kvoffload: config must be an OffloadConfig, a dict or None, got {type(config).__name__}"
        )
    return config


def session_of(model: torch.nn.Module) -> OffloadSession:
    """The session attached to ``model`` (``ValueError`` if none)."""
    session = getattr(model, _ATTR, None)
    if session is None:
        raise ValueError(
            f"{type(model).__name__} is not offloaded; call torch_kvoffload.offload(model) (or compile) first"
        )
    return session


def attach(model: torch.nn.Module, config: Any = None) -> OffloadSession:
    """Inspect ``model``, build its session and wrap ``forward`` / ``generate`` (see the module docstring)."""
    if getattr(model, _ATTR, None) is not None:
        raise ValueError(f"{type(model).__name__} is already offloaded (model._kvoffload_session is set)")
    spec = inspect_model(model)
    cfg = _resolve_config(config, spec.has_indexer)
    session = OffloadSession(spec, cfg)
    from torch_kvoffload.integrations.hf.cache import is_offload_cache

    original_forward = model.forward
    original_generate = model.generate

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError(
                f"offloaded {type(model).__name__}: pass input_ids (the host store keys KV by token ids; "
                "inputs_embeds alone is not supported)"
            )
        cache = kwargs.pop("past_key_values", None) or kwargs.get("cache")
        if cache is None:
            cache = session.new_cache()
        elif not is_offload_cache(cache):
            raise ValueError(
                f"offloaded {type(model).__name__}: the cache must be the library's (model._kvoffload_session."
                f"new_cache(), or none), got {type(cache).__name__}"
            )
        if cache.session is not session:
            raise ValueError(f"offloaded {type(model).__name__}: the cache belongs to another session")
        kwargs["cache"] = cache
        kwargs["use_cache"] = True
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError(
                f"offloaded {type(model).__name__}: attention_mask must be a 2-D [batch, past + new] tensor, "
                f"got {type(mask).__name__}"
            )
        past = cache.seen_tokens
        session.begin_forward(input_ids, mask, kwargs.get("cache_position"), past=past, owner=cache)
        try:
            out = original_forward(*args, **kwargs)
        except BaseException:
            session.abort_forward()
            raise
        session.end_forward()
        cache.seen_tokens = past + input_ids.shape[1]
        return out

    @functools.wraps(original_generate)
    def generate(*args: Any, **kwargs: Any) -> Any:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
            kwargs["cache"] = session.new_cache()
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            gen = kwargs.get("generation_config") or model.generation_config
            max_new = kwargs.get("max_new_tokens", getattr(gen, "max_new_tokens", None))
            if max_new is not None:
                total = input_ids.shape[1] + int(max_new)
            else:
                total = int(kwargs.get("max_length", getattr(gen, "max_length", input_ids.shape[1])))
            session.plan_generation(input_ids.shape[0], total)
        return original_generate(*args, **kwargs)

    model.forward = forward
    model.generate = generate
    setattr(model, _ATTR, session)
    model._kvoffload_originals = {"forward": original_forward, "generate": original_generate}
    return session


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
    return model


def detach(model: torch.nn.Module) -> None:
    """Undo :func:`attach` / :func:`offload` and close the session."""
    session = session_of(model)
    for module in session.spec.attention_modules:
        if hasattr(module, "_kvoffload_original_forward"):
            module.forward = module._kvoffload_original_forward
            del module._kvoffload_original_forward
        if hasattr(module, "_kvoffload_session"):
            del module._kvoffload_session
    originals = model._kvoffload_originals
    model.forward, model.generate = originals["forward"], originals["generate"]
    del model._kvoffload_originals
    delattr(model, _ATTR)
    session.close()
