"""torch_kvoffload: KV-cache offload for MLA / SFA attention models in PyTorch."""

from torch_kvoffload import device, ops, transfer
from torch_kvoffload._extension import extension_available, extension_load_error
from torch_kvoffload._version import __version__
from torch_kvoffload.api import OffloadConfig, offload, stats
from torch_kvoffload.backend import compile, explain
from torch_kvoffload.ops import registered_ops

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
