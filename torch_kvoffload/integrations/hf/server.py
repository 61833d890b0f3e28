"""Serve a model directory, offloaded, with transformers' own OpenAI-compatible server, continuous batching on.

transformers ships the server behind ``transformers serve --continuous-batching``
(:class:`transformers.cli.serve.Serve`): ``/v1/chat/completions``, ``/v1/completions`` and the rest, with
requests batched by the model's ``init_continuous_batching`` manager. It loads its model itself, by name;
there is no way to hand it a model prepared beforehand (offloaded, here). :func:`run_server` serves a
``save_pretrained`` directory: it loads the model (:func:`load_model_dir`), calls ``prepare`` on it (the
command passes ``torch_kvoffload.offload`` with its config) and serves it under the directory's name, the
server otherwise transformers' own: its routes, handlers, continuous-batching manager and uvicorn. Where the
model is loaded and prepared depends on the transformers release; each of the two server designs has a name
(:func:`server_design`) and its own transformers names (:data:`TRANSFORMERS_NAMES`, :data:`SERVE_KWARGS`,
keyed by that name; ``tests/hf/test_serve.py`` checks the installed release's):

:data:`IN_PROCESS` (transformers 5.24)
    ``Serve.__init__`` builds a ``ModelManager`` that loads models in the server's process. :func:`run_server`
    loads and prepares the model there, then builds ``Serve`` while the module attribute
    ``transformers.cli.serving.model_manager.ModelManager`` names a subclass (:func:`preloaded_manager_class`)
    whose ``_load_model`` and ``_load_processor`` return the prepared model and tokenizer for the served
    name and raise ``ValueError`` for any other (HTTP 400), and puts the attribute back once ``Serve`` is
    built. ``Serve`` runs uvicorn in a thread of its own (``non_blocking=True``, its ``start_server``): the
    calling thread forwards SIGINT / SIGTERM to uvicorn's ``handle_exit``, waits for that thread
    (``Serve._thread``), then calls ``Serve.kill_server``, which stops the continuous-batching worker (a
    non-daemon thread that would otherwise keep the process alive); requests still in flight get
    :data:`GRACEFUL_SHUTDOWN_S` to end.
    transformers' handlers key a request's continuous-batching results by the client's ``X-Request-ID``
    header (or a fresh one): two live requests of one id would read each other's tokens. While the server
    runs, ``CBGenerateManager.generate_streaming`` / ``generate_non_streaming`` (of
    ``transformers.cli.serving.utils``) give the manager an id of the server's own instead
    (:func:`_server_owned_request_ids`); the answer still echoes the client's id. A ``ValueError`` there (a
    request the library refuses: an empty prompt, one longer than ``serving.max_request_tokens``) is an
    HTTP 400 naming the reason.

:data:`ENGINE_PROCESS` (transformers 5.25)
    The served model runs in a process of its own, the engine, which ``ModelManager`` spawns (before the port
    opens) and which loads it with a pickled copy of ``Serve.loader``, a ``ModelLoader``
    (``load_model_and_processor``), then generates there, continuous batching included; the server's process
    only reads the model's config and processor (``load_config``, ``load_processor``). A model prepared in the
    server's process could not reach the engine, so the preparation runs in the engine: :func:`run_server`
    builds a subclass of ``Serve`` whose ``run`` (the method ``Serve.__init__`` ends with, which builds the
    ``ModelManager`` from ``self.loader``) first puts an :func:`engine_loader` in ``self.loader``: a
    ``ModelLoader`` whose ``load_model_and_processor`` loads and prepares the directory exactly as the
    in-process design does, and whose ``load_processor`` returns the same tokenizer. A ``ValueError`` the
    engine raises while loading or preparing (a model it cannot load, a model ``offload`` refuses) is written
    to a file of :func:`run_server`'s, which raises it again in the server's process: the same ``ValueError``
    as in-process, before the port opens. transformers itself refuses a request naming another model
    (``force_model``: ``ModelManager.get_engine``, HTTP 400). ``Serve`` runs uvicorn in the calling thread,
    which handles SIGINT / SIGTERM itself and, once stopped, raises the signal again under the handler it
    found: :func:`run_server` holds one there that ends the server cleanly, and that also stops it cleanly
    when a signal arrives while the engine is still loading.

:func:`read_offload_config` and :func:`check_model_dir` check the command line's inputs before anything is
loaded, each error a ``ValueError`` naming what is wrong.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch_kvoffload.core.config import OffloadConfig

__all__ = [
    "ENGINE_PROCESS",
    "ENGINE_PROCESS_SINCE",
    "IN_PROCESS",
    "SERVE_KWARGS",
    "TRANSFORMERS_NAMES",
    "check_model_dir",
    "default_device",
    "engine_loader",
    "load_model_dir",
    "preloaded_manager_class",
    "read_offload_config",
    "run_server",
    "server_design",
]

#: transformers' server design up to 5.24: the model loads in the server's process (see the module docstring).
IN_PROCESS = "in_process"
#: transformers' server design from 5.25 on: the model loads and generates in a process of its own.
ENGINE_PROCESS = "engine_process"
#: Seconds the server waits, once told to stop, for requests in flight to end before it cuts them (then
#: transformers stops its continuous-batching worker within 2 s more): SIGTERM ends the process in < 10 s.
GRACEFUL_SHUTDOWN_S = 5.0
#: The first transformers release of :data:`ENGINE_PROCESS`.
ENGINE_PROCESS_SINCE = "5.25.0"

_MODEL_MANAGER = "transformers.cli.serving.model_manager"
_SERVING_UTILS = "transformers.cli.serving.utils"
#: The ``CBGenerateManager`` methods :func:`_server_owned_request_ids` overrides (:data:`IN_PROCESS` only).
_CB_ENTRIES = ("generate_streaming", "generate_non_streaming")
#: ``{design: ((module, attribute, members), ...)}``: the transformers names each design uses or overrides.
#: :data:`IN_PROCESS`: ``ModelManager`` is replaced (while ``Serve`` is built) by a subclass overriding
#: ``_load_model`` and ``_load_processor`` (its ``process_model_name`` names the served model); of
#: ``Serve``, ``start_server`` / ``kill_server`` are called; ``CBGenerateManager``'s generation entries are
#: wrapped while the server runs. :data:`ENGINE_PROCESS`: ``ModelLoader`` is
#: subclassed, overriding ``load_model_and_processor`` and ``load_processor``; ``Serve.run`` is overridden.
TRANSFORMERS_NAMES: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    IN_PROCESS: (
        (_MODEL_MANAGER, "ModelManager", ("_load_model", "_load_processor", "process_model_name")),
        ("transformers.cli.serve", "Serve", ("start_server", "kill_server")),
        (_SERVING_UTILS, "CBGenerateManager", _CB_ENTRIES),
    ),
    ENGINE_PROCESS: (
        (_MODEL_MANAGER, "ModelLoader", ("load_model_and_processor", "load_processor")),
        ("transformers.cli.serve", "Serve", ("run",)),
    ),
}
#: ``{design: keywords}``: the ``Serve`` keywords :func:`run_server` passes (:data:`ENGINE_PROCESS`:
#: ``device`` too, so that the ``ModelLoader`` ``Serve`` builds, replaced by :func:`engine_loader`, agrees).
SERVE_KWARGS: dict[str, tuple[str, ...]] = {
    IN_PROCESS: (
        "force_model",
        "continuous_batching",
        "host",
        "port",
        "log_level",
        "non_blocking",
        "cb_max_batch_tokens",
    ),
    ENGINE_PROCESS: (
        "force_model",
        "continuous_batching",
        "device",
        "host",
        "port",
        "log_level",
        "enable_log_requests",
        "cb_max_batch_tokens",
    ),
}


def server_design() -> str:
    """:data:`ENGINE_PROCESS` for transformers >= :data:`ENGINE_PROCESS_SINCE`, else :data:`IN_PROCESS`."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version(ENGINE_PROCESS_SINCE):
        return ENGINE_PROCESS
    return IN_PROCESS


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


