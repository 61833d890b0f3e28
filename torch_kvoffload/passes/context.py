"""What the passes need to know about the runtime they wire a graph to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch_kvoffload._utils import check_int

__all__ = ["PassContext"]


@dataclass(frozen=True)
class PassContext:
    """The names the inserted ops carry and how many cache tensors each layer has.

    Parameters
    ----------
    runtime : str
        Name under which the session is registered for ``kvoffload::mla_cache_write`` /
        ``mla_cache_attention`` (``session.name``).
    num_caches : callable ``layer -> int``
        ``len(session.layer_caches(layer))``: how many cache tensors the layer's ops take.
    layerwise_runtime : str or None
        Name of the registered layerwise runtime (``layer_wait`` / ``layer_prefetch`` / ``layer_save``);
        ``None``: layerwise offload off.
    kvpp_scheduler : str or None
        Name of the registered KVPP scheduler (``kvpp_wait_layer`` / ``kvpp_prefetch_layer``); ``None``: off.
    num_layers : int or None
        The session's layer count; layers the graph shows beyond it are an error.
    runtime_runs_hooks : bool
        Whether the ``runtime`` runs the layerwise and KVPP steps of each layer it writes (the library's
        KV core does, in ``cache_write``): the hook passes then wrap only the layers whose KV accesses are
        not its ``mla_cache_write`` (a layer the absorb pass left to the model's own cache).
    """

    runtime: str
    num_caches: Callable[[int], int]
    layerwise_runtime: str | None = None
    kvpp_scheduler: str | None = None
    num_layers: int | None = None
    runtime_runs_hooks: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.runtime, str) or not self.runtime:
            raise ValueError(f"PassContext: runtime must be a non-empty session name, got {self.runtime!r}")
        for field in ("layerwise_runtime", "kvpp_scheduler"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"PassContext: {field} must be None or a non-empty name, got {value!r}")
        if self.num_layers is not None:
            check_int("PassContext", "num_layers", self.num_layers, minimum=1)

    def caches_of(self, layer: int) -> int:
        """How many cache tensors ``layer`` has (checked: at least one)."""
        if self.num_layers is not None and not 0 <= layer < self.num_layers:
            raise ValueError(
                f"kvoffload passes: the graph has attention layer {layer}, the session has "
                f"{self.num_layers} layers"
            )
        return check_int(
            "PassContext.num_caches", f"caches of layer {layer}", self.num_caches(layer), minimum=1
        )
