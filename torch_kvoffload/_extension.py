"""Loading of the optional C++ extension ``torch_kvoffload._C``.

Importing ``_C`` registers the C++ device kernels (``TORCH_LIBRARY_IMPL``) for ops whose schemas
:mod:`torch_kvoffload.ops` has already defined. When the extension was not built
(``TORCH_KVOFFLOAD_BUILD_EXT=0``), fails to load, or is switched off at run time with
``TORCH_KVOFFLOAD_DISABLE_EXT=1``, every op runs on its pure-PyTorch reference kernel.
"""

from __future__ import annotations

import importlib
import logging
import os

logger = logging.getLogger(__name__)

_loaded: bool | None = None
_load_error: str | None = None


def load_extension() -> bool:
    """Import ``torch_kvoffload._C`` once; return whether its kernels are registered."""
    global _loaded, _load_error
    if _loaded is not None:
        return _loaded
    if os.environ.get("TORCH_KVOFFLOAD_DISABLE_EXT", "0") not in ("", "0"):
        _loaded, _load_error = False, "disabled by TORCH_KVOFFLOAD_DISABLE_EXT"
    else:
        try:
            importlib.import_module("torch_kvoffload._C")
            _loaded = True
        except ImportError as exc:  # not built, or built against another torch
            _loaded, _load_error = False, str(exc)
    if not _loaded:
        logger.info("torch_kvoffload C++ extension not in use (%s); using reference kernels", _load_error)
    return _loaded


def extension_module():
    """The loaded ``torch_kvoffload._C`` module, or ``None`` when the extension is not in use."""
    return importlib.import_module("torch_kvoffload._C") if load_extension() else None


def extension_available() -> bool:
    """Whether the C++ kernels of ``torch_kvoffload._C`` are loaded and registered."""
    return load_extension()


def extension_load_error() -> str | None:
    """Why the extension is not in use, or ``None`` when it is."""
    load_extension()
    return _load_error