def check_model_dir(model_dir: str | Path) -> Any:
    """The fast tokenizer of the ``save_pretrained`` directory ``model_dir``, which must hold a model config.

    ``ValueError`` names what is wrong: no such directory, no ``config.json``, no tokenizer (the server
    tokenizes prompts and decodes tokens with it), a tokenizer without ``tokenizer.json`` (the server's
    streaming needs a fast one), or the tokenizer failing to load. The weights are not read.
    """
    from transformers import AutoTokenizer

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
    return tokenizer


def load_model_dir(model_dir: str | Path, *, device: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a ``save_pretrained`` directory: the causal LM in its saved dtype on
    ``device`` (default :func:`default_device`), in eval mode, and its fast tokenizer.

    ``ValueError`` names what is wrong: what :func:`check_model_dir` refuses, or the model's load failing.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = check_model_dir(model_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            Path(model_dir), dtype="auto", device_map=device or default_device()
        )
    except (OSError, ValueError) as e:
        raise ValueError(f"MODEL_DIR {str(model_dir)!r}: could not load the model: {e}") from None
    return model.eval(), tokenizer


def _load_and_prepare(model_dir: str, prepare: Callable[[Any], Any], device: str) -> tuple[Any, Any]:
    """``(prepare(model), tokenizer)`` of ``model_dir``: what both designs serve."""
    model, tokenizer = load_model_dir(model_dir, device=device)
    return prepare(model), tokenizer


