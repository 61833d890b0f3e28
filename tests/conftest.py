"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import pytest
import torch

import torch_kvoffload  # noqa: F401  (defines the ops and loads the extension)
from torch_kvoffload.ops import has_kernel


def cpp_kernel_available(op: str) -> bool:
    """Whether op ``op`` has a C++ CPU kernel registered (asks the dispatcher, not the environment)."""
    return has_kernel(op, "CPU")


requires_cpp = pytest.mark.skipif(
    not cpp_kernel_available("copy_rows"), reason="C++ extension not built / disabled"
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
