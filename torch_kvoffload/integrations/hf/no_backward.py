"""A forward of an offloaded model with autograd on: the values of the unmodified model, no backward.

The library's attention ops compute no gradients (``kv_a_proj_with_mqa``, ``kv_b_proj`` and the indexer would
get none), so a backward through them would train the rest of the model with silently missing gradients.
transformers' own callers (tests, pipelines) run forwards with autograd on without ever calling backward. So
such a forward runs under ``torch.no_grad()``, and each floating-point tensor it returns (``logits``, ``loss``,
hidden states, attentions) comes back requiring grad through :class:`RefusedBackward`, whose backward raises
``RuntimeError`` naming the model: what a forward computes is the unmodified model's, and a backward is
refused instead of being wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RefusedBackward", "autograd_anchor", "without_autograd"]


class RefusedBackward(torch.autograd.Function):
    """Identity forward (``value``, any shape and dtype) whose backward raises; ``anchor`` (a parameter that
    requires grad) makes the output require grad."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, anchor: torch.Tensor, who: str) -> torch.Tensor:
        ctx.who = who
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise RuntimeError(
            f"{ctx.who}: backward through an offloaded model: the library's attention computes no gradients "
            "(kv_a_proj_with_mqa, kv_b_proj and the indexer would get none, and the layers below them wrong ones); "
            "train the unmodified model"
        )


def autograd_anchor(model: torch.nn.Module) -> torch.Tensor | None:
    """A parameter of ``model`` that requires grad when autograd is on (a forward would record a graph);
    ``None`` otherwise."""
    if not torch.is_grad_enabled():
        return None
    return next((p for p in model.parameters() if p.requires_grad), None)


def _refuse(value: Any, anchor: torch.Tensor, who: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return RefusedBackward.apply(value, anchor, who)
        return value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_refuse(v, anchor, who) for v in value)
    return value


def without_autograd(who: str, anchor: torch.Tensor, call: Callable[[], Any]) -> Any:
    """``call()`` under ``torch.no_grad()``; its floating-point output tensors (top level, in tuples, or the
    fields of a ``ModelOutput``) pass through :class:`RefusedBackward`. The cache it returns is untouched."""
    with torch.no_grad():
        out = call()
    if hasattr(out, "items") and hasattr(out, "__setitem__"):
        for key, value in list(out.items()):
            refused = _refuse(value, anchor, who)
            if refused is not value:
                out[key] = refused
        return out
    return _refuse(out, anchor, who)
