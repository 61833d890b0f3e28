"""``output_attentions=True`` on an offloaded model: the attention probabilities in Hugging Face's layout.

The library's attention is absorbed MLA over the latent KV: it never forms the ``[heads, q_len, kv_len]``
probabilities the unmodified model returns. When a forward asks for them (the ``output_attentions``
keyword, a ``generate`` option, or ``model.config.output_attentions``), :func:`collect_attentions` runs it
with the KV core recording, per layer, the probabilities its attention applied (a second pass over the
rows that attention read, with the same selection: every visible row for MLA, the indexer's top-k for
DSA; :attr:`KVCore.attention_probs <torch_kvoffload.core.kv.KVCore.attention_probs>`), and
:func:`attention_weights` turns them into what the unmodified model's eager attention returns for the
layer: ``[batch, heads, q_len, past + q_len]`` in the model's dtype, one column per position of the
sequence (padding included), zero on padding columns, on columns the query does not see and, for DSA, on
keys outside the indexer's top-k. A query that sees no real token (left padding before a row's first
token) gets ``1 / kv_len`` on every column, as the eager softmax over a fully masked row gives.

Nothing is computed for a forward that does not ask. The unmodified model returns the probabilities only
with ``attn_implementation="eager"`` (``sdpa`` returns none and warns); an offloaded model returns them
whatever the implementation: its attention is the library's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = ["attention_weights", "collect_attentions", "output_attentions_requested"]

T = TypeVar("T")


@dataclass(frozen=True)
class _Request:
    """The forward that asked: its ``attention_mask [B, past + S]`` as given (``None``: no padding in
    it) and ``past`` (positions before it, padding included)."""

    mask: torch.Tensor | None
    past: int


_REQUEST: contextvars.ContextVar[_Request | None] = contextvars.ContextVar(
    "kvoffload_output_attentions", default=None
)


def output_attentions_requested(model: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether a forward with ``kwargs`` returns attentions: the keyword, else (unset or ``None``)
    ``model.config.output_attentions``."""
    value = kwargs.get("output_attentions")
    if value is None:
        value = getattr(model.config, "output_attentions", False)
    return bool(value)


@contextlib.contextmanager
def _recording(core: Any, request: _Request) -> Iterator[None]:
    token = _REQUEST.set(request)
    core.attention_probs = {}
    try:
        yield
    finally:
        core.attention_probs = None
        _REQUEST.reset(token)


def collect_attentions(core: Any, mask: torch.Tensor | None, past: int, body: Callable[[], T]) -> T:
    """``body()`` (a forward of the session whose KV core is ``core``, begun with ``attention_mask=mask``
    and ``past``) with the core recording every layer's attention probabilities for
    :func:`attention_weights`."""
    with _recording(core, _Request(mask, past)):
        return body()


def attention_weights(session: Any, layer: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``layer``'s attention probabilities of the running forward in the unmodified model's layout
    (``[B, H, S, past + S]``, ``dtype``; see the module docstring), or ``None`` when the forward did not
    ask (:func:`collect_attentions`).

    ``ValueError`` for a forward without ``attention_mask`` continuing a sequence that had padding: the
    unmodified model would attend over the padding's cached KV, which the library does not keep.
    """
    request = _REQUEST.get()
    core = session.core
    if request is None or core.attention_probs is None:
        return None
    probs = core.attention_probs.pop(layer)  # fp32 [B, S, H, L] over each request's logical positions
    fwd = core.forward
    B, S, H, L = probs.shape
    past = request.past
    T = past + S
    device = probs.device
    if request.mask is None:
        if any(old != past for old in fwd.old_len):
            raise ValueError(
                "output_attentions=True: a forward without attention_mask after earlier padding; the "
                "unmodified model would attend over the padding's cached KV, which the library does not keep. "
                "Pass the sequence's attention_mask [batch, past + new]"
            )
        real = torch.ones(B, T, dtype=torch.bool, device=device)
    else:
        real = request.mask.to(device=device).bool()
    if real.sum(dim=1).tolist() != list(fwd.new_len):
        raise RuntimeError(
            f"output_attentions: the attention_mask's real positions per row {real.sum(dim=1).tolist()} are not "
            f"the tokens the session holds {list(fwd.new_len)}"
        )
    # column of each request's logical position p (its p-th real column); column T absorbs the rest
    rank = real.long().cumsum(dim=1)
    cols = torch.full((B, L + 1), T, dtype=torch.int64, device=device)
    at = torch.where(real, rank - 1, L).clamp(max=L)
    cols.scatter_(1, at, torch.arange(T, device=device).expand(B, T).contiguous())
    cols = cols[:, :L]
    out = probs.new_zeros((B, H, S, T + 1))
    out.scatter_(3, cols[:, None, None, :].expand(B, H, S, L), probs.permute(0, 2, 1, 3))
    out = out[..., :T]
    # a query that sees no real column: the eager softmax over a fully masked row is uniform
    blind = rank[:, past:] == 0
    out.masked_fill_(blind[:, None, :, None], 1.0 / T)
    return out.to(dtype)
