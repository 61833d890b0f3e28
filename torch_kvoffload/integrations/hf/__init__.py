"""Hugging Face ``transformers`` integration: inspect an MLA / SFA model, serve its KV from the library's
runtimes (``OffloadSession``), supply the cache ``generate`` uses, and replace its attention (eager path).
"""

from torch_kvoffload.integrations.hf.inspect import HFModelSpec, inspect_model
from torch_kvoffload.integrations.hf.install import attach, detach, offload
from torch_kvoffload.integrations.hf.session import OffloadSession, session_of
from torch_kvoffload.kv.spec import ModelSpec

__all__ = [
    "HFModelSpec",
    "ModelSpec",
    "OffloadSession",
    "attach",
    "detach",
    "inspect_model",
    "offload",
    "session_of",
]
