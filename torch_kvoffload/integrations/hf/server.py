"""Serve a preloaded model with transformers' own OpenAI-compatible server, continuous batching on.

transformers 5.24 ships the server behind ``transformers serve --continuous-batching``
(:class:`transformers.cli.serve.Serve`): ``/v1/chat/completions``, ``/v1/completions`` and the rest, with
requests batched by the model's ``init_continuous_batching`` manager. It loads its model itself, by name,
through a ``ModelManager`` it builds inside ``Serve.__init__``; there is no way to hand it a model that was
prepared beforehand (offloaded, here). :func:`run_server` therefore builds ``Serve`` while the module
attribute ``transformers.cli.serving.model_manager.ModelManager`` names a subclass
(:func:`preloaded_manager_class`) whose ``_load_model`` and ``_load_processor`` return the preloaded model
and tokenizer for the served name, and puts the attribute back once ``Serve`` is built. The server is
otherwise transformers' own: its routes, handlers, continuous-batching manager and uvicorn.

``Serve`` runs uvicorn in a thread of its own (``non_blocking=True``, its ``start_server``): the calling
thread forwards SIGINT / SIGTERM to uvicorn's ``handle_exit``, waits for that thread (``Serve._thread``),
then calls ``Serve.kill_server``, which stops the continuous-batching worker (a non-daemon thread that
would otherwise keep the process alive).

Every transformers name this relies on is listed in :data:`TRANSFORMERS_NAMES`
(``tests/hf/test_serve.py`` checks them against the installed transformers).

:func:`read_offload_config` and :func:`load_model_dir` check the command line's inputs before anything
listens, each error a ``ValueError`` naming what is wrong.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch_kvoffload.core.config import OffloadConfig

__all__ = [
    "SERVE_KWARGS",
    "TRANSFORMERS_NAMES",
    "default_device",
    "load_model_dir",
    "preloaded_manager_class",
    "read_offload_config",
    "run_server",
]

#: ``(module, attribute, members)``: the transformers names the server integration uses or overrides.
#: ``ModelManager`` is replaced (while ``Serve`` is built) by a subclass overriding ``_load_model`` and
#: ``_load_processor``; of ``Serve``, its constructor keywords and ``server`` / ``_thread`` /
#: ``kill_server`` are used.
TRANSFORMERS_NAMES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("transformers.cli.serving.model_manager", "ModelManager", ("_load_model", "_load_processor")),
    ("transformers.cli.serve", "Serve", ("start_server", "kill_server")),
)
#: The ``Serve`` keywords :func:`run_server` passes.
SERVE_KWARGS = (
    "force_model",
    "continuous_batching",
    "host",
    "port",
    "log_level",
    "non_blocking",
    "cb_max_batch_tokens",
)
_MANAGER_MODULE = "transformers.cli.serving.model_manager"


def read_offload_config(text: str | None) -> OffloadConfig | None:
    """The :class:`OffloadConfig` that ``--config`` names: a JSON object, or the path of a file holding one.

    ``None`` stays ``None`` (the library's default config for the model). ``ValueError`` names what is
    wrong: not JSON, not an object, no such file, or the field :meth:`OffloadConfig.model_validate`
    rejects.
    """
    if text is None:
        return None
    source = "--config"
    path = Path(text)
    if not text.lstrip().startswith(("{", "[")):
        if not path.is_file():
            raise ValueError(f"--config {text!r}: neither a JSON object nor an existing file")
        source = f"--config file {str(path)!r}"
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    try:
        return OffloadConfig.model_validate(data)
    except ValueError as e:  # pydantic's ValidationError is a ValueError and names each field
        raise ValueError(f"{source}: invalid OffloadConfig: {e}") from None


def default_device() -> str:
    """``"cuda"`` when an accelerator is visible to torch, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model_dir(model_dir: str | Path, *, device: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a ``save_pretrained`` directory: the causal LM in its saved dtype on
    ``device`` (default :func:`default_device`) and its fast tokenizer.

    ``ValueError`` names what is wrong: no such directory, no ``config.json``, no tokenizer (the server
    tokenizes prompts and decodes tokens with it), a tokenizer without ``tokenizer.json`` (the server's
    streaming needs a fast one), or the load itself failing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"MODEL_DIR {str(model_dir)!r}: no such directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"MODEL_DIR {str(model_dir)!r}: no config.json (not a save_pretrained directory)")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"MODEL_DIR {str(model_dir)!r}: no tokenizer (tokenizer.json / tokenizer_config.json); the server "
            "needs one: save it there with tokenizer.save_pretrained(MODEL_DIR)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"MODEL_DIR {str(model_dir)!r}: could not load the tokenizer: {e}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"MODEL_DIR {str(model_dir)!r}: the tokenizer is not a fast one (no tokenizer.json); the server "
            "needs a fast tokenizer"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype="auto", device_map=device or default_device()
        )
    except (OSError, ValueError) as e:
        raise ValueError(f"MODEL_DIR {str(model_dir)!r}: could not load the model: {e}") from None
    return model.eval(), tokenizer


def preloaded_manager_class(name: str, model: Any, processor: Any) -> type:
    """A subclass of transformers' ``ModelManager`` that serves ``model`` and ``processor`` under ``name``.

    Its ``_load_model`` / ``_load_processor`` return them for ``name`` (the manager's own caching, listing
    and ``/reset`` work unchanged: a reload after ``/reset`` returns the same objects) and raise
    ``ValueError`` for any other model.
    """
    import importlib

    base = importlib.import_module(_MANAGER_MODULE).ModelManager

    def _check(manager: Any, model_id: str) -> None:
        if model_id != manager.process_model_name(name):
            raise ValueError(f"this server serves only {name!r}, not {model_id!r}")

    class PreloadedModelManager(base):
        """transformers' ``ModelManager`` with one preloaded model (``torch_kvoffload.serve``)."""

        def _load_model(self, model_id_and_revision: str, *args: Any, **kwargs: Any) -> Any:
            _check(self, model_id_and_revision)
            return model

        def _load_processor(self, model_id_and_revision: str, *args: Any, **kwargs: Any) -> Any:
            _check(self, model_id_and_revision)
            return processor

    return PreloadedModelManager


@contextlib.contextmanager
def _manager_class_swapped(cls: type) -> Iterator[None]:
    import importlib

    module = importlib.import_module(_MANAGER_MODULE)
    original = module.ModelManager
    module.ModelManager = cls
    try:
        yield
    finally:
        module.ModelManager = original


def run_server(
    model: Any,
    tokenizer: Any,
    *,
    name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    cb_max_batch_tokens: int | None = None,
) -> int:
    """Serve ``model`` (prepared: offloaded, continuous-batching capable) with ``tokenizer`` under ``name``
    with transformers' OpenAI-compatible server on ``host:port``, continuous batching on, until SIGINT or
    SIGTERM. Returns the exit status: 0 after a clean stop, 1 if uvicorn could not start (port taken).

    Clients name the model ``name`` (``GET /v1/models`` lists it); the server accepts no other.
    ``cb_max_batch_tokens``: tokens per continuous-batching step (``transformers serve
    --cb-max-batch-tokens``); ``None``: the offloaded model's default, ``min(serving.max_request_tokens,
    512)``. The cache's blocks follow the model's ``OffloadConfig.serving``.
    """
    from transformers.cli.serve import Serve

    manager_cls = preloaded_manager_class(name, model, tokenizer)
    with _manager_class_swapped(manager_cls):
        serve = Serve(
            force_model=name,
            continuous_batching=True,
            host=host,
            port=port,
            log_level=log_level,
            non_blocking=True,
            cb_max_batch_tokens=cb_max_batch_tokens,
        )
    previous = {sig: signal.signal(sig, serve.server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve._thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        serve.kill_server()
    if not serve.server.started:
        print(f"torch_kvoffload.serve: error: could not listen on {host}:{port} (see above)", file=sys.stderr)
        return 1
    return 0
