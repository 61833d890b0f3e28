"""``KVCore``: the request-level KV of one model, independent of any model library.

It owns the :class:`~torch_kvoffload.kv.requests.RequestTable`, the :class:`~torch_kvoffload.kv.layout.
KVLayout` every device cache is sized for, and the backends the configuration enables
(:func:`~torch_kvoffload.core.backends.build_backends`), and dispatches to them:

* sizing: :meth:`size` (no live request: caches for ``slots`` requests of ``tokens`` tokens, rebuilt only
  when the layout changes; a P/D node keeps sizes that suffice) and :meth:`grow` (live requests need more
  tokens: every backend grows in place, or the growth is refused before anything changes);
* requests: :meth:`admit` / :meth:`finish`, each request independently (a request may finish while others
  continue; its slot is reused by the next admission); :meth:`fork` (a new request continuing a live one:
  beam search) and :meth:`truncate` (drop a request's last rows: assisted decoding);
* forwards: :meth:`begin_forward` plans the index tensors of a forward over some live requests and begins
  it on the backends that take part; per layer :meth:`cache_write` and :meth:`cache_attention` (what the
  ``kvoffload::mla_cache_write`` / ``mla_cache_attention`` ops call: a core is the runtime they find
  by name in ``ops.mla_runtime.runtimes``); :meth:`end_forward` /
  :meth:`abort_forward`; :meth:`retry_caps` / :meth:`restart` run a layerwise forward again whose stored
  prefix could not be loaded.

A model with a sparse backend runs decode steps (one new real token per request after earlier ones, no
padding) on it alone: the layerwise buffers are released at the first decode step and allocated again by
the next :meth:`size` (unless :attr:`keep_prefill_buffers`: continuous batching prefills at any step).

Padding (a batch row's positions that are not real tokens) may be anywhere in any forward, and a row may
have no real token in a forward. Padding keeps no KV, but its query still attends as the Hugging Face
model's does: over the request's real tokens before it (:mod:`torch_kvoffload.kv.forward`, ``pad_*``),
through the backends' keys (never the sparse-offload decode step: a forward with such queries is not a
decode step). A padding query that sees no real token (left padding before a request's first token) gets
zero: what ``sdpa`` gives for a fully masked query on torch >= 2.5 (the eager implementation averages over
the masked keys instead; the output there is meaningless either way).

:attr:`KVCore.prefix` (:class:`~torch_kvoffload.core.prefix.PrefixReuse`) looks a new request's prompt up
in the store and adopts its cached prefix without a forward.

Why one module: the core's state (layout, requests, the running forward) is read and changed by every
method here; split, each part would reach into the others' fields.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from torch_kvoffload.core import layer as layer_step
from torch_kvoffload.core.backends import Backends, build_backends
from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.core.pd_role import PDRole
from torch_kvoffload.core.prefix import PrefixReuse
from torch_kvoffload.counters import Counters
from torch_kvoffload.kv.backend import KVBackend
from torch_kvoffload.kv.forward import (
    ForwardPlan,
    check_bias,
    check_queries,
    check_write,
    plan_forward,
    plan_mixed,
    plan_packed,
)  # fmt: skip
from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.kv.requests import Request, RequestTable
from torch_kvoffload.kv.spec import ModelSpec

logger = logging.getLogger(__name__)

__all__ = ["KVCore"]

_COUNTERS = (
    "forwards",
    "prefill_forwards",
    "decode_forwards",
    "mixed_forwards",
    "resizes",
    "failed_forwards",
)


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class KVCore:
    """The KV of ``spec`` under ``config`` (see the module docstring).

    Parameters
    ----------
    spec : ModelSpec
    config : OffloadConfig
        Resolved (``None`` features off).
    name : str
        Names the model in logs; the KVPP scheduler is registered as ``f"{name}/kvpp"``.
    role : PDRole, optional
        The node's P/D role (``config.pd``).
    """

    def __init__(
        self, spec: ModelSpec, config: OffloadConfig, *, name: str, role: PDRole | None = None
    ) -> None:
        self.spec, self.config, self.name = spec, config, name
        self.block_size = config.resolved_block_size
        self.backends: Backends = build_backends(
            spec, config, block_size=self.block_size, kvpp_name=f"{name}/kvpp", role=role
        )
        self._indexer = self.backends.indexer
        self.requests = RequestTable()
        self.layout: KVLayout | None = None
        self.forward: ForwardPlan | None = None
        #: keep the layerwise buffers through decode steps (continuous batching: prefills come at any step)
        self.keep_prefill_buffers = False
        #: a dict (set by the caller, e.g. for ``output_attentions``): :meth:`attend` stores there per layer the
        #: probabilities it applied, fp32 ``[B, S, H, max(new_len)]`` over each request's logical positions (0
        #: where nothing is attended); a second pass over the rows the attention read, only when set
        self.attention_probs: dict[int, torch.Tensor] | None = None
        #: set by the caller for the next forward it begins (e.g. a custom 4-D mask): the additive bias its
        #: attention and indexer use instead of the causal rule (:func:`~torch_kvoffload.kv.forward.check_bias`)
        self.attention_bias: torch.Tensor | None = None
        self.counters = Counters(_COUNTERS)
        #: prefix reuse: a new request's cached prompt prefix, adopted without a forward
        self.prefix = PrefixReuse(self)

    # ------------------------------------------------------------------------------------ sizing
    @property
    def reserved_tokens(self) -> int:
        """Tokens per request the device caches are sized for (0 before sizing)."""
        return self.layout.tokens if self.layout is not None else 0

    @property
    def blocks_per_request(self) -> int:
        """Blocks of ``block_size`` tokens each request owns in the paged caches (0 before sizing)."""
        return self.layout.blocks_per_request if self.layout is not None else 0

    def size(self, slots: int, tokens: int) -> None:
        """Caches for ``slots`` requests of ``tokens`` tokens (no request may be live)."""
        if len(self.requests):
            raise RuntimeError(f"KVCore.size: {len(self.requests)} requests are live; finish them first")
        cur, role = self.layout, self.backends.role
        same = (
            cur is not None
            and slots == cur.slots
            and (tokens == cur.tokens or (role is not None and tokens <= cur.tokens))
        )
        if not same:
            self._build(KVLayout(slots, tokens, self.block_size, paged_by_block=role is not None))
            return
        assert cur is not None
        for b in self.backends.all:
            if not b.built:  # layer buffers released for decode by the previous requests
                b.resize(cur, [])

    def _build(self, layout: KVLayout) -> None:
        self.discard()
        self.layout = layout
        self.requests.resize(layout.slots)
        try:
            for b in self.backends.all:
                b.resize(layout, [])
        except BaseException:
            self.discard()
            raise
        self.counters.add("resizes")
        logger.info(
            "offload session %s: %d requests x %d tokens, device KV %d bytes",
            self.name, layout.slots, layout.tokens, self.device_kv_bytes(),
        )  # fmt: skip

    def check_growth(self, tokens: int) -> None:
        """``ValueError`` (nothing changes) when the live requests cannot grow to ``tokens`` tokens each in
        place: a backend keeps the sizes of the requests' first forward (a host pool, KVPP, a P/D role)."""
        cur = self.layout
        assert cur is not None
        if tokens <= cur.tokens:
            return
        new = dataclasses.replace(cur, tokens=tokens)
        live = list(self.requests)
        if not all(b.can_grow(new, live) for b in self.backends.all):
            raise ValueError(
                f"KVCore: the live requests need {tokens} tokens per request but {cur.tokens} were reserved, "
                "and a backend keeps the sizes of the requests' first forward; size() the core for the longest "
                "request before admitting them"
            )

    def grow(self, tokens: int) -> None:
        """The live requests need ``tokens`` tokens each: grow every device cache in place, keeping their
        rows (:meth:`check_growth` first). A failure part way leaves caches of mixed sizes: discard them."""
        self.check_growth(tokens)
        cur = self.layout
        assert cur is not None
        if tokens <= cur.tokens:
            return
        new = dataclasses.replace(cur, tokens=tokens)
        live = list(self.requests)
        self.layout = new
        for b in self.backends.all:
            b.resize(new, live)
        self.counters.add("resizes")
        logger.info(
            "offload session %s: the running sequence grew to %d tokens per request, device KV %d bytes",
            self.name, tokens, self.device_kv_bytes(),
        )  # fmt: skip

    def drop_prefill_buffers(self) -> None:
        """Release the layerwise buffers: the running requests continue on the sparse backend alone (the
        next :meth:`size` allocates them again)."""
        lw = self.backends.layerwise
        if lw is not None and lw.built:
            lw.free()

    def discard(self) -> None:
        """Free every device cache; the live requests go with them (the core is unsized afterwards)."""
        for rid in self.requests.ids:
            self.requests.finish(rid)
        self.layout = None
        first: BaseException | None = None
        for b in self.backends.all:
            try:
                b.free()
            except BaseException as exc:  # free the others first
                first = first or exc
        if first is not None:
            raise first

    # ---------------------------------------------------------------------------------- requests
    def admit(self, count: int) -> list[Request]:
        """``count`` new requests in free slots; every backend reserves what they need."""
        assert self.layout is not None, "KVCore.admit before size()"
        reqs = self.requests.admit(count)
        try:
            for b in self.backends.all:
                b.admit(self.layout, reqs)
        except BaseException:
            self.finish([r.id for r in reqs])
            raise
        return reqs

    def finish(self, request_ids: Sequence[int]) -> None:
        """End requests (their slots are free); a backend failing to release them drops every cache."""
        ids = [rid for rid in request_ids if rid in self.requests]
        for rid in ids:
            self.requests.finish(rid)
        if not ids:
            return
        try:
            for b in self.backends.all:
                b.release(ids)
        except Exception as exc:  # a failed transfer: drop the caches rather than keep the blocks
            logger.warning(
                "offload session %s: releasing requests failed (%s); caches rebuilt", self.name, exc
            )
            self.discard()

    def fork(self, request_id: int) -> Request:
        """A new request in a free slot continuing live request ``request_id``: every backend gives it a
        copy of the source's rows (:meth:`KVBackend.fork`), and it takes the source's tokens. Between
        forwards only; ``ValueError`` when no slot is free; on any failure nothing stays admitted."""
        if self.forward is not None:
            raise RuntimeError("KVCore.fork: a forward is running")
        assert self.layout is not None, "KVCore.fork before size()"
        src = self.requests.get(request_id)
        (dst,) = self.admit(1)
        try:
            for b in self.backends.all:
                b.fork(self.layout, src, dst, src.length)
        except BaseException:
            self.finish([dst.id])
            raise
        dst.tokens, dst.keyed = list(src.tokens), src.keyed
        dst.positions = None if src.positions is None else list(src.positions)
        return dst

    def truncate(self, request_id: int, length: int) -> None:
        """Live request ``request_id`` keeps its first ``length`` tokens (``0 <= length <= its length``);
        every backend drops the later rows (:meth:`KVBackend.truncate`). Between forwards only. A backend
        failing part way leaves the request unusable: it is finished and the error propagates."""
        if self.forward is not None:
            raise RuntimeError("KVCore.truncate: a forward is running")
        r = self.requests.get(request_id)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= r.length:
            raise ValueError(f"KVCore.truncate: length must be an int in [0, {r.length}], got {length!r}")
        if length == r.length:
            return
        try:
            for b in self.backends.all:
                b.truncate(r, length)
        except BaseException:
            self.finish([r.id])
            raise
        del r.tokens[length:]
        r.truncate_positions(length)

    # ---------------------------------------------------------------------------------- forwards
    def _engaged(self, fwd: ForwardPlan) -> list[tuple[ForwardPlan, KVBackend]]:
        """``(part, backend)`` of every backend taking part in each part of ``fwd``, in call order."""
        return layer_step.engaged(fwd, self._taking_part)

    def _taking_part(self, fwd: ForwardPlan) -> list[KVBackend]:
        parts = fwd.memo.get("backends")
        if parts is None:
            parts = fwd.memo["backends"] = [b for b in self.backends.all if b.takes_part(fwd)]
        return parts

    def begin_forward(
        self,
        requests: Sequence[Request],
        new_tokens: Sequence[Sequence[int]],
        new_mask: torch.Tensor | None = None,
        *,
        padding_queries: bool = True,
        positions: Sequence[Sequence[int] | None] | None = None,
    ) -> ForwardPlan:
        """Begin a forward of live ``requests`` holding ``new_tokens[r]`` each; return its plan. ``new_mask
        None``: a packed forward, the layers' inputs are the new tokens one after the other in one row ``[1,
        N]``, request-major (:func:`~torch_kvoffload.kv.forward.plan_packed`). Else one batch row per request
        whose real new positions are ``new_mask bool [B, S]`` (host, padding anywhere;
        ``padding_queries=False``: the padding positions' outputs are discarded by the caller, none
        attends). ``positions[r]``: the model (rotary) positions the model computes ``new_tokens[r]`` at
        (``None``: their logical positions; see :attr:`Request.positions`). A backend failing to begin
        ends the ones that began, and the error propagates (no forward is running then)."""
        if self.forward is not None:
            raise RuntimeError("KVCore.begin_forward: a forward is running; call end_forward()")
        assert self.layout is not None
        old_len = [r.length for r in requests]
        n_new = [len(t) for t in new_tokens]
        bias = self.attention_bias  # a biased forward reads every row: the decode attention knows no bias
        if bias is not None:
            if new_mask is None:
                raise ValueError("KVCore.begin_forward: an attention_bias needs a batched forward (new_mask)")
            check_bias(bias, new_mask, [o + n for o, n in zip(old_len, n_new, strict=True)])
        # with earlier tokens every padding position sees them: a padded forward is never a decode step
        decode = self.backends.sparse is not None and bias is None and all(old_len)
        all_real = new_mask is None or bool(new_mask.all())  # no padding
        decode = decode and all_real and all(n == 1 for n in n_new)
        if decode and not self.keep_prefill_buffers:
            self.drop_prefill_buffers()  # prefill is over: decode runs on the sparse backend alone
        lw = self.backends.layerwise
        layerwise = lw is not None and not decode and lw.built
        if positions is not None:
            if len(positions) != len(requests):
                raise ValueError(
                    f"KVCore.begin_forward: {len(positions)} rows of positions for {len(requests)} requests"
                )
            for b, (pos, toks) in enumerate(zip(positions, new_tokens, strict=True)):
                if pos is not None and len(pos) != len(toks):
                    raise ValueError(
                        f"KVCore.begin_forward: row {b} has {len(toks)} new tokens and {len(pos)} positions"
                    )
        for b, (r, toks) in enumerate(zip(requests, new_tokens, strict=True)):
            self.requests.extend(r.id, toks)
            r.add_positions(old_len[b], None if positions is None else positions[b])
        where = dict(decode=decode, layerwise=layerwise, device=self.spec.device)
        batched = dict(padding_queries=padding_queries, bias=bias, all_real=all_real)
        mixed = None
        if new_mask is None and self.backends.sparse is not None:  # decode tokens take the sparse decode path
            mixed = plan_mixed(
                requests, old_len, n_new, self.layout, layerwise=layerwise, device=self.spec.device
            )
        if mixed is not None:
            fwd = mixed
        elif new_mask is None:
            fwd = plan_packed(requests, old_len, n_new, self.layout, **where)
        else:
            fwd = plan_forward(requests, old_len, new_mask, self.layout, **where, **batched)
        self.counters.add("forwards")
        self.counters.add(
            "mixed_forwards" if fwd.parts else "decode_forwards" if decode else "prefill_forwards"
        )
        begun: list[tuple[ForwardPlan, KVBackend]] = []
        try:
            for part, b in self._engaged(fwd):
                b.begin_forward(part)
                begun.append((part, b))
        except BaseException:  # the requests keep the tokens they had
            self._close_failed(begun)
            for r, old in zip(requests, old_len, strict=True):
                del r.tokens[old:]
                r.truncate_positions(old)
            raise
        self.forward = fwd
        return fwd

    def end_forward(self) -> None:
        """End the running forward on every backend that took part (in reverse order); raise the first
        failure after all ended; then :meth:`PrefixReuse.store_completed`."""
        fwd, self.forward = self.forward, None
        if fwd is None:
            raise RuntimeError("KVCore.end_forward: no forward is running")
        first: BaseException | None = None
        for part, b in reversed(self._engaged(fwd)):
            try:
                b.end_forward(part)
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first
        self.prefix.store_completed(fwd.requests)

    def abort_forward(self) -> None:
        """Close a forward that raised; the backends' errors are logged (the forward's own is reported)."""
        fwd, self.forward = self.forward, None
        if fwd is not None:
            self._close_failed(self._engaged(fwd))

    def _close_failed(self, begun: Sequence[tuple[ForwardPlan, KVBackend]]) -> None:
        for fwd, b in reversed(begun):
            try:
                b.abort_forward(fwd)
            except Exception as exc:
                logger.warning("offload session %s: closing a failed %s forward: %s", self.name, b.name, exc)

    def retry_caps(self, caps: list[int] | None, exc: BaseException) -> list[int] | None:
        """Prefix caps of another try of the running forward, which raised ``exc``; ``None`` when it cannot
        run again (see :meth:`LayerwiseBackend.retry_caps`; never on a P/D node, whose peer was told of
        the first try)."""
        lw, fwd = self.backends.layerwise, self.forward
        if lw is None or fwd is None or self.backends.role is not None or fwd.parts:
            return None
        return lw.retry_caps(fwd, caps, exc)

    def restart(self, caps: list[int]) -> None:
        """Begin the running forward again with its prefixes capped at ``caps`` (after :meth:`retry_caps`);
        on failure no forward is running."""
        lw, fwd = self.backends.layerwise, self.forward
        assert lw is not None and fwd is not None
        try:
            lw.restart(fwd, caps)
        except BaseException:
            self.forward = None
            raise

    # --------------------------------------------------------------------------------- per layer
    def check_layer(self, fn: str, layer: object) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
            raise ValueError(
                f"KVCore.{fn}: layer must be an int in [0, {self.spec.num_layers}), got {layer!r}"
            )
        return layer

    def _running(self, fn: str, layer: int) -> ForwardPlan:
        if self.forward is None:
            raise RuntimeError(f"KVCore.{fn}: no forward is running; call begin_forward()")
        self.check_layer(fn, layer)
        return self.forward

    def layer_caches(self, layer: int) -> list[torch.Tensor]:
        """The tensors every op of ``layer`` takes: each backend's, in call order (empty before sizing)."""
        self.check_layer("layer_caches", layer)
        return [t for b in self.backends.all for t in b.layer_caches(layer)]

    def cache_write(
        self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor | None
    ) -> None:
        """Keep ``layer``'s new rows of the running forward (``kv_c [B,S,Dc]``, ``k_pe [B,S,Dr]``,
        ``index_k [B,S,Di]`` or ``None``) in every backend that takes part: first each one's
        ``before_write`` (layerwise: wait for the layer's loads, issue the next ones; KVPP: wait for the
        layer's broadcast), then the writes, then each one's ``after_write`` (layerwise: save)."""
        f = self._running("cache_write", layer)
        check_write(f, self.spec, kv_c, k_pe, index_k)
        layer_step.write_rows(layer, f, self.spec, self._taking_part, kv_c, k_pe, index_k)

    def cache_attention(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        index_q: torch.Tensor | None,
        index_weights: torch.Tensor | None,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Absorbed MLA attention of ``layer`` into ``out [B,S,H,Dc]``; see ``kvoffload::mla_cache_attention``.
        A padding position attends over its request's real tokens before it; one that sees none (left
        padding before the request's first token) gets zero (see the module docstring)."""
        f = self._running("cache_attention", layer)
        check_queries(f, self.spec, q_nope, q_pe, index_q, index_weights, out)
        layer_step.attend_queries(
            layer, f, self.spec, self._taking_part, self._indexer, (q_nope, q_pe, index_q, index_weights),
            scale, out, self.attention_probs,
        )  # fmt: skip

    # ------------------------------------------------------------------------------ accounting
    def device_kv_bytes(self) -> int:
        """Bytes of KV the backends hold on the compute device now (from the allocated tensors)."""
        tensors = [t for b in self.backends.all for t in b.device_tensors()]
        return _nbytes(t for t in tensors if t.device.type == self.spec.device.type)

    def backend_stats(self) -> dict[str, float]:
        """The backends' counters (and the prefix store's), summed by name."""
        return self.backends.stats()

    def close(self) -> None:
        """Close the role's endpoints, the backends, the role."""
        self.backends.close()
