"""tools/hf_generation_suite.py and its pytest plugin: the patching seam, test selection, the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from hf_generation_suite import CACHE_CLASS_ASSERTIONS, _dumps, parse_junit, summarize
from hf_generation_suite_plugin import Offloader, restore
from support import ROOT, TOOLS_DIR
from support.hf_models import SMALL, build_model


def test_offloader_offloads_on_first_use_and_restores_the_class() -> None:
    model = build_model("deepseek_v3", **SMALL)
    cls = type(model)
    before = {name: vars(cls).get(name) for name in ("forward", "generate")}
    ids = torch.randint(3, 1000, (1, 5))
    with torch.no_grad():
        reference = model(ids).logits
    offloader = Offloader("offload")
    undo = offloader.patch([cls])
    try:
        assert getattr(model, "_kvoffload_session", None) is None  # nothing happens before the first call
        with torch.no_grad():
            logits = model(ids).logits
        assert model._kvoffload_session is not None and offloader.count == 1
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        model.generate(ids, max_new_tokens=2, do_sample=False)  # already offloaded: no second offload
        assert offloader.count == 1
    finally:
        restore(undo)
    assert {name: vars(cls).get(name) for name in ("forward", "generate")} == before
    assert not any(name.startswith("_kvsuite") for name in vars(cls))


_FAKE_SUITE = """
import unittest

import torch
from transformers import DeepseekV3ForCausalLM

from support.hf_models import SMALL, tiny_config


class GenerationTesterMixin:
    def test_generate(self):
        model = DeepseekV3ForCausalLM(tiny_config("deepseek_v3", **SMALL)).eval()
        model.generate(torch.randint(3, 1000, (1, 5)), max_new_tokens=2, do_sample=False)
        assert model._kvoffload_session is not None

    def test_no_model(self):
        pass


class FakeModelTest(GenerationTesterMixin, unittest.TestCase):
    def test_not_a_generation_test(self):
        raise AssertionError("deselected: not defined by GenerationTesterMixin")
"""


def test_plugin_selects_the_mixin_tests_and_reports_models_offloaded(tmp_path: Path) -> None:
    (tmp_path / "test_fake_suite.py").write_text(textwrap.dedent(_FAKE_SUITE))
    junit, report = tmp_path / "junit.xml", tmp_path / "offloaded.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TOOLS_DIR), str(ROOT / "tests")])}
    cmd = [
        sys.executable, "-m", "pytest", "test_fake_suite.py", "-p", "hf_generation_suite_plugin",
        "-p", "no:cacheprovider", "--kvoffload-mode=offload", f"--kvoffload-report={report}",
        f"--junitxml={junit}", "-q", "--rootdir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tests = parse_junit(junit)
    assert {name: t["outcome"] for name, t in tests.items()} == {
        "test_generate": "passed",
        "test_no_model": "passed",
    }
    offloaded = {
        k.rsplit("::", 1)[-1]: v["models_offloaded"] for k, v in json.loads(report.read_text()).items()
    }
    assert offloaded == {"test_generate": 1, "test_no_model": 0}


def test_summary_separates_failures_excepted_and_vacuous_passes() -> None:
    excepted = next(iter(CACHE_CLASS_ASSERTIONS))

    def run(**outcomes: str) -> dict:
        return {
            "seconds": 1.0,
            "tests": {name: {"outcome": o, "error": "E: x"} for name, o in outcomes.items()},
        }

    unmodified = run(
        test_a="passed", test_b="passed", test_c="skipped", test_d="failed", **{excepted: "passed"}
    )
    offload = run(test_a="passed", test_b="failed", test_c="skipped", test_d="failed", **{excepted: "failed"})
    offload["tests"]["test_a"]["models_offloaded"] = 0
    row = summarize({"m": {"unmodified": unmodified, "offload": offload}})["m"]
    assert (row["passed_unmodified"], row["skipped_unmodified"], row["failed_unmodified"]) == (
        3,
        1,
        ["test_d"],
    )
    r = row["offload"]
    assert (r["passed"], r["of"]) == (1, 3)
    assert [e["test"] for e in r["failures"]] == ["test_b"]
    assert [e["test"] for e in r["excepted_cache_class"]] == [excepted]
    assert r["passed_without_offloading_a_model"] == ["test_a"]
    payload = {"summary": {"m": row}, "nested": {"a": [1, {"b": "[x]"}]}}
    assert json.loads(_dumps(payload)) == payload
