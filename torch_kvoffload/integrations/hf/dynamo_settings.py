"""The Dynamo settings a compiled model's forward runs under (:data:`TRACING_SETTINGS`), and
:data:`tracing_settings`, which applies them while any compiled forward runs and restores the caller's
values after the last one (any thread).

Dynamo reads them when it traces a call, so they are in force around every call of a model compiled by
:func:`torch_kvoffload.compile` (a call that traces nothing pays two attribute writes):

* ``fake_tensor_cache_enabled=False``: with the batch, token and cached-length dims dynamic (see
  :mod:`torch_kvoffload.integrations.hf.compile`), each hit of the fake-tensor dispatch cache rebuilds its
  output with symbolic sizes (``empty_strided`` + ``set_`` through sympy), which costs more than the
  dispatch it saves: a first ``generate`` of a tiny DeepseekV32 (prefill and decode graphs) took 8.3 s with
  the cache and 5.0 s without it for 2 layers, 13.8 and 8.6 s for 4 layers.
* ``specialize_float=True``: a model's attention scale stays a constant of its graph. Models sharing
  transformers' attention function (every MLA family) otherwise see it as a symbolic float once a model of
  other head widths was compiled in the process, and the passes cannot fold a symbolic scale into the
  absorbed attention (they refuse such a graph).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["TRACING_SETTINGS", "tracing_settings"]

#: ``torch._dynamo.config`` values while a compiled model's forward runs (see the module docstring).
TRACING_SETTINGS: dict[str, Any] = {"fake_tensor_cache_enabled": False, "specialize_float": True}


class _TracingSettings:
    """A context manager: :data:`TRACING_SETTINGS` in ``torch._dynamo.config`` from the first entry to the
    last exit over all threads (a count under a lock), the values found at the first entry restored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                config = torch._dynamo.config
                self._saved = {name: getattr(config, name) for name in TRACING_SETTINGS}
                for name, value in TRACING_SETTINGS.items():
                    setattr(config, name, value)
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for name, value in self._saved.items():
                    setattr(torch._dynamo.config, name, value)


#: The process's one instance (the settings are process-wide).
tracing_settings = _TracingSettings()
