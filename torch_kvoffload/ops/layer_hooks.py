"""Layer runtime hooks: ``kvoffload::layer_wait`` / ``layer_prefetch`` / ``layer_save``.

Each op calls the runtime hook of the same verb (``wait_layer`` / ``prefetch_layer`` / ``save_layer``) of
the :class:`~torch_kvoffload.layerwise.runtime.LayerwiseOffloadRuntime` registered under ``runtime`` in
:data:`runtimes` (``runtimes.register(name, rt)``; ``runtimes.unregister(name)``) for one layer. The
registry lives here so that ``ops`` never imports ``torch_kvoffload.layerwise``. They take the layer's
cache tensors as declared mutated
arguments (``Tensor(a!)[]``): a graph then orders them against every read and write of those caches, and
dead-code elimination cannot drop them although they return nothing.

There is no C++ kernel: the kernel is the Python runtime itself (stream / event bookkeeping and store
calls, no tensor math), registered as the reference kernel for every device. The fake kernel does
nothing (the ops return nothing and change no metadata).

Under a functionalizing backend the op may receive clones of the caches: ``layer_wait`` then copies the
buffer (with the loaded prefix) into them, and ``layer_save`` copies them into the buffer before saving,
so the graph sees the same data as eager execution.
"""

from __future__ import annotations

from typing import Protocol

import torch

from torch_kvoffload.ops._hook_registry import HookRegistry
from torch_kvoffload.ops._registry import define_op

__all__ = ["LayerHooks", "layer_prefetch", "layer_save", "layer_wait", "runtimes"]

_SCHEMA = "(str runtime, int layer, Tensor(a!)[] caches) -> ()"


class LayerHooks(Protocol):
    """What the ops call: a layerwise runtime (see ``torch_kvoffload.layerwise.LayerwiseOffloadRuntime``)."""

    def wait_layer(self, layer: int, caches: list[torch.Tensor] | None = None) -> None: ...

    def prefetch_layer(self, layer: int, caches: list[torch.Tensor] | None = None) -> None: ...

    def save_layer(self, layer: int, caches: list[torch.Tensor] | None = None) -> None: ...


#: The runtimes the ops find by name: ``runtimes.register(name, rt)`` makes ``rt`` reachable as ``name``.
runtimes: HookRegistry[LayerHooks] = HookRegistry(
    "layerwise runtime", methods=("wait_layer", "prefetch_layer", "save_layer")
)


def _fake(runtime: str, layer: int, caches: list[torch.Tensor]) -> None:
    return None


def _wait_kernel(runtime: str, layer: int, caches: list[torch.Tensor]) -> None:
    runtimes.get(runtime).wait_layer(layer, caches)


def _prefetch_kernel(runtime: str, layer: int, caches: list[torch.Tensor]) -> None:
    runtimes.get(runtime).prefetch_layer(layer, caches)


def _save_kernel(runtime: str, layer: int, caches: list[torch.Tensor]) -> None:
    runtimes.get(runtime).save_layer(layer, caches)


_layer_wait_op = define_op("layer_wait", _SCHEMA, fake=_fake, reference=_wait_kernel)
_layer_prefetch_op = define_op("layer_prefetch", _SCHEMA, fake=_fake, reference=_prefetch_kernel)
_layer_save_op = define_op("layer_save", _SCHEMA, fake=_fake, reference=_save_kernel)


def layer_wait(runtime: str, layer: int, caches: list[torch.Tensor]) -> None:
    """Wait until ``layer`` may use its physical buffer and its cached prefix is loaded.

    Parameters
    ----------
    runtime : str
        Name of a layerwise runtime registered in :data:`runtimes`.
    layer : int
        Layer index in ``[0, N)``.
    caches : list of Tensor
        The layer's cache tensors (``runtime.layer_caches(layer)``: main components
        ``[num_blocks, block_size, D_i]``, then indexer components), any dtype; declared mutated.

    Raises ``KeyError`` for an unknown runtime, ``ValueError`` / ``TypeError`` for wrong caches,
    :class:`~torch_kvoffload.transfer.TransferError` when the buffer's previous save / reader or this
    layer's load failed.
    """
    _layer_wait_op(runtime, layer, caches)


def layer_prefetch(runtime: str, layer: int, caches: list[torch.Tensor]) -> None:
    """Issue the loads of ``layer`` and the next ``prefetch_depth`` layers whose buffers are free.

    ``caches``: the cache tensors of ``layer`` (as for :func:`layer_wait`); declared mutated so the node
    stays ordered after the reads of the buffer it may refill.
    """
    _layer_prefetch_op(runtime, layer, caches)


def layer_save(runtime: str, layer: int, caches: list[torch.Tensor]) -> None:
    """Start the asynchronous save of ``layer``'s newly written blocks to the host KV pool.

    ``caches``: the cache tensors of ``layer`` (as for :func:`layer_wait`), after the cache write.
    """
    _layer_save_op(runtime, layer, caches)
