"""torch_kvoffload: KV-cache offload for MLA / SFA attention models in PyTorch.

``compile`` and ``explain`` (Hugging Face models, :mod:`torch_kvoffload.integrations.hf.compile`) are
loaded on first access: importing the package, which the ``kvoffload`` backend's entry point does, loads
no model-library integration. The package registers that integration's session hooks with the backend
(:func:`torch_kvoffload.backend.register_session_hooks`), resolved on the backend's first use.
"""

from typing import TYPE_CHECKING, Any

from torch_kvoffload import backend, device, ops, transfer
from torch_kvoffload._extension import extension_available, extension_load_error
from torch_kvoffload.api import OffloadConfig, offload, stats
from torch_kvoffload.ops import registered_ops

if TYPE_CHECKING:
    from torch_kvoffload.integrations.hf.compile import compile, explain

__version__ = "0.1.0"

__all__ = [
    "OffloadConfig",
    "__version__",
    "compile",
    "device",
    "explain",
    "extension_available",
    "extension_load_error",
    "offload",
    "ops",
    "registered_ops",
    "stats",
    "transfer",
]

_LAZY = ("compile", "explain")


def _hf_session_hooks() -> "backend.SessionHooks":
    from torch_kvoffload.integrations.hf.compile import SESSION_HOOKS

    return SESSION_HOOKS


backend.register_session_hooks(_hf_session_hooks)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from torch_kvoffload.integrations.hf import compile as hf_compile

        value = getattr(hf_compile, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torch_kvoffload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
