"""``python -m torch_kvoffload.serve MODEL_DIR``: an OpenAI-compatible server for an offloaded model.

Serves the model and tokenizer saved in ``MODEL_DIR`` (``save_pretrained``), the model's KV cache offloaded
with :func:`torch_kvoffload.offload` (``--config``: an :class:`~torch_kvoffload.OffloadConfig` as a JSON object
or the path of a JSON file; default: the library's default for the model), with transformers' own server,
continuous batching on (:mod:`torch_kvoffload.integrations.hf.server`; from transformers 5.25 on, the model
is loaded and offloaded in the process transformers generates in). A bad config or model directory, or a
model that cannot be loaded or offloaded, or a serving plan that cannot hold (the device budget, the host
pool, transformers' step buffers against host memory, ``--cb-max-batch-tokens``: see
:func:`~torch_kvoffload.integrations.hf.continuous_batching.check_serving`), ends the command with status 2 and
a message naming the problem, before the port is opened.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from torch_kvoffload.api import offload
from torch_kvoffload.integrations.hf import server

__all__ = ["main", "prepare"]


def prepare(model, *, config=None, cb_max_batch_tokens: int | None = None, log_level: str = "warning"):
    """``model`` offloaded with ``config`` and checked to serve continuous batching with
    ``cb_max_batch_tokens`` tokens per step (``ValueError`` naming the field otherwise); what the server
    serves. The library's own log lines go to stderr from ``log_level`` on (in the process that serves the
    model). Picklable as a ``functools.partial`` (transformers' engine process gets a copy)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from torch_kvoffload.integrations.hf.continuous_batching import check_serving

    _log_to_stderr(log_level)
    offload(model, config=config)
    check_serving(model, ContinuousBatchingConfig(max_batch_tokens=cb_max_batch_tokens))
    return model


def _log_to_stderr(level: str) -> None:
    """The ``torch_kvoffload`` loggers write to stderr from ``level`` on (once per process)."""
    library = logging.getLogger("torch_kvoffload")
    library.setLevel(level.upper())
    if not any(getattr(h, "_kvoffload_serve", False) for h in library.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler._kvoffload_serve = True
        library.addHandler(handler)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_kvoffload.serve",
        description="Serve a DeepSeek-V3 / V3.2 model with KV offload behind an OpenAI-compatible API "
        "(transformers' server, continuous batching on).",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a save_pretrained directory: model and tokenizer")
    p.add_argument(
        "--config",
        default=None,
        help="OffloadConfig as a JSON object or the path of a JSON file (default: the library's default)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument(
        "--device", default=None, help="device of the model (default: cuda if available, else cpu)"
    )
    p.add_argument(
        "--cb-max-batch-tokens",
        type=_positive_int,
        default=None,
        help="continuous batching: tokens per step (default: min(serving.max_request_tokens, 512))",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error", "critical"),
        help="transformers' log level (default: warning; from transformers 5.25 on, its server's, which logs a "
        "line per request from info on) and the library's (info: a line per finished request)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, load, offload and serve; returns the exit status (2 for a bad config or model)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = server.read_offload_config(args.config)
        server.check_model_dir(args.model_dir)
        # Why: run_server raises ValueError only before the port opens (loading or offloading the model).
        return server.run_server(
            args.model_dir,
            functools.partial(
                prepare, config=config, cb_max_batch_tokens=args.cb_max_batch_tokens, log_level=args.log_level
            ),
            device=args.device,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            cb_max_batch_tokens=args.cb_max_batch_tokens,
        )
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
