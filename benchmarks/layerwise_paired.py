"""Paired A/B comparison of two layerwise runtime variants in one process.

On a small shared machine the run-to-run spread of ``layerwise_bench.py`` (± 0.1 efficiency) is larger
than most single changes. This script builds two runtimes over the same store, the same buffers' plan
and the same compute, and alternates their forwards (A B, then B A, ...), so drifting machine load hits
both alike; it reports, per configuration, the median of the per-pair wall ratios A / B (> 1: B faster).

A variant is a set of runtime keyword arguments or CPU tuning values (``--a critical_parts=1``; the
tuning of ``layerwise_bench.TUNING`` is set on the runtime's private attributes) and optionally another git
revision (``--a-rev HEAD~1``: the layerwise runtime — ``layerwise/runtime.py`` and the modules it is made
of, every module of ``layerwise/`` but the planner, the allocation and the config —, the embedded store and
the block hashing of that revision, loaded under other module names, each variant with its own store; the
rest of the package, kernels included, is this checkout's).

    python benchmarks/layerwise_paired.py --a critical_parts=1 --b critical_parts=2 [--pairs 21]

Writes ``benchmarks/results/layerwise_paired.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from layerwise_bench import Compute, ForeignLoad, Setup, add_workload_args, filled_store

from torch_kvoffload.layerwise import LayerwiseOffloadRuntime
from torch_kvoffload.store.local import LocalKVStore

ROOT = Path(__file__).resolve().parent.parent


# modules of torch_kvoffload/layerwise/ a variant takes from this checkout at every revision: the runtime
# checks its plan and buffers against these classes
_CHECKOUT_LAYERWISE = {"__init__", "allocation", "config", "planner"}


def _git_show(rev: str, path: str) -> str:
    return subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def _load(name: str, src: str):
    """``src`` loaded as module ``name`` (not replacing any of this checkout's modules)."""
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(src)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _runtime_modules_at(rev: str, tag: str) -> dict[str, object]:
    """The layerwise runtime's modules as of ``rev`` by name (``"runtime"``, and the modules it is made of
    at that revision), each loaded as ``_paired_{room}_{tag}`` and importing its siblings of ``rev``."""
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "torch_kvoffload/layerwise/"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    rooms = sorted(
        Path(p).stem for p in listing if p.endswith(".py") and Path(p).stem not in _CHECKOUT_LAYERWISE
    )
    alias = {room: f"_paired_{room}_{tag}" for room in rooms}
    dotted = re.compile(r"\btorch_kvoffload\.layerwise\.(" + "|".join(map(re.escape, rooms)) + r")\b")

    def from_package(m: re.Match) -> str:
        # "from torch_kvoffload.layerwise import a, b" naming rooms only: import those of the revision
        names = [n.strip() for n in m.group(1).split(",")]
        if not all(n in alias for n in names):
            return m.group(0)
        return "import " + ", ".join(f"{alias[n]} as {n}" for n in names)

    package = re.compile(r"^from torch_kvoffload\.layerwise import ([\w, ]+)$", re.MULTILINE)
    sources = {
        room: package.sub(
            from_package,
            dotted.sub(lambda m: alias[m.group(1)], _git_show(rev, f"torch_kvoffload/layerwise/{room}.py")),
        )
        for room in rooms
    }
    folder = Path(tempfile.mkdtemp())
    for room, src in sources.items():
        (folder / f"{alias[room]}.py").write_text(src)
    sys.path.insert(0, str(folder))
    try:
        return {room: importlib.import_module(alias[room]) for room in rooms}
    finally:
        sys.path.remove(str(folder))


def _variant_at(rev: str) -> tuple[type, type]:
    """``LayerwiseOffloadRuntime`` and ``LocalKVStore`` as of git revision ``rev``: their modules and the
    block hashing of that revision; the rest of the package (kernels included) is this checkout's."""
    tag = "".join(c if c.isalnum() else "_" for c in rev)
    keys = _load(f"_paired_keys_{tag}", _git_show(rev, "torch_kvoffload/store/keys.py"))
    local = _load(f"_paired_local_{tag}", _git_show(rev, "torch_kvoffload/store/local.py"))
    modules = _runtime_modules_at(rev, tag)
    for module in modules.values():
        if hasattr(module, "block_hashes"):
            module.block_hashes = keys.block_hashes
    return modules["runtime"].LayerwiseOffloadRuntime, local.LocalKVStore


def _kwargs(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        name, _, value = item.partition("=")
        out[name] = json.loads(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", nargs="*", default=[], help="runtime kwargs of variant A, name=json")
    p.add_argument("--b", nargs="*", default=[], help="runtime kwargs of variant B, name=json")
    p.add_argument("--a-rev", default=None, help="git revision whose runtime module variant A uses")
    p.add_argument("--b-rev", default=None, help="git revision whose runtime module variant B uses")
    p.add_argument("--pairs", type=int, default=21)
    p.add_argument("--configs", default="1:1,2:1,2:2,2:3,4:1,4:2,4:3", help="B:depth,...")
    p.add_argument("--compute-ms", type=float, default=1.7, help="per-layer compute (fixed for both)")
    add_workload_args(p)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "layerwise_paired.json"))
    args = p.parse_args()
    torch.set_num_threads(1)

    cls_a, store_a = _variant_at(args.a_rev) if args.a_rev else (LayerwiseOffloadRuntime, LocalKVStore)
    cls_b, store_b = _variant_at(args.b_rev) if args.b_rev else (LayerwiseOffloadRuntime, LocalKVStore)
    kw_a, kw_b = _kwargs(args.a), _kwargs(args.b)

    # each (store, runtime) class pair gets a store filled by that runtime, so its keys are the ones it reads
    stores = {pair: filled_store(args, *pair) for pair in {(store_a, cls_a), (store_b, cls_b)}}
    compute = Compute(args.compute_dim)
    compute.calibrate(args.compute_ms * 1e-3)
    for _ in range(2):
        got = statistics.median(compute.time_layers(args.layers) for _ in range(3))
        compute.rows = max(1, round(compute.rows * args.compute_ms * 1e-3 * args.layers / got))
        compute.a = torch.randn(compute.rows, compute.dim)

    rows = []
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    for b, depth in tqdm(configs, desc="paired"):
        load = ForeignLoad()
        sa = Setup(args, b, depth, stores[store_a, cls_a], runtime_cls=cls_a, **dict(kw_a))
        sb = Setup(args, b, depth, stores[store_b, cls_b], runtime_cls=cls_b, **dict(kw_b))
        for s in (sa, sb):
            s.forward(compute)
        wa, wb, ratios, alone = [], [], [], []
        for i in range(args.pairs):
            alone.append(compute.time_layers(args.layers))
            first, second = (sa, sb) if i % 2 == 0 else (sb, sa)
            t1, _ = first.forward(compute)
            t2, _ = second.forward(compute)
            ta, tb = (t1, t2) if i % 2 == 0 else (t2, t1)
            wa.append(ta)
            wb.append(tb)
            ratios.append(ta / tb)
        sa.rt.close()
        sb.rt.close()
        c = statistics.median(alone)
        rows.append(
            {
                "B": b,
                "prefetch_depth": depth,
                "pairs": args.pairs,
                "median_ratio_a_over_b": statistics.median(ratios),
                "b_faster_pairs": sum(r > 1 for r in ratios),
                "wall_a_ms": statistics.median(wa) * 1e3,
                "wall_b_ms": statistics.median(wb) * 1e3,
                "compute_alone_ms": c * 1e3,
                "efficiency_a": c / statistics.median(wa),
                "efficiency_b": c / statistics.median(wb),
                "foreign_cores": load.cores(),
            }
        )
    print(f"A: {args.a_rev or 'this checkout'} {kw_a}   B: {args.b_rev or 'this checkout'} {kw_b}")
    print(
        f"{'B':>2} {'depth':>5} {'A/B':>6} {'B wins':>6} {'wall A':>7} {'wall B':>7} {'Σc':>6} {'eff A':>5} {'eff B':>5} {'foreign':>7}"
    )
    for r in rows:
        print(
            f"{r['B']:>2} {r['prefetch_depth']:>5} {r['median_ratio_a_over_b']:>6.3f} "
            f"{r['b_faster_pairs']:>3}/{r['pairs']:<2} {r['wall_a_ms']:>7.1f} {r['wall_b_ms']:>7.1f} "
            f"{r['compute_alone_ms']:>6.1f} {r['efficiency_a']:>5.2f} {r['efficiency_b']:>5.2f} {r['foreign_cores'] or 0:>7.2f}"
        )
    print(f"load average at the end: {os.getloadavg()}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(args), "load_average_at_end": os.getloadavg(), "rows": rows}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
