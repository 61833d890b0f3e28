"""Helpers shared by the benchmark scripts: timing, result files, summary tables."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def median_seconds(fn: Callable[[], object], *, repeat: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    return interleaved_medians({"fn": fn}, repeat=repeat, warmup=warmup)["fn"]


def interleaved_medians(
    fns: dict[str, Callable[[], object]], *, repeat: int, warmup: int = 2, progress: Any = None
) -> dict[str, float]:
    """Median wall time of each function, timed round-robin so machine noise hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        if progress is not None:
            progress.update(1)
    return {name: statistics.median(ts) for name, ts in times.items()}


def machine_info() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    return path


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers, *[[f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: one colour per variant of the Hugging Face benchmarks, the same in every plot
VARIANT_COLOURS = {"unmodified": "tab:blue", "resident": "tab:orange", "offloaded": "tab:green"}


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` (printed) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return None
    return plt


def _gloo_entry(
    rank: int, fn: Callable[..., Any], world: int, port: int, timeout_s: float, args: tuple
) -> None:
    import datetime
    import os
    import traceback

    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        fn(rank, world, *args)
    except BaseException:
        raise RuntimeError(f"rank {rank}:\n{traceback.format_exc()}") from None
    finally:
        dist.destroy_process_group()


def launch_gloo(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 600.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes joined by gloo on 127.0.0.1 (one CPU
    thread each; ``timeout_s``: the process group's collective timeout)."""
    import torch.multiprocessing as mp

    from torch_kvoffload._utils import free_port

    mp.spawn(_gloo_entry, args=(fn, world, free_port(), timeout_s, args), nprocs=world, join=True)
