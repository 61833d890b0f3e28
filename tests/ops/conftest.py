"""The op tests run the C++ kernels on at least two intra-op threads, so that ``at::parallel_for`` really
splits their work (the suite gives each xdist worker one thread; see ``tests/conftest.py``)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _two_intraop_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)
