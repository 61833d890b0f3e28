"""pytest plugin: run transformers' ``GenerationTesterMixin`` tests with every generative model offloaded.

Loaded by ``tools/hf_generation_suite.py`` (``-p hf_generation_suite_plugin``, with ``tools/`` on the path)
inside a checkout of transformers' test sources; not part of the installed package. Options:

- ``--kvoffload-mode {unmodified,offload,compile}``: ``offload`` / ``compile`` pass every model a test
  builds through ``torch_kvoffload.offload`` / ``torch_kvoffload.compile`` (default config of its family)
  before its first use; ``unmodified`` patches nothing (the baseline).
- ``--kvoffload-report PATH``: per test, how many models were offloaded (a test that passes without
  offloading any model checked nothing of the library).
- ``--kvoffload-test-timeout S``: fail a test that runs longer than ``S`` seconds (``SIGALRM``).
- ``--kvoffload-no-grad``: run each test under ``torch.no_grad()`` (the library refuses forwards with
  autograd on; this shows what the tests that call the model that way check beyond the refusal).

The seam: the mixin builds its models with ``model_class(config)``, ``model_class._from_config(...)`` or
``model_class.from_pretrained(...)``, then moves, casts and evaluates them, so a model is only final at its
first ``forward`` or ``generate``. For the duration of each test, the generative model classes the test
module imports get a class-level ``forward`` and ``generate`` that, on an instance's first call, bind the
class's own methods to the instance, offload it in place (the library then wraps those instance methods),
and call the instance's (now offloaded) method. Models that are never called are never offloaded.

Only the tests ``GenerationTesterMixin`` defines (those of its names the model's test class overrides
included) are collected; every other test of the module is deselected.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import types
from pathlib import Path
from typing import Any

import pytest

MODES = ("unmodified", "offload", "compile")
_REPORT_KEY = pytest.StashKey[dict]()  # nodeid -> {"models_offloaded": n}
_PATCHED_METHODS = ("forward", "generate")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvoffload", "torch_kvoffload generation-suite harness")
    group.addoption("--kvoffload-mode", choices=MODES, default="unmodified")
    group.addoption("--kvoffload-report", default=None, help="JSON file: models offloaded per test")
    group.addoption("--kvoffload-test-timeout", type=float, default=0.0, help="seconds per test, 0 = none")
    group.addoption("--kvoffload-no-grad", action="store_true", help="run each test under torch.no_grad()")


def _mixin_of(cls: type | None) -> type | None:
    for base in getattr(cls, "__mro__", ()):
        if base.__name__ == "GenerationTesterMixin":
            return base
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        mixin = _mixin_of(getattr(item, "cls", None))
        name = getattr(item, "originalname", None) or item.name
        if mixin is not None and name.startswith("test_") and name in vars(mixin):
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


class Offloader:
    """Patches the generative model classes of one test module so their instances offload on first use."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.count = 0  # models offloaded during the current test

    def offload(self, model: Any) -> None:
        import torch_kvoffload

        # Bind the class's own methods to the instance first, so the library wraps them, not our hooks.
        for name in _PATCHED_METHODS:
            setattr(model, name, types.MethodType(getattr(type(model), f"_kvsuite_class_{name}"), model))
        if self.mode == "offload":
            torch_kvoffload.offload(model)
        else:
            torch_kvoffload.compile(model)
        self.count += 1

    def hook(self, name: str, original: Any) -> Any:
        offloader = self

        @functools.wraps(original)
        def first_use(model: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(model, "_kvoffload_session", None) is None:
                offloader.offload(model)
                return getattr(model, name)(*args, **kwargs)
            return original(model, *args, **kwargs)

        return first_use

    def patch(self, classes: list[type]) -> list[tuple[type, str, Any]]:
        undo: list[tuple[type, str, Any]] = []
        # Read every original before patching any: a subclass inherits its parent's hook otherwise.
        originals = {(cls, name): getattr(cls, name) for cls in classes for name in _PATCHED_METHODS}
        for (cls, name), original in originals.items():
            undo.append((cls, name, vars(cls).get(name)))
            undo.append((cls, f"_kvsuite_class_{name}", None))
            setattr(cls, f"_kvsuite_class_{name}", original)
            setattr(cls, name, self.hook(name, original))
        return undo


def restore(undo: list[tuple[type, str, Any]]) -> None:
    """Undo :meth:`Offloader.patch`: every class attribute as it was (absent ones deleted)."""
    for cls, name, value in reversed(undo):
        if value is None:
            if name in vars(cls):
                delattr(cls, name)
        else:
            setattr(cls, name, value)


def _generative_classes(module: Any) -> list[type]:
    from transformers import PreTrainedModel

    found = []
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, PreTrainedModel) and value.can_generate():
            found.append(value)
    return found


class _Timeout(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout("test exceeded --kvoffload-test-timeout")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    config = item.config
    mode = config.getoption("--kvoffload-mode")
    timeout = config.getoption("--kvoffload-test-timeout")
    offloader = Offloader(mode)
    undo = offloader.patch(_generative_classes(item.module)) if mode != "unmodified" else []
    grad = contextlib.nullcontext()
    if config.getoption("--kvoffload-no-grad"):
        import torch

        grad = torch.no_grad()
    if timeout:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with grad:
            yield
    finally:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        restore(undo)
        config.stash.setdefault(_REPORT_KEY, {})[item.nodeid] = {"models_offloaded": offloader.count}


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--kvoffload-report")
    if path:
        report = session.config.stash.get(_REPORT_KEY, {})
        Path(path).write_text(json.dumps(report, indent=1, sort_keys=True))
