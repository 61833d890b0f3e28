"""Helpers shared by the tests (tiny models, references, multi-process launchers, fakes); no tests here.

Test files import from this package only, never from each other.
"""

from __future__ import annotations

from pathlib import Path

#: the repository's root
ROOT = Path(__file__).resolve().parents[2]
#: the repository's test services and research utilities (``mooncake_master``, ``residency_policies``): not
#: part of the installed package; the suite's conftest puts this folder on ``sys.path``
TOOLS_DIR = ROOT / "tools"
