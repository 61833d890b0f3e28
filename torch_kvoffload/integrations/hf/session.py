"""``OffloadSession``: the Hugging Face adapter over a model's request-level KV core.

A session is built from a :class:`~torch_kvoffload.kv.spec.ModelSpec` and an
:class:`~torch_kvoffload.core.config.OffloadConfig`. The KV itself is a
:class:`~torch_kvoffload.core.kv.KVCore` with one backend per enabled feature (layerwise, sparse offload,
resident sparse, KVPP, P/D role: see :mod:`torch_kvoffload.core.backends`); the session maps Hugging Face
forwards onto it, supplies the cache object (:meth:`new_cache`), registers the ops' runtimes and assembles
:meth:`stats`.

Registries: the KV core in ``ops.mla_runtime.runtimes`` under :attr:`name` (the ``mla_cache_write`` /
``mla_cache_attention`` ops call its ``cache_write`` / ``cache_attention`` directly); with layerwise offload the
layerwise backend in ``ops.layer_hooks.runtimes`` under :attr:`layerwise_runtime`; with KVPP the KVPP
scheduler under :attr:`kvpp_runtime`.

Around every model forward the caller runs ``begin_forward(input_ids, attention_mask, cache_position,
past=..., owner=cache)`` and ``end_forward()`` (or :meth:`run_forward`); in between, per layer: projections
→ ``layer_wait`` + ``layer_prefetch`` → ``mla_cache_write`` → ``layer_save`` → ``mla_cache_attention`` →
W_UV → ``o_proj``, every op taking ``layer_caches(layer)`` as its ``caches``.

Sequences (:class:`~torch_kvoffload.integrations.hf.sequence.HFSequence`): batch row ``r`` of a sequence is
one request of the core (padding dropped, wherever it is); one sequence (one ``OffloadCache``) is served at
a time, a forward with an empty cache starts a new one, and a failed forward releases its requests at once;
between forwards the cache may reorder, select or repeat its rows (:meth:`rebuild_rows`: beam search) and
drop its last positions (:meth:`crop`: assisted decoding). Each fresh forward sizes the caches for its
batch and the larger of its width and the planned tokens per request (``generate`` plans prompt width +
``max_new_tokens`` - 1; :meth:`reserve` plans explicitly); a running sequence that outgrows its size grows the device caches in place (``stats()["resizes"]``), except
that the host pool, a KVPP runtime and a P/D session keep the size of the sequence's first forward
(outgrowing them is a ``ValueError``).

P/D (``config.pd``): the session's role (:mod:`torch_kvoffload.integrations.hf.pd`) is :attr:`pd`. On a
prefill node the layer buffers come from the role's transport and always carry the indexer keys; on a
decode node :meth:`begin_external_sequence` starts a sequence whose prompt KV is placed from outside.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from torch_kvoffload.backend import SESSION_ATTR
from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.core.pd_role import PDRole
from torch_kvoffload.integrations.hf.sequence import HFSequence
from torch_kvoffload.ops import layer_hooks, mla_runtime
from torch_kvoffload.sparse.backend import SparseOffloadBackend

if TYPE_CHECKING:
    from torch_kvoffload.core.config import OffloadConfig
    from torch_kvoffload.integrations.hf.inspect import HFModelSpec
    from torch_kvoffload.kvpp import KVPPConfig, KVPPRuntime
    from torch_kvoffload.layerwise import LayerwiseOffloadRuntime
    from torch_kvoffload.pd import PDConfig
    from torch_kvoffload.sparse import SparseDecodeOffload

__all__ = ["OffloadSession", "RoleFactory", "session_of"]

T = TypeVar("T")

#: builds the session's P/D role (``integrations.hf.pd.make_role``)
RoleFactory = Callable[["OffloadSession", "PDConfig"], PDRole]

_ids = itertools.count()
# stats keys every session reports, in order (the backends' counters, summed; 0 where none counts)
_BACKEND_KEYS = (
    "bytes_h2d", "bytes_d2h", "hits", "misses", "evictions", "layer_loads", "layer_saves", "store_hits",
    "store_misses", "corrupt_records", "store_errors", "forward_retries", "broadcasts", "fork_shared_blocks",
    "cow_copies",
)  # fmt: skip
_KVPP_KEYS = (
    "bytes_broadcast", "kvpp_waits", "kvpp_wait_seconds", "kvpp_broadcast_seconds", "kvpp_owned_layers",
    "kvpp_persistent_bytes", "kvpp_scratch_bytes",
)  # fmt: skip
_HOST_POOL_KEYS = ("host_pool_bytes", "shared_host_pool_bytes")


def session_of(model: torch.nn.Module) -> OffloadSession:
    """The session attached to ``model`` (``ValueError`` if none)."""
    session = getattr(model, SESSION_ATTR, None)
    if session is None:
        raise ValueError(
            f"{type(model).__name__} is not offloaded; call torch_kvoffload.offload(model) (or compile) first"
        )
    return session


class OffloadSession:
    """The KV and attention of one offloaded Hugging Face model (see the module docstring).

    Parameters
    ----------
    spec : HFModelSpec
        From :func:`~torch_kvoffload.integrations.hf.inspect.inspect_model` (the model's attention modules
        with it); with a store (``config.stores_kv``), with the weights' fingerprint
        (:meth:`ModelSpec.with_weights`): the store keys carry it, so models of one architecture with other weights never read each other's KV.
    config : OffloadConfig
        Resolved (``None`` fields off). Sparse attention needs ``spec.has_indexer``.
    name : str, optional
        Registry name (default: unique per session).
    role_factory : RoleFactory, optional
        Builds the P/D role when ``config.pd`` is set (``torch_kvoffload.offload`` passes
        ``integrations.hf.pd.make_role``).
    """

    def __init__(
        self,
        spec: HFModelSpec,
        config: OffloadConfig,
        *,
        name: str | None = None,
        role_factory: RoleFactory | None = None,
    ) -> None:
        if config.stores_kv and not spec.weights_fingerprint:
            what = "layerwise offload" if config.layerwise is not None else "prefix reuse"
            raise ValueError(
                f"OffloadSession: {what} of {spec.model_class} keys its store by the weights, but "
                "the spec has no weights_fingerprint; pass inspect_model(model).with_weights(model)"
            )
        if config.sparse is not None and not spec.has_indexer:
            mode = "resident sparse attention" if config.sparse.offload is False else "sparse decode offload"
            raise ValueError(
                f"torch_kvoffload cannot offload {spec.model_class}: {mode} needs a lightning indexer "
                "(index_topk / indexer module), which this model does not have"
            )
        if config.pd is not None and role_factory is None:
            raise ValueError(
                "OffloadSession: config.pd needs a role_factory (integrations.hf.pd.make_role); "
                "torch_kvoffload.offload and compile pass it"
            )
        self.spec, self.config = spec, config
        self.name = name or f"hf-{spec.model_class}-{next(_ids)}"
        self.block_size = config.resolved_block_size
        self.layerwise_on = config.layerwise is not None
        self.sparse_on = config.sparse is not None
        self.kvpp_on = config.kvpp_requested
        self._closed = False
        #: the P/D role (``integrations.hf.pd``) when ``config.pd`` is set
        self.pd: PDRole | None = None
        if config.pd is not None:
            assert role_factory is not None
            self.pd = role_factory(self, config.pd)
        try:
            self._core = KVCore(spec, config, name=self.name, role=self.pd)
        except BaseException:
            if self.pd is not None:
                self.pd.close()
            raise
        self._seq = HFSequence(self._core)
        #: the continuous-batching state (``integrations.hf.serving.ServingRequests``) once a CB manager
        #: was built for the model; while it is open, forwards and ``generate`` of other callers are refused
        self.serving: Any = None
        backends = self._core.backends
        self.layerwise_runtime: str | None = None
        self.kvpp_runtime: str | None = f"{self.name}/kvpp" if backends.kvpp is not None else None
        registered = False
        try:
            mla_runtime.runtimes.register(self.name, self._core)
            registered = True
            if backends.layerwise is not None:
                layer_hooks.runtimes.register(f"{self.name}/layerwise", backends.layerwise)
                self.layerwise_runtime = f"{self.name}/layerwise"
        except BaseException:  # a name taken: nothing of this session stays registered or allocated
            if registered:
                mla_runtime.runtimes.unregister(self.name)
            self._core.close()
            raise

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadSession:
        """A new, empty session for a deep copy of the model: the spec (its attention modules mapped through
        ``memo`` to the copy's; the copy has these weights, so the same weights fingerprint) and config
        copied, its own runtimes and store, no sequence. A KVPP or P/D session is not copied
        (``NotImplementedError``): its peers would not know of the copy."""
        if self.kvpp_on or self.pd is not None:
            raise NotImplementedError(
                f"copy.deepcopy of an offloaded {self.spec.model_class} with KVPP or P/D is not supported: the "
                "copy would need its own process group / peer; offload a fresh model on every rank instead"
            )
        new = object.__new__(type(self))
        memo[id(self)] = new  # the spec's attention modules refer back to the session
        new.__init__(copy.deepcopy(self.spec, memo), copy.deepcopy(self.config, memo))
        return new

    @property
    def core(self) -> KVCore:
        """The request-level KV core (continuous batching drives it request by request)."""
        return self._core

    def check_not_serving(self, who: str) -> None:
        """``RuntimeError`` naming ``who`` while a continuous-batching manager serves this model."""
        if self.serving is not None and self.serving.is_open:
            raise RuntimeError(
                f"{who}: the model is serving continuous batching (a generation loop of its "
                "ContinuousBatchingManager runs); stop the manager first, or add the request to it"
            )

    # ------------------------------------------------------------------------------------ sizing
    @property
    def blocks_per_request(self) -> int:
        """Blocks of ``block_size`` tokens each request owns in the paged caches (0 before sizing)."""
        return self._core.blocks_per_request

    @property
    def reserved_tokens(self) -> int:
        """Tokens per request the device caches are sized for (0 before sizing)."""
        return self._core.reserved_tokens

    def plan_generation(self, batch: int, max_tokens: int) -> None:
        """The next sequence is a ``generate`` of ``batch`` requests of at most ``max_tokens`` tokens
        (prompt width + ``max_new_tokens``): see :meth:`HFSequence.plan`."""
        self._seq.plan(batch, max_tokens)

    def reserve(self, batch: int, max_tokens: int) -> None:
        """Size the buffers, host pool and indexer cache for ``batch`` requests of ``max_tokens`` tokens:
        exactly this between sequences (and plan the next one so), growth only while one runs (see
        :meth:`HFSequence.reserve`)."""
        if self._closed:
            raise RuntimeError("OffloadSession.reserve: the session is closed")
        self._seq.reserve(batch, max_tokens)

    # ---------------------------------------------------------------------------------- the cache
    def new_cache(self) -> Any:
        """A fresh ``transformers.Cache`` bound to this session (holds no KV itself)."""
        from torch_kvoffload.integrations.hf.cache import new_offload_cache

        return new_offload_cache(self)

    def layer_caches(self, layer: int) -> list[torch.Tensor]:
        """The tensors passed as ``caches`` to every op of ``layer``: each backend's (layer buffer
        components; KVPP view; indexer cache and hot buffers or resident KV). Empty before sizing."""
        return self._core.layer_caches(layer)

    # --------------------------------------------------------------------------------- forwards
    @property
    def forward_running(self) -> bool:
        """Whether a forward is between :meth:`begin_forward` and :meth:`end_forward`."""
        return self._core.forward is not None

    def begin_forward(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
        *,
        past: int | None = None,
        owner: Any = None,
        shape: tuple[int, int] | None = None,
        position_ids: torch.Tensor | None = None,
        unkeyed: str | None = None,
    ) -> None:
        """Start a forward of ``input_ids int64 [B, S]``, or of embeddings of ``shape`` ``(B, S)`` when
        ``input_ids`` is ``None`` (their requests are then not keyed by content: no prefix reuse; nor
        when ``unkeyed`` names why the forward's KV is not what its tokens alone give, e.g. a custom mask).

        ``position_ids [B, S]`` or ``[1, S]``: the model's positions, as the model is given them (``None``:
        transformers' default ``past .. past + S - 1``, padding counted). With layerwise offload the store
        keys each block by its tokens and these positions: KV computed at other positions is never loaded.

        ``attention_mask [B, past + S]`` (0 = padding, anywhere) or ``None`` (no padding).
        ``past`` (tokens already seen, padding included) defaults to ``cache_position[0]``, else the
        session's count; ``past == 0`` ends the previous sequence and starts a new one (sizing the caches
        for it, see the module docstring). ``owner``: the cache object of the sequence (a later forward
        with another owner and ``past > 0`` is an error).
        """
        if self._closed:
            raise RuntimeError("OffloadSession.begin_forward: the session is closed")
        self._seq.begin_forward(
            input_ids, attention_mask, cache_position, past, owner, shape, position_ids, unkeyed
        )

    def run_forward(
        self,
        body: Callable[[], T],
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
        *,
        past: int | None = None,
        owner: Any = None,
        shape: tuple[int, int] | None = None,
        position_ids: torch.Tensor | None = None,
        unkeyed: str | None = None,
    ) -> T:
        """:meth:`begin_forward`, ``body()`` (the model's forward), :meth:`end_forward`; a ``body`` that
        raises aborts the forward (:meth:`abort_forward`) and the error propagates.

        Except when blocks of the prefix the layerwise lookup found cannot be loaded when their layer
        needs them (a record that fails its checksum or size on a store that checks at read time, a store
        read that failed, a block evicted in between: :class:`PrefixEvictedError`): then the forward runs
        again, each request's prefix cut at its first missing block (every later block of the chained
        prefix is computed too), and returns what the unmodified model would. Counted in
        ``forward_retries``. Only where the rows before the forward are all in whole blocks the cut keeps
        (any forward that starts a sequence); otherwise the error propagates as for any other failure.
        """
        self.begin_forward(
            input_ids, attention_mask, cache_position, past=past, owner=owner, shape=shape,
            position_ids=position_ids, unkeyed=unkeyed,
        )  # fmt: skip
        return self._seq.run_forward(body)

    def run_packed(
        self,
        body: Callable[[], T],
        tokens: list[list[int]],
        positions: torch.Tensor | None = None,
        *,
        unkeyed: bool = False,
    ) -> T:
        """``body()`` over segments ``tokens[i]`` one after the other ``[1, n]``, no cache, a request each
        (released after; the running sequence ends first): see :meth:`HFSequence.run_packed`."""
        if self._closed:
            raise RuntimeError("OffloadSession.run_packed: the session is closed")
        return self._seq.run_packed(body, tokens, positions, unkeyed)

    def end_forward(self) -> None:
        """Finish the forward: wait for its transfers (raising the first failure)."""
        self._seq.end_forward()

    def abort_forward(self) -> None:
        """Close a forward that raised and release its sequence's requests; the sequence cannot continue
        (the next forward must start anew). Idempotent."""
        self._seq.abort_forward()

    def end_sequence(self) -> None:
        """Release the running sequence's requests (host-pool blocks, residency rows); the caches stay
        sized for the next sequence. A forward continuing the released sequence is an error. Called by
        every forward that starts a new sequence and when a forward fails; idempotent."""
        self._seq.end()

    # ------------------------------------------------------------------------------- batch rows
    def _owned(self, owner: Any, where: str) -> None:
        if self._closed:
            raise RuntimeError(f"{where}: the session is closed")
        if owner is not self._seq.owner or not self._seq.requests:
            raise ValueError(
                f"{where}: this cache's sequence is not the one the session holds (ended, failed, or another "
                "cache's sequence started since)"
            )

    def rebuild_rows(self, owner: Any, sources: list[int], where: str) -> None:
        """Row ``i`` of ``owner``'s sequence continues today's row ``sources[i]`` (beam search, selecting or
        repeating rows): see :meth:`HFSequence.rebuild_rows`. Between forwards."""
        self._owned(owner, where)
        self._seq.rebuild_rows(sources, where)

    def crop(self, owner: Any, remove: int) -> None:
        """Forget the last ``remove`` positions of ``owner``'s sequence in every row and backend (assisted
        decoding): see :meth:`HFSequence.crop`. Between forwards."""
        self._owned(owner, "OffloadCache.crop")
        self._seq.crop(remove)

    # ------------------------------------------------------------------------ runtimes and requests
    @property
    def layerwise_offload(self) -> LayerwiseOffloadRuntime | None:
        """The layerwise runtime over the current layer buffers (``None`` when off or released)."""
        lw = self._core.backends.layerwise
        return lw.runtime if lw is not None else None

    @property
    def sparse_offload(self) -> SparseDecodeOffload | None:
        """The sparse decode runtime (its ``pool`` is the host KV pool); ``None`` when off or not sized."""
        sp = self._core.backends.sparse
        return sp.runtime if isinstance(sp, SparseOffloadBackend) else None

    @property
    def kvpp_offload(self) -> KVPPRuntime | None:
        """This rank's KVPP runtime (``None`` when off or not sized)."""
        kv = self._core.backends.kvpp
        return kv.runtime if kv is not None else None

    @property
    def kvpp_config(self) -> KVPPConfig | None:
        """The resolved KVPP configuration (``None`` when off)."""
        kv = self._core.backends.kvpp
        return kv.config if kv is not None else None

    def indexer_caches(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, the device indexer cache of sparse attention: ``([num_pages, page, index_dim],)`` in the
        model dtype, or int8 keys and fp32 scales ``[num_pages, page]``; request ``r`` owns the pages
        :meth:`device_blocks` names (on a P/D session pages are the session's blocks; otherwise one page of
        :attr:`reserved_tokens` rows per request). Empty when sparse attention is off or not sized."""
        sp = self._core.backends.sparse
        return list(sp.index.layers) if sp is not None else []

    @property
    def request_ids(self) -> list[int]:
        """The request id of each batch row of the running sequence (host-pool request ids)."""
        return [r.id for r in self._seq.requests]

    @property
    def owner(self) -> Any:
        """The cache object of the running sequence (``None`` when none runs)."""
        return self._seq.owner

    def device_blocks(self, request_id: int) -> list[int]:
        """The pages of :meth:`indexer_caches` request ``request_id`` of the running sequence owns."""
        sparse = self._core.backends.sparse
        return [] if sparse is None else sparse.index.slot_pages(self._core.requests.get(request_id).slot)

    def begin_external_sequence(self, tokens: list[list[int]], width: int, owner: Any) -> list[int]:
        """Start a sequence whose first ``width`` positions (padding included) were computed elsewhere.

        ``tokens[r]``: request ``r``'s real tokens (at most ``width``); ``owner``: the sequence's cache,
        whose ``seen_tokens`` the caller sets to ``width``. The caller places every request's main KV in the
        host pool (blocks ``sparse_offload.pool.blocks_of(request_ids[r])``) and indexer keys in
        :meth:`indexer_caches` before the next forward, which continues at ``past = width``. Needs sparse
        offload sized by :meth:`reserve`; returns :attr:`request_ids`.
        """
        self._seq.begin_external(tokens, width, owner, has_host_pool=self.sparse_offload is not None)
        return self.request_ids

    # ------------------------------------------------------------------------------ observability
    def device_kv_bytes(self) -> int:
        """Bytes of KV the session holds on the compute device now (from the allocated tensors): layer
        buffers and tails, KVPP bundles, hot buffers, indexer cache, resident KV."""
        return self._core.device_kv_bytes()

    def dense_kv_bytes(self) -> int:
        """What the unmodified model's cache holds for the tokens seen (padding included, as it counts)."""
        spec = self.spec
        per_token = spec.kv_lora_rank + spec.rope_dim + spec.index_head_dim
        seq = self._seq
        return spec.num_layers * len(seq.requests) * seq.seen * per_token * spec.dtype.itemsize

    def stats(self) -> dict[str, float]:
        """Counters and memory figures.

        ``device_kv_bytes``, ``dense_kv_bytes``; ``bytes_h2d`` / ``bytes_d2h`` (everything the session's
        copies moved: layer loads / saves, sparse misses / appends, chunked-prefill host reads);
        ``hits`` / ``misses`` / ``evictions`` (sparse residency; 0 with a resident KV);
        ``layer_loads`` / ``layer_saves`` (layerwise per-layer transfers), ``store_hits`` /
        ``store_misses`` (blocks found / not found); ``corrupt_records`` (records of the session's store
        that failed their checksum or size: damaged or truncated, each a miss, recomputed) and
        ``store_errors`` (store calls that failed: backend gets / puts of a remote store, and lookups; each
        a miss or a dropped put) — the store's counts, so a store several sessions share reports theirs
        too; ``forward_retries`` (forwards run again because blocks of their prefix could not be loaded,
        see :meth:`run_forward`); ``forwards``, ``prefill_forwards``, ``decode_forwards``,
        ``failed_forwards``; ``resizes`` (times the device caches were allocated for new sizes, growth of
        a running sequence included), ``reserved_tokens`` (tokens per request they are sized for),
        ``reserved_requests`` (requests holding host-pool blocks) and ``resident_rows`` (residency rows
        held; both 0 once a sequence ended or failed); ``fork_shared_blocks`` (host-pool blocks a forked
        request shares with its source instead of a copy: beam search) and ``cow_copies`` (shared blocks
        copied before a write); ``unkeyed_requests`` (requests fed ``inputs_embeds``
        without token ids so far: their KV is never looked up or shared by content). Continuous batching:
        ``serving_slots`` (requests the caches hold at once), ``serving_requests`` (held now),
        ``serving_steps`` (CB steps run so far). KVPP: ``broadcasts`` (layer broadcasts issued),
        ``bytes_broadcast``, ``kvpp_waits`` / ``kvpp_wait_seconds`` (layer waits and the time the forward
        spent in them: a broadcast not hidden behind compute), ``kvpp_broadcast_seconds`` (the broadcasts'
        own time on the transfer thread; on CPU ``1 - kvpp_wait_seconds / kvpp_broadcast_seconds`` is the
        share hidden behind compute), ``kvpp_owned_layers`` (layers this rank stores persistently),
        ``kvpp_persistent_bytes`` / ``kvpp_scratch_bytes`` (this rank's owned bundles / its two scratch
        buffers; their sum is in ``device_kv_bytes``). Sparse decode offload: ``host_pool_bytes`` (the
        host KV pool this process allocated) and ``shared_host_pool_bytes`` (a tensor-parallel reader's
        mapping of the pool TP rank 0 allocated), so that summed over the ranks the pool counts once.
        Prefix reuse (:mod:`torch_kvoffload.core.prefix`): ``prompt_tokens`` (of the prompts of fresh
        forwards), ``prefix_store_tokens`` / ``prefix_live_tokens`` (of those, adopted from the store / from a
        running request holding them), ``prompt_tokens_computed`` (the rest), ``prefix_lookups`` /
        ``prefix_lookup_seconds``, ``prefix_fallbacks`` (found but not taken over: computed),
        ``persisted_blocks`` / ``persist_failures`` (blocks read back into the store from the host pool, a
        resident KV or KVPP's owned layers), ``prefix_waits`` (steps a new continuous-batching request sat
        out while another computed their shared prefix).
        """
        got = self._core.backend_stats()
        own = self._core.counters.snapshot()
        out = {"device_kv_bytes": self.device_kv_bytes(), "dense_kv_bytes": self.dense_kv_bytes()}
        out.update({k: got.get(k, 0) for k in _BACKEND_KEYS})
        out.update({k: own[k] for k in ("forwards", "prefill_forwards", "decode_forwards", "mixed_forwards")})
        out["failed_forwards"] = own["failed_forwards"]
        prefix = self._core.prefix.counters.snapshot()
        out.update(prefix, prompt_tokens_computed=prefix["prompt_tokens"] - prefix["prefix_store_tokens"]
                   - prefix["prefix_live_tokens"])  # fmt: skip
        out.update(
            resizes=own["resizes"],
            reserved_tokens=self.reserved_tokens,
            reserved_requests=got.get("reserved_requests", 0),
            resident_rows=got.get("resident_rows", 0),
            unkeyed_requests=self._seq.unkeyed_requests,
            serving_slots=self.serving.slots if self.serving is not None else 0,
            serving_requests=self.serving.live if self.serving is not None else 0,
            serving_steps=self.serving.steps if self.serving is not None else 0,
        )
        if self.kvpp_on:
            out.update({k: got.get(k, 0) for k in _KVPP_KEYS})
        if isinstance(sp := self._core.backends.sparse, SparseOffloadBackend):  # hybrid sparse adds its own
            out.update({k: got.get(k, 0) for k in (*_HOST_POOL_KEYS, *sp.STATS)})
        return out

    def close(self) -> None:
        """Stop the runtimes and unregister. Idempotent."""
        if self._closed:
            return
        self._closed = True
        mla_runtime.runtimes.unregister(self.name)
        if self.layerwise_runtime is not None:
            layer_hooks.runtimes.unregister(self.layerwise_runtime)
        self._core.close()
