"""The op overloads the passes insert, looked up when a pass runs."""

from __future__ import annotations

import contextlib
import importlib

import torch

# Module that defines each op family (imported on first use so ``passes`` imports nothing heavy).
_DEFINED_IN = {
    "mla_cache_write": "torch_kvoffload.ops.mla_runtime",
    "mla_cache_attention": "torch_kvoffload.ops.mla_runtime",
    "layer_wait": "torch_kvoffload.ops.layer_hooks",
    "layer_prefetch": "torch_kvoffload.ops.layer_hooks",
    "layer_save": "torch_kvoffload.ops.layer_hooks",
    "kvpp_wait_layer": "torch_kvoffload.ops.kvpp",
    "kvpp_prefetch_layer": "torch_kvoffload.ops.kvpp",
}


def op(name: str) -> torch._ops.OpOverload:
    """``torch.ops.kvoffload.<name>.default``; ``RuntimeError`` naming the op when it is not defined."""
    if not hasattr(torch.ops.kvoffload, name):
        with contextlib.suppress(ImportError):
            importlib.import_module(_DEFINED_IN[name])
    if not hasattr(torch.ops.kvoffload, name):
        raise RuntimeError(
            f"kvoffload passes: op kvoffload::{name} is not defined (module {_DEFINED_IN[name]})"
        )
    return getattr(torch.ops.kvoffload, name).default
