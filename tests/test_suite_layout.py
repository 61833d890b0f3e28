"""The suite's own shape: test files import shared helpers from ``support/`` only, never another test file
or a conftest, and every folder of tests names a package of the library (or ``support``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import ROOT

TESTS = ROOT / "tests"
PACKAGE = ROOT / "torch_kvoffload"
_FILES = sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)
#: folders that are not a package of the library: the shared helpers, the integration adapters' tests
#: (``hf`` for ``torch_kvoffload/integrations/hf``)
_OTHER_FOLDERS = {"support": TESTS / "support", "hf": PACKAGE / "integrations" / "hf"}


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", _FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_imports_another_test_file(path: Path) -> None:
    test_modules = {p.stem for p in _FILES if p.stem.startswith("test_") or p.stem == "conftest"}
    wrong = sorted(m for m in _imported_modules(path) if m.split(".")[-1] in test_modules)
    assert not wrong, f"{path.relative_to(TESTS)} imports {wrong}: shared helpers belong in tests/support/"


def test_test_folders_mirror_the_package() -> None:
    folders = sorted({p.parent for p in _FILES if p.parent != TESTS})
    for folder in folders:
        name = folder.relative_to(TESTS).parts[0]
        target = _OTHER_FOLDERS.get(name, PACKAGE / name)
        assert target.exists(), f"tests/{name}/ names no package of torch_kvoffload ({target} is missing)"


def test_test_file_names_are_unique() -> None:
    # the suite imports test files by their base name (pytest's default import mode)
    stems = [p.stem for p in _FILES if p.stem.startswith("test_")]
    assert len(stems) == len(set(stems)), sorted({s for s in stems if stems.count(s) > 1})
