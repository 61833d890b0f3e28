"""The P/D roles of an :class:`~torch_kvoffload.integrations.hf.session.OffloadSession` (DESIGN §9).

``OffloadConfig(pd=PDConfig(role=...))`` gives the session a role, reachable as ``session.pd``
(:func:`prefill_role` / :func:`decode_role` check and return it). A role is a
:class:`~torch_kvoffload.kv.backend.PDRole` of the session's KV core (forward hooks, the layerwise
runtime over exported buffers) and drives the session through its public methods only:

* :class:`PrefillRole` (``role="prefill"``, layerwise offload on): the session's layer buffers are
  allocated by the transport (:func:`~torch_kvoffload.pd.export_layer_buffers` for ``shm``, registered
  with :func:`~torch_kvoffload.pd.register_layer_buffers` otherwise) and always carry the indexer keys;
  a :class:`~torch_kvoffload.pd.PrefillSender` over them is the layerwise runtime's completion provider.
  :meth:`PrefillRole.submit` hands the tickets of the next prefill forward: during that forward every
  layer is published to the decode peer as soon as it is written, and its physical buffer is reused only
  after the decode read (and the host save) finished.
* :class:`DecodeRole` (``role="decode"``, sparse decode offload on): a
  :class:`~torch_kvoffload.pd.DecodeReceiver` over the session's host KV pool (main KV) and device indexer
  cache. :meth:`DecodeRole.expect` starts a sequence whose prompt is computed by the prefill node and
  returns its tickets; once :meth:`DecodeRole.wait` returned, the sequence continues at ``past =
  prompt width`` (``model.generate`` with the prompt plus prefill's first token and
  :attr:`DecodeRole.cache`).

Tensor parallelism (models loaded with ``tp_plan="auto"``, :attr:`ModelSpec.tp`): each side runs one process
per TP rank, in its own process group; ``prefill_tp_size`` / ``decode_tp_size`` must be the models' TP sizes
(the side's own size is checked against its model) and ``prefill_tp_size`` a multiple of ``decode_tp_size``
(:func:`~torch_kvoffload.pd.decode_rank_of`). Prefill TP rank ``p`` sends as ``p_rank = p``; decode TP rank
``t`` receives as ``tp_rank = t`` into its DP rank's host pool, shared by its TP ranks (each receives its
share of the blocks, the whole indexer lands in every rank's indexer cache). :meth:`DecodeRole.expect` and
:meth:`DecodeRole.wait` are collective over the decode TP group: every rank calls them with the same
arguments, ``expect`` returns the same tickets on every rank, ``wait`` returns only once every rank's
receiver is done (or raises the same error on every rank). One DP rank per side (``dp_rank`` 0). Requests are
the batch rows (left padding dropped), each paged from block 0 of its own block range.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torch_kvoffload.core.pd_role import PDRole
from torch_kvoffload.integrations.hf.session import OffloadSession, session_of
from torch_kvoffload.kv.group_outcomes import exchange_outcomes
from torch_kvoffload.pd.config import PDConfig

if TYPE_CHECKING:
    from torch_kvoffload.kv.forward import ForwardPlan
    from torch_kvoffload.layerwise import LayerCacheSpec, LayerwiseConfig, LayerwiseOffloadRuntime
    from torch_kvoffload.pd import DecodeReceiver, PrefillSender, TransferTicket
    from torch_kvoffload.store.base import KVStore

logger = logging.getLogger(__name__)

__all__ = ["DecodeRole", "PrefillRole", "decode_role", "make_role", "prefill_role"]


def make_role(session: OffloadSession, config: PDConfig) -> PrefillRole | DecodeRole:
    """The role ``config.role`` names for ``session`` (checked before anything is built)."""
    where = f"OffloadSession(pd.role={config.role!r})"
    if config.decode_dp_size != 1 or config.prefill_dp_size != 1:
        raise ValueError(
            f"{where}: the Hugging Face path runs one process per side and TP rank (one DP rank); got "
            f"prefill_dp_size={config.prefill_dp_size}, decode_dp_size={config.decode_dp_size} "
            "(use the torch_kvoffload.pd runtimes directly for DP deployments)"
        )
    field = f"{config.role}_tp_size"
    size = getattr(config, field)
    if size != session.spec.tp_size:
        raise ValueError(
            f"{where}: {field}={size} but the {config.role} model is sharded over {session.spec.tp_size} "
            f"tensor-parallel rank(s) (its tp_plan process group); {field} must be the model's TP size"
        )
    if config.transport == "shm" and session.spec.device.type != "cpu":
        raise ValueError(
            f"{where}: transport 'shm' shares host memory only; the model is on {session.spec.device} "
            "(use transport='mooncake' or 'memfabric')"
        )
    if config.role == "prefill":
        return PrefillRole(session, config)
    return DecodeRole(session, config)


def _role(model_or_session: Any, cls: type, role: str):
    session = (
        model_or_session if isinstance(model_or_session, OffloadSession) else session_of(model_or_session)
    )
    if not isinstance(session.pd, cls):
        raise ValueError(
            f"{session.name}: not a P/D {role} session (OffloadConfig.pd.role is "
            f"{None if session.config.pd is None else session.config.pd.role!r})"
        )
    return session.pd


def prefill_role(model_or_session: Any) -> PrefillRole:
    """The :class:`PrefillRole` of an offloaded model (or session); ``ValueError`` if it has none."""
    return _role(model_or_session, PrefillRole, "prefill")


def decode_role(model_or_session: Any) -> DecodeRole:
    """The :class:`DecodeRole` of an offloaded model (or session); ``ValueError`` if it has none."""
    return _role(model_or_session, DecodeRole, "decode")


def _compatibility(session: OffloadSession, main: Sequence[torch.Tensor], indexer: Sequence[torch.Tensor]):
    from torch_kvoffload.pd import make_compatibility

    return make_compatibility(
        model_fingerprint=session.spec.fingerprint, num_layers=session.spec.num_layers,
        block_size=session.block_size, main=main, indexer=indexer,
    )  # fmt: skip


def _ptrs(session: OffloadSession) -> list[tuple[int, ...]]:
    """The addresses of the session's indexer caches, per layer."""
    return [tuple(t.data_ptr() for t in layer) for layer in session.indexer_caches()]


