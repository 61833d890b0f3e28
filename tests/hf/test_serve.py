"""``python -m torch_kvoffload.serve``: transformers' OpenAI-compatible server on an offloaded model.

A tiny DeepseekV32 (8 indexer heads, ``index_topk`` 8 below the prompt lengths, so the selection is
sparse) and a word-level tokenizer are saved to a temporary directory; the server runs in a subprocess on
127.0.0.1. Reference: per-prompt greedy ``generate()`` of the unmodified model loaded from the same
directory. The word-level tokenizer decodes ids to space-separated words, one per id, so equal text means
equal generated tokens. What differs between transformers' server designs (``server.server_design()``: 5.24
loads the model in the server's process, 5.25 in an engine process of its own) is named per design below.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pickle
import re
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.cli.serving.model_manager")
pytest.importorskip("openai")

from support.hf_models import SMALL, build_model, indexer_boundary_ties
from support.serving import EXIT_TIMEOUT_S, START_TIMEOUT_S, run_module, running_server, save_model_dir, words

from torch_kvoffload import serve
from torch_kvoffload.integrations.hf import server

#: Seconds one HTTP request may take (the first one builds the continuous-batching state).
REQUEST_TIMEOUT_S = 60.0
NEW_TOKENS = 8
COMPLETION_PROMPTS = ((12, 0), (20, 1), (9, 2))  # (length, seed)
CHAT_PROMPTS = ((10, 3), (16, 4), (13, 5))
STREAM_PROMPT = (14, 6)  # a streamed completion
# Why: 16 tokens per step (passed to transformers' continuous batching) make the longer prompts' prefills
# take several steps, mixed with the other requests' decode steps.
CB_ARGS = ("--cb-max-batch-tokens", "16")
MAX_REQUEST_TOKENS = 40  # prompt + max_tokens of one request (serving.max_request_tokens)
SERVING_CONFIG = {
    "layerwise": {},
    "sparse": {},
    "serving": {"max_request_tokens": MAX_REQUEST_TOKENS, "max_requests": 4},
}
DESIGN = server.server_design()
#: The log's line for a request served with continuous batching, and for one served without, per design:
#: 5.24 logs a warning per request, 5.25 an info line (``--log-level info``, which the server runs with).
REQUEST_LOG = {
    server.IN_PROCESS: ("CB: True", "CB: False"),
    server.ENGINE_PROCESS: ("prompt tokens, continuous batching,", "prompt tokens, generate,"),
}[DESIGN]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_dir(tmp_path_factory.mktemp("v32"))


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """``(base_url, log_path)`` of a running server; stopped (SIGTERM, then SIGKILL) when the module ends."""
    tmp = tmp_path_factory.mktemp("serve")
    with running_server(model_dir, tmp, SERVING_CONFIG, "--log-level", "info", *CB_ARGS) as (url, log, _):
        yield url, log


def _reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Per-prompt greedy ``generate()`` of the unmodified model, completion prompts (the streamed one last)
    then chat prompts:
    prompt ids, generated ids and their text; checks no DSA top-k boundary tie makes the selection implementation-defined."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [tok(words(n, s))["input_ids"] for n, s in (*COMPLETION_PROMPTS, STREAM_PROMPT)]
    prompts += [
        tok.apply_chat_template(
            [{"role": "user", "content": words(n, s)}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for n, s in CHAT_PROMPTS
    ]
    tokens, sequences = [], []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0]
            tokens.append(out[len(p) :].tolist())
            sequences.append(out)
    assert indexer_boundary_ties(model, sequences) == 0
    return prompts, tokens, [tok.decode(t, skip_special_tokens=True) for t in tokens]


def test_concurrent_requests_equal_per_prompt_generate(served, model_dir: Path) -> None:
    from openai import OpenAI

    url, log = served
    prompts, tokens, texts = _reference(model_dir)
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    name = str(model_dir)
    assert [m.id for m in client.models.list().data] == [name]

    def complete(prompt: tuple[int, int]):
        return client.completions.create(
            model=name, prompt=words(*prompt), max_tokens=NEW_TOKENS, temperature=0
        )

    def chat(prompt: tuple[int, int]):
        return client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": words(*prompt)}],
            max_tokens=NEW_TOKENS,
            temperature=0,
        )

    def stream(prompt: tuple[int, int]) -> str:
        chunks = client.completions.create(
            model=name, prompt=words(*prompt), max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(len(COMPLETION_PROMPTS) + len(CHAT_PROMPTS) + 1) as pool:
        completions = [pool.submit(complete, p) for p in COMPLETION_PROMPTS]
        streamed = pool.submit(stream, STREAM_PROMPT)
        chats = [pool.submit(chat, p) for p in CHAT_PROMPTS]
        completions = [f.result() for f in completions]
        streamed = streamed.result()
        chats = [f.result() for f in chats]

    k = len(completions)
    assert streamed == texts[k]
    del prompts[k], tokens[k], texts[k]
    for got, prompt, ids, text in zip(completions, prompts[:k], tokens[:k], texts[:k], strict=True):
        assert (got.choices[0].text, got.usage.prompt_tokens) == (text, len(prompt))
        assert got.usage.completion_tokens == len(ids)
    for got, prompt, ids, text in zip(chats, prompts[k:], tokens[k:], texts[k:], strict=True):
        assert (got.choices[0].message.content, got.usage.prompt_tokens) == (text, len(prompt))
        assert got.usage.completion_tokens == len(ids)
    import openai

    # A request naming another model is refused.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=f"{name}-other", prompt=words(8, 7), max_tokens=2, temperature=0)
    # The --config file reached the served model: its serving.max_request_tokens refuses one token more.
    room = MAX_REQUEST_TOKENS - 8
    client.completions.create(model=name, prompt=words(8, 7), max_tokens=room, temperature=0)
    with pytest.raises(openai.BadRequestError) as too_long:  # the request's fault: HTTP 400 naming the limit
        client.completions.create(model=name, prompt=words(8, 7), max_tokens=room + 1, temperature=0)
    # transformers logs each request with whether continuous batching serves it.
    served_log = log.read_text()
    with_cb, without_cb = REQUEST_LOG
    assert served_log.count(with_cb) == len(completions) + 1 + len(chats) + 2, served_log
    assert without_cb not in served_log
    assert f"serving.max_request_tokens={MAX_REQUEST_TOKENS}" in too_long.value.response.text


def test_bad_requests_fail_alone_and_a_client_id_is_never_the_key(served, model_dir: Path) -> None:
    """An empty prompt and an over-long one get an HTTP 400 naming the reason; two concurrent streams sent
    with one ``X-Request-ID`` each get their own tokens (the header is echoed, never the key); the worker
    lives on: ``/health`` answers 200 and a later request gets the unmodified model's tokens."""
    import openai
    from openai import OpenAI

    url, _ = served
    _, _, texts = _reference(model_dir)
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    name = str(model_dir)

    def stream(prompt: tuple[int, int]) -> tuple[str, str]:
        body = {
            "model": name,
            "prompt": words(*prompt),
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Request-ID": "same"},
        )
        text = ""
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as r:
            echoed = r.headers.get("x-request-id")
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return echoed, text

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(stream, COMPLETION_PROMPTS[:2]))
    assert got == [("same", texts[0]), ("same", texts[1])]
    with pytest.raises(openai.BadRequestError) as empty:
        client.completions.create(model=name, prompt="", max_tokens=NEW_TOKENS, temperature=0)
    assert "empty prompt" in empty.value.response.text
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(
            model=name, prompt=words(8, 7), max_tokens=MAX_REQUEST_TOKENS, temperature=0
        )
    assert f"serving.max_request_tokens={MAX_REQUEST_TOKENS}" in long.value.response.text

    with urllib.request.urlopen(f"{url}/health", timeout=REQUEST_TIMEOUT_S) as r:
        assert r.status == 200
    late = client.completions.create(
        model=name, prompt=words(*COMPLETION_PROMPTS[2]), max_tokens=NEW_TOKENS, temperature=0
    )
    assert late.choices[0].text == texts[2]


