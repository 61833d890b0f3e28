"""Every ```python block of README.md and docs/*.md runs, as written, on tiny random models.

The blocks are collected with ``mktestdocs.grab_code_blocks`` (a fence whose info string is exactly
``python``) and executed here, so that each document gets the objects its reader already has:

* **Blocks of a document run in order in one namespace per process**: what a block defines (imports,
  ``config``, ``rt``) is there for the next block, as in a reader's session.
* **The reader's own objects** (``model``, ``input_ids``, ``mask``, ``token_ids``, ``specs`` ...) come
  from the document's entry in :data:`DOCS`: a tiny random Hugging Face model (``tests/support/hf_models.py``) or
  small tensors. Each one is made fresh before every block that uses it: every example in the docs
  starts from the reader's unmodified model (``model = torch_kvoffload.offload(model)`` in one block
  and ``torch_kvoffload.compile(model, config)`` in the next are two alternatives, not a sequence).
* **A block whose first line is one of these comments runs in another process** (spawned; the other
  blocks of the document run in this one):

  - ``# on every rank ...``: in each of :data:`WORLD` processes joined by gloo on 127.0.0.1
    (``torch.distributed`` initialised, as the docs say);
  - ``# decode process ...`` / ``# prefill process ...``: the two sides of a P/D pair, concurrently;
    the document's entry gives them the channels its text leaves to the reader (``send_to_prefill``,
    ``receive_tickets``, ...) as queues between the two.

  The processes of a document run its blocks for them in order, each in its own namespace. Every wait
  they make is bounded by a configured timeout (gloo's, the channels', the library's own), so once one
  process failed the others are given those timeouts to finish and are then terminated; nothing here
  waits on a wall-clock guess.

Nothing is skipped: a block that does not run here fails the test. Text that is not Python uses a
fence naming its language (``bash``, ``cpp``) or a plain fence (diagrams, formulas);
:func:`test_python_fences_are_collected` fails on a Python-looking fence that mktestdocs would not
collect (``py``, ``pycon``, ``python title=...``), so no Python block is left out silently.
"""

from __future__ import annotations

import ast
import contextlib
import io
import multiprocessing as mp
import multiprocessing.connection
import queue
import re
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mktestdocs
import pytest
import torch
from support.gloo import master_store

from torch_kvoffload._utils import free_port

ROOT = Path(__file__).resolve().parents[1]
#: The documents whose Python blocks run (performance-notes.md holds measurements, no examples).
DOC_PATHS = sorted(
    [ROOT / "README.md", *(p for p in (ROOT / "docs").glob("*.md") if p.name != "performance-notes.md")]
)
#: Processes of a ``# on every rank`` block.
WORLD = 2
#: gloo's timeout for the ``# on every rank`` processes (their collectives fail after it).
GLOO_TIMEOUT_S = 60.0
#: The ``role.wait(timeout=...)`` of the P/D Hugging Face example (docs/disaggregation.md).
PD_WAIT_S = 60.0

_MARKERS = {
    "# on every rank": "rank",
    "# decode process": "decode",
    "# prefill process": "prefill",
}


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks of ``path``, as mktestdocs collects them."""
    return mktestdocs.grab_code_blocks(path.read_text(), lang="python")


def process_of(block: str) -> str:
    """Where a block runs: ``"main"`` (this process), ``"rank"``, ``"decode"`` or ``"prefill"``."""
    first = block.lstrip("\n").split("\n", 1)[0].strip().lower()
    for marker, process in _MARKERS.items():
        if first.startswith(marker):
            return process
    return "main"


# ------------------------------------------------------------------------------ the reader's objects


@dataclass
class Ctx:
    """What a document's reader factories may use: the process, its rank, the P/D channels, the port."""

    process: str
    rank: int = 0
    channels: dict[str, Any] = field(default_factory=dict)
    kv_port: int = 0
    peer_timeout_s: float = 0.0


def _tiny(family: str = "deepseek_v32", layers: int = 2):
    from support.hf_models import build_model

    # two layers keep every example fast; the indexer of the V3.2 config has 32 heads (>= 8); its latent and
    # indexer widths are multiples of 128, as DeepSeek's, so the FP8 examples run on the same model
    fp8_widths = {"kv_lora_rank": 128, "index_head_dim": 128} if family == "deepseek_v32" else {}
    return build_model(family, num_hidden_layers=layers, **fp8_widths)


def _batch():
    from support.hf_models import left_padded_batch

    return left_padded_batch([12, 9])


def _hf_reader(ctx: Ctx, layers: int = 2) -> dict[str, Callable[[], Any]]:
    family = "deepseek_v3" if ctx.process == "rank" else "deepseek_v32"
    return {
        "model": lambda: _tiny(family, layers),
        "input_ids": lambda: _batch()[0],
        "mask": lambda: _batch()[1],
    }


