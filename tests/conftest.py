"""Fixtures of the whole suite (the op implementations to run, the seed); shared helpers live in ``support/``."""

from __future__ import annotations

import os
import sys
from collections import Counter

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


def _threads_per_worker() -> int:
    """Intra-op threads for this pytest process: the cores divided among the xdist workers (one each on
    two cores). More threads than cores spin against each other: two workers of two threads each ran the
    HF tests 1.4x slower than two of one."""
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    return max(1, len(os.sched_getaffinity(0)) // workers)


THREADS = _threads_per_worker()
torch.set_num_threads(THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))  # the processes tests spawn share the cores too


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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules holding ``slow`` tests (whole models, spawned processes, servers: the long ones) run
    first, then the others; within each group the modules of more tests first (xdist's own order). ``make
    test`` hands each xdist worker one module at a time in this order (``--dist loadfile
    --no-loadscope-reorder``), so the long modules start early and the short ones fill the end, instead of a
    long module of few tests starting last and running alone. Runs after the directory hooks that mark
    their tests ``slow`` and after ``-m`` deselected any."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    tests = Counter(item.path for item in items)
    items.sort(key=lambda item: (item.path not in slow, -tests[item.path]))
