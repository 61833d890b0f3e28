"""The op tests run the C++ kernels on at least two intra-op threads, so that ``at::parallel_for`` really
splits their work (the suite gives each xdist worker one thread; see ``tests/conftest.py``).

Under Triton's interpreter (no accelerator) a kernel runs in Python: an indexer or attention case takes a
second or more. Of their shape x dtype grids (``MATH_GRIDS``), the Triton cases in float32 on the smaller
shapes are the unit tier; those in other dtypes and on the larger shapes (index ``SLOW_SHAPES_FROM`` and up)
are the ``slow`` tier, which ``make test`` runs and ``make test-fast`` leaves out. (The copy kernels' grids
stay whole: a dtype there is an element size, and a case takes milliseconds.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent
MATH_GRIDS = ("test_indexer_ops.py", "test_sparse_attention_ops.py")
SLOW_SHAPES_FROM = 4


def _interpreted_beyond_the_unit_tier(item: pytest.Item) -> bool:
    spec = getattr(item, "callspec", None)
    if Path(item.path).name not in MATH_GRIDS or spec is None or spec.params.get("op_impl") != "triton":
        return False
    other_dtype = any(spec.params.get(name, torch.float32) != torch.float32 for name in ("dtype", "w_dtype"))
    shape = re.search(r"\bshape(\d+)\b", spec.id)  # pytest's id of the i-th value of a "shape" grid
    return other_dtype or (shape is not None and int(shape.group(1)) >= SLOW_SHAPES_FROM)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(item.path).parent == _HERE and _interpreted_beyond_the_unit_tier(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _two_intraop_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)