def _compiling_reader(ctx: Ctx) -> dict[str, Callable[[], Any]]:
    """:func:`_hf_reader` with a one-layer model: a document that compiles many graphs (Dynamo traces every
    layer of each)."""
    return _hf_reader(ctx, layers=1)


def _layerwise_reader(ctx: Ctx) -> dict[str, Callable[[], Any]]:
    from support.mla_stack import MLAConfig, MLAStack

    cfg = MLAConfig(num_layers=4, num_blocks=16)
    stack = MLAStack(cfg)
    g = torch.Generator().manual_seed(0)
    # two requests sharing their first block; 10 and 7 tokens of 4-token blocks
    shared = torch.randint(0, cfg.vocab, (4,), generator=g).tolist()
    tokens = [shared + torch.randint(0, cfg.vocab, (6,), generator=g).tolist(), [*shared, 1, 2, 3]]
    return {
        "specs": stack.cache_specs,
        "N": lambda: cfg.num_layers,
        "token_ids": lambda: [list(t) for t in tokens],
        "block_tables": lambda: [[0, 1, 2], [3, 4]],
        "model": lambda: stack,
    }


def _store_reader(ctx: Ctx) -> dict[str, Callable[[], Any]]:
    from support.mla_stack import MLAConfig, MLAStack

    token_ids = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    full = len(token_ids) // 128
    return {
        "token_ids": lambda: list(token_ids),
        "specs": lambda: MLAStack(MLAConfig(num_layers=2)).cache_specs(),
        "kv": lambda: torch.randn(full, 128, 576).to(torch.bfloat16),
        "outs": lambda: [torch.empty(128, 576, dtype=torch.bfloat16) for _ in range(full)],
    }


def _kvpp_reader(ctx: Ctx) -> dict[str, Callable[[], Any]]:
    return {
        "device": lambda: torch.device("cpu"),
        "stage_layers": lambda: list(range(4)),
        "available_bytes": lambda: 64 << 20,
        "has_history": lambda: True,
        "block_tables": lambda: [[0, 1, 2], [5, 6]],
    }


def _pd_reader(ctx: Ctx) -> dict[str, Callable[[], Any]]:
    if ctx.process == "main":  # the runtime-level sketch: one prefill rank and one decode rank
        import support.pd_helpers as h

        from torch_kvoffload.layerwise import plan_layer_buffers
        from torch_kvoffload.sparse import HostKVPool
        from torch_kvoffload.store import create_store

        return {
            "p": lambda: 1,
            "t": lambda: 0,
            "n": lambda: h.L,
            "bs": lambda: h.BS,
            "kv_port": lambda: ctx.kv_port,
            "plan": lambda: plan_layer_buffers(h.specs(), 2, [0]),
            "store": lambda: create_store("local", capacity_bytes=1 << 20),
            "pool": lambda: HostKVPool.create(h.L, h.POOL_BLOCKS, h.BS, h.R, h.P, h.KV_DTYPE),
            "indexer_caches": lambda: [
                tuple(torch.zeros(h.IDX_BLOCKS, h.BS, *row, dtype=dt) for row, dt in h.IDX_ROWS)
                for _ in range(h.L)
            ],
        }
    tickets_q, first_q = ctx.channels["tickets"], ctx.channels["first"]
    timeout = ctx.peer_timeout_s
    reader: dict[str, Callable[[], Any]] = {
        "build": lambda: _tiny,
        "kv_port": lambda: ctx.kv_port,
        "input_ids": lambda: _batch()[0],
        "attention_mask": lambda: _batch()[1],
    }
    if ctx.process == "decode":
        reader["send_to_prefill"] = lambda: tickets_q.put
        reader["receive_first_token"] = lambda: lambda: first_q.get(timeout=timeout)
    else:
        reader["receive_tickets"] = lambda: lambda: tickets_q.get(timeout=timeout)
        reader["send_to_decode"] = lambda: first_q.put
    return reader


def _no_reader(ctx: Ctx) -> dict[str, Callable[[], Any]]:
    return {}


def _pd_timeout() -> float:
    """How long a P/D process may wait for its peer: the handshake, then the document's ``role.wait``."""
    from torch_kvoffload.pd import PDConfig

    cfg = PDConfig(role="decode")
    return cfg.handshake_timeout_s + PD_WAIT_S


