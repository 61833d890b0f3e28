"""Run transformers' own generation test suite (``GenerationTesterMixin``) through the library.

For each model family, runs the ``GenerationTesterMixin`` tests of its transformers test module three ways,
one pytest process each: ``unmodified``, ``offload`` (every model the tests build passed through
``torch_kvoffload.offload`` with its family's default config before its first forward or ``generate``) and
``compile`` (``torch_kvoffload.compile``). The patching lives in ``tools/hf_generation_suite_plugin.py``
(loaded with ``-p``); see its docstring for the seam. Writes ``<out>.json`` (every test's outcome per mode)
and ``<out>.md`` (per model: passed per mode, and every test that passes unmodified but fails through the
library, with the first line of its error).

transformers' test sources are not in its wheel; ``SUITE`` is a folder holding them (never copy them into
this repository): ``SUITE/tests/`` with ``test_modeling_common.py``, ``test_configuration_common.py`` and
the other top-level testers, ``generation/test_utils.py``, ``causal_lm_tester.py``, ``utils/`` and
``models/<family>/test_modeling_<family>.py``; ``SUITE/conftest.py`` and ``SUITE/pyproject.toml`` (pytest
settings); ``SUITE/src/transformers`` (a link to the installed package, which ``test_pipeline_mixin`` reads)
and ``SUITE/utils/test_module``. An optional ``SUITE/SOURCE.txt`` names where they came from (copied into
the results). The tests need ``parameterized`` and ``httpx`` installed.

    python tools/hf_generation_suite.py /tmp/hfsuite                      # 5 families x 3 modes
    python tools/hf_generation_suite.py /tmp/hfsuite --models deepseek_v3 --modes offload
    python tools/hf_generation_suite.py /tmp/hfsuite --no-grad            # + the library modes under no_grad

``--no-grad`` adds ``offload+no_grad`` / ``compile+no_grad`` runs: each test's body under
``torch.no_grad()``, which shows what the tests that call the model with autograd on (refused by the
library, see docs/huggingface.md) check beyond that refusal. Results of earlier runs in ``<out>.json``
are kept for the (model, mode) pairs not rerun.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "hf_generation_suite"
MODELS = ("deepseek_v3", "deepseek_v32", "deepseek_v2", "glm4_moe_lite", "glm_moe_dsa")
MODES = ("unmodified", "offload", "compile")
LIBRARY_MODES = ("offload", "compile", "offload+no_grad", "compile+no_grad")

# Tests whose failure through the library is an assertion on transformers' own cache classes (or on
# transformers compiling its own cache), excepted by the issue; the reason is printed in the report.
CACHE_CLASS_ASSERTIONS: dict[str, str] = {
    "test_generate_with_static_cache": (
        "asserts the returned cache `isinstance(..., StaticCache)`; the library serves "
        "`cache_implementation='static'` with its own `OffloadCache`"
    ),
    "test_generate_from_inputs_embeds_with_static_cache": (
        "asserts `assertIsInstance(outputs.past_key_values, StaticCache)` (same reason)"
    ),
    "test_generate_compile_model_forward_fullgraph": (
        "asserts the returned cache is a `DynamicCache`, then a compileable non-dynamic cache and "
        "`model._compiled_call` (transformers compiling its own static cache); the library's cache is neither "
        "and `compile_config` has no effect on an offloaded model"
    ),
    "test_static_cache_no_recompile_with_smaller_length": (
        "asserts `hasattr(model, '_compiled_call')`: transformers compiles `forward` itself only for its own "
        "compileable caches"
    ),
}


def run_one(
    suite: Path, model: str, mode: str, workdir: Path, test_timeout: float, run_timeout: float
) -> dict:
    """One pytest process: ``model``'s GenerationTesterMixin tests in ``mode``; returns its outcomes."""
    base_mode, _, variant = mode.partition("+")
    tag = f"{model}.{mode.replace('+', '_')}"
    junit, report, log = workdir / f"{tag}.xml", workdir / f"{tag}.offloaded.json", workdir / f"{tag}.log"
    for path in (junit, report):
        path.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "pytest", f"tests/models/{model}/test_modeling_{model}.py",
        "-p", "hf_generation_suite_plugin", "-p", "no:cacheprovider",
        f"--kvoffload-mode={base_mode}", f"--kvoffload-report={report}",
        f"--kvoffload-test-timeout={test_timeout}", f"--junitxml={junit}",
        "-o", "log_cli=false", "-W", "ignore", "-q", "--tb=short",
    ]  # fmt: skip
    if variant == "no_grad":
        cmd.append("--kvoffload-no-grad")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TOOLS), os.environ.get("PYTHONPATH")])),
    }
    start = time.perf_counter()
    with log.open("w") as out:
        try:
            rc = subprocess.run(
                cmd, cwd=suite, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=run_timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = round(time.perf_counter() - start, 1)
    tests = parse_junit(junit) if junit.exists() else {}
    offloaded = json.loads(report.read_text()) if report.exists() else {}
    for nodeid, info in offloaded.items():
        name = nodeid.rsplit("::", 1)[-1]
        if name in tests:
            tests[name]["models_offloaded"] = info["models_offloaded"]
    return {"returncode": rc, "seconds": seconds, "log": str(log), "tests": tests}


def parse_junit(path: Path) -> dict[str, dict[str, Any]]:
    tests: dict[str, dict[str, Any]] = {}
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "").strip()
                break
        failed = outcome in ("failed", "error")
        entry = {"outcome": outcome, "seconds": round(float(case.get("time") or 0.0), 1)}
        if failed:
            entry.update(error=first_line(message), where=failing_line(child.text or ""))
        elif outcome == "skipped":
            entry["skip_reason"] = first_line(message)
        tests[case.get("name", "")] = entry
    return tests