# ------------------------------------------------------------------------------------ IN_PROCESS (5.24)
def preloaded_manager_class(name: str, model: Any, processor: Any) -> type:
    """A subclass of transformers' ``ModelManager`` that serves ``model`` and ``processor`` under ``name``
    (:data:`IN_PROCESS` only).

    Its ``_load_model`` / ``_load_processor`` return them for ``name`` (the manager's own caching, listing
    and ``/reset`` work unchanged: a reload after ``/reset`` returns the same objects) and raise
    ``ValueError`` for any other model.
    """
    import importlib

    base = importlib.import_module(_MODEL_MANAGER).ModelManager

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

    module = importlib.import_module(_MODEL_MANAGER)
    original = module.ModelManager
    module.ModelManager = cls
    try:
        yield
    finally:
        module.ModelManager = original


def _server_owned(method: Callable) -> Callable:
    """``method`` (a ``CBGenerateManager`` generation entry) with its ``request_id`` replaced by a fresh id of
    the server's, and a ``ValueError`` turned into an HTTP 400 naming it."""
    import inspect
    import uuid

    signature = inspect.signature(method)

    def rebound(args: tuple, kwargs: dict) -> inspect.BoundArguments:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["request_id"] = f"kvoffload-{uuid.uuid4().hex}"
        return bound

    def refused(error: ValueError) -> BaseException:
        from fastapi import HTTPException

        return HTTPException(status_code=400, detail=str(error))

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            bound = rebound(args, kwargs)
            try:
                return await method(*bound.args, **bound.kwargs)
            except ValueError as e:
                raise refused(e) from None

        return run_async

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        bound = rebound(args, kwargs)
        try:
            return method(*bound.args, **bound.kwargs)
        except ValueError as e:
            raise refused(e) from None

    return run


@contextlib.contextmanager
def _server_owned_request_ids() -> Iterator[None]:
    """While the block runs, transformers' continuous-batching generation entries key requests by ids of the
    server's (see the module docstring); put back on exit."""
    import importlib

    cls = importlib.import_module(_SERVING_UTILS).CBGenerateManager
    saved = {name: vars(cls)[name] for name in _CB_ENTRIES}
    try:
        for name in _CB_ENTRIES:
            setattr(cls, name, _server_owned(saved[name]))
        yield
    finally:
        for name, method in saved.items():
            setattr(cls, name, method)


