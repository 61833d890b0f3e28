"""Under ``CI=true`` the Mooncake tests never skip: a missing client fails them, saying what to install."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).with_name("test_store_mooncake.py")


def _import_without_mooncake(monkeypatch, ci: str | None):
    """Import test_store_mooncake as a fresh module while ``import mooncake.store`` fails."""
    monkeypatch.setitem(sys.modules, "mooncake", None)  # the import raises ImportError
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    spec = importlib.util.spec_from_file_location("_mooncake_tests_probe", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_missing_mooncake_fails_the_module_under_ci(monkeypatch) -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        _import_without_mooncake(monkeypatch, "true")
    msg = str(info.value)
    assert "CI=true and the Mooncake tests cannot run: the Mooncake client cannot be imported" in msg
    assert "pip install '.[mooncake]'" in msg and "apt-get install libibverbs1" in msg


@pytest.mark.parametrize("ci", [None, "false", "1"])
def test_missing_mooncake_skips_with_the_install_commands_elsewhere(monkeypatch, ci) -> None:
    module = _import_without_mooncake(monkeypatch, ci)
    (mark,) = [m for m in [module.pytestmark] if m.name == "skipif"]
    assert mark.args == (True,)
    reason = mark.kwargs["reason"]
    assert reason.startswith("the Mooncake client cannot be imported (ModuleNotFoundError")
    assert "pip install '.[mooncake]'" in reason and "apt-get install libibverbs1" in reason
