"""The ``transformers`` releases the Hugging Face integration supports, and the check at its entry points.

:data:`MIN_TRANSFORMERS` is the oldest release that has every name and calling convention the integration
relies on: 5.24.0 renamed the cache keyword of the models' ``forward`` from ``past_key_values`` to
``cache``, which the library's forward and ``generate`` wrappers pass; 5.23 and older would ignore it.
:data:`MAX_TRANSFORMERS` is the newest release tested. ``pyproject.toml``'s ``hf`` extra states the same
range. :func:`check_transformers_version` raises a ``RuntimeError`` outside it; ``torch_kvoffload.offload``
and ``torch_kvoffload.compile`` call it before touching the model.

``torch_kvoffload.serve`` (:mod:`~torch_kvoffload.integrations.hf.server`) follows transformers' two server
designs in this range: 5.24 loads the served model in the server's process, 5.25 in a process of its own
(``server.server_design``).
"""

from __future__ import annotations

import functools

__all__ = ["MAX_TRANSFORMERS", "MIN_TRANSFORMERS", "check_transformers_version", "supported_range"]

#: The oldest supported ``transformers`` release (the ``cache=`` forward keyword).
MIN_TRANSFORMERS = "5.24.0"
#: The newest ``transformers`` release tested.
MAX_TRANSFORMERS = "5.25.0"


def supported_range() -> str:
    """The supported releases as a requirement specifier: ``">=5.24.0,<=5.25.0"``."""
    return f">={MIN_TRANSFORMERS},<={MAX_TRANSFORMERS}"


@functools.cache
def _check(version: str) -> None:
    from packaging.version import InvalidVersion, Version

    try:
        installed = Version(version)
    except InvalidVersion:
        raise RuntimeError(
            f"torch_kvoffload: cannot read the installed transformers version {version!r}; the Hugging Face "
            f"integration supports transformers{supported_range()}"
        ) from None
    if not Version(MIN_TRANSFORMERS) <= installed <= Version(MAX_TRANSFORMERS):
        raise RuntimeError(
            f"torch_kvoffload: transformers {version} is installed; the Hugging Face integration supports "
            f"transformers{supported_range()}: pip install 'transformers{supported_range()}'"
        )


def check_transformers_version() -> None:
    """Raise ``RuntimeError`` naming the installed ``transformers`` version and :func:`supported_range`
    when the installed release is outside it. A no-op without ``transformers`` (a model that is not a
    Hugging Face one needs none). Cheap: the verdict is cached per version string."""
    try:
        import transformers
    except ImportError:
        return
    _check(str(transformers.__version__))
