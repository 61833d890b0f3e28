"""``HFSequence``: a Hugging Face generation as requests of the KV core, one sequence at a time.

Batch row ``r`` of a sequence is one request of the :class:`~torch_kvoffload.core.kv.KVCore` (row ``r``
holds device slot ``r``): its tokens are the row's real tokens (left padding, ``attention_mask == 0``, is
dropped), at logical positions ``0 .. len-1``. Hugging Face counts positions with the padding (``past``,
``seen``); the core counts each request's real tokens. A forward with ``past == 0`` ends the previous
sequence and starts a new one; its requests live until the next such forward, :meth:`end`, or a failed
forward (which releases them at once: a failed call leaves nothing reserved, and the next fresh forward
works). Later forwards must continue the sequence exactly (same batch, ``past`` = positions seen, same
cache object).

Sizing: a fresh forward sizes the caches for its batch and the larger of its width and the planned tokens
per request (:meth:`plan` from ``generate``, :meth:`reserve`); a later forward may only grow them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.core.requests import Request
from torch_kvoffload.integrations.hf.inputs import forward_shape, new_positions

__all__ = ["HFSequence"]

T = TypeVar("T")


class HFSequence:
    """The running sequence of an offloaded model over ``core`` (see the module docstring)."""

    def __init__(self, core: KVCore) -> None:
        self.core = core
        self.requests: list[Request] = []  # by batch row
        self.seen = 0  # positions of the sequence (padding included)
        self.owner: Any = None
        self.broken = False
        self._planned: tuple[int, int] | None = None
        self._pending_seen = 0  # what seen becomes when the running forward ends

    # ------------------------------------------------------------------------------------ sizing
    def plan(self, batch: int, max_tokens: int) -> None:
        """The next sequence is a ``generate`` of ``batch`` requests of at most ``max_tokens`` tokens
        (prompt width + ``max_new_tokens``, padding included). Its last token is sampled and never fed
        back, so a forward on a fresh cache with ``batch`` rows sizes the caches for ``max_tokens - 1``
        tokens, until the next plan (``generate(use_cache=False)`` starts a sequence every step: they all
        keep that size)."""
        where = "OffloadSession.plan_generation"
        batch = check_int(where, "batch", batch, minimum=1)
        max_tokens = check_int(where, "max_tokens", max_tokens, minimum=1)
        self._planned = (batch, max(1, max_tokens - 1))

    def reserve(self, batch: int, max_tokens: int) -> None:
        """Size the caches for ``batch`` requests of ``max_tokens`` tokens.

        Between sequences the caches are resized to exactly this (grown or shrunk; a P/D session keeps
        sizes that suffice), and the next sequence is planned at this size. While a sequence runs, only
        growth of that sequence (the device caches grow in place).
        """
        where = "OffloadSession.reserve"
        batch = check_int(where, "batch", batch, minimum=1)
        max_tokens = check_int(where, "max_tokens", max_tokens, minimum=1)
        if self.core.forward is not None:
            raise RuntimeError(f"{where}: a forward is running")
        if self.requests:
            if batch != len(self.requests):
                raise ValueError(
                    f"OffloadSession: the running sequence has {len(self.requests)} requests, got a batch of {batch}"
                )
            self._grow(max_tokens)
            return
        self.core.size(batch, max_tokens)
        self._planned = (batch, max_tokens)

    def _grow(self, tokens: int) -> None:
        """The running sequence needs ``tokens`` tokens per request (see :meth:`KVCore.grow`): a refusal
        changes nothing; any other failure ends the sequence and drops the caches."""
        self.core.check_growth(tokens)
        try:
            self.core.grow(tokens)
        except BaseException:  # e.g. out of memory: the sequence cannot continue
            self.fail()
            self.core.discard()
            raise

    # --------------------------------------------------------------------------------- forwards
    def begin_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache_position: torch.Tensor | None,
        past: int | None,
        owner: Any,
    ) -> None:
        """See :meth:`OffloadSession.begin_forward`."""
        where = "OffloadSession.begin_forward"
        if self.core.forward is not None:
            raise RuntimeError(f"{where}: a forward is running; call end_forward()")
        B, S = forward_shape(input_ids)
        if past is None:
            past = (
                int(cache_position[0]) if cache_position is not None else (self.seen if self.requests else 0)
            )
        if past < 0:
            raise ValueError(f"{where}: past must be >= 0, got {past}")
        if past == 0:
            # a fresh forward ends the previous sequence (its requests are released), even one rejected below
            self.end()
        else:
            self._check_continuation(B, past, owner)
        new_mask = new_positions(attention_mask, B, S, past)
        ids_cpu = input_ids.to("cpu")
        new_tokens = [ids_cpu[b][new_mask[b]].tolist() for b in range(B)]
        old_len = [r.length for r in self.requests] if past > 0 else [0] * B
        longest = max(o + len(t) for o, t in zip(old_len, new_tokens, strict=True))
        if past == 0:
            want = longest
            if self._planned is not None and self._planned[0] == B:
                want = max(want, self._planned[1])
            self.core.size(B, want)
            self._start(B, owner)
        elif longest > self.core.reserved_tokens:
            self._grow(longest)
        try:
            self.core.begin_forward(self.requests, new_tokens, new_mask)
        except BaseException:
            self.fail()
            raise
        self._pending_seen = past + S

    def _check_continuation(self, B: int, past: int, owner: Any) -> None:
        where = "OffloadSession.begin_forward"
        if self.broken:
            raise RuntimeError(f"{where}: an earlier forward of this sequence failed; start a new one")
        if owner is not None and owner is not self.owner:
            raise ValueError(
                f"{where}: this cache's sequence is not the one the session holds (a session serves one "
                "sequence at a time)"
            )
        if past != self.seen or len(self.requests) != B:
            raise ValueError(
                f"{where}: the sequence has {len(self.requests)} requests and {self.seen} positions, got a "
                f"batch of {B} with past={past}"
            )

    def run_forward(self, body: Callable[[], T]) -> T:
        """``body()`` in the forward :meth:`begin_forward` began, then :meth:`end_forward`; see
        :meth:`OffloadSession.run_forward` (a layerwise forward whose prefix cannot be loaded runs again
        with the prefixes cut)."""
        caps: list[int] | None = None
        while True:
            try:
                out = body()
            except BaseException as exc:
                caps = self.core.retry_caps(caps, exc)
                if caps is None:
                    self.abort_forward()
                    raise
                try:
                    self.core.restart(caps)
                except BaseException:
                    self.fail()
                    raise
                continue
            self.end_forward()
            return out

    def end_forward(self) -> None:
        """Finish the forward: wait for its transfers (raising the first failure)."""
        if self.core.forward is None:
            raise RuntimeError("OffloadSession.end_forward: no forward is running")
        try:
            self.core.end_forward()
        except BaseException:
            self.fail()
            raise
        self.seen = self._pending_seen

    def abort_forward(self) -> None:
        """Close a forward that raised and release the sequence's requests. Idempotent."""
        self.core.abort_forward()
        self.fail()

    # -------------------------------------------------------------------------------- lifetime
    def end(self) -> None:
        """Release the sequence's requests (the caches stay sized); idempotent."""
        seq, self.requests = self.requests, []
        self.core.finish([r.id for r in seq])
        self.seen, self.owner = 0, None

    def fail(self) -> None:
        """A forward of the sequence failed: release its requests; it cannot continue."""
        self.core.counters.add("failed_forwards")
        try:
            self.end()
        finally:
            self.broken = True

    def _start(self, B: int, owner: Any) -> None:
        self.end()
        self.owner, self.broken = owner, False
        try:
            self.requests = self.core.admit(B)
        except BaseException:
            self.fail()
            raise

    def begin_external(self, tokens: list[list[int]], width: int, owner: Any, *, has_host_pool: bool) -> None:
        """See :meth:`OffloadSession.begin_external_sequence`."""
        where = "OffloadSession.begin_external_sequence"
        core = self.core
        if core.forward is not None:
            raise RuntimeError(f"{where}: a forward is running")
        layout = core.layout
        if not has_host_pool or layout is None:
            raise ValueError(f"{where}: needs sparse decode offload, sized by reserve(batch, max_tokens)")
        if len(tokens) != layout.slots:
            raise ValueError(f"{where}: {len(tokens)} requests, {layout.slots} were reserved")
        lens = [len(t) for t in tokens]
        if (
            not isinstance(width, int)
            or width < max(lens, default=0)
            or width >= layout.tokens
            or min(lens) < 1
        ):
            raise ValueError(
                f"{where}: every request needs 1..width tokens and width < the reserved {layout.tokens}; "
                f"got width={width!r}, lengths {lens}"
            )
        core.drop_prefill_buffers()  # decode continues on the sparse path only
        self._start(len(tokens), owner)
        for r, t in zip(self.requests, tokens, strict=True):
            core.requests.extend(r.id, t)
        self.seen = width
