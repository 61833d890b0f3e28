"""The one place where ``kvoffload`` op schemas are defined and their kernels registered.

Every op is declared with :func:`define_op`, which

* defines the schema once in the ``kvoffload`` namespace,
* registers the fake (meta) kernel used by ``torch.compile`` / ``torch.export`` tracing,
* registers the pure-PyTorch reference kernel under ``CompositeExplicitAutograd``: it serves every device
  that has no dedicated kernel (CPU when the C++ extension is absent, CUDA / NPU until a device kernel
  lands) and is the golden model in tests.

Dedicated device kernels override the reference for their dispatch key: C++ CPU kernels through
``TORCH_LIBRARY_IMPL(kvoffload, CPU, m)`` in ``csrc/``, Python-level kernels (Triton, torch_npu) through
:func:`register_device_kernel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

NAMESPACE = "kvoffload"

_lib = torch.library.Library(NAMESPACE, "DEF")
_references: dict[str, Callable[..., object]] = {}
_schemas: dict[str, str] = {}

# Dispatch keys reported by :func:`registered_ops`.
KERNEL_KEYS = ("CPU", "CUDA", "PrivateUse1", "Meta", "CompositeExplicitAutograd")


def define_op(
    name: str,
    schema: str,
    *,
    fake: Callable[..., object],
    reference: Callable[..., object],
    tags: tuple[torch.Tag, ...] = (),
) -> torch._ops.OpOverload:
    """Define ``kvoffload::<name><schema>`` with its fake and reference kernels; return the overload."""
    if name in _schemas:
        raise RuntimeError(f"kvoffload op {name!r} is already defined")
    _lib.define(f"{name}{schema}", tags=tags)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_lib)
    _lib.impl(name, reference, "CompositeExplicitAutograd")
    _references[name] = reference
    _schemas[name] = schema
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def register_device_kernel(name: str, dispatch_key: str, kernel: Callable[..., object]) -> None:
    """Register a Python-level device kernel (e.g. Triton for ``"CUDA"``) for an existing op."""
    if name not in _schemas:
        raise KeyError(f"kvoffload op {name!r} is not defined")
    _lib.impl(name, kernel, dispatch_key)


def reference_kernel(name: str) -> Callable[..., object]:
    """The pure-PyTorch reference kernel of op ``name``."""
    return _references[name]


@dataclass(frozen=True)
class OpInfo:
    """One registered op: its name, schema and the dispatch keys that have a kernel."""

    name: str
    schema: str
    kernels: tuple[str, ...]

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"


def has_kernel(name: str, dispatch_key: str) -> bool:
    """Whether op ``name`` has a kernel registered directly for ``dispatch_key``."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", dispatch_key)


def registered_ops() -> list[OpInfo]:
    """All ``kvoffload`` ops, sorted by name, with the dispatch keys that have a kernel."""
    return [
        OpInfo(name, _schemas[name], tuple(k for k in KERNEL_KEYS if has_kernel(name, k)))
        for name in sorted(_schemas)
    ]


def format_registered_ops() -> str:
    """A table of :func:`registered_ops` for humans."""
    rows = [("op", "kernels"), *((info.qualname, ", ".join(info.kernels)) for info in registered_ops())]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)