def test_transformers_names_exist() -> None:
    """The transformers names the installed release's server design relies on: fails loudly when transformers
    renames them (``server.TRANSFORMERS_NAMES``, ``server.SERVE_KWARGS``)."""
    for module, attr, members in server.TRANSFORMERS_NAMES[DESIGN]:
        cls = getattr(importlib.import_module(module), attr)
        missing = [m for m in members if not callable(getattr(cls, m, None))]
        assert not missing, f"{module}.{attr} has no {missing}"
    from transformers.cli.serve import Serve

    params = inspect.signature(Serve.__init__).parameters
    kwargs = server.SERVE_KWARGS[DESIGN]
    assert set(kwargs) <= set(params), set(kwargs) - set(params)
    if DESIGN == server.IN_PROCESS:
        _check_in_process_names()
    else:
        _check_engine_process_names()


def _check_in_process_names() -> None:
    from transformers.cli.serve import Serve
    from transformers.cli.serving.model_manager import ModelManager

    # Why: the swap of ModelManager only reaches Serve if Serve looks it up in that module when built.
    assert "from .serving.model_manager import ModelManager" in inspect.getsource(Serve.__init__)
    assert list(inspect.signature(ModelManager._load_model).parameters)[:2] == [
        "self",
        "model_id_and_revision",
    ]
    assert list(inspect.signature(ModelManager._load_processor).parameters)[:2] == [
        "self",
        "model_id_and_revision",
    ]
    source = inspect.getsource(ModelManager.load_model_and_processor)
    assert "self._load_processor(" in source and "self._load_model(" in source
    # run_server waits for the uvicorn thread start_server makes and forwards signals to uvicorn's handler.
    assert "self._thread = " in inspect.getsource(Serve.start_server)
    import uvicorn

    assert callable(uvicorn.Server.handle_exit)


