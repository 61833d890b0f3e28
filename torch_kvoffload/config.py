"""User-facing configuration: pydantic v2 models, validated when they are built.

Each capability defines its own model (``SparseDecodeConfig``, ``LayerwiseConfig``, ``KVPPConfig``, ...)
deriving from :class:`ConfigModel`; invalid combinations raise ``ValueError`` (pydantic's
``ValidationError`` is a subclass) at construction. :func:`parse_lax_bool` is the one parser for
boolean switches that arrive as strings from launchers.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigModel", "parse_lax_bool"]

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}


class ConfigModel(BaseModel):
    """Base of every configuration model: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConfigModel:
        return cls.model_validate(data)

    @classmethod
    def from_json(cls, text: str) -> ConfigModel:
        return cls.model_validate_json(text)


def parse_lax_bool(key: str, value: Any) -> bool:
    """``True``/``False``, 0/1 and strings such as ``"true"``, ``"False"``, ``"1"``, ``"off"``.

    Anything else raises ``ValueError`` naming the key and the value.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    raise ValueError(f"{key}: expected a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")
