"""Configuration of layerwise prefill offload."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from torch_kvoffload.config import ConfigModel

__all__ = ["LayerwiseConfig"]


class LayerwiseConfig(ConfigModel):
    """Layerwise prefill offload settings.

    ``num_shared_buffers``: ``B >= 1`` shared device buffers the reusable layers rotate through.
    ``independent_layers``: layers with a dedicated buffer (negative indices wrap when planned) or ``"all"``.
    ``prefetch_depth``: how many layers ahead loads are issued (``>= 1``).
    ``store_kind``: host KV pool backend, ``"local"`` (in-process, LRU) or ``"memcache"`` (``memcache_hybrid``).
    ``store_options``: backend options, e.g. ``{"capacity_bytes": 1 << 30}`` for ``"local"``.
    ``model_id``: mixed into the store keys so different models never share entries.
    """

    num_shared_buffers: StrictInt = Field(default=2, ge=1)
    independent_layers: list[StrictInt] | Literal["all"] = Field(default_factory=lambda: [0])
    prefetch_depth: StrictInt = Field(default=2, ge=1)
    store_kind: Literal["local", "memcache"] = "local"
    store_options: dict[str, Any] = Field(default_factory=dict)
    model_id: str = ""

    @field_validator("independent_layers")
    @classmethod
    def _unique(cls, v: list[int] | str) -> list[int] | str:
        if isinstance(v, list) and len(set(v)) != len(v):
            raise ValueError(f"independent_layers: layers must be distinct, got {v}")
        return v

    @model_validator(mode="after")
    def _store(self) -> LayerwiseConfig:
        if self.store_kind == "local":
            unknown = set(self.store_options) - {"capacity_bytes"}
            if unknown:
                raise ValueError(f"store_options: unknown option(s) {sorted(unknown)} for store_kind 'local'")
            cap = self.store_options.get("capacity_bytes", 1 << 30)
            if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
                raise ValueError(f"store_options.capacity_bytes: expected a positive int, got {cap!r}")
        return self