@dataclass(frozen=True)
class Doc:
    """How one document runs: its reader's objects, what to close after its blocks (per process), and
    how long a process may wait for a peer (``None``: a single process); ``prints``: text that what the
    document's blocks print in this process must contain (what its prose says they show)."""

    reader: Callable[[Ctx], dict[str, Callable[[], Any]]] = _no_reader
    close: tuple[str, ...] = ()
    peer_timeout_s: Callable[[], float] | None = None
    prints: tuple[str, ...] = ()
    #: the ``slow`` tier (``make test-fast`` leaves it out): documents that compile models; those whose
    #: blocks spawn processes (a ``peer_timeout_s``) are slow too
    slow: bool = False


#: The head of ``explain``'s report once a graph was compiled (before: "no graph compiled yet").
_EXPLAINED = "graph(s) compiled with the kvoffload passes"

DOCS: dict[str, Doc] = {
    "README.md": Doc(_hf_reader, prints=("'device_kv_bytes'", _EXPLAINED, "kvoffload::copy_rows")),
    "docs/adding-an-op.md": Doc(),
    "docs/compile.md": Doc(_compiling_reader, prints=(_EXPLAINED, "'device_kv_bytes'"), slow=True),
    "docs/core.md": Doc(),
    "docs/device.md": Doc(),
    "docs/disaggregation.md": Doc(
        _pd_reader, close=("receiver", "runtime", "transport", "role", "pool"), peer_timeout_s=_pd_timeout
    ),
    "docs/huggingface.md": Doc(_hf_reader, peer_timeout_s=lambda: GLOO_TIMEOUT_S),
    "docs/kvpp.md": Doc(_kvpp_reader, close=("rt",), peer_timeout_s=lambda: GLOO_TIMEOUT_S),
    "docs/layerwise.md": Doc(_layerwise_reader, close=("rt",)),
    "docs/memory-pressure.md": Doc(_hf_reader, prints=("\n2\n",)),
    "docs/prefix-cache.md": Doc(prints=("'prefix_store_tokens': 96",)),
    "docs/serving.md": Doc(),
    "docs/sparse-decode.md": Doc(),
    "docs/sparse-ops.md": Doc(),
    "docs/store.md": Doc(_store_reader),
}


# ----------------------------------------------------------------------------------------- running


def _used_names(source: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}


def run_blocks(doc: str, blocks: list[tuple[int, str]], ctx: Ctx) -> str:
    """Run ``blocks`` (index in the document, source) in order in one namespace, the reader's objects
    made fresh before each block that names them; close the document's ``close`` names afterwards.
    Returns what the blocks printed."""
    reader = DOCS[doc].reader(ctx)
    ns: dict[str, Any] = {"__name__": "__main__"}
    printed = io.StringIO()
    try:
        for index, source in blocks:
            for name in _used_names(source) & reader.keys():
                ns[name] = reader[name]()
            code = compile(source, f"<{doc} python block {index}>", "exec")
            try:
                with contextlib.redirect_stdout(printed):
                    exec(code, ns)
            except BaseException as e:
                raise AssertionError(
                    f"{doc}: python block {index} ({ctx.process}) failed: {type(e).__name__}: {e}\n"
                    f"--- block ---\n{source}"
                ) from e
    finally:
        for name in DOCS[doc].close:
            obj = ns.get(name)
            if obj is not None and callable(getattr(obj, "close", None)):
                obj.close()
    return printed.getvalue()


def _child(
    doc: str,
    process: str,
    rank: int,
    blocks: list,
    channels: dict,
    kv_port: int,
    gloo_port: int,
    timeout_s: float,
    results: Any,
) -> None:
    """Body of a spawned process: run its blocks, report ``(process, rank, error or None)``."""
    error = None
    try:
        torch.set_num_threads(1)
        if process == "rank":
            import torch.distributed as dist
            from support.gloo import init_gloo

            init_gloo(rank, WORLD, gloo_port, timeout_s)
        try:
            run_blocks(doc, blocks, Ctx(process, rank, channels, kv_port, timeout_s))
        finally:
            if process == "rank":
                dist.destroy_process_group()
    except BaseException:
        error = traceback.format_exc()
    results.put((process, rank, error))


