"""The package works on its reference kernels when the C++ extension is disabled or was never built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch_kvoffload

CHECK = r"""
import torch, torch_kvoffload as k
assert not k.extension_available(), k.extension_load_error()
assert not k.ops.has_kernel("copy_rows", "CPU")
assert k.ops.has_kernel("copy_rows", "CompositeExplicitAutograd")
src = torch.randn(6, 4, 3)
dst = torch.zeros(3, 4, 3)
k.ops.copy_blocks(src, dst, torch.tensor([[5, 0], [2, 2]]))
assert torch.equal(dst[0], src[5]) and torch.equal(dst[2], src[2]) and not dst[1].any()
k.ops.copy_rows(src, dst, torch.tensor([0, 23]), torch.tensor([5, 6]))
assert torch.equal(dst[1, 1], src[0, 0]) and torch.equal(dst[1, 2], src[5, 3])
try:
    k.ops.copy_rows(src, dst, torch.tensor([24]), torch.tensor([0]))
except IndexError as e:
    assert "kvoffload::copy_rows" in str(e)
else:
    raise SystemExit("no error")
print("REFERENCE-OK", k.extension_load_error())
"""


# An editable install maps ``torch_kvoffload._C`` to the source tree whatever sys.path says; drop that
# finder so the copied package is the only one visible.
ONLY_SYS_PATH = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
"""


def _run(env: dict[str, str], cwd: str, prelude: str = "") -> str:
    out = subprocess.run(
        [sys.executable, "-c", prelude + CHECK], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_disabled_at_run_time(tmp_path: Path) -> None:
    env = {**os.environ, "TORCH_KVOFFLOAD_DISABLE_EXT": "1"}
    assert "disabled by TORCH_KVOFFLOAD_DISABLE_EXT" in _run(env, str(tmp_path))


def test_never_built(tmp_path: Path) -> None:
    """A copy of the package without the compiled ``_C`` library imports and runs every op."""
    package = Path(torch_kvoffload.__file__).parent
    shutil.copytree(
        package, tmp_path / "torch_kvoffload", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_KVOFFLOAD_DISABLE_EXT"}
    env["PYTHONPATH"] = str(tmp_path)
    assert "REFERENCE-OK" in _run(env, str(tmp_path), ONLY_SYS_PATH)
