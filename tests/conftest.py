"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import os

import torch

# The Triton kernels run on CPU tensors only in Triton's interpreter, which is chosen when triton is
# imported: set it before anything (the package included) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import torch_kvoffload  # noqa: F401  (defines the ops and loads the extension)
from torch_kvoffload.ops import has_kernel, reference_kernel
from torch_kvoffload.ops.triton import interpreting, triton_available, triton_kernel


def cpp_kernel_available(op: str) -> bool:
    """Whether op ``op`` has a C++ CPU kernel registered (asks the dispatcher, not the environment)."""
    return has_kernel(op, "CPU")


requires_cpp = pytest.mark.skipif(
    not cpp_kernel_available("copy_rows"), reason="C++ extension not built / disabled"
)

#: Implementations an op suite runs against: the dispatcher's kernel for the tensors' device (the C++
#: kernel on CPU, the registered device kernel on an accelerator) and the Triton kernel called directly.
OP_IMPLS = ("dispatch", "triton")


def _skip_unusable(impl: str) -> None:
    if impl != "triton":
        return
    if not triton_available():
        pytest.skip("triton is not importable (install the test extra)")
    if not interpreting():
        # With a CUDA device the interpreter is off: the Triton kernels are then the dispatch kernels of
        # CUDA tensors, and these CPU-tensor suites cannot call them directly.
        pytest.skip("Triton kernels take CPU tensors only under TRITON_INTERPRET=1")


@pytest.fixture(params=OP_IMPLS)
def op_impl(request: pytest.FixtureRequest) -> str:
    """``"dispatch"`` or ``"triton"`` (skipped when triton does not import or cannot take CPU tensors)."""
    _skip_unusable(request.param)
    return request.param


@pytest.fixture(params=(*OP_IMPLS, "reference"))
def any_impl(request: pytest.FixtureRequest) -> str:
    """:func:`op_impl`'s values plus ``"reference"`` (the pure-PyTorch kernel), for bad-input tests."""
    _skip_unusable(request.param)
    return request.param


def call_op(op_impl: str, name: str, *args, **kwargs):
    """Run op ``name`` through ``op_impl``: ``torch.ops.kvoffload.<name>``, its Triton kernel, or (for
    ``"reference"``) its pure-PyTorch reference kernel."""
    if op_impl == "dispatch":
        return getattr(torch.ops.kvoffload, name)(*args, **kwargs)
    if op_impl == "triton":
        return triton_kernel(name)(*args, **kwargs)
    if op_impl == "reference":
        return reference_kernel(name)(*args, **kwargs)
    raise ValueError(f"call_op: unknown op_impl {op_impl!r}; expected one of {(*OP_IMPLS, 'reference')}")


def skip_unless_kernel(op_impl: str, name: str) -> None:
    """Skip a kernel-vs-reference test whose ``"dispatch"`` variant would only run the reference itself.

    On CPU without the C++ kernel the dispatcher falls back to the reference kernel; comparing it with
    the reference proves nothing, so the test skips.
    """
    if op_impl == "dispatch" and not has_kernel(name, "CPU"):
        pytest.skip(f"C++ CPU kernel of {name} not built / disabled")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