def failing_line(traceback: str) -> str:
    """``file:line: code`` of the innermost frame of the test suite in a ``--tb=short`` traceback."""
    lines = traceback.splitlines()
    where = ""
    for i, line in enumerate(lines):
        if line.startswith("tests/") and ": in " in line:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            where = f"{line.split(': in ')[0]}: {code}"[:300]
    return where


def first_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0][:400] if lines else ""


def summarize(results: dict[str, dict[str, dict]]) -> dict[str, Any]:
    """Per model: counts per mode over the tests that pass unmodified, and the regressions."""
    summary: dict[str, Any] = {}
    for model, runs in results.items():
        base = runs.get("unmodified", {}).get("tests", {})
        passing = sorted(name for name, t in base.items() if t["outcome"] == "passed")
        row: dict[str, Any] = {
            "collected": len(base),
            "passed_unmodified": len(passing),
            "skipped_unmodified": sum(t["outcome"] == "skipped" for t in base.values()),
            "failed_unmodified": sorted(n for n, t in base.items() if t["outcome"] in ("failed", "error")),
        }
        for mode in LIBRARY_MODES:
            if mode not in runs:
                continue
            tests = runs[mode]["tests"]
            regressions, excepted, vacuous = [], [], []
            for name in passing:
                t = tests.get(name, {"outcome": "missing", "error": "no result (run interrupted?)"})
                if t["outcome"] == "passed":
                    if t.get("models_offloaded", 1) == 0:
                        vacuous.append(name)
                    continue
                entry = {
                    "test": name,
                    "outcome": t["outcome"],
                    "error": t.get("error") or t.get("skip_reason", ""),
                    "where": t.get("where", ""),
                }
                (excepted if name in CACHE_CLASS_ASSERTIONS else regressions).append(entry)
            row[mode] = {
                "passed": len(passing) - len(regressions) - len(excepted),
                "of": len(passing),
                "excepted_cache_class": excepted,
                "failures": regressions,
                "passed_without_offloading_a_model": vacuous,
                "seconds": runs[mode]["seconds"],
            }
        summary[model] = row
    return summary


def _dumps(payload: dict[str, Any]) -> str:
    """Indented JSON with every innermost object or list on one line (one line per test)."""
    text = json.dumps(payload, indent=1)
    return re.sub(
        r"([\[{])\n\s*([^\[\]{}]*?)\n\s*([\]}])",
        lambda m: m.group(1) + re.sub(r"\n\s*", " ", m.group(2)) + m.group(3),
        text,
    )


def _normalized(error: str) -> str:
    """The error with the model class name replaced, so one cause groups across families."""
    return re.sub(r"\b\w+ForCausalLM\b", "<Model>ForCausalLM", error)


