"""``ServingPrefixes``: prefix reuse for the requests of continuous batching.

transformers' scheduler asks for a new request's cached prefix as it first schedules it
(``search_prefix_match``, answered by :meth:`ServingPrefixes.adopt`): the request's library request is
admitted holding the prefix the store has (:class:`~torch_kvoffload.core.prefix.PrefixReuse`), and the
scheduler schedules only the rest. A new request whose prompt starts with full blocks that another request
taken into the same step is computing now, and the store does not hold yet, sits out that step
(:meth:`ServingPrefixes.waits`: the cache refuses to store its tokens, so the scheduler leaves it waiting)
and is asked again at the next one, when those blocks are stored: requests arriving together with one
system prompt compute it once. Under tensor parallelism the ranks, which schedule in lock step, agree on
what each request takes over (:meth:`~torch_kvoffload.core.prefix.PrefixReuse.agree`).
"""

from __future__ import annotations

from typing import Any

from torch_kvoffload.core.prefix import shared_prefix

__all__ = ["ServingPrefixes"]


class ServingPrefixes:
    """Prefix reuse of ``serving``'s requests (see the module docstring); the generation thread only."""

    def __init__(self, serving: Any) -> None:  # a ServingRequests (which imports this module)
        self.serving = serving
        self.reset()

    def reset(self) -> None:
        #: the prompt of each request looked up; the step a new request sits out
        self._prompts: dict[str, list[int]] = {}
        self._waiting_at: dict[str, int] = {}
        #: the step being planned and the requests the scheduler took into it so far
        self._taken: tuple[int, list[str]] = (-1, [])

    def forget(self, request_id: str) -> None:
        for held in (self._prompts, self._waiting_at):
            held.pop(request_id, None)

    def scheduled(self, request_id: str) -> None:
        """The scheduler took ``request_id`` into the step being planned."""
        step, taken = self._taken
        if step != self.serving.steps:
            self._taken = step, taken = self.serving.steps, []
        taken.append(request_id)

    def waits(self, request_id: str) -> bool:
        """Whether new request ``request_id`` sits out the step being planned (another request of the step
        computes the prefix they share; it adopts that prefix in a later step instead)."""
        return self._waiting_at.get(request_id) == self.serving.steps

    def adopt(self, request_id: str, prompt: list[int]) -> int:
        """Tokens of a new request's ``prompt`` taken over from the store before its first step: its library
        request is admitted now holding them. 0, nothing admitted, when nothing is cached, no slot is free,
        the request sits out this step (:meth:`waits`), or the adoption fails (the store no longer gives
        the prefix when it is read: counted in ``prefix_fallbacks``, and the request computes its whole
        prompt; never an error in the scheduler's loop)."""
        serving = self.serving
        reuse = serving.session.core.prefix
        if serving.request(request_id) is not None or serving.live >= serving.slots or not reuse.enabled:
            return 0
        # asked again at each step while the request waits: another request may have stored its prefix since
        (found,) = reuse.agree([reuse.lookup(prompt, None, new=request_id not in self._prompts)])
        self._prompts[request_id] = prompt = list(prompt)
        if self._computed_by_another(request_id, prompt, found):
            self._waiting_at[request_id] = serving.steps
            reuse.counters.add("prefix_waits")
            return 0
        if not found:
            return 0
        request = serving.admit(request_id)

        def undo() -> None:  # another TP rank could not take it over
            serving.session.core.finish([request.id])

        # on failure adopt finished the request: it computes its prompt, in a free slot again
        error = reuse.together(lambda: reuse.adopt([request], [prompt], [None], [found]), undo, None)
        if error is not None:
            serving.drop(request_id)
            reuse.fell_back(f"continuous batching, request {request_id}", error)
            return 0
        return found

    def _computed_by_another(self, request_id: str, prompt: list[int], found: int) -> bool:
        """Whether a request the scheduler took into this step computes full blocks of ``prompt`` that the
        store does not hold yet, right after the ``found`` tokens it holds: they are stored as the step ends.
        Each step a request waits, that request computes more of its prompt, so the wait ends."""
        serving = self.serving
        block = serving.session.config.resolved_block_size
        if found >= (len(prompt) - 1) // block * block:  # the store holds every block it could take over
            return False
        step, taken = self._taken
        for other in taken if step == serving.steps else ():
            r, other_prompt = serving.request(other), self._prompts.get(other)
            if other == request_id or r is None or other_prompt is None:
                continue
            if r.length // block >= len(other_prompt) // block:  # its prompt's blocks are computed (decoding)
                continue
            shared = shared_prefix(prompt, other_prompt, block)
            # its blocks of the prefix completed before this step
            done = min(shared, r.length // block * block)
            if shared > found >= done:  # the store holds those, and it computes the next ones now
                return True
        return False