def _serve_in_process(
    model_dir: str, prepare: Callable[[Any], Any], device: str, serve_kwargs: dict[str, Any]
) -> int:
    from transformers.cli.serve import Serve

    model, tokenizer = _load_and_prepare(model_dir, prepare, device)
    with _server_owned_request_ids():
        with _manager_class_swapped(preloaded_manager_class(model_dir, model, tokenizer)):
            serve = Serve(force_model=model_dir, continuous_batching=True, non_blocking=True, **serve_kwargs)
        # uvicorn reads it when it shuts down: a stream still open then is cut instead of waited for
        serve.server.config.timeout_graceful_shutdown = GRACEFUL_SHUTDOWN_S
        previous = {
            sig: signal.signal(sig, serve.server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            serve._thread.join()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            serve.kill_server()
    return 0 if serve.server.started else 1


# -------------------------------------------------------------------------------- ENGINE_PROCESS (5.25)
@functools.cache
def _engine_loader_class() -> type:
    """The ``ModelLoader`` subclass :func:`engine_loader` builds (transformers' base exists from 5.25 on)."""
    import importlib

    base = importlib.import_module(_MODEL_MANAGER).ModelLoader

    class EngineModelLoader(base):
        """transformers' ``ModelLoader`` for one ``save_pretrained`` directory, prepared by the library."""

        def __init__(
            self, model_dir: str, prepare: Callable[[Any], Any], device: str, refusal_file: str | None
        ) -> None:
            super().__init__(device=device, continuous_batching=True)
            self.model_dir, self.prepare = model_dir, prepare
            self.served_device, self.refusal_file = device, refusal_file

        def load_processor(self, model_id: str) -> Any:
            return check_model_dir(self.model_dir)

        def load_model_and_processor(self, model_id: str, on_progress: Callable | None = None) -> Any:
            try:
                return _load_and_prepare(self.model_dir, self.prepare, self.served_device)
            except ValueError as e:
                if self.refusal_file is not None:
                    Path(self.refusal_file).write_text(str(e))
                raise

        def __reduce__(self) -> tuple[Any, ...]:
            # Why: a class built at run time pickles by its constructor (the engine gets a pickled copy).
            return (engine_loader, (self.model_dir, self.prepare, self.served_device, self.refusal_file))

    return EngineModelLoader


def engine_loader(
    model_dir: str, prepare: Callable[[Any], Any], device: str, refusal_file: str | None = None
) -> Any:
    """The ``ModelLoader`` (:data:`ENGINE_PROCESS` only) of :func:`run_server`: its
    ``load_model_and_processor`` returns ``(prepare(model), tokenizer)`` of ``model_dir`` loaded on
    ``device`` (:func:`load_model_dir`) whatever model transformers asks for (its ``force_model`` makes every
    request ask for the served one), and its ``load_processor`` the same tokenizer. A ``ValueError`` while
    loading or preparing is written to ``refusal_file`` (when given) before it is raised.
    Picklable when ``prepare`` is: the engine process gets a copy.
    """
    return _engine_loader_class()(model_dir, prepare, device, refusal_file)


class _Stopped(BaseException):
    """SIGINT / SIGTERM under :func:`_serve_in_engine_process`'s handler: the server stops, exit status 0."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped(signal.Signals(signum).name)


def _serve_in_engine_process(
    model_dir: str, prepare: Callable[[Any], Any], device: str, serve_kwargs: dict[str, Any]
) -> int:
    from transformers.cli.serve import Serve

    with tempfile.TemporaryDirectory(prefix="kvoffload-serve-") as tmp:
        refusal = Path(tmp) / "refusal"
        loader = engine_loader(model_dir, prepare, device, str(refusal))

        class OffloadedModelServe(Serve):
            """transformers' ``Serve`` whose model loads through :func:`engine_loader`."""

            def run(self, *args: Any, **kwargs: Any) -> None:
                self.loader = loader
                super().run(*args, **kwargs)

        previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            OffloadedModelServe(
                force_model=model_dir,
                continuous_batching=True,
                device=device,
                enable_log_requests=True,
                **serve_kwargs,
            )
        except _Stopped:
            pass
        except RuntimeError:  # the engine could not load the model: a refusal of the library's, or not
            if refusal.is_file():
                raise ValueError(refusal.read_text()) from None
            raise
        except SystemExit:  # uvicorn could not start (port taken): sys.exit(STARTUP_FAILURE)
            return 1
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 0


def run_server(
    model_dir: str,
    prepare: Callable[[Any], Any],
    *,
    device: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    cb_max_batch_tokens: int | None = None,
) -> int:
    """Serve the ``save_pretrained`` directory ``model_dir`` with transformers' OpenAI-compatible server on
    ``host:port``, continuous batching on, until SIGINT or SIGTERM. Returns the exit status: 0 after a clean
    stop, 1 if uvicorn could not start (port taken).

    The model is loaded on ``device`` (:func:`load_model_dir`, default :func:`default_device`) and
    ``prepare(model)`` (``functools.partial(torch_kvoffload.offload, config=config)``: offloaded, continuous
    batching capable) is served, before the port opens, in the server's process or in transformers' engine
    process (:func:`server_design`); ``prepare`` must be picklable. A ``ValueError`` while loading or
    preparing is raised here, in both designs, and nothing listens. Clients name the model ``model_dir``,
    exactly as given (``GET /v1/models`` lists it); the server accepts no other. ``cb_max_batch_tokens``:
    tokens per continuous-batching step (``transformers serve --cb-max-batch-tokens``); ``None``: the
    offloaded model's default, ``min(serving.max_request_tokens, 512)``. The cache's blocks follow the
    model's ``OffloadConfig.serving``. ``log_level``: transformers' (its server's, from 5.25 on, which then
    logs a line per request from ``info`` on).
    """
    serve_kwargs = {
        "host": host,
        "port": port,
        "log_level": log_level,
        "cb_max_batch_tokens": cb_max_batch_tokens,
    }
    device = device or default_device()
    if server_design() == ENGINE_PROCESS:
        status = _serve_in_engine_process(model_dir, prepare, device, serve_kwargs)
    else:
        status = _serve_in_process(model_dir, prepare, device, serve_kwargs)
    if status:
        print(f"torch_kvoffload.serve: error: could not listen on {host}:{port} (see above)", file=sys.stderr)
    return status
