"""KVPP layer hooks as ops: wait for a layer's bundle broadcast, start a layer's broadcast prefetch.

``kvpp_wait_layer(scheduler, layer, bundle)`` and ``kvpp_prefetch_layer(scheduler, layer, bundle)`` call
``wait_layer`` / ``prefetch_layer`` of the KVPP scheduler registered in :data:`runtimes` under the name
``scheduler``. They take the layer's cache tensors as mutated arguments (``Tensor(a!)[]``): a broadcast
writes them, so a graph keeps them ordered before the layer's first KV read or write and dead-code
elimination cannot drop them. An FX pass inserts them into model graphs; eager callers use the same ops.
Under a functionalizing backend the wait may receive copies of the cache tensors: the scheduler then
copies the layer's cache (with the broadcast data) into them, so the graph reads what eager code reads.

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

__all__ = ["KVPPLayerHooks", "kvpp_prefetch_layer", "kvpp_wait_layer", "runtimes"]


class KVPPLayerHooks(Protocol):
    """What the ops call: a KVPP scheduler (see :class:`torch_kvoffload.kvpp.KVPPScheduler`)."""

    def wait_layer(self, layer: int, bundle: list[torch.Tensor] | None = None) -> None: ...

    def prefetch_layer(self, layer: int, bundle: list[torch.Tensor] | None = None) -> None: ...


#: The KVPP schedulers the ops reach by name; a scheduler built with a name registers here.
runtimes: HookRegistry[KVPPLayerHooks] = HookRegistry(
    "KVPP scheduler", methods=("wait_layer", "prefetch_layer")
)


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
    runtimes.get(scheduler).wait_layer(layer, list(bundle))


def _prefetch_fake(scheduler: str, layer: int, bundle: list[torch.Tensor]) -> None:
    _structure("kvpp_prefetch_layer", scheduler, layer, bundle)


def _prefetch_reference(scheduler: str, layer: int, bundle: list[torch.Tensor]) -> None:
    _structure("kvpp_prefetch_layer", scheduler, layer, bundle)
    runtimes.get(scheduler).prefetch_layer(layer, list(bundle))


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
    """Wait for ``layer``'s bundle broadcast, then start the next target layer's.

    On CPU the calling thread blocks until the broadcast finished; on an accelerator the compute stream
    waits on the broadcast's event (no host synchronize). When the tensors given are not the layer's cache
    itself (copies made by a functionalizing backend), the cache is copied into them.

    Parameters
    ----------
    scheduler : name of a registered KVPP scheduler.
    layer : the layer index (a draft / MTP layer, or any layer of a forward without history: no-op).
    bundle : the layer's cache tensors (e.g. ``c_kv [num_blocks, block_size, kv_lora_rank]``,
        ``k_pe [num_blocks, block_size, rope_dim]``, indexer key and scales, in bundle order; or the
        layer's ``uint8`` byte span), written by the broadcast.

    Raises ``KeyError`` for an unknown scheduler, ``TransferError`` when the broadcast failed and
    ``RuntimeError`` when called out of layer order.
    """
    _wait_op(scheduler, layer, bundle)


def kvpp_prefetch_layer(scheduler: str, layer: int, bundle: list[torch.Tensor]) -> None:
    """Start ``layer``'s bundle broadcast if it is the next one and not started yet (idempotent).

    Same arguments as :func:`kvpp_wait_layer`; a no-op in a forward without history.
    """
    _prefetch_op(scheduler, layer, bundle)
