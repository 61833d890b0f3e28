"""Serving soak: ``python -m torch_kvoffload.serve`` on loopback under a long mix of valid and bad requests.

The scenario of ``tests/hf/test_serve_soak.py`` (``tests/support/soak.py``), longer: valid completions
(plain and streamed), streams sharing one ``X-Request-ID``, empty prompts, over-long prompts and streams the
client drops after the first event, from several client threads, against a tiny random DeepSeek-V3.2
(nothing downloaded). Checks, as the test does: every valid greedy answer equals the unmodified model's
``generate()``, every bad request gets HTTP 400, ``/health`` answers 200 throughout, the server's memory after
warm-up grows by at most 5 %, and SIGTERM with streams open ends it within 10 s. Prints a latency table per
kind and writes ``benchmarks/results/serving_soak.json`` and ``.png``.

    python benchmarks/serving_soak.py [--requests 2000] [--clients 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _common import RESULTS_DIR, format_table, machine_info, pyplot, write_json
from support.serving import running_server, save_model_dir
from support.soak import SOAK_CONFIG, reference_texts, run_soak, server_rss, stop_with_streams_open

STOP_S = 10.0


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvoffload-soak-") as tmp:
        model_dir = save_model_dir(Path(tmp) / "model")
        references = reference_texts(model_dir)
        with running_server(model_dir, Path(tmp), SOAK_CONFIG) as (url, _log, proc):
            rss_start = server_rss(proc.pid)
            report = run_soak(
                url, str(model_dir), references, requests=args.requests, clients=args.clients, pid=proc.pid
            )
            stop_s = stop_with_streams_open(url, str(model_dir), proc)
    rows, kinds = [], {}
    for kind, seconds in sorted(report.latencies.items()):
        ms = [s * 1e3 for s in seconds]
        kinds[kind] = {
            "count": len(ms),
            "p50_ms": statistics.median(ms),
            "p90_ms": _quantile(ms, 0.9),
            "max_ms": max(ms),
        }
        rows.append(
            [kind, len(ms), f"{kinds[kind]['p50_ms']:.0f}", f"{kinds[kind]['p90_ms']:.0f}", f"{max(ms):.0f}"]
        )
    print(format_table(["kind", "requests", "p50 ms", "p90 ms", "max ms"], rows))
    checks = {
        "valid_answers_wrong": len(report.wrong),
        "unexpected_answers": len(report.unexpected),
        "health_checks": report.health_checks,
        "health_failures": report.health_failures,
        "rss_start_bytes": rss_start,
        "rss_after_warmup_bytes": report.rss_warm,
        "rss_end_bytes": report.rss_after,
        "rss_growth_after_warmup": report.rss_after / report.rss_warm - 1,
        "sigterm_stop_seconds": stop_s,
        "server_exit_status": proc.returncode,
    }
    print(
        f"{sum(report.kinds.values())} requests in {report.seconds:.1f} s from {args.clients} clients; "
        + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in checks.items())
    )
    ok = (
        not report.wrong
        and not report.unexpected
        and report.health_failures == 0
        and report.rss_after <= report.rss_warm * 1.05
        and stop_s <= STOP_S
        and proc.returncode == 0
    )
    path = write_json(
        "serving_soak",
        {
            "machine": machine_info(),
            "requests": args.requests,
            "clients": args.clients,
            "seconds": report.seconds,
            "kinds": kinds,
            "checks": checks,
            "passed": ok,
            "first_unexpected": report.unexpected[:5],
            "first_wrong": [list(map(str, w)) for w in report.wrong[:5]],
        },
    )
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = list(kinds)
        ax.bar([i - 0.2 for i in range(len(names))], [kinds[n]["p50_ms"] for n in names], 0.4, label="p50")
        ax.bar([i + 0.2 for i in range(len(names))], [kinds[n]["p90_ms"] for n in names], 0.4, label="p90")
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"serving soak: {args.requests} requests, {args.clients} clients")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS_DIR / "serving_soak.png", dpi=120)
        print(f"wrote {RESULTS_DIR / 'serving_soak.png'}")
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
