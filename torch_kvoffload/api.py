"""The user surface for a model: :class:`OffloadConfig`, :func:`offload` and :func:`stats`.

``offload(model, config)`` inspects a Hugging Face MLA / SFA model, builds an
:class:`~torch_kvoffload.integrations.hf.session.OffloadSession` and replaces each MLA attention's forward
by the library's (the model's own weights are reused); afterwards ``model.generate(...)`` works unchanged.
``stats(model)`` reports what the session holds and moved.

``OffloadConfig`` (:mod:`torch_kvoffload.core.config`) groups the capability configs.
``OffloadConfig.default()`` (what ``config=None`` means): layerwise offload on, plus sparse decode offload
when the model has a lightning indexer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch_kvoffload.core.config import DEFAULT_BLOCK_SIZE, OffloadConfig
from torch_kvoffload.sparse.config import SparseOptions

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_BLOCK_SIZE", "OffloadConfig", "SparseOptions", "offload", "stats"]


def offload(model: torch.nn.Module, config: OffloadConfig | dict[str, Any] | None = None) -> torch.nn.Module:
    """Offload ``model``'s KV cache with the library's eager attention; return ``model``.

    ``config``: an :class:`OffloadConfig` (or its dict form); ``None`` = :meth:`OffloadConfig.default`.
    Raises ``ValueError`` (naming the model class and the reason) for a model the library cannot handle,
    before anything is allocated, and ``RuntimeError`` for a transformers release outside the supported
    range (:mod:`torch_kvoffload.integrations.hf.versions`).
    """
    from torch_kvoffload.integrations.hf.install import offload as _offload
    from torch_kvoffload.integrations.hf.versions import check_transformers_version

    check_transformers_version()
    return _offload(model, config)


def stats(model: torch.nn.Module) -> dict[str, float]:
    """What the offloaded ``model`` holds and moved: ``device_kv_bytes``, ``dense_kv_bytes``,
    ``bytes_h2d``, ``bytes_d2h``, ``hits``, ``misses``, ``layer_loads``, ``layer_saves``, ``broadcasts``
    and more (see :meth:`OffloadSession.stats`)."""
    from torch_kvoffload.integrations.hf.session import session_of

    return session_of(model).stats()
