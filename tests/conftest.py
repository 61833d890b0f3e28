"""Fixtures of the whole suite (the op implementations to run, the seed); shared helpers live in ``support/``."""

from __future__ import annotations

import os
import sys

import torch

# The Triton kernels run on CPU tensors only in Triton's interpreter, which is chosen when triton is
# imported: set it before anything (the package included) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from support import TOOLS_DIR
from support.op_impls import OP_IMPLS, skip_unusable

import torch_kvoffload  # noqa: F401  (defines the ops and loads the extension)

if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))


@pytest.fixture(params=OP_IMPLS)
def op_impl(request: pytest.FixtureRequest) -> str:
    """``"dispatch"`` or ``"triton"`` (skipped when triton does not import or has nowhere to run)."""
    skip_unusable(request.param)
    return request.param


@pytest.fixture(params=(*OP_IMPLS, "reference"))
def any_impl(request: pytest.FixtureRequest) -> str:
    """:func:`op_impl`'s values plus ``"reference"`` (the pure-PyTorch kernel), for bad-input tests."""
    skip_unusable(request.param)
    return request.param


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
