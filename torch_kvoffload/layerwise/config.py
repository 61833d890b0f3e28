"""Configuration of layerwise prefill offload."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, field_validator

from torch_kvoffload.config import ConfigModel
from torch_kvoffload.store.factory import StoreConfig

__all__ = ["LayerwiseConfig"]


class LayerwiseConfig(ConfigModel):
    """Layerwise prefill offload settings.

    ``num_shared_buffers``: ``B >= 1`` shared device buffers the reusable layers rotate through.
    ``independent_layers``: layers with a dedicated buffer (negative indices wrap when planned) or ``"all"``.
    ``prefetch_depth``: loads are issued up to this many layers ahead of the running layer (``>= 1``).
    ``store``: the host KV pool (:class:`~torch_kvoffload.store.factory.StoreConfig`: ``kind`` —
    ``"local"``, ``"memcache"``, ``"mooncake"`` — and that kind's options).
    ``model_id``: names the model (weights, revision). The store keys carry it together with a digest of
    the cache layout (:func:`~torch_kvoffload.store.keys.cache_layout_fingerprint`), so models with
    different layouts never share entries even when ``model_id`` is empty. The Hugging Face integration
    (``torch_kvoffload.offload`` / ``compile``) also adds a fingerprint of the model's weights
    (:func:`~torch_kvoffload.kv.spec.weights_fingerprint`), so fine-tunes of one
    architecture never share entries; a runtime built directly from this config keys by ``model_id`` and
    layout only: give each set of weights its own ``model_id`` there.
    """

    num_shared_buffers: StrictInt = Field(default=2, ge=1)
    independent_layers: list[StrictInt] | Literal["all"] = Field(default_factory=lambda: [0])
    prefetch_depth: StrictInt = Field(default=2, ge=1)
    store: StoreConfig = Field(default_factory=StoreConfig)
    model_id: str = ""

    @field_validator("independent_layers")
    @classmethod
    def _unique(cls, v: list[int] | str) -> list[int] | str:
        if isinstance(v, list) and len(set(v)) != len(v):
            raise ValueError(f"independent_layers: layers must be distinct, got {v}")
        return v
