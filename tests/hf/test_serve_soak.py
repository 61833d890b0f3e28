"""A soak of ``python -m torch_kvoffload.serve`` on loopback: a few hundred requests over the OpenAI API, a
mix of valid, empty, over-long, duplicate-id, and disconnected-mid-stream ones, from several client threads.

Checks: every valid greedy answer equals per-prompt ``generate()`` of the unmodified model, every bad
request gets its HTTP 400, ``/health`` answers 200 throughout, the server's memory after warm-up grows by at
most 5 %, the library holds no request's rows once all are answered, and SIGTERM with streams in flight
ends the server within 10 s. The same scenario, longer and
with a latency table: ``benchmarks/serving_soak.py`` (``support/soak.py`` holds both).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("transformers.cli.serving.model_manager")

from support.serving import running_server, save_model_dir
from support.soak import SOAK_CONFIG, reference_texts, run_soak, server_rss, stop_with_streams_open

#: Requests of the soak (its first tenth is the warm-up the memory is measured after).
REQUESTS = 240
CLIENTS = 6
#: Seconds the last dropped stream may take to be noticed and finished
IDLE_WAIT_S = 10.0
IDLE = "finished; 0 live, reserved_requests 0"
#: Seconds SIGTERM may take to end the server with requests in flight (the issue's bound).
STOP_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = save_model_dir(tmp_path_factory.mktemp("soak-model"))
    tmp = tmp_path_factory.mktemp("soak")
    with running_server(model_dir, tmp, SOAK_CONFIG, "--log-level", "info") as (url, log, proc):
        yield model_dir, url, log, proc


def test_soak_answers_every_valid_request_and_the_worker_lives(server) -> None:
    model_dir, url, log, proc = server
    references = reference_texts(model_dir)
    report = run_soak(url, str(model_dir), references, requests=REQUESTS, clients=CLIENTS, pid=proc.pid)
    assert report.wrong == [], f"{len(report.wrong)} valid answers differ, first: {report.wrong[:3]}"
    assert report.unexpected == [], f"unexpected answers: {report.unexpected[:5]}\n{log.read_text()[-4000:]}"
    assert report.health_failures == 0 and report.health_checks > 0
    assert sum(report.kinds.values()) == REQUESTS and all(report.kinds.values()), report.kinds
    assert report.rss_after <= report.rss_warm * 1.05, (
        f"server memory grew from {report.rss_warm} to {report.rss_after} bytes after warm-up"
    )
    # once every request was answered (or dropped), the library holds no request and no request's rows: its
    # line for the last request that finished says so (a dropped stream finishes when the server notices)
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        lines = [line for line in log.read_text().splitlines() if "finished; " in line and "live, " in line]
        if (lines and lines[-1].endswith(IDLE)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert lines and lines[-1].endswith(IDLE), lines[-3:]


def test_sigterm_with_streams_in_flight_ends_the_server_in_bounded_time(server) -> None:
    model_dir, url, log, proc = server
    assert server_rss(proc.pid) > 0
    took = stop_with_streams_open(url, str(model_dir), proc)
    assert proc.returncode == 0, log.read_text()[-4000:]
    assert took <= STOP_S, f"the server took {took:.1f} s to stop after SIGTERM"
    assert isinstance(model_dir, Path)
