"""``HFSequence``: a Hugging Face generation as requests of the KV core, one sequence at a time.

Batch row ``r`` of a sequence is one request of the :class:`~torch_kvoffload.core.kv.KVCore`: its tokens
are the row's real tokens (padding, ``attention_mask == 0`` anywhere, is dropped), at logical positions
``0 .. len-1``; :attr:`HFSequence.masks` remembers which positions of each row were real. Hugging Face counts positions with the padding (``past``,
``seen``); the core counts each request's real tokens. A forward with ``past == 0`` ends the previous
sequence and starts a new one; its requests live until the next such forward, :meth:`end`, or a failed
forward (which releases them at once: a failed call leaves nothing reserved, and the next fresh forward
works). Later forwards must continue the sequence exactly (same batch, ``past`` = positions seen, same
cache object, the mask so far unchanged).

Between forwards the rows may change as a whole (:meth:`HFSequence.rebuild_rows`: beam search's reorder,
selecting or repeating rows; a row taking a request another row keeps gets a fork of it) and the last
positions may be dropped (:meth:`HFSequence.crop`: assisted decoding); both act on every backend.

Sizing: a fresh forward sizes the caches for its batch and the larger of its width and the planned tokens
per request (:meth:`plan` from ``generate``, :meth:`reserve`); a later forward may only grow them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.integrations.hf.inputs import forward_shape, model_positions, new_positions
from torch_kvoffload.kv.requests import Request

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
        self.unkeyed_requests = 0  # requests fed embeddings: not keyed by content, no prefix reuse
        self._pending_seen = 0  # what seen becomes when the running forward ends
        # bool [B, seen] (host): which positions of each row are real tokens (its request's rows)
        self.masks = torch.zeros(0, 0, dtype=torch.bool)
        self._pending_mask = self.masks

    @property
    def masks(self) -> torch.Tensor:
        return self._masks

    @masks.setter
    def masks(self, value: torch.Tensor) -> None:
        self._masks = value
        self._device_masks: torch.Tensor | None = None  # made again when a forward's mask is on a device

    def _masks_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`masks` on ``device``: kept there and extended by each forward (a decode step's mask is
        compared where it lives, not read back whole)."""
        if device.type == "cpu":
            return self._masks
        if self._device_masks is None or self._device_masks.device != device:
            self._device_masks = self._masks.to(device)
        return self._device_masks

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
        try:
            self.core.check_growth(tokens)
        except ValueError:
            raise ValueError(
                f"OffloadSession: the running sequence needs {tokens} tokens per request but "
                f"{self.core.reserved_tokens} were reserved; pass max_new_tokens to generate() (or call "
                "reserve() before the first forward)"
            ) from None
        try:
            self.core.grow(tokens)
        except BaseException:  # e.g. out of memory: the sequence cannot continue
            self.fail()
            self.core.discard()
            raise

    # --------------------------------------------------------------------------------- forwards
    def begin_forward(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cache_position: torch.Tensor | None,
        past: int | None,
        owner: Any,
        shape: tuple[int, int] | None = None,
        position_ids: torch.Tensor | None = None,
        unkeyed: str | None = None,
    ) -> None:
        """See :meth:`OffloadSession.begin_forward`; ``input_ids`` ``None`` (the forward is fed embeddings of
        ``shape`` ``(B, S)``) or ``unkeyed`` (why this forward's KV is not what its tokens alone give):
        its rows' requests are not keyed (see :class:`Request`). With layerwise
        offload the requests record the model positions of their tokens (``position_ids``, else
        transformers' default ``past ..``): the store keys their blocks by them."""
        where = "OffloadSession.begin_forward"
        # how the forward's rows come without a content key (None: keyed by their token ids)
        unkeyed_as = (
            f"with {unkeyed}" if unkeyed is not None else "from inputs_embeds" if input_ids is None else None
        )
        if self.core.forward is not None:
            raise RuntimeError(f"{where}: a forward is running; call end_forward()")
        if input_ids is None:
            if shape is None:
                raise ValueError(f"{where}: pass input_ids or the shape of inputs_embeds")
            B, S = shape
        else:
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
            if (
                unkeyed_as is not None
                and any(r.keyed for r in self.requests)
                and self.core.backends.layerwise
            ):
                raise ValueError(
                    f"{where}: a sequence started from input_ids cannot continue {unkeyed_as} with layerwise "
                    f"offload (its stored blocks are keyed by token ids); start it {unkeyed_as}"
                )
        seen = None
        if past > 0:
            on = attention_mask.device if isinstance(attention_mask, torch.Tensor) else torch.device("cpu")
            seen = self._masks_on(on)
        new_mask = new_positions(attention_mask, B, S, past, seen)
        # only the layerwise store keys read them (and reading position_ids waits for the device)
        positions = (
            model_positions(position_ids, B, S, past, new_mask)
            if self.core.backends.layerwise is not None
            else None
        )
        if input_ids is None:
            new_tokens = [[-1] * int(n) for n in new_mask.sum(dim=1).tolist()]
        elif bool(new_mask.all()):  # no padding (every decode step): the rows as they are
            new_tokens = input_ids.to("cpu").tolist()
        else:
            ids_cpu = input_ids.to("cpu")
            new_tokens = [ids_cpu[b][new_mask[b]].tolist() for b in range(B)]
        old_len = [r.length for r in self.requests] if past > 0 else [0] * B
        longest = max(o + len(t) for o, t in zip(old_len, new_tokens, strict=True))
        if past == 0:
            self.size_fresh(B, longest)
            self._start(B, owner)
        elif longest > self.core.reserved_tokens:
            self._grow(longest)
        self._begin(new_tokens, new_mask, positions, unkeyed_as is not None, past + S)

    def _begin(
        self,
        new_tokens: list[list[int]],
        new_mask: torch.Tensor | None,
        positions: list[list[int]] | None,
        unkeyed: bool,
        seen: int,
    ) -> None:
        """Begin the core's forward of the sequence's requests (``new_mask None``: packed), their rows
        unkeyed first when ``unkeyed``; a failure ends the sequence. :meth:`end_forward` then records
        ``seen`` positions and the new mask."""
        if unkeyed:
            for r in self.requests:
                if r.keyed:
                    r.keyed = False
                    self.unkeyed_requests += 1
        try:
            self.core.begin_forward(self.requests, new_tokens, new_mask, positions=positions)
        except BaseException:
            self.fail()
            raise
        self._pending_seen = seen
        self._pending_mask = (
            new_mask if new_mask is not None else torch.zeros(len(new_tokens), 0, dtype=torch.bool)
        )

    def run_packed(
        self,
        body: Callable[[], T],
        tokens: list[list[int]],
        positions: torch.Tensor | None,
        unkeyed: bool,
    ) -> T:
        """One packed forward of independent sequences without a cache: ``tokens[i]`` is segment ``i``'s, a
        new request each; ``body()`` runs the model over their tokens one after the other in one row ``[1,
        n]`` (no padding computed); the requests are released after it. Ends the running sequence first, as
        a forward from position 0 does. ``positions int64 [n]``: the model positions of the segments'
        tokens, one after the other (``None``: ``0 ..`` each), which the layerwise store keys its blocks by
        (read only then: reading them waits for the device); ``unkeyed``: the forward is fed embeddings,
        no block is keyed. A layerwise prefix that cannot be loaded runs the forward again with the
        prefixes cut (:meth:`run_forward`)."""
        where = "OffloadSession.run_packed"
        if self.core.forward is not None:
            raise RuntimeError(f"{where}: a forward is running; call end_forward()")
        lengths = [len(t) for t in tokens]
        if not lengths or min(lengths) < 1:
            raise ValueError(f"{where}: every segment needs at least one token, got lengths {lengths}")
        keys = None
        if positions is not None and self.core.backends.layerwise is not None:
            keys = [p.tolist() for p in positions.to("cpu").split(lengths)]
        self.end()  # a packed forward starts sequences of its own, as any forward from position 0
        self.core.size(len(tokens), max(lengths))
        self._start(len(tokens), None)
        self._begin(tokens, None, keys, unkeyed, 0)
        try:
            return self.run_forward(body)
        finally:
            self.end()  # nothing continues a forward without a cache

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
        kept = self._device_masks
        self.masks = (
            torch.cat([self.masks, self._pending_mask], dim=1) if self.masks.numel() else self._pending_mask
        )
        if kept is not None:  # extended on its device too
            pending = self._pending_mask.to(kept.device, non_blocking=True)
            self._device_masks = torch.cat([kept, pending], dim=1) if kept.numel() else pending

    def abort_forward(self) -> None:
        """Close a forward that raised and release the sequence's requests. Idempotent."""
        self.core.abort_forward()
        self.fail()

    # ------------------------------------------------------------------------------- batch rows
    def _between_forwards(self, where: str) -> None:
        if self.core.forward is not None:
            raise RuntimeError(f"{where}: a forward is running")
        if self.broken:
            raise RuntimeError(f"{where}: an earlier forward of this sequence failed; start a new one")

    def rebuild_rows(self, sources: list[int], where: str) -> None:
        """The batch becomes ``len(sources)`` rows, row ``i`` continuing today's row ``sources[i]``
        (beam search's reorder, a selection of rows, a repetition of each row).

        Each source request goes to the first row that takes it (a row that keeps its own request first);
        requests no row takes end; every further row taking a source gets a fork of it (a new request
        with a copy of its rows, in a slot an ended request freed). ``ValueError`` (nothing changed) when
        a source is out of range or the rows need more slots than the caches were sized for. A fork that
        fails ends the sequence and the error propagates.
        """
        self._between_forwards(where)
        B = len(self.requests)
        if any(not 0 <= s < B for s in sources):
            raise ValueError(f"{where}: row indices must be in [0, {B}), got {sources}")
        if not self.requests:
            return
        layout = self.core.layout
        assert layout is not None
        if len(sources) > layout.slots:
            raise ValueError(
                f"{where}: {len(sources)} rows but the caches hold {layout.slots} requests; plan the "
                "generation for the expanded batch (generate does: batch x max(num_beams, num_return_sequences))"
            )
        if sources == list(range(B)):
            return
        rows: list[Request | None] = [None] * len(sources)
        taken: set[int] = set()
        for i, src in enumerate(sources):  # rows keeping their own request first: no fork for them
            if i < B and src == i:
                rows[i] = self.requests[src]
                taken.add(src)
        for i, src in enumerate(sources):
            if rows[i] is None and src not in taken:
                rows[i] = self.requests[src]
                taken.add(src)
        self.core.finish([r.id for b, r in enumerate(self.requests) if b not in taken])
        try:
            for i, src in enumerate(sources):
                if rows[i] is None:
                    rows[i] = self.core.fork(self.requests[src].id)
        except BaseException:
            forked = [r.id for r in rows if r is not None and all(r is not q for q in self.requests)]
            self.core.finish(forked)
            self.fail()
            raise
        self.requests = [r for r in rows if r is not None]
        self.masks = self.masks[torch.tensor(sources, dtype=torch.int64)]

    def crop(self, remove: int) -> None:
        """Forget the last ``remove`` positions of every row (assisted decoding's rejected draft tokens):
        each request keeps its real tokens before position ``seen - remove``."""
        where = "OffloadCache.crop"
        self._between_forwards(where)
        if isinstance(remove, bool) or not isinstance(remove, int) or not 0 <= remove <= self.seen:
            raise ValueError(f"{where}: can remove 0..{self.seen} positions, got {remove!r}")
        if remove == 0 or not self.requests:
            return
        keep = self.seen - remove
        masks = self.masks[:, :keep]
        lengths = masks.sum(dim=1).tolist()
        try:
            for r, n in zip(self.requests, lengths, strict=True):
                self.core.truncate(r.id, int(n))
        except BaseException:
            self.fail()
            raise
        self.seen, self.masks = keep, masks

    # -------------------------------------------------------------------------------- lifetime
    def end(self, persist: bool = True) -> None:
        """Release the sequence's requests (the caches stay sized); idempotent. With ``persist`` (not after a
        failure) the blocks their decode steps completed go to the store first (prefix reuse)."""
        seq, self.requests = self.requests, []
        if persist and not self.broken:
            self.core.prefix.persist(seq)
        self.core.finish([r.id for r in seq])
        self.seen, self.owner = 0, None
        self.masks = torch.zeros(0, 0, dtype=torch.bool)

    def fail(self) -> None:
        """A forward of the sequence failed: release its requests; it cannot continue."""
        self.core.counters.add("failed_forwards")
        try:
            self.end(persist=False)
        finally:
            self.broken = True

    def size_fresh(self, B: int, longest: int) -> None:
        """What a fresh forward of ``B`` rows of at most ``longest`` real tokens does first: end the running
        sequence and size the caches (for the planned tokens when the plan is for ``B`` rows)."""
        want = longest
        if self._planned is not None and self._planned[0] == B:
            want = max(want, self._planned[1])
        self.end()
        self.core.size(B, want)

    def start_with_prefix(
        self,
        owner: Any,
        masks: torch.Tensor,
        prompts: list[list[int]],
        positions: list[list[int] | None],
        lengths: list[int],
    ) -> None:
        """Start a sequence of ``len(prompts)`` rows whose first ``masks.shape[1]`` positions (``masks bool
        [B, P]``: which are real) hold stored KV: row ``r``'s request adopts the first ``lengths[r]`` tokens
        of its prompt ``prompts[r]`` (at ``positions[r]``) from the store (:class:`~torch_kvoffload.core.
        prefix.PrefixReuse`), sized as a fresh forward of the whole prompts would size it; the next forward
        continues at ``past = P``. Rows with the same prompt and length (beams, ``num_return_sequences``)
        adopt once: the others are forks of the first (:meth:`KVCore.fork`: host-pool blocks shared). On
        failure the sequence is ended (not broken: a fresh forward follows) and the error propagates.
        :meth:`size_fresh` first."""
        self._start(len(prompts), owner)
        first: dict[tuple, int] = {}
        copies: dict[int, int] = {}  # row -> the earlier row it continues
        for b, (prompt, pos, n) in enumerate(zip(prompts, positions, lengths, strict=True)):
            key = (n, tuple(prompt), None if pos is None else tuple(pos))
            if n and key in first:
                copies[b] = first[key]
            first.setdefault(key, b)
        own = [b for b in range(len(prompts)) if b not in copies]
        core = self.core
        try:
            core.prefix.adopt(
                [self.requests[b] for b in own], [prompts[b] for b in own], [positions[b] for b in own],
                [lengths[b] for b in own],
            )  # fmt: skip
            for b, src in copies.items():
                core.finish([self.requests[b].id])
                self.requests[b] = core.fork(self.requests[src].id)
                core.prefix.counters.add("prefix_store_tokens", lengths[b])
        except BaseException:
            self.end(persist=False)
            raise
        self.seen, self.masks = int(masks.shape[1]), masks

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
            for backend in core.backends.all:
                backend.received(r, len(t))
        self.seen = width
        self.masks = torch.arange(width)[None, :] >= torch.tensor([width - n for n in lens])[:, None]
