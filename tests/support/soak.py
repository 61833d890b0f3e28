"""The serving soak shared by ``tests/hf/test_serve_soak.py`` and ``benchmarks/serving_soak.py``: a mix of
valid and bad requests sent to a running ``torch_kvoffload.serve`` from several client threads over plain
HTTP (the OpenAI-compatible ``/v1/completions``), with ``/health`` polled throughout and the server's memory
read from ``/proc``."""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from support.serving import words

NEW_TOKENS = 6
MAX_REQUEST_TOKENS = 48
SOAK_CONFIG = {"sparse": {}, "serving": {"max_request_tokens": MAX_REQUEST_TOKENS, "max_requests": 4}}
#: (length, seed) of the valid prompts
PROMPTS = ((4, 10), (9, 11), (15, 12), (22, 13), (30, 14), (12, 15))
#: One cycle of request kinds; the soak repeats it
KINDS = (
    "valid", "stream", "duplicate_id", "empty", "valid", "disconnect", "too_long", "stream", "duplicate_id",
    "valid",
)  # fmt: skip
TIMEOUT_S = 120.0
HEALTH_EVERY_S = 0.25


def reference_texts(model_dir: Path) -> dict[tuple[int, int], str]:
    """Greedy ``generate()`` of the unmodified model for every prompt of :data:`PROMPTS`, decoded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from support.hf_models import indexer_boundary_ties

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out, sequences = {}, []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(words(*prompt))["input_ids"]
            seq = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0]
            sequences.append(seq)
            out[prompt] = tok.decode(seq[len(ids) :], skip_special_tokens=True)
    assert indexer_boundary_ties(model, sequences) == 0
    return out


def server_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and its descendants (transformers 5.25's engine runs in a child)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def _post(url: str, body: dict, headers: dict | None = None):
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    return urllib.request.urlopen(request, timeout=TIMEOUT_S)


def _stream_text(response) -> str:
    text = ""
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["text"]
    return text


def stream_first_chunk(url: str, name: str, seed: int):
    """A streamed request (the longest the server takes) whose first event was read; the response stays open."""
    body = {
        "model": name,
        "prompt": words(4, 100 + seed),
        "max_tokens": MAX_REQUEST_TOKENS - 4,
        "stream": True,
    }
    response = _post(url, {**body, "temperature": 0})
    for raw in response:
        if raw.startswith(b"data: "):
            break
    return response


def stop_with_streams_open(url: str, name: str, proc, streams: int = 3, timeout: float = 60.0) -> float:
    """Seconds ``proc`` (the server) takes to exit after SIGTERM sent while ``streams`` streamed requests are
    open and unread (:func:`stream_first_chunk`); they are closed afterwards."""
    import signal

    held = [stream_first_chunk(url, name, seed) for seed in range(streams)]
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=timeout)
    took = time.monotonic() - start
    for r in held:
        r.close()
    return took


@dataclass
class SoakReport:
    kinds: Counter = field(default_factory=Counter)
    wrong: list = field(default_factory=list)  # (kind, prompt, got, want)
    unexpected: list = field(default_factory=list)  # (kind, what happened)
    latencies: dict = field(default_factory=dict)  # kind -> [seconds]
    health_checks: int = 0
    health_failures: int = 0
    rss_warm: int = 0
    rss_after: int = 0
    seconds: float = 0.0


def _one(url: str, name: str, kind: str, prompt: tuple[int, int], want: str, report: SoakReport) -> None:
    body = {"model": name, "prompt": words(*prompt), "max_tokens": NEW_TOKENS, "temperature": 0}
    start = time.monotonic()
    try:
        if kind == "valid":
            with _post(url, body) as r:
                got = json.loads(r.read())["choices"][0]["text"]
        elif kind in ("stream", "duplicate_id"):
            headers = {"X-Request-ID": "soak-same-id"} if kind == "duplicate_id" else None
            with _post(url, {**body, "stream": True}, headers) as r:
                got = _stream_text(r)
        elif kind == "disconnect":
            r = stream_first_chunk(url, name, prompt[1])
            r.close()
            got = want
        else:
            bad = {"empty": "", "too_long": words(MAX_REQUEST_TOKENS - NEW_TOKENS + 1, prompt[1])}[kind]
            try:
                with _post(url, {**body, "prompt": bad}) as r:
                    report.unexpected.append((kind, f"HTTP {r.status}: {r.read()[:200]!r}"))
            except urllib.error.HTTPError as e:
                if e.code != 400:
                    report.unexpected.append((kind, f"HTTP {e.code}: {e.read()[:200]!r}"))
            got = want
    except Exception as e:  # counted: the soak goes on
        report.unexpected.append((kind, f"{type(e).__name__}: {e}"))
        return
    finally:
        report.latencies.setdefault(kind, []).append(time.monotonic() - start)
        report.kinds[kind] += 1
    if got != want:
        report.wrong.append((kind, prompt, got, want))


def run_soak(
    url: str, name: str, references: dict, *, requests: int, clients: int, pid: int, warmup: float = 0.1
) -> SoakReport:
    """``requests`` requests of :data:`KINDS` in turn over :data:`PROMPTS`, from ``clients`` threads; the
    server's memory is read after the first ``warmup`` share and at the end."""
    report = SoakReport()
    stop = threading.Event()

    def health() -> None:
        while not stop.is_set():
            report.health_checks += 1
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=TIMEOUT_S) as r:
                    report.health_failures += r.status != 200
            except Exception:
                report.health_failures += 1
            stop.wait(HEALTH_EVERY_S)

    plan = list(itertools.islice(zip(itertools.cycle(KINDS), itertools.cycle(PROMPTS)), requests))
    warm = max(1, int(requests * warmup))
    poller = threading.Thread(target=health, daemon=True)
    start = time.monotonic()
    poller.start()
    try:
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(lambda kp: _one(url, name, kp[0], kp[1], references[kp[1]], report), plan[:warm]))
            report.rss_warm = server_rss(pid)
            list(pool.map(lambda kp: _one(url, name, kp[0], kp[1], references[kp[1]], report), plan[warm:]))
        report.rss_after = server_rss(pid)
    finally:
        stop.set()
        poller.join(TIMEOUT_S)
    report.seconds = time.monotonic() - start
    return report