def write_markdown(path: Path, payload: dict[str, Any]) -> None:
    summary, meta = payload["summary"], payload["meta"]
    modes = [m for m in LIBRARY_MODES if any(m in row for row in summary.values())]
    lines = [
        "# transformers' generation tests through torch_kvoffload",
        "",
        f"transformers {meta['transformers']}, torch {meta['torch']}, test sources: {meta['suite_source']}. "
        f"Generated by `tools/hf_generation_suite.py` on {meta['date']}.",
        "",
        "Of the `GenerationTesterMixin` tests that pass on the unmodified model, how many pass through each "
        "mode; in parentheses, how many of the failures are excepted assertions on transformers' own cache "
        "classes (listed at the end). `+no_grad`: every test body under `torch.no_grad()`.",
        "",
        "| model | collected | unmodified: passed / skipped / failed | " + " | ".join(modes) + " |",
        "|---|---|---|" + "---|" * len(modes),
    ]
    for model, row in summary.items():
        cells = []
        for m in modes:
            r = row.get(m)
            cells.append(f"{r['passed']} / {r['of']} ({len(r['excepted_cache_class'])})" if r else "—")
        lines.append(
            f"| {model} | {row['collected']} | {row['passed_unmodified']} / {row['skipped_unmodified']} / "
            f"{len(row['failed_unmodified'])} | " + " | ".join(cells) + " |"
        )
    groups: dict[tuple[str, str], list[str]] = {}
    excepted: dict[str, list[str]] = {}
    vacuous: dict[str, list[str]] = {}
    for model, row in summary.items():
        for mode in modes:
            r = row.get(mode)
            if r is None:
                continue
            for entry in r["failures"]:
                key = (_normalized(entry["error"]), entry.get("where", ""))
                groups.setdefault(key, []).append(f"{model} {mode}: `{entry['test']}`")
            for entry in r["excepted_cache_class"]:
                excepted.setdefault(entry["test"], []).append(f"{model} {mode}")
            for name in r["passed_without_offloading_a_model"]:
                vacuous.setdefault(name, []).append(f"{model} {mode}")
    if groups:
        lines += ["", "## Failures through the library (not excepted), by error", ""]
        for (error, where), cases in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            at = f" — at `{where}`" if where else ""
            lines += [f"- **{error}**{at} ({len(cases)}):", "  " + "; ".join(cases)]
    if excepted:
        lines += ["", "## Excepted: assertions on transformers' own cache classes", ""]
        for name, cases in sorted(excepted.items()):
            lines.append(f"- `{name}` ({', '.join(cases)}): {CACHE_CLASS_ASSERTIONS[name]}")
    if vacuous:
        lines += ["", "## Passed without calling any model (nothing was offloaded)", ""]
        lines += [f"- `{name}`: {', '.join(cases)}" for name, cases in sorted(vacuous.items())]
    lines += ["", "Logs and junit files: `--workdir`; per mode and model, seconds are in the JSON."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", type=Path, help="folder with transformers' test sources (see the docstring)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--no-grad", action="store_true", help="also run the library modes under no_grad")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results path without extension")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hf_generation_suite"), help="logs, junit")
    parser.add_argument("--test-timeout", type=float, default=300.0, help="seconds per test")
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per pytest process")
    parser.add_argument(
        "--report-only", action="store_true", help="rerun nothing: re-read the workdir's junit files, rewrite"
    )
    args = parser.parse_args(argv)

    suite = args.suite.resolve()
    if not (suite / "tests" / "generation" / "test_utils.py").exists():
        parser.error(f"{suite} has no tests/generation/test_utils.py (see the docstring)")
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    if args.no_grad:
        modes += [f"{m}+no_grad" for m in modes if m in ("offload", "compile")]
    args.workdir.mkdir(parents=True, exist_ok=True)

    json_path = args.out.with_suffix(".json")
    previous = json.loads(json_path.read_text()) if json_path.exists() else {}
    results: dict[str, dict[str, dict]] = previous.get("results", {})
    if args.report_only:
        for model, runs in results.items():
            for mode, run in runs.items():
                junit = args.workdir / f"{model}.{mode.replace('+', '_')}.xml"
                if junit.exists():
                    tests = parse_junit(junit)
                    for name, t in tests.items():
                        t["models_offloaded"] = run["tests"].get(name, {}).get("models_offloaded")
                        if t["models_offloaded"] is None:
                            del t["models_offloaded"]
                    run["tests"] = tests
        models = []
    for model in models:
        for mode in modes:
            print(f"[hf_generation_suite] {model} {mode} ...", flush=True)
            run = run_one(suite, model, mode, args.workdir, args.test_timeout, args.run_timeout)
            outcomes = [t["outcome"] for t in run["tests"].values()]
            print(
                f"[hf_generation_suite] {model} {mode}: {outcomes.count('passed')} passed, "
                f"{outcomes.count('failed') + outcomes.count('error')} failed, {outcomes.count('skipped')} skipped "
                f"in {run['seconds']} s (log {run['log']})",
                flush=True,
            )
            results.setdefault(model, {})[mode] = run

    import torch
    import transformers

    source = suite / "SOURCE.txt"
    payload = {
        "meta": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "suite_source": source.read_text().strip() if source.exists() else str(suite),
            "date": datetime.date.today().isoformat(),
            "cache_class_assertions": CACHE_CLASS_ASSERTIONS,
        },
        "summary": summarize(results),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(_dumps(payload) + "\n")
    write_markdown(args.out.with_suffix(".md"), payload)
    print(f"[hf_generation_suite] wrote {json_path} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
