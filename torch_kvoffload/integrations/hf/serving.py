"""``ServingRequests``: an offloaded model's KV under continuous batching, one library request per CB request.

transformers' continuous batching (``generate_batch``, the ``ContinuousBatchingManager``, ``transformers
serve``) schedules requests that arrive and finish at any time and packs each step's tokens into one row:
decode tokens of some requests and prefill chunks of others (``input_ids [1, Q]``, ``cu_seq_lens_q``).
Here each CB request id holds one request of the session's :class:`~torch_kvoffload.core.kv.KVCore`,
admitted when the scheduler first stores tokens for it (:meth:`admit`: host-pool blocks, hot buffers and
indexer-cache rows reserved) and finished when the scheduler frees its blocks (:meth:`finish`: end,
cancellation, failure, a reset). A step (:meth:`run_step`) is cut into its segments by
:class:`~torch_kvoffload.integrations.hf.packed.PackedRows`, the layout packed forwards use too, and runs
as one packed forward of the library's attention (the segments' tokens one after the other in one row, no
padding computed) whose decode tokens take the sparse decode path (indexer, residency, only the misses
copied) and whose prompt chunks the prefill path (layerwise offload when configured; a later chunk attends
over its request's earlier rows): :func:`~torch_kvoffload.kv.forward.plan_mixed`, on a P/D node too. The
logits of each request's last token of the step are placed where the step's ``logits_indices`` read them.

Sizing (:meth:`plan`): every device cache is sized once for :attr:`slots` requests of
``config.serving.max_request_tokens`` tokens; with ``device_kv_budget`` the slots are as many as fit,
measured on the allocated caches (a fixed part, the layer buffers, and a part per request, the hot
buffers and indexer rows), so admission counts what really sits on the device.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
import zlib
from typing import TYPE_CHECKING, Any

import torch

from torch_kvoffload.integrations.hf.packed import PackedRows
from torch_kvoffload.integrations.hf.serving_prefix import ServingPrefixes
from torch_kvoffload.kv.group_outcomes import exchange_outcomes
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.sparse.hybrid_backend import HybridSparseBackend

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
    hybrid = core.backends.sparse if isinstance(core.backends.sparse, HybridSparseBackend) else None
    # a hybrid backend's resident pool fills what the budget leaves: a request is held by its offloaded
    # footprint (hot buffers, indexer rows), measured without the pool
    with hybrid.without_pool() if hybrid is not None else contextlib.nullcontext():
        core.size(1, tokens)
        one = core.device_kv_bytes()
        core.size(2, tokens)
        per = core.device_kv_bytes() - one
        fixed = one - per
    if hybrid is not None:
        core.discard()  # sized again below, with the pool
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
    _check_host_pool(session, slots, tokens)
    core.size(slots, tokens)
    if opts.device_kv_budget is not None and core.device_kv_bytes() > opts.device_kv_budget:
        raise ValueError(
            f"serving.device_kv_budget={opts.device_kv_budget} bytes: {slots} requests hold "
            f"{core.device_kv_bytes()} bytes on the device"
        )
    return slots, per, fixed


def _check_host_pool(session: OffloadSession, slots: int, tokens: int) -> None:
    """``ValueError`` naming ``sparse.host_pool_blocks`` when a pool of that many blocks (given in the config;
    by default the pool is sized for the requests) cannot hold ``slots`` requests of ``tokens`` tokens."""
    sparse = session.config.sparse
    given = None if sparse is None or not sparse.offload else sparse.host_pool_blocks
    if given is None:
        return
    per = -(-tokens // session.config.resolved_block_size)
    if given < slots * per:
        raise ValueError(
            f"sparse.host_pool_blocks={given} cannot hold {slots} requests of serving.max_request_tokens="
            f"{tokens} tokens ({per} blocks of {session.config.resolved_block_size} tokens each, {slots * per} in "
            "all); raise it, lower serving.max_requests / max_request_tokens, or leave it unset (sized for them)"
        )


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
        self.prefixes = ServingPrefixes(self)
        self._step: list[tuple[str, int, int]] = []  # (request id, past, query) in packed order
        self._open = threading.Event()
        self.steps = 0
        #: ids added and not answered yet (:meth:`claim`); guarded by :attr:`_lock` (callers' threads and
        #: the generation thread)
        self._claimed: set[str] = set()
        self._lock = threading.Lock()
        self._owner: weakref.ref | None = None
        #: the error of the last step that failed as a whole (:meth:`run_step`), until :meth:`take_step_error`
        self._step_error: BaseException | None = None
        #: ``{request id: error}`` of the last step's requests that failed alone, until :meth:`take_failed`
        self._failed: dict[str, BaseException] = {}

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

    def planned_slots(self) -> int:
        """The requests :meth:`plan` will hold, without sizing anything: ``serving.max_requests`` or the
        default, or (with a device budget, which only measuring the caches settles) :attr:`slots` once
        planned, else ``serving.max_requests`` or 1."""
        opts = self.session.config.serving
        if self.slots:
            return self.slots
        if opts.device_kv_budget is None:
            return opts.max_requests or DEFAULT_REQUESTS
        return opts.max_requests or 1

    def open(self) -> None:
        """Start serving: caches sized for :attr:`slots` requests, no request live."""
        session = self.session
        self.plan()  # refuses a running forward and ends the generate() sequence
        session.core.size(self.slots, self.max_tokens)
        session.core.keep_prefill_buffers = True
        self._live, self._step = {}, []
        self.prefixes.reset()
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

    # ------------------------------------------------------------------------------------- owner
    def take_ownership(self, manager: Any, who: str) -> None:
        """``manager`` becomes the one continuous-batching manager of this model; ``RuntimeError`` naming
        ``who`` while another one holds it (created, and neither stopped nor collected)."""
        with self._lock:
            held = self._owner() if self._owner is not None else None
            if held is not None and held is not manager:
                raise RuntimeError(
                    f"{who}: another ContinuousBatchingManager of this offloaded model exists and has not "
                    "stopped; one manager at a time holds the model's KV caches (stop it first, or add the "
                    "requests to it)"
                )
            self._owner = weakref.ref(manager)

    def release_ownership(self, manager: Any) -> None:
        """``manager`` no longer holds the model (it stopped); another may be created."""
        with self._lock:
            if self._owner is not None and self._owner() in (manager, None):
                self._owner = None

    # ----------------------------------------------------------------------------------- requests
    @property
    def live(self) -> int:
        return len(self._live)

    def claim(self, request_id: str) -> None:
        """``request_id`` is taken until its last output is delivered (:meth:`release`). ``ValueError`` when
        it is taken already: two live requests of one id would read each other's outputs."""
        with self._lock:
            if request_id in self._claimed:
                raise ValueError(
                    f"continuous batching of an offloaded model: request id {request_id!r} is already in use by a "
                    "request that has not finished; give each live request its own id"
                )
            self._claimed.add(request_id)

    def release(self, request_id: str) -> None:
        with self._lock:
            self._claimed.discard(request_id)

    def refusal(self, request_id: str, prompt: int, new: int) -> str | None:
        """Why a request of ``prompt`` prompt tokens and up to ``new`` new ones cannot be served (``None``:
        it can)."""
        if prompt == 0:
            return (
                f"continuous batching of an offloaded model: request {request_id} has an empty prompt (a "
                "request needs at least one token to attend to)"
            )
        if prompt + new > self.max_tokens:
            return (
                f"continuous batching of an offloaded model: request {request_id} needs {prompt + new} tokens "
                f"(prompt + max_new_tokens) but each request holds at most serving.max_request_tokens="
                f"{self.max_tokens}; raise it in the OffloadConfig"
            )
        return None

    def take_step_error(self) -> BaseException | None:
        """The error of the step that just ran, if it failed as a whole (then cleared)."""
        error, self._step_error = self._step_error, None
        return error

    def take_failed(self) -> dict[str, BaseException]:
        """``{request id: error}`` of the step that just ran: its requests that failed alone (then cleared)."""
        failed, self._failed = self._failed, {}
        return failed

    def can_admit(self, request_id: str, tokens: int) -> bool:
        """Whether ``request_id`` holds, or could now get, a slot for ``tokens`` tokens in all."""
        if tokens > self.max_tokens:
            return False
        return request_id in self._live or len(self._live) < self.slots

    def admit(self, request_id: str) -> Request:
        """``request_id`` gets a slot (idempotent); returns its library request."""
        if request_id not in self._live:
            (self._live[request_id],) = self.session.core.admit(1)
        return self._live[request_id]

    def request(self, request_id: str) -> Request | None:
        return self._live.get(request_id)

    def drop(self, request_id: str) -> None:
        """Forget ``request_id``'s library request, which the core already finished."""
        self._live.pop(request_id, None)

    def scheduled(self, request_id: str) -> None:
        """The scheduler takes ``request_id`` into the step being planned: it gets a slot (:meth:`admit`)."""
        self.admit(request_id)
        self.prefixes.scheduled(request_id)

    def finish(self, request_id: str) -> None:
        """``request_id``'s KV is released (idempotent; unknown ids are ignored)."""
        self.prefixes.forget(request_id)
        r = self._live.pop(request_id, None)
        if r is not None:
            self.session.core.prefix.persist([r])  # its decoded blocks, for a later turn of its conversation
            self.session.core.finish([r.id])
            if logger.isEnabledFor(logging.INFO):  # a leak shows as rows held with no request live
                logger.info(
                    "continuous batching of %s: request %s finished; %d live, reserved_requests %d",
                    self.session.name, request_id, len(self._live),
                    self.session.stats().get("reserved_requests", 0),
                )  # fmt: skip

    def finish_all(self) -> None:
        self.prefixes.reset()
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
        ids = kwargs["input_ids"].to("cpu", torch.int64)  # host once: the requests' tokens are read there
        logits: torch.Tensor | None = None
        self._step_error, self._failed = None, {}
        try:
            layout, requests = self._agree_step(step, ids, kwargs["cu_seq_lens_q"])
            if step:  # one forward: its decode tokens take the sparse decode path inside it (plan_mixed)
                logits = self._forward_isolating(
                    model, layout, list(range(len(step))), step, requests, ids, None
                )
        except (
            Exception
        ) as exc:  # the step's requests fail (update_batch, see continuous_batching); not the loop
            logger.exception("continuous batching: a step of %d request(s) failed", len(step))
            self._step_error = exc
        if logits is None:  # nothing ran: what is sampled from these is never delivered
            config = model.config.get_text_config()
            logits = torch.zeros(
                1, int(ids.shape[-1]), config.vocab_size, dtype=model.dtype, device=model.device
            )
        self.steps += 1
        keep = kwargs.get("logits_to_keep")
        if isinstance(keep, torch.Tensor):  # as the model's own forward: only these positions' logits
            logits = logits[:, keep.to(logits.device)]
        elif isinstance(keep, int) and keep > 0:
            logits = logits[:, -keep:]
        return CausalLMOutputWithPast(logits=logits)

    def _step_requests(
        self, step: list[tuple[str, int, int]], ids: torch.Tensor, cu: Any
    ) -> tuple[PackedRows, list[Request]]:
        """The step's layout and the library request of each segment; ``RuntimeError`` when the step does
        not match what the scheduler recorded or the library holds."""
        if not self.is_open:
            raise RuntimeError("continuous batching: the offloaded model's serving state is closed")
        layout = PackedRows.from_cu("continuous batching", cu, int(ids.shape[-1]))
        if layout.lengths != [q for _, _, q in step]:
            raise RuntimeError(
                f"continuous batching: the step packs query lengths {layout.lengths} "
                f"but the scheduler recorded {[(rid, q) for rid, _, q in step]} (padded or asynchronous "
                "batching is not supported for offloaded models)"
            )
        requests: list[Request] = []
        for rid, past, _ in step:
            r = self._live.get(rid)
            if r is None or r.length != past:
                raise RuntimeError(
                    f"continuous batching: request {rid} continues at position {past} but the library holds "
                    f"{'no request' if r is None else f'{r.length} tokens'} for it"
                )
            requests.append(r)
        return layout, requests

    def _agree_step(
        self, step: list[tuple[str, int, int]], ids: torch.Tensor, cu: Any
    ) -> tuple[PackedRows, list[Request]]:
        """:meth:`_step_requests` on this rank. Under tensor parallelism (transformers' TP rank 0 drives the
        scheduler and every rank replays it) one exchange over the TP group checks that every rank runs
        the same step: a rank whose step failed, or was fed other requests, positions or tokens, fails the
        step on every rank, instead of one rank leaving the others waiting in a sharded layer's all-reduce
        or two batches being mixed in it."""
        tp = self.session.spec.tp
        if tp is None:
            return self._step_requests(step, ids, cu)
        mine: list = []

        def check() -> tuple:  # the step's requests, positions, query lengths and a checksum of its tokens
            mine[:] = self._step_requests(step, ids, cu)
            return tuple(step), zlib.crc32(ids.numpy().tobytes())

        values = exchange_outcomes(tp, check).values_or_raise("continuous batching: the step")
        signature = values[tp.rank]
        if any(sig != signature for sig in values):
            described = "; ".join(
                f"TP rank {r}: {list(sig[0])}, tokens crc32 {sig[1]:08x}" for r, sig in enumerate(values)
            )
            raise RuntimeError(
                "continuous batching under tensor parallelism: the TP ranks run different steps "
                f"({described}); every rank must replay TP rank 0's schedule with the same inputs"
            )
        layout, requests = mine
        return layout, requests

    def _forward_isolating(
        self,
        model: torch.nn.Module,
        layout: PackedRows,
        segments: list[int],
        step: list[tuple[str, int, int]],
        requests: list[Request],
        ids: torch.Tensor,
        logits: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """:meth:`_forward` of ``segments``; when it raises, each segment again alone, so that only the
        requests whose own forward fails fail (recorded for :meth:`take_failed`) and the others keep their
        logits. A forward that raised wrote nothing a request holds (the core aborts it; the rows past each
        request's length are written again). Under tensor parallelism the step fails as a whole instead: a
        rank retrying alone would leave the others in a collective."""
        try:
            return self._forward(model, layout.select(segments), [requests[i] for i in segments], ids, logits)
        except Exception as exc:
            if len(segments) > 1 and self.session.spec.tp is None:
                for i in segments:
                    logits = self._forward_isolating(model, layout, [i], step, requests, ids, logits)
                return logits
            if self.session.spec.tp is not None:
                raise
            rid = step[segments[0]][0]
            logger.exception("continuous batching: request %s failed in its step", rid)
            self._failed[rid] = exc
            return logits

    def _forward(
        self,
        model: torch.nn.Module,
        layout: PackedRows,
        requests: list[Request],
        ids: torch.Tensor,
        logits: torch.Tensor | None,
    ) -> torch.Tensor:
        """One packed forward of the library's attention over ``layout``'s segments of the step's ``ids int64
        [1, Q]`` (host), segment ``i`` continuing ``requests[i]``: the segments' tokens one after the other
        in one row ``[1, n]`` (no padding computed), each at its request's positions; the logits of each
        segment's last token go to its packed position in ``logits [1, Q, V]`` (allocated when ``None``),
        which is returned."""
        core, device = self.session.core, self.session.spec.device
        packed = layout.take(ids)  # [1, n]: the segments' tokens, in segment order
        tokens = [t.tolist() for t in packed[0].split(layout.lengths)]
        plan = core.begin_forward(requests, tokens)
        # the requests continue at their lengths: the model's positions are the plan's logical positions
        pos = plan.pos[None, :]
        keep = plan.cu_seqlens_q[1:].long() - 1  # each segment's last token: only its logits are needed
        try:
            out = model._kvoffload_originals["forward"](
                input_ids=packed.to(device), position_ids=pos.to(device), use_cache=False,
                logits_to_keep=keep.to(device),
            ).logits  # fmt: skip
        except BaseException:
            core.abort_forward()
            raise
        core.end_forward()
        if logits is None:
            logits = out.new_zeros(1, layout.width, out.shape[-1])
        return layout.scatter_last(out[0], logits)