def run_processes(doc: str, groups: dict[str, list[tuple[int, str]]], kv_port: int) -> None:
    """Spawn the processes of ``groups`` (process kind -> blocks), wait for them, raise their errors.

    No deadline while every process is running: each of their waits is bounded by the document's
    ``peer_timeout_s``. Once one failed or exited, the others get that long (plus the same again for
    their own closing waits) before they are terminated.
    """
    peer_timeout = DOCS[doc].peer_timeout_s
    assert peer_timeout is not None, f"{doc}: blocks for other processes need a Doc.peer_timeout_s"
    timeout_s = peer_timeout()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    channels = {"tickets": ctx.Queue(), "first": ctx.Queue()}
    gloo = master_store(timeout_s)  # the ranks' rendezvous, served here until they are done
    gloo_port = gloo.port
    procs = []
    for process, blocks in groups.items():
        for rank in range(WORLD if process == "rank" else 1):
            args = (doc, process, rank, blocks, channels, kv_port, gloo_port, timeout_s, results)
            procs.append(ctx.Process(target=_child, args=args, name=f"{doc}:{process}{rank}", daemon=True))
    for p in procs:
        p.start()
    errors: list[str] = []
    grace_s = 2 * timeout_s
    try:
        pending = {p.sentinel: p for p in procs}
        deadline: float | None = None  # set when the first process ended
        while pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mp.connection.wait(list(pending), timeout=wait_s)
            if not ready:
                break  # the survivors outlived every timeout of their waits
            for s in ready:
                pending.pop(s).join()
            if deadline is None:
                deadline = time.monotonic() + grace_s
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
                errors.append(f"{p.name}: still running {grace_s:.0f} s after a peer ended; terminated")
    reported = set()
    while len(reported) < len(procs):
        try:
            process, rank, error = results.get(timeout=1.0)
        except queue.Empty:
            break
        reported.add(f"{doc}:{process}{rank}")
        if error is not None:
            errors.append(f"{process} {rank}:\n{error}")
    errors += [f"{p.name}: exit code {p.exitcode}, no report" for p in procs if p.name not in reported]
    if errors:
        raise AssertionError(f"{doc}: " + "\n".join(errors))


# -------------------------------------------------------------------------------------------- tests


def test_every_document_has_an_entry() -> None:
    assert sorted(DOCS) == sorted(_name(p) for p in DOC_PATHS)


_FENCE = re.compile(r"^\s*```+\s*(\S*)(.*)$")


@pytest.mark.parametrize("path", DOC_PATHS, ids=_name)
def test_python_fences_are_collected(path: Path) -> None:
    """Every fence that looks like Python is one mktestdocs collects (info string exactly ``python``)."""
    opening, inside = [], False
    for line in path.read_text().splitlines():
        m = _FENCE.match(line)
        if m is None:
            continue
        if not inside:
            opening.append((m.group(1).lower(), m.group(2).strip()))
        inside = not inside
    assert not inside, f"{_name(path)}: unclosed code fence"
    pythonish = [
        (lang, rest) for lang, rest in opening if lang in {"py", "python", "python3", "pycon", "ipython"}
    ]
    odd = [f"```{lang} {rest}".strip() for lang, rest in pythonish if lang != "python" or rest]
    assert not odd, f"{_name(path)}: fences mktestdocs would not run: {odd} (use a bare ```python)"
    assert len(python_blocks(path)) == len(pythonish)


def _doc_param(path: Path):
    doc = DOCS[_name(path)]
    slow = doc.slow or doc.peer_timeout_s is not None
    return pytest.param(path, id=_name(path), marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("path", [_doc_param(p) for p in DOC_PATHS])
def test_document_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The document's Python blocks run; what they print holds what the prose says it shows."""
    # files the examples leave in the temporary directory (P/D rendezvous, its key) stay in tmp_path
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the spawned processes
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this one
    doc = _name(path)
    blocks = python_blocks(path)
    groups: dict[str, list[tuple[int, str]]] = {}
    for index, source in enumerate(blocks):
        groups.setdefault(process_of(source), []).append((index, source))
    torch._dynamo.reset()  # Dynamo's recompile limit is per code object: start each document afresh
    kv_port = free_port()
    printed = run_blocks(doc, groups.pop("main", []), Ctx("main", kv_port=kv_port))
    missing = [text for text in DOCS[doc].prints if text not in printed]
    assert not missing, f"{doc}: the examples did not print {missing}; they printed:\n{printed}"
    if groups:
        run_processes(doc, groups, kv_port)


@pytest.mark.parametrize(
    ("block", "process"),
    [
        ("x = 1\n", "main"),
        ("\n# on every rank, after init_process_group\nx = 1\n", "rank"),
        ("# Decode process: sparse decode offload\n", "decode"),
        ("# prefill process\n", "prefill"),
        ("x = 1  # on every rank\n", "main"),  # only a first-line comment names a process
    ],
)
def test_process_of(block: str, process: str) -> None:
    assert process_of(block) == process


def test_a_failing_block_names_its_document_and_index() -> None:
    blocks = [(0, "x = 1\n"), (1, "assert x == 2, 'x is not 2'\n"), (2, "raise SystemExit('not reached')\n")]
    with pytest.raises(
        AssertionError, match=r"docs/device\.md: python block 1 \(main\) failed: AssertionError: x is not 2"
    ):
        run_blocks("docs/device.md", blocks, Ctx("main"))