def _check_engine_process_names() -> None:
    from transformers.cli.serve import Serve
    from transformers.cli.serving.model_manager import EngineClient, ModelLoader, ModelManager

    # Why: run_server's Serve.run puts its loader in self.loader, which __init__ set and run hands on.
    init, run = inspect.getsource(Serve.__init__), inspect.getsource(Serve.run)
    assert "self.loader = ModelLoader(" in init and "self.run()" in init
    assert "self.loader," in run
    # The engine process loads with (a pickled copy of) the loader, the server's process reads the processor.
    assert "partial(loader.load_model_and_processor," in inspect.getsource(EngineClient.start_process)
    assert "loader.load_processor(model_id)" in inspect.getsource(EngineClient.__init__)
    assert list(inspect.signature(ModelLoader.load_model_and_processor).parameters) == [
        "self",
        "model_id",
        "on_progress",
    ]
    assert list(inspect.signature(ModelLoader.load_processor).parameters) == ["self", "model_id"]
    # transformers refuses a request naming another model than force_model (the model name check).
    assert "model != self.force_model" in inspect.getsource(ModelManager.get_engine)


@pytest.mark.skipif(DESIGN != server.IN_PROCESS, reason="transformers >= 5.25: the engine loads the model")
def test_preloaded_manager_serves_only_its_model() -> None:
    model, processor = object(), object()
    manager = server.preloaded_manager_class("tiny", model, processor)()
    key = manager.process_model_name("tiny")
    assert manager._load_model(key) is model
    assert manager._load_processor(key) is processor
    with pytest.raises(ValueError, match="serves only 'tiny'"):
        manager._load_model(manager.process_model_name("other"))


