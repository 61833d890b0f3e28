"""Recomputing instead of failing when a store that cannot pin drops part of a looked-up prefix.

``begin_forward`` leases the blocks it found; a store that cannot pin them (remote pools evict on their
own) may drop one before its layer loads it. The load then raises
:class:`~torch_kvoffload.layerwise.errors.PrefixEvictedError` (which layer, how many prefix tokens per
request are still usable), the runtime stays usable, and :func:`run_forward` reruns the forward with the
prefix cut there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.layerwise.errors import PrefixEvictedError

logger = logging.getLogger(__name__)

__all__ = ["retry_caps", "run_forward"]

T = TypeVar("T")


class _Forwards(Protocol):
    """The runtime methods a retried forward uses."""

    def begin_forward(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        block_tables: Sequence[Sequence[int]] | torch.Tensor,
        num_cached_tokens: Sequence[int] | None = None,
        *,
        max_cached_tokens: Sequence[int] | None = None,
        positions: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
    ) -> list[int]: ...

    def end_forward(self) -> None: ...

    def end_aborted_forward(self) -> None: ...

    def retry_caps(
        self, cached: Sequence[int], caps: Sequence[int] | None, evicted: PrefixEvictedError
    ) -> list[int]: ...


def run_forward(
    rt: _Forwards,
    token_ids: Sequence[Sequence[int] | torch.Tensor],
    block_tables: Sequence[Sequence[int]] | torch.Tensor,
    body: Callable[[list[int]], T],
    *,
    num_cached_tokens: Sequence[int] | None = None,
    max_cached_tokens: Sequence[int] | None = None,
    positions: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
) -> T:
    """``rt.begin_forward``, ``body(cached)``, ``rt.end_forward`` — recomputing instead of failing when the
    store dropped part of the prefix.

    ``body(cached)`` runs every layer of the model (``wait_layer`` / ``save_layer`` or the hook ops) for
    the cached token counts it is given, and returns the model's outputs. If a load finds its blocks gone
    (:class:`PrefixEvictedError`, from ``body`` or ``end_forward``), the forward is closed and run again
    from the first layer, looking each request's prefix up again with at most the tokens still usable
    (``max_cached_tokens``; also after a first try with ``num_cached_tokens``). Requests sharing a block
    that must now be recomputed get it computed by the first of them and read by the others. Every retry
    lowers the cap of the request whose blocks were missing, so this ends — at worst with the whole
    prompt recomputed. Any other error closes the forward and propagates. ``positions``: see
    ``begin_forward`` (the same on every try).
    """
    if isinstance(block_tables, torch.Tensor):
        block_tables = block_tables.tolist()
    fixed, caps = num_cached_tokens, max_cached_tokens
    at = {} if positions is None else {"positions": positions}
    while True:
        cached = rt.begin_forward(
            token_ids, block_tables, fixed, **at, **({} if fixed is not None else {"max_cached_tokens": caps})
        )
        try:
            out = body(cached)
        except PrefixEvictedError as exc:
            evicted = exc
            rt.end_aborted_forward()
        except BaseException:
            rt.end_aborted_forward()
            raise
        else:
            try:
                rt.end_forward()
                return out
            except PrefixEvictedError as exc:
                evicted = exc
        caps = rt.retry_caps(cached, caps, evicted)
        fixed = None


def retry_caps(
    counters: Counters, cached: Sequence[int], caps: Sequence[int] | None, evicted: PrefixEvictedError
) -> list[int]:
    """The ``max_cached_tokens`` of the next try of a forward that raised ``evicted`` after
    ``begin_forward`` returned ``cached`` (under the caps ``caps`` of that try, or ``None``): each
    request's prefix cut at its first missing block, so every retry shortens it. Counted in
    ``counters``' ``forward_retries`` and logged."""
    cut = [min(c, u) for c, u in zip(cached, evicted.usable_tokens, strict=True)]
    assert sum(cut) < sum(cached), "a prefix eviction must shorten the prefix"
    logger.warning(
        "layerwise: layer %d found %d prefix block(s) missing or unreadable; recomputing with cached "
        "tokens %s instead of %s",
        evicted.layer,
        evicted.missing_blocks,
        cut,
        list(cached),
    )
    counters.add("forward_retries")
    return cut if caps is None else [min(c, p) for c, p in zip(cut, caps, strict=True)]
