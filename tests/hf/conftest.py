"""The Hugging Face tests run whole models (many compile them with Dynamo, some spawn process groups or a
server): all of them are the ``slow`` tier, which ``make test`` runs and ``make test-fast`` leaves out."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.slow)
