"""KVPP layer hooks as ops: wait for a layer's bundle broadcast, start a layer's broadcast prefetch.

``kvpp_wait_layer(scheduler, layer, bundle)`` and ``kvpp_prefetch_layer(scheduler, layer, bundle)`` call
the KVPP scheduler registered under the name ``scheduler`` (:func:`register_scheduler`). They take the
layer's cache tensors as mutated arguments (``Tensor(a!)[]``): a broadcast writes them, so a graph keeps
them ordered before the layer's first KV read or write and dead-code elimination cannot drop them. An FX
pass inserts them into model graphs; eager callers use the same ops.

These ops have no C++ kernel on purpose: they drive a Python scheduler (a transfer thread and
``torch.distributed`` collectives), so the reference kernel — registered for every device — is the kernel.
The fake kernel only checks structure and returns nothing.

The registry lives here, not in the runtime, so that ``ops`` never imports ``torch_kvoffload.kvpp``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops._hook_registry import HookRegistry
from torch_kvoffload.ops._registry import define_op

__all__ = [
    "KVPPLayerHooks",
    "get_scheduler",
    "kvpp_prefetch_layer",
    "kvpp_wait_layer",
    "register_scheduler",
    "registered_schedulers",
    "unregister_scheduler",
]


class KVPPLayerHooks(Protocol):
    """What the ops call: a KVPP scheduler (see :class:`torch_kvoffload.kvpp.KVPPScheduler`)."""

    def wait_for_layer(self, layer: int, bundle: list[torch.Tensor] | None = None) -> None: ...

    def prefetch_layer(self, layer: int, bundle: list[torch.Tensor] | None = None) -> None: ...


_schedulers: HookRegistry[KVPPLayerHooks] = HookRegistry("KVPP scheduler")


def register_scheduler(name: str, scheduler: KVPPLayerHooks) -> None:
    """Make ``scheduler`` reachable from the ops as ``name``; a name is registered once at a time."""
    _schedulers.register(name, scheduler)


def unregister_scheduler(name: str) -> None:
    _schedulers.unregister(name)


def get_scheduler(name: str) -> KVPPLayerHooks:
    return _schedulers.get(name)


def registered_schedulers() -> list[str]:
    return _schedulers.names()


def _structure(op: str, scheduler: str, layer: int, bundle: list[torch.Tensor]) -> None:
    if not scheduler:
        _checks.fail(op, "argument 'scheduler' must be a non-empty scheduler name, got ''")
    if layer < 0:
        _checks.fail(op, f"argument 'layer' must be a non-negative layer index, got {layer}")
    if len(bundle) == 0:
        _checks.fail(op, "argument 'bundle' must hold the layer's cache tensors, got an empty list")


def _wait_fake(scheduler: str, layer: int, bundle: list[torch.Tensor]) -> None:
    _structure("kvpp_wait_layer", scheduler, layer, bundle)


def _wait_reference(scheduler: str, layer: int, bundle: list[torch.Tensor]) -> None:
    _structure("kvpp_wait_layer", scheduler, layer, bundle)
    get_scheduler(scheduler).wait_for_layer(layer, list(bundle))


def _prefetch_fake(scheduler: str, layer: int, bundle: list[torch.Tensor]) -> None:
    _structure("kvpp_prefetch_layer", scheduler, layer, bundle)


def _prefetch_reference(scheduler: str, layer: int, bundle: list[torch.Tensor]) -> None:
    _structure("kvpp_prefetch_layer", scheduler, layer, bundle)
    get_scheduler(scheduler).prefetch_layer(layer, list(bundle))


_wait_op = define_op(
    "kvpp_wait_layer",
    "(str scheduler, int layer, Tensor(a!)[] bundle) -> ()",
    fake=_wait_fake,
    reference=_wait_reference,
)
_prefetch_op = define_op(
    "kvpp_prefetch_layer",
    "(str scheduler, int layer, Tensor(a!)[] bundle) -> ()",
    fake=_prefetch_fake,
    reference=_prefetch_reference,
)


def kvpp_wait_layer(scheduler: str, layer: int, bundle: list[torch.Tensor]) -> None:
    """Block until ``layer``'s bundle broadcast finished, then start the next target layer's.

    Parameters
    ----------
    scheduler : name of a registered KVPP scheduler.
    layer : the layer index (a draft / MTP layer, or any layer of a forward without history: no-op).
    bundle : the layer's cache tensors (e.g. ``c_kv [num_blocks, block_size, kv_lora_rank]``,
        ``k_pe [num_blocks, block_size, rope_dim]``, indexer key and scales), written by the broadcast.

    Raises ``KeyError`` for an unknown scheduler, ``TransferError`` when the broadcast failed and
    ``RuntimeError`` when called out of layer order.
    """
    _wait_op(scheduler, layer, bundle)


def kvpp_prefetch_layer(scheduler: str, layer: int, bundle: list[torch.Tensor]) -> None:
    """Start ``layer``'s bundle broadcast if it is the next one and not started yet (idempotent).

    Same arguments as :func:`kvpp_wait_layer`; a no-op in a forward without history.
    """
    _prefetch_op(scheduler, layer, bundle)