def _tp_rank(session: OffloadSession) -> int:
    """This process's rank in the model's tensor-parallel group (0 without tensor parallelism)."""
    tp = session.spec.tp
    return 0 if tp is None else tp.rank


def _agree(session: OffloadSession, where: str, fn: Callable[[], Any]) -> list[Any]:
    """``fn()`` on this rank, then every TP rank's result in rank order (``[fn()]`` without tensor
    parallelism), gathered over the model's TP group.

    Every rank learns every rank's outcome, so all of them return or all of them raise: a rank whose
    ``fn`` raised re-raises its own error after the exchange; the others raise
    :class:`~torch_kvoffload.pd.PDTransferError` (``TimeoutError`` when every failure was a timeout) naming
    the failed ranks and their errors. The exchange is a collective: every TP rank must reach it.
    """
    from torch_kvoffload.pd import PDTransferError

    outcomes = exchange_outcomes(session.spec.tp, fn)
    outcomes.raise_own()
    if outcomes.failed:
        cls = TimeoutError if outcomes.all_timeouts else PDTransferError
        raise cls(f"{where}: failed on decode {outcomes.failures()}")
    return outcomes.values


class PrefillRole(PDRole):
    """The prefill side of a session (see the module docstring). Built by the session."""

    name = "P/D prefill"
    computes_prompts = True

    def __init__(self, session: OffloadSession, config: PDConfig) -> None:
        if session.config.layerwise is None:
            raise ValueError("OffloadSession(pd.role='prefill'): needs layerwise offload")
        self.session, self.config = session, config
        self.sender: PrefillSender | None = None
        self._transport: Any = None
        self._tickets: list[TransferTicket] | None = None
        self._forward: list[int] = []  # request ids of the running forward
        #: the ticket request ids of the last prefill forward that published its layers
        self.last_requests: list[int] = []

    @property
    def runtime(self) -> LayerwiseOffloadRuntime | None:
        """The layerwise runtime whose buffers the sender publishes."""
        return self.session.layerwise_offload

    # ------------------------------------------------------------------------------ core hooks
    def build_layerwise_runtime(
        self, lw: LayerwiseConfig, specs: Sequence[LayerCacheSpec], *, store: KVStore
    ) -> LayerwiseOffloadRuntime:
        """What ``build_layerwise_runtime`` does, with the buffers exported through a fresh
        transport and a :class:`PrefillSender` over them registered as completion provider."""
        from torch_kvoffload.layerwise.allocation import allocate_layer_buffers
        from torch_kvoffload.layerwise.planner import plan_layer_buffers
        from torch_kvoffload.layerwise.runtime import LayerwiseOffloadRuntime
        from torch_kvoffload.pd import (
            PrefillSender,
            export_layer_buffers,
            make_transport,
            register_layer_buffers,
        )
        from torch_kvoffload.store import build_store

        self.stop()
        self._close_transport()
        plan = plan_layer_buffers(specs, lw.num_shared_buffers, lw.independent_layers)
        p_rank = _tp_rank(self.session)
        transport = make_transport(self.config, rank_name=f"hf-prefill-tp{p_rank}-{os.getpid()}")
        try:
            if transport.name == "shm":
                buffers = export_layer_buffers(plan, transport)
            else:
                buffers = register_layer_buffers(
                    allocate_layer_buffers(plan, self.session.spec.device), transport
                )
            rt = LayerwiseOffloadRuntime(
                plan, buffers, store if store is not None else build_store(lw.store),
                prefetch_depth=lw.prefetch_depth, model_id=lw.model_id,
            )  # fmt: skip
            compat = _compatibility(self.session, buffers.layer_main(0), buffers.layer_indexer(0) or ())
            sender = PrefillSender(
                self.config, p_rank=p_rank, buffers=buffers, transport=transport, compat=compat
            )
        except BaseException:
            transport.close()
            raise
        rt.register_completion_provider(sender.provider)
        self._transport, self.sender = transport, sender
        return rt

    def takes_part(self, fwd: ForwardPlan) -> bool:
        return fwd.layerwise

    def begin_forward(self, fwd: ForwardPlan) -> None:
        """Before a layerwise forward: start publishing it when tickets were submitted."""
        tickets, self._tickets = self._tickets, None
        self._forward = []
        if tickets is None:
            return
        where = "PrefillRole.begin_forward"
        lengths = fwd.new_len
        if len(tickets) != len(lengths):
            raise ValueError(f"{where}: {len(tickets)} tickets were submitted for a batch of {len(lengths)}")
        for r, (t, n) in enumerate(zip(tickets, lengths, strict=True)):
            if t.num_tokens != n:
                raise ValueError(
                    f"{where}: the ticket of request {t.request_id} (batch row {r}) is for {t.num_tokens} tokens, "
                    f"the row has {n} (padding dropped)"
                )
        assert self.sender is not None
        self.sender.begin_forward(tickets, fwd.block_table.cpu().tolist())
        self._forward = [t.request_id for t in tickets]

    def end_forward(self, fwd: ForwardPlan) -> None:
        if self.sender is not None and self._forward:
            self.sender.end_forward()
            self.last_requests, self._forward = self._forward, []

    # --------------------------------------------------------------------------------- user API
    def submit(self, tickets: Sequence[TransferTicket]) -> None:
        """Publish the next prefill forward (a fresh sequence: ``past == 0``) to decode: ``tickets[r]``
        (from :meth:`DecodeRole.expect`, through the router) holds batch row ``r``'s destinations."""
        from torch_kvoffload.pd import TransferTicket

        if self.session.forward_running:
            raise RuntimeError("PrefillRole.submit: a forward is running")
        tickets = list(tickets)
        bad = [type(t).__name__ for t in tickets if not isinstance(t, TransferTicket)]
        if not tickets or bad:
            raise ValueError(
                f"PrefillRole.submit: expected a non-empty list of TransferTicket, got {bad or 'none'}"
            )
        self._tickets = tickets

    def wait(self, timeout: float | None = None) -> None:
        """Block until decode acknowledged every layer of the last published forward; raises its
        :class:`~torch_kvoffload.pd.PDTransferError`, ``TimeoutError`` after ``timeout`` seconds. Under
        tensor parallelism each prefill rank waits for its own sends (no collective)."""
        if self.sender is None or not self.last_requests:
            raise RuntimeError("PrefillRole.wait: no forward was published (submit() tickets first)")
        for rid in self.last_requests:
            self.sender.wait_request(rid, timeout)

    def stop(self) -> None:
        """Close the sender (outstanding transfers fail, their buffers are released)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def _close_transport(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def close(self) -> None:
        self.stop()
        self._close_transport()


class DecodeRole(PDRole):
    """The decode side of a session (see the module docstring). Built by the session. It takes part in
    no forward: the prompt's KV arrives before the sequence's first forward."""

    name = "P/D decode"

    def takes_part(self, fwd: ForwardPlan) -> bool:
        return False

    def __init__(self, session: OffloadSession, config: PDConfig) -> None:
        sparse = session.config.sparse
        if sparse is None:
            raise ValueError("OffloadSession(pd.role='decode'): needs sparse decode offload")
        if sparse.indexer_dtype == "int8":
            raise ValueError(
                "OffloadSession(pd.role='decode'): prefill sends the indexer keys of its layer buffers in the "
                "model's dtype or as FP8 rows; sparse.indexer_dtype='int8' is not supported with P/D on the "
                "Hugging Face path"
            )
        self.session, self.config = session, config
        self.receiver: DecodeReceiver | None = None
        self._sparse: Any = None  # the sparse runtime the receiver writes into
        self._indexer: list[tuple[int, ...]] = []  # the addresses of the indexer caches it writes into
        #: the cache of the sequence started by :meth:`expect`
        self.cache: Any = None
        self._requests: list[int] = []

    def reserve(self, batch: int, max_tokens: int) -> None:
        """Size the session for ``batch`` requests of ``max_tokens`` tokens (prompt + generation) and
        listen for prefill (the receiver binds ``kv_port`` and advertises it). Under tensor parallelism a
        collective of the decode TP group: TP rank ``t`` binds ``kv_port + t``, and every rank checks that
        the ranks share one host pool (``RuntimeError`` on every rank otherwise)."""
        from torch_kvoffload.pd import DecodeReceiver, main_components

        s = self.session
        s.reserve(batch, max_tokens)
        # the destinations registered: the same pool and indexer tensors (hybrid sparse's grow with the requests)
        if self.receiver is not None and (self._sparse, self._indexer) == (s.sparse_offload, _ptrs(s)):
            return
        self.stop()
        sp = s.sparse_offload
        assert sp is not None
        if s.spec.tp is not None:
            self._check_shared_pool(sp.pool)
        indexer = s.indexer_caches()
        compat = _compatibility(s, main_components(sp.pool, 0), indexer[0])
        self.receiver = DecodeReceiver(
            self.config, pool=sp.pool, compat=compat, indexer=indexer, tp_rank=_tp_rank(s)
        )
        self._sparse, self._indexer = sp, _ptrs(s)

    def _check_shared_pool(self, pool: Any) -> None:
        """Decode TP ranks receive disjoint shares of each request's blocks into one host pool: it must be
        the pool the TP group shares (the same ``/dev/shm`` pool on every rank)."""
        names = _agree(self.session, "DecodeRole.reserve", lambda: pool.name)
        if names[0] is None or len(set(names)) != 1:
            raise RuntimeError(
                f"DecodeRole.reserve: decode TP ranks receive their shares of the KV into one host pool shared "
                f"by the TP group, but the ranks' sparse offload pools are {names} (None: a private pool)"
            )

    def expect(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_tokens: int
    ) -> list[TransferTicket]:
        """Start the sequence of prompt ``input_ids int64 [B, S]`` (``attention_mask [B, S]``, 0 = left
        padding) whose KV prefill computes; reserve ``max_tokens`` (≥ ``S + 1``, padding included) per
        request; return one ticket per batch row for :meth:`PrefillRole.submit`.

        Under tensor parallelism a collective of the decode TP group: every rank calls it with the same
        arguments and gets the same tickets, each holding every rank's part (hand them from one rank)."""
        from torch_kvoffload.pd import TicketPart, TransferTicket

        where = "DecodeRole.expect"
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.dtype.is_floating_point
        ):
            raise ValueError(
                f"{where}: 'input_ids' must be an int tensor [B, S], got {getattr(input_ids, 'shape', input_ids)}"
            )
        B, S = input_ids.shape
        if attention_mask is None:
            mask = torch.ones(B, S, dtype=torch.bool)
        elif not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, S):
            raise ValueError(
                f"{where}: 'attention_mask' must be [{B}, {S}], got {getattr(attention_mask, 'shape', attention_mask)}"
            )
        else:
            mask = attention_mask.to("cpu").bool()
        if (S > 1 and not bool((mask[:, 1:].int() >= mask[:, :-1].int()).all())) or not bool(
            mask[:, -1].all()
        ):
            raise ValueError(f"{where}: 'attention_mask' must be left padding (zeros, then ones)")
        if not isinstance(max_tokens, int) or max_tokens <= S:
            raise ValueError(f"{where}: max_tokens must be an int > the prompt width {S}, got {max_tokens!r}")
        s = self.session
        if s.forward_running:
            raise RuntimeError(f"{where}: a forward is running")
        s.end_sequence()  # the previous sequence ends here; its requests are released
        self.reserve(B, max_tokens)
        recv = self.receiver
        assert recv is not None
        self._release()
        ids = input_ids.to("cpu")
        tokens = [ids[b][mask[b]].tolist() for b in range(B)]
        self.cache = s.new_cache()
        rids = s.begin_external_sequence(tokens, S, self.cache)
        self.cache.seen_tokens = S
        pool, bs = self._sparse.pool, s.block_size

        def announce() -> list[tuple[int, tuple[int, ...], TicketPart]]:
            parts = []
            for rid, toks in zip(rids, tokens, strict=True):
                nb = math.ceil(len(toks) / bs)
                main = pool.blocks_of(rid)[:nb]
                parts.append((rid, tuple(main), recv.expect(rid, len(toks), main, s.device_blocks(rid)[:nb])))
                self._requests.append(rid)
            return parts

        ranks = _agree(s, where, announce)  # every decode TP rank's parts
        tickets = []
        for r, (rid, toks) in enumerate(zip(rids, tokens, strict=True)):
            seen = {(parts[r][0], parts[r][1]) for parts in ranks}
            if len(seen) != 1:  # the ranks replay one allocation sequence: it cannot differ
                raise RuntimeError(
                    f"{where}: decode TP ranks disagree on batch row {r}'s request id / host-pool blocks: {seen}"
                )
            main = ranks[0][r][1]
            tickets.append(TransferTicket.combine(rid, len(toks), 0, main, [parts[r][2] for parts in ranks]))
        return tickets

    def wait(self, timeout: float | None = None) -> Any:
        """Block until every request of the sequence was received on every decode rank; return
        :attr:`cache`. Raises :class:`~torch_kvoffload.pd.PDTransferError` when a transfer failed (the
        sequence must be recomputed), ``TimeoutError`` after ``timeout`` seconds.

        Under tensor parallelism a collective of the decode TP group: every rank returns only once every
        rank's receiver wrote its share of the shared host pool (so every rank may read all of it), or every
        rank raises — the rank that failed its own error, the others a ``PDTransferError`` naming it
        (``TimeoutError`` when every failure was a timeout)."""
        from torch_kvoffload.pd import all_ranks_ready

        if self.receiver is None or not self._requests:
            raise RuntimeError("DecodeRole.wait: no sequence is expected (call expect() first)")
        recv, rids = self.receiver, list(self._requests)

        deadline = None if timeout is None else time.monotonic() + timeout

        def received() -> list[str]:
            for rid in rids:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    recv.wait_request(rid, left)
                except TimeoutError as exc:
                    raise TimeoutError(f"DecodeRole.wait: not received within {timeout} s: {exc}") from None
            return [recv.state(rid) for rid in rids]

        # every TP rank's receiver is done before any rank reads the shared pool: each one wrote its own
        # share of the blocks, and this exchange orders those writes before every rank's reads
        states = _agree(self.session, "DecodeRole.wait", received)
        for i in range(len(rids)):
            ready = all_ranks_ready([per_rank[i] for per_rank in states])
            assert ready
        return self.cache

    def _release(self) -> None:
        if self.receiver is not None:
            for rid in self._requests:
                self.receiver.release(rid)
        self._requests = []

    def stop(self) -> None:
        """Close the receiver (BYE to prefill, advertisement withdrawn)."""
        if self.receiver is not None:
            self._release()
            self.receiver.close()
            self.receiver = None
            self._sparse = None

    def close(self) -> None:
        self.stop()
