"""A served tiny model for the server tests: its directory (weights and a word-level tokenizer), prompts as
words, and a server process started and stopped on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from torch_kvoffload._utils import free_port

#: Seconds the server may take from launch to answering ``/health`` (imports, load, offload).
START_TIMEOUT_S = 120.0
#: Seconds a stopped or failing server may take to exit.
EXIT_TIMEOUT_S = 60.0
#: Pause between two readiness probes (each a wait on the process, which ends early if it exits).
POLL_S = 0.2
VOCAB = 1000


def words(length: int, seed: int) -> str:
    """``length`` random words ``w{i}`` (ids 3 … VOCAB-1 of :func:`save_tokenizer`'s tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{i}" for i in torch.randint(3, VOCAB, (length,), generator=g).tolist())


def save_tokenizer(path: Path) -> None:
    """A fast word-level tokenizer: id ``i`` >= 3 is the word ``w{i}``, 0 / 1 / 2 are pad / bos / eos; the
    chat template joins the messages' contents and ends the prompt with ``w5``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
    )
    fast.save_pretrained(path)


def save_model_dir(path: Path) -> Path:
    """``path`` with a tiny DeepseekV32 (the 2-layer ``SMALL`` model, 8 indexer heads, ``index_topk`` 8) and
    :func:`save_tokenizer`'s tokenizer saved in it."""
    from support.hf_models import SMALL, build_model

    build_model("deepseek_v32", index_n_heads=8, **SMALL).save_pretrained(path)
    save_tokenizer(path)
    return path


def log_of(proc: subprocess.Popen, log: Path) -> str:
    return f"server exited with {proc.returncode}; its output:\n{log.read_text()}"


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Returns once ``url/health`` answers 200; ``AssertionError`` with the log if the server exits first or
    does not answer within :data:`START_TIMEOUT_S`."""
    for _ in range(int(START_TIMEOUT_S / POLL_S)):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=POLL_S * 5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        try:
            proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            continue
        raise AssertionError(log_of(proc, log))
    raise AssertionError(f"the server did not answer /health within {START_TIMEOUT_S} s:\n{log.read_text()}")


@contextmanager
def running_server(
    model_dir: Path, tmp: Path, config: dict, *args: str
) -> Iterator[tuple[str, Path, subprocess.Popen]]:
    """``(base_url, log_path, process)`` of ``python -m torch_kvoffload.serve model_dir`` with ``config`` on a
    free loopback port; on exit SIGTERM, then SIGKILL after :data:`EXIT_TIMEOUT_S` (an ``AssertionError``
    then, and when the exit status is not 0)."""
    path = tmp / "offload.json"
    path.write_text(json.dumps(config))
    log = tmp / "server.log"
    port = free_port()
    cmd = [sys.executable, "-m", "torch_kvoffload.serve", str(model_dir), "--port", str(port)]
    cmd += ["--config", str(path), "--device", "cpu", *args]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "TQDM_DISABLE": "1"}
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log)
        yield url, log, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"the server did not stop within {EXIT_TIMEOUT_S} s of SIGTERM:\n{log.read_text()}"
            ) from None
    assert proc.returncode == 0, log_of(proc, log)


def _run_module(module: str, argv: list[str], out_path: str) -> None:
    """A forked process's body: ``python -m module *argv``, its stdout and stderr into ``out_path``."""
    import runpy

    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)  # its sys.exit() is the exit code


def run_module(module: str, argv: list[str], out_dir: Path, timeout: float) -> tuple[int, str]:
    """``(exit code, stdout + stderr)`` of ``python -m module *argv`` in a process of its own, forked from
    the test session's forkserver (which imported torch, transformers and the package once: what a command
    line spends seconds importing is not what its tests check). The process is killed, and the test fails,
    when it runs past ``timeout`` seconds."""
    from support.pd_helpers import hf_context

    out = out_dir / f"{module}.out"
    # not a daemon: a server from transformers 5.25 on starts its engine in a process of its own
    proc = hf_context().Process(target=_run_module, args=(module, argv, str(out)), daemon=False)
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"python -m {module} {' '.join(argv)} still ran after {timeout} s")
    return proc.exitcode, out.read_text(errors="replace")