def _mark_prepared(model):
    model.kvoffload_test_prepared = True
    return model


@pytest.mark.skipif(DESIGN != server.ENGINE_PROCESS, reason="transformers < 5.25 has no engine process")
def test_engine_loader_loads_and_prepares_the_directory(model_dir: Path, tmp_path: Path) -> None:
    refusal = tmp_path / "refusal"
    loader = pickle.loads(
        pickle.dumps(server.engine_loader(str(model_dir), _mark_prepared, "cpu", str(refusal)))
    )
    assert loader.load_processor("any").is_fast
    model, tokenizer = loader.load_model_and_processor("any")
    assert model.kvoffload_test_prepared and not model.training and tokenizer.is_fast
    assert not refusal.exists()
    bad = server.engine_loader(str(tmp_path / "nope"), _mark_prepared, "cpu", str(refusal))
    with pytest.raises(ValueError, match="no such directory"):
        bad.load_model_and_processor("any")
    assert "no such directory" in refusal.read_text()


@pytest.fixture
def held_port():
    """A port the test listens on: a server that tried to open it would fail with "address in use"."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# A refused configuration exits before the port opens: in process (run_server never called) for each
# fault here; as the real command, with the port held, in test_a_bad_serving_plan_exits_before_listening.
@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ('{"block_size": 0}', "block_size"),
        ('{"no_such_field": 1}', "no_such_field"),
        ('{"serving": {"max_requests": 0}}', "max_requests"),
        ("[1, 2]", "expected a JSON object"),
        ("{not json", "not valid JSON"),
        ("/no/such/config.json", "neither a JSON object nor an existing file"),
    ],
)
def test_bad_config_is_named(
    config: str, needle: str, model_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuse_to_listen(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        serve.main([str(model_dir), "--config", config])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "--config" in err, err


# serving plans refused before the port opens: (config, what the message names)
BAD_PLANS = [
    ({"sparse": {}, "serving": {"device_kv_budget": 1}}, "serving.device_kv_budget=1"),
    ({"sparse": {"capacity": 4}}, "capacity"),  # below the model's index_topk (8)
    (
        {"sparse": {"host_pool_blocks": 2}, "serving": {"max_requests": 4, "max_request_tokens": 256}},
        "sparse.host_pool_blocks=2",
    ),
    # 8 requests of 4M tokens: transformers' step buffers alone would be 512 x 32M x 4 bytes (65 GB)
    ({"sparse": {}, "serving": {"max_request_tokens": 4 * 10**6}}, "serving.max_request_tokens=4000000"),
    # offload under memory pressure: the budget holds the requests offloaded (the server sized once by it),
    # or it is refused
    (
        {"sparse": {"offload": "auto"}, "serving": {"max_requests": 64, "device_kv_budget": 10**6}},
        "serving.device_kv_budget=1000000",
    ),
]


@pytest.mark.parametrize(
    ("config", "needle"), BAD_PLANS, ids=["budget", "capacity", "host_pool", "huge", "auto-budget"]
)
def test_a_serving_plan_that_cannot_hold_is_refused_by_prepare(config: dict, needle: str) -> None:
    model = build_model("deepseek_v32", index_n_heads=8, **SMALL)
    with pytest.raises(ValueError, match=re.escape(needle)):
        serve.prepare(model, config=config, cb_max_batch_tokens=None)
    good = build_model("deepseek_v32", index_n_heads=8, **SMALL)
    assert serve.prepare(good, config=SERVING_CONFIG, cb_max_batch_tokens=16) is good  # and a good plan holds
    auto = build_model("deepseek_v32", index_n_heads=8, **SMALL)
    config = {"sparse": {"offload": "auto"}, "serving": {"max_requests": 4, "device_kv_budget": 10**7}}
    assert serve.prepare(auto, config=config, cb_max_batch_tokens=16) is auto


def test_a_bad_serving_plan_exits_before_listening(model_dir: Path, held_port: int, tmp_path: Path) -> None:
    argv = [
        str(model_dir),
        "--port",
        str(held_port),
        "--config",
        json.dumps(BAD_PLANS[0][0]),
        "--device",
        "cpu",
    ]
    code, err = run_module("torch_kvoffload.serve", argv, tmp_path, EXIT_TIMEOUT_S)
    assert code == 2, err
    assert BAD_PLANS[0][1] in err, err
    assert "Uvicorn" not in err and "address already in use" not in err, err


@pytest.mark.parametrize("tokens", ["0", "-3"])
def test_cb_max_batch_tokens_below_one_is_refused(
    tokens: str, model_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuse_to_listen(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        serve.main([str(model_dir), "--cb-max-batch-tokens", tokens])
    assert exit_info.value.code == 2
    assert "--cb-max-batch-tokens" in capsys.readouterr().err


def test_config_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(SERVING_CONFIG))
    assert server.read_offload_config(str(path)).serving.max_requests == 4
    assert server.read_offload_config(None) is None


def _refuse_to_listen(monkeypatch: pytest.MonkeyPatch) -> None:
    def run_server(*args, **kwargs):
        raise AssertionError("run_server was called")

    monkeypatch.setattr(server, "run_server", run_server)


def _bad_model_dir(case: str, model_dir: Path, bad: Path) -> str:
    """Makes ``bad`` a model directory with the fault ``case``; returns what the error names."""
    if case != "missing":
        bad.mkdir()
    if case in ("no_tokenizer", "no_weights"):
        (bad / "config.json").write_text((model_dir / "config.json").read_text())
    if case == "no_weights":
        for f in model_dir.glob("tokenizer*"):
            (bad / f.name).write_text(f.read_text())
    return {
        "missing": "no such directory",
        "empty": "no config.json",
        "no_tokenizer": "no tokenizer",
        "no_weights": "could not load the model",
    }[case]


# Why: the weights are read by run_server (from transformers 5.25 on in the engine process), "no_weights"
# only in test_bad_model_dir_exits_before_listening.
@pytest.mark.parametrize("case", ["missing", "empty", "no_tokenizer"])
def test_bad_model_dir_is_named(
    case: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuse_to_listen(monkeypatch)
    bad = tmp_path / "m"
    needle = _bad_model_dir(case, model_dir, bad)
    with pytest.raises(SystemExit) as exit_info:
        serve.main([str(bad), "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and str(bad) in err, err


# the real command with the port held: a directory whose weights fail to load (the faults found before any
# load are named in process, test_bad_model_dir_is_named)
@pytest.mark.parametrize("case", ["no_weights"])
def test_bad_model_dir_exits_before_listening(
    case: str, model_dir: Path, tmp_path: Path, held_port: int
) -> None:
    bad = tmp_path / "m"
    needle = _bad_model_dir(case, model_dir, bad)
    argv = [str(bad), "--port", str(held_port), "--device", "cpu"]
    code, err = run_module("torch_kvoffload.serve", argv, tmp_path, EXIT_TIMEOUT_S)
    assert code == 2, err
    error = err.strip().splitlines()[-1]
    assert error.startswith("python -m torch_kvoffload.serve: error: MODEL_DIR"), err
    assert needle in error and str(bad) in error, err
    assert "Uvicorn" not in err and "address already in use" not in err, err


def test_taken_port_exits_1(model_dir: Path, held_port: int, tmp_path: Path) -> None:
    argv = [
        str(model_dir),
        "--port",
        str(held_port),
        "--device",
        "cpu",
        "--config",
        json.dumps(SERVING_CONFIG),
    ]
    code, err = run_module("torch_kvoffload.serve", argv, tmp_path, START_TIMEOUT_S)
    assert code == 1, err
    assert f"could not listen on 127.0.0.1:{held_port}" in err, err
