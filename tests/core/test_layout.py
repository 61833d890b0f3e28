"""The package's shape: module sizes, where bytes move, and the README's layout section.

The import graph (layer order, no circles) is checked by ``make lint`` with the import-linter contracts in
``pyproject.toml``; these checks cover what a graph cannot see.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torch_kvoffload"

#: Lines above which a module must say in its docstring why it is one module (``Why one module:``).
MAX_LINES = 500
REASON = "Why one module:"
#: Constructors of threads and thread pools: outside the transfer interface only where a module's
#: docstring says why its thread moves no KV bytes (``Not a transfer:``).
THREAD_CALLS = ("threading.Thread(", "ThreadPoolExecutor(", "Thread(target=")
NOT_A_TRANSFER = "Not a transfer:"


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_long_module_says_why_it_is_one_module(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    if lines > MAX_LINES:
        assert REASON in _docstring(path), (
            f"{path.relative_to(ROOT)} has {lines} lines (> {MAX_LINES}); split it into modules of one job "
            f"or give the reason in its docstring ({REASON!r})"
        )


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_threads_outside_the_transfer_interface_say_why(path: Path) -> None:
    if path == PACKAGE / "transfer.py":
        return
    text = path.read_text()
    calls = [c for c in THREAD_CALLS if c in text]
    if calls:
        assert NOT_A_TRANSFER in _docstring(path), (
            f"{path.relative_to(ROOT)} starts threads ({calls}); KV bytes move through "
            f"torch_kvoffload.transfer, or its docstring says why this thread is not a transfer "
            f"({NOT_A_TRANSFER!r})"
        )


#: The top-level package's own private modules, shared by every subpackage (helpers, the extension loader).
SHARED_PRIVATE = ("torch_kvoffload._utils", "torch_kvoffload._extension", "torch_kvoffload._version")


def _private_imports(path: Path) -> list[str]:
    """What ``path`` imports by a private name (a module or name starting with ``_``) from another
    subpackage of ``torch_kvoffload`` (the shared private modules of the top-level package aside)."""
    rel = path.relative_to(PACKAGE).parts
    own = rel[0] if len(rel) > 1 else None
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (
            isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch_kvoffload.")
        ):
            continue
        if node.module.startswith(SHARED_PRIVATE):
            continue
        parts = node.module.split(".")
        if parts[1] == own:
            continue
        private = any(p.startswith("_") for p in parts[1:]) or any(a.name.startswith("_") for a in node.names)
        if private:
            found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_is_imported_across_packages(path: Path) -> None:
    found = _private_imports(path)
    assert not found, (
        f"{path.relative_to(ROOT)} imports private names of another package: {found}; "
        "that package exports what others use"
    )


def _config_methods_building_runtimes(path: Path) -> list[str]:
    """Methods of the configuration models in ``path`` (classes based on ``ConfigModel``) that build a
    runtime: named ``build*`` or ``*runtime*``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "ConfigModel" for b in node.bases):
            found += [
                f"{node.name}.{f.name}"
                for f in node.body
                if isinstance(f, ast.FunctionDef) and (f.name.startswith("build") or "runtime" in f.name)
            ]
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_configs_are_data(path: Path) -> None:
    """A configuration describes; the feature's package builds its runtime from it."""
    found = _config_methods_building_runtimes(path)
    assert not found, (
        f"{path.relative_to(ROOT)}: {found} build runtimes; a config is data "
        "(build the runtime in the feature's package, e.g. build_layerwise_runtime(config, ...))"
    )


def _layout_entries() -> set[str]:
    """The paths the README's Layout section names under ``torch_kvoffload/``."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    return set(re.findall(r"torch_kvoffload/[\w/.]*", block))


def test_readme_layout_names_every_package_and_top_level_module() -> None:
    entries = _layout_entries()
    tree = {f"torch_kvoffload/{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    tree |= {
        f"torch_kvoffload/{p.name}"
        for p in PACKAGE.glob("*.py")
        if p.name != "__init__.py" and not p.name.startswith("_")
    }
    assert tree - entries == set(), f"README's Layout section misses {sorted(tree - entries)}"
    stale = {e for e in entries if not (ROOT / e).exists()}
    assert stale == set(), f"README's Layout section names paths that do not exist: {sorted(stale)}"
