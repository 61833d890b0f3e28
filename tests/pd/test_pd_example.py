"""``examples/disaggregated.py``: the parent notices a child that exits without a result at once, instead of
waiting out its result timeout (``RESULT_TIMEOUT_S``) on the child's queue."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
from support import ROOT

EXAMPLE = ROOT / "examples" / "disaggregated.py"


def _example():
    spec = importlib.util.spec_from_file_location("disaggregated_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_child_result_reports_a_child_that_exited_without_a_result_without_waiting_out_the_timeout():
    ex = _example()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=os._exit, args=(3,), daemon=True)
    proc.start()
    proc.join()
    start = time.monotonic()
    out = ex.child_result(q, proc, "decode", ex.RESULT_TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert out == {"error": "the decode process exited with code 3 without a result"}
    assert elapsed < ex.RESULT_TIMEOUT_S


def test_child_result_returns_a_result_put_just_before_a_clean_exit():
    ex = _example()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=q.put, args=({"tokens": [1, 2]},), daemon=True)
    proc.start()
    proc.join()
    assert proc.exitcode == 0
    assert ex.child_result(q, proc, "decode", ex.RESULT_TIMEOUT_S) == {"tokens": [1, 2]}


@pytest.mark.slow
def test_kill_decode_fault_ends_within_the_result_timeout():
    """Before, the parent waited ``RESULT_TIMEOUT_S`` on the dead decode's queue after prefill's result, so
    the whole run took longer than that; now the run ends well within it, with the fault's report."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    ex = _example()
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--synthetic",
        "--fault",
        "kill-decode",
        "--tokens",
        "128",
        "--layers",
        "4",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=ex.RESULT_TIMEOUT_S, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "decode error: the decode process exited with code 1 without a result" in run.stdout, run.stdout
    assert "prefill error:" in run.stdout and "no heartbeat" in run.stdout, run.stdout
