"""``ServingRequests``: an offloaded model's KV under continuous batching, one library request per CB request.

transformers' continuous batching (``generate_batch``, the ``ContinuousBatchingManager``, ``transformers
serve``) schedules requests that arrive and finish at any time and packs each step's tokens into one row:
decode tokens of some requests and prefill chunks of others (``input_ids [1, Q]``, ``cu_seq_lens_q``).
Here each CB request id holds one request of the session's :class:`~torch_kvoffload.core.kv.KVCore`,
admitted when the scheduler first stores tokens for it (:meth:`admit`: host-pool blocks, hot buffers and
indexer-cache rows reserved) and finished when the scheduler frees its blocks (:meth:`finish`: end,
cancellation, failure, a reset). A step (:meth:`run_step`) runs as at most two forwards of the library's
attention: every decode row in one batch ``[R, 1]`` (the sparse decode path: indexer, residency, only the
misses copied), every prefill chunk in one right-padded batch ``[P, longest chunk]`` (layerwise offload when
configured; a later chunk attends over its request's earlier rows). The logits of each request's last
token of the step are placed where the step's ``logits_indices`` read them.

Sizing (:meth:`plan`): every device cache is sized once for :attr:`slots` requests of
``config.serving.max_request_tokens`` tokens; with ``device_kv_budget`` the slots are as many as fit,
measured on the allocated caches (a fixed part, the layer buffers, and a part per request, the hot
buffers and indexer rows), so admission counts what really sits on the device.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

from torch_kvoffload.core.requests import Request

if TYPE_CHECKING:
    from torch_kvoffload.integrations.hf.session import OffloadSession

logger = logging.getLogger(__name__)

__all__ = ["ServingRequests", "serving_slots"]

#: requests held at once when ``config.serving`` gives neither ``max_requests`` nor a device budget
DEFAULT_REQUESTS = 8


def serving_slots(session: OffloadSession) -> tuple[int, int, int]:
    """``(slots, device bytes per request, fixed device bytes)`` for ``session.config.serving``; the device
    caches are left sized for ``slots`` requests. ``ValueError`` (naming the option) when the budget holds no
    request or ``max_requests`` do not fit in it. Needs no live request."""
    opts, core = session.config.serving, session.core
    tokens = opts.max_request_tokens
    core.size(1, tokens)
    one = core.device_kv_bytes()
    core.size(2, tokens)
    per = core.device_kv_bytes() - one
    fixed = one - per
    if opts.device_kv_budget is None:
        slots = opts.max_requests or DEFAULT_REQUESTS
    else:
        budget = opts.device_kv_budget
        fit = (budget - fixed) // per if per > 0 else None
        if fit is None and opts.max_requests is None:
            raise ValueError(
                "serving.device_kv_budget: no device KV is held per request in this configuration; set "
                "serving.max_requests instead"
            )
        slots = opts.max_requests if opts.max_requests is not None else int(fit or 0)
        if slots < 1 or (fit is not None and slots > fit):
            raise ValueError(
                f"serving.device_kv_budget={budget} bytes holds {max(int(fit or 0), 0)} request(s) of "
                f"{tokens} tokens ({fixed} bytes fixed + {per} per request on the device), "
                f"{'need at least 1' if slots < 1 else f'max_requests={slots} asked'}"
            )
    core.size(slots, tokens)
    if opts.device_kv_budget is not None and core.device_kv_bytes() > opts.device_kv_budget:
        raise ValueError(
            f"serving.device_kv_budget={opts.device_kv_budget} bytes: {slots} requests hold "
            f"{core.device_kv_bytes()} bytes on the device"
        )
    return slots, per, fixed


class ServingRequests:
    """The continuous-batching requests of one offloaded model's session (see the module docstring).

    Used from the CB manager's generation thread only (:meth:`open` → steps → :meth:`close`); the session
    refuses ``forward`` / ``generate`` callers while it is open (:attr:`is_open`).
    """

    def __init__(self, session: OffloadSession) -> None:
        self.session = session
        self.max_tokens = session.config.serving.max_request_tokens
        self.slots = 0
        #: device bytes the caches hold per request and in total for :attr:`slots` (from :meth:`plan`)
        self.device_bytes_per_request = 0
        self.fixed_device_bytes = 0
        self._live: dict[str, Request] = {}
        self._step: list[tuple[str, int, int]] = []  # (request id, past, query) in packed order
        self._open = threading.Event()
        self.steps = 0

    # ----------------------------------------------------------------------------------- lifetime
    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def plan(self) -> int:
        """Size the caches for serving (:func:`serving_slots`, measured once per session) and return
        :attr:`slots`. The model's ``generate()`` sequence, if any, ends."""
        if self.is_open:
            return self.slots
        if self.session.forward_running:
            raise RuntimeError("continuous batching: the offloaded model is running a forward; wait for it")
        self.session.end_sequence()
        if not self.slots:
            self.slots, self.device_bytes_per_request, self.fixed_device_bytes = serving_slots(self.session)
        return self.slots

    def open(self) -> None:
        """Start serving: caches sized for :attr:`slots` requests, no request live."""
        session = self.session
        self.plan()  # refuses a running forward and ends the generate() sequence
        session.core.size(self.slots, self.max_tokens)
        session.core.keep_prefill_buffers = True
        self._live, self._step = {}, []
        self._open.set()
        logger.info(
            "offload session %s serves %d requests of %d tokens (device KV %d bytes)",
            session.name, self.slots, self.max_tokens, session.device_kv_bytes(),
        )  # fmt: skip

    def close(self) -> None:
        """Stop serving: every request finishes; the model may ``generate()`` again. Idempotent."""
        if not self.is_open:
            return
        core = self.session.core
        try:
            if core.forward is not None:
                core.abort_forward()
            self.finish_all()
        finally:
            self._live, self._step = {}, []
            core.keep_prefill_buffers = False
            self._open.clear()

    # ----------------------------------------------------------------------------------- requests
    @property
    def live(self) -> int:
        return len(self._live)

    def check_length(self, request_id: str, tokens: int) -> None:
        """``ValueError`` when a request of ``tokens`` tokens (prompt + new) cannot be held."""
        if tokens > self.max_tokens:
            raise ValueError(
                f"continuous batching of an offloaded model: request {request_id} needs {tokens} tokens "
                f"(prompt + max_new_tokens) but each request holds at most serving.max_request_tokens="
                f"{self.max_tokens}; raise it in the OffloadConfig"
            )

    def can_admit(self, request_id: str, tokens: int) -> bool:
        """Whether ``request_id`` holds, or could now get, a slot for ``tokens`` tokens in all."""
        if tokens > self.max_tokens:
            return False
        return request_id in self._live or len(self._live) < self.slots

    def admit(self, request_id: str) -> None:
        """``request_id`` gets a slot (idempotent)."""
        if request_id not in self._live:
            (self._live[request_id],) = self.session.core.admit(1)

    def finish(self, request_id: str) -> None:
        """``request_id``'s KV is released (idempotent; unknown ids are ignored)."""
        r = self._live.pop(request_id, None)
        if r is not None:
            self.session.core.finish([r.id])

    def finish_all(self) -> None:
        ids = [r.id for r in self._live.values()]
        self._live = {}
        self.session.core.finish(ids)

    def record(self, request_id: str, past: int, query: int) -> None:
        """The step being packed feeds ``query`` tokens of ``request_id`` after its first ``past``."""
        self._step.append((request_id, past, query))

    # --------------------------------------------------------------------------------------- steps
    def run_step(self, model: torch.nn.Module, kwargs: dict[str, Any]) -> Any:
        """One packed CB step (``input_ids [1, Q]``, ``cu_seq_lens_q``, ``logits_indices``) on ``model``;
        returns an output whose ``logits [1, Q, V]`` hold each request's last token of the step (only the
        positions of ``logits_to_keep`` when given, as the model's own forward does)."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        step, self._step = self._step, []
        ids = kwargs["input_ids"]
        cu = kwargs["cu_seq_lens_q"].tolist()
        if not self.is_open:
            raise RuntimeError("continuous batching: the offloaded model's serving state is closed")
        packed = [b - a for a, b in itertools.pairwise(cu)]
        if packed != [q for _, _, q in step]:
            raise RuntimeError(
                f"continuous batching: the step packs query lengths {packed} "
                f"but the scheduler recorded {[(rid, q) for rid, _, q in step]} (padded or asynchronous "
                "batching is not supported for offloaded models)"
            )
        flat = ids.reshape(-1).tolist()
        decode: list[tuple[Request, int, int, int]] = []  # (request, past, packed start, query length)
        prefill: list[tuple[Request, int, int, int]] = []
        for (rid, past, q), start in zip(step, cu, strict=False):
            r = self._live.get(rid)
            if r is None or r.length != past:
                raise RuntimeError(
                    f"continuous batching: request {rid} continues at position {past} but the library holds "
                    f"{'no request' if r is None else f'{r.length} tokens'} for it"
                )
            (decode if past > 0 and q == 1 else prefill).append((r, past, start, q))
        logits: torch.Tensor | None = None
        for rows in (decode, prefill):  # decode rows first: the sparse decode path, then the prefill chunks
            if rows:
                logits = self._forward(model, rows, flat, logits)
        self.steps += 1
        keep = kwargs.get("logits_to_keep")
        if isinstance(keep, torch.Tensor):  # as the model's own forward: only these positions' logits
            logits = logits[:, keep.to(logits.device)]
        elif isinstance(keep, int) and keep > 0:
            logits = logits[:, -keep:]
        return CausalLMOutputWithPast(logits=logits)

    def _forward(
        self,
        model: torch.nn.Module,
        rows: list[tuple[Request, int, int, int]],
        flat: list[int],
        logits: torch.Tensor | None,
    ) -> torch.Tensor:
        """One forward of the library's attention over ``rows`` (request, past, packed start, length),
        right-padded to the longest; the logits of each row's last token go to its packed position in
        ``logits [1, Q, V]`` (allocated when ``None``), which is returned."""
        core, device = self.session.core, self.session.spec.device
        B, S = len(rows), max(q for *_, q in rows)
        mask = torch.zeros(B, S, dtype=torch.bool)
        ids = torch.zeros(B, S, dtype=torch.int64)
        tokens = []
        for b, (_, _, start, q) in enumerate(rows):
            mask[b, :q] = True
            tokens.append(flat[start : start + q])
            ids[b, :q] = torch.tensor(tokens[-1])
        past = torch.tensor([p for _, p, _, _ in rows])
        pos = past[:, None] + torch.arange(S)[None, :]
        last = torch.tensor([q - 1 for *_, q in rows])
        keep = torch.unique(last)  # the columns whose logits are needed
        # the padding's outputs are never read: it attends nowhere
        core.begin_forward([r for r, *_ in rows], tokens, mask, padding_queries=False)
        try:
            out = model._kvoffload_originals["forward"](
                input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False,
                logits_to_keep=keep.to(device),
            ).logits  # fmt: skip
        except BaseException:
            core.abort_forward()
            raise
        core.end_forward()
        if logits is None:
            logits = out.new_zeros(1, len(flat), out.shape[-1])
        col = torch.searchsorted(keep, last)
        at = torch.tensor([start + q - 1 for _, _, start, q in rows])
        logits[0, at.to(out.device)] = out[torch.arange(B, device=out.device), col.to(out.device)]
        return logits
