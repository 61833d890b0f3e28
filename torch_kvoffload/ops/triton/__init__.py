"""Triton kernels of the ``kvoffload`` ops: one source for CUDA and Ascend (through triton-ascend).

Each op family has a module here (``copy``, ``fp8``, ``fp8_attention``, ``fp8_copy_attention``,
``fp8_indexer``, ``indexer``, ``residency``, ``sparse_attention``) that defines ``KERNELS: dict[str, Callable]``: op name → a wrapper with
the op's own Python signature. A wrapper runs the op's validation (the same checks, messages and exception
types as the reference and C++ kernels), allocates the outputs like the op does, then launches. Family
modules import ``triton`` at their top, so this package imports them lazily, only once
:func:`triton_available` said ``triton`` imports; a family module that fails to import is skipped with a
logged warning.

:func:`register_triton_kernels` registers every wrapper for ``CUDA`` when a CUDA device is present and
for ``PrivateUse1`` when ``torch_npu`` and triton-ascend import. :func:`triton_kernel` returns a wrapper
directly: on CPU tensors it runs under the Triton interpreter (``TRITON_INTERPRET=1``), which is how the
tests exercise the kernels on machines without an accelerator.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable

import torch

from torch_kvoffload.ops._registry import register_device_kernel

__all__ = [
    "FAMILIES",
    "device_guard",
    "interpreting",
    "register_triton_kernels",
    "require_launchable",
    "triton_available",
    "triton_kernel",
    "triton_kernels",
]

logger = logging.getLogger(__name__)

#: Family modules under ``torch_kvoffload.ops.triton`` that may define ``KERNELS``.
FAMILIES = (
    "copy",
    "fp8",
    "fp8_attention",
    "fp8_copy_attention",
    "fp8_indexer",
    "indexer",
    "residency",
    "sparse_attention",
)

_available: bool | None = None
_kernels: dict[str, Callable[..., object]] | None = None
_registered: set[tuple[str, str]] = set()


def triton_available() -> bool:
    """Whether ``triton`` (and ``triton.language``) import in this process."""
    global _available
    if _available is None:
        try:
            importlib.import_module("triton")
            importlib.import_module("triton.language")
            _available = True
        except Exception as exc:  # ImportError, or a broken install failing at import time
            logger.debug("triton is not importable: %s", exc)
            _available = False
    return _available


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``; CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_launchable(op: str, device: torch.device) -> None:
    """Raise unless a Triton kernel of ``op`` can run on tensors of ``device``.

    A real launch needs an accelerator (CUDA, or Ascend through triton-ascend); CPU tensors are accepted
    only under the interpreter.
    """
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            f"kvoffload::{op}: the Triton kernel got CPU tensors; it runs on CPU only under the Triton "
            "interpreter (set TRITON_INTERPRET=1 before triton is imported), otherwise use the op itself"
        )


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a launch (Triton launches on the current device and stream)."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    module = getattr(torch, device.type, None)  # torch.cuda, torch.npu (registered by torch_npu)
    if module is None or not hasattr(module, "device"):
        return contextlib.nullcontext()
    return module.device(device)


def triton_kernels() -> dict[str, Callable[..., object]]:
    """Every Triton wrapper found in the family modules (op name → wrapper); empty without triton."""
    global _kernels
    if _kernels is not None:
        return dict(_kernels)
    if not triton_available():
        return {}
    found: dict[str, Callable[..., object]] = {}
    for family in FAMILIES:
        modname = f"{__name__}.{family}"
        try:
            module = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name == modname:  # the family has no Triton kernels (yet)
                logger.debug("no Triton kernel module %s", modname)
                continue
            logger.warning("skipping Triton kernels of %s: %s", modname, exc)
            continue
        except Exception as exc:
            logger.warning("skipping Triton kernels of %s: %s", modname, exc)
            continue
        kernels = getattr(module, "KERNELS", None)
        if not isinstance(kernels, dict):
            logger.warning("skipping Triton kernels of %s: it defines no KERNELS dict", modname)
            continue
        for name, fn in kernels.items():
            if name in found:
                raise RuntimeError(f"Triton kernel for kvoffload op {name!r} is defined twice ({modname})")
            found[name] = fn
    _kernels = found
    return dict(found)


def triton_kernel(name: str) -> Callable[..., object]:
    """The Triton implementation of op ``name``, called with the op's own Python signature.

    Raises ``RuntimeError`` when ``triton`` does not import and ``KeyError`` when op ``name`` has no Triton
    kernel.
    """
    if not triton_available():
        raise RuntimeError(
            f"triton_kernel({name!r}): triton is not importable; install it with `pip install triton` "
            "(CUDA) or triton-ascend (Ascend)"
        )
    kernels = triton_kernels()
    if name not in kernels:
        raise KeyError(f"triton_kernel: kvoffload op {name!r} has no Triton kernel; have {sorted(kernels)}")
    return kernels[name]


def _ascend_available() -> bool:
    """Whether ``torch_npu`` imports with a usable NPU and triton has its Ascend backend."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
        if not (hasattr(torch, "npu") and torch.npu.is_available()):
            return False
        backends = importlib.import_module("triton.backends")
        return any("ascend" in str(b).lower() or "npu" in str(b).lower() for b in backends.backends)
    except Exception as exc:
        logger.debug("Ascend Triton backend not usable: %s", exc)
        return False


def register_triton_kernels() -> list[str]:
    """Register every available Triton kernel for the present accelerators; return ``"op:Key"`` entries.

    ``CUDA`` when :func:`torch.cuda.is_available`, ``PrivateUse1`` when ``torch_npu`` and triton-ascend
    import. Idempotent: an op already registered for a key is not registered again (the result lists
    only what this call registered). Without triton or an accelerator it registers nothing.
    """
    keys = []
    if torch.cuda.is_available():
        keys.append("CUDA")
    if _ascend_available():
        keys.append("PrivateUse1")
    if not keys or not triton_available():  # triton is imported only when there is a device to serve
        return []
    done = []
    for name, fn in sorted(triton_kernels().items()):
        for key in keys:
            if (name, key) in _registered:
                continue
            register_device_kernel(name, key, fn)
            _registered.add((name, key))
            done.append(f"{name}:{key}")
    if done:
        logger.info("registered Triton kernels: %s", ", ".join(done))
    return done
