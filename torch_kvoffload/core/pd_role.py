"""``PDRole``: a node's role in a disaggregated deployment, as the KV core sees it (the P/D integration
implements it; :func:`~torch_kvoffload.core.backends.build_backends` puts it first among the backends)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch_kvoffload.kv.backend import KVBackend

if TYPE_CHECKING:
    from torch_kvoffload.kv.layout import KVLayout
    from torch_kvoffload.kv.requests import Request
    from torch_kvoffload.layerwise import LayerCacheSpec, LayerwiseConfig, LayerwiseOffloadRuntime
    from torch_kvoffload.store.base import KVStore

__all__ = ["PDRole"]


class PDRole(KVBackend):
    """A node's role in a disaggregated deployment, as the KV core sees it: a backend (forward hooks, no
    KV of its own) that may supply the layerwise runtime over buffers its transport exports.

    :meth:`stop` closes the endpoints before the core closes its backends (outstanding transfers fail
    instead of holding the buffers); :meth:`close` afterwards.
    """

    name = "P/D"
    #: whether the node computes its requests' prompts (a prefill node: prefix reuse may skip their cached
    #: blocks, the whole prompt's KV is still sent from the layer buffers); a decode node receives them and
    #: takes part in no forward
    computes_prompts = False

    def can_grow(self, layout: KVLayout, live: Sequence[Request]) -> bool:
        return False  # the peer was told the requests' blocks: sizes are fixed per sequence

    def build_layerwise_runtime(
        self, config: LayerwiseConfig, specs: Sequence[LayerCacheSpec], *, store: KVStore
    ) -> LayerwiseOffloadRuntime | None:
        """The layerwise runtime over this role's layer buffers; ``None``: the layerwise backend allocates
        its own."""
        return None

    def stop(self) -> None:
        """Close the role's endpoints."""

    def close(self) -> None:
        self.stop()
